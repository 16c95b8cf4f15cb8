"""File names of a stage shard, and what a manifest says about them. Plain Python (no numpy,
no torch): the leader checks pushes with it and stays light."""

from __future__ import annotations

from typing import Any

MANIFEST = "shard_manifest.json"
WEIGHTS = "weights.npz"
OPTIMIZER = "optimizer.npz"
# Beside an export's shards/: which shard each stage holds, and whether they make one model.
RUN_MANIFEST = "run_manifest.json"


def names_optimizer(manifest: dict[str, Any]) -> bool:
    """Whether the shard carries optimiser state (a manifest from before it never does)."""
    return manifest.get("optimizer_sha256") is not None
