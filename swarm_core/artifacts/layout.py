"""File names of a stage shard, where a shard lives, how one is written, and what a manifest
says about them. Plain Python (no numpy, no torch): the leader checks pushes with it and the
headless CLI fetches exports with it, and both stay light."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

from swarm_core import jsonio
from swarm_core.paths import atomic_write, fsync_dir

MANIFEST = "shard_manifest.json"
WEIGHTS = "weights.npz"
OPTIMIZER = "optimizer.npz"
# Beside an export's shards/: which shard each stage holds, and whether they make one model.
RUN_MANIFEST = "run_manifest.json"


def names_optimizer(manifest: dict[str, Any]) -> bool:
    """Whether the shard carries optimiser state (a manifest from before it never does)."""
    return manifest.get("optimizer_sha256") is not None


def shard_dir_name(stage: int, fellow_id: int) -> str:
    # Built from integers only: no user text reaches a path.
    return f"stage-{stage}-fellow-{fellow_id}"


def drop_other_holders(root: Path, stage: int, keep: Path) -> None:
    """One shard per stage under ``root``: another fellow may have held the stage before a
    restart, and its directory goes (the one at ``keep`` stays)."""
    for old in root.glob(f"stage-{stage}-fellow-*"):
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def write_shard(root: Path, manifest: dict[str, Any], weights: bytes,
                optimizer: bytes | None = None) -> Path:
    """Weights and optimiser state first, manifest last: a manifest on disk means the files it
    names are complete."""
    d = root / shard_dir_name(manifest["stage"], manifest["fellow_id"])
    # Private, as the leader's copies are: weights are a job's work, not the machine's.
    atomic_write(d / WEIGHTS, weights, mode=0o600)
    if optimizer is not None:
        atomic_write(d / OPTIMIZER, optimizer, mode=0o600)
    atomic_write(d / MANIFEST, jsonio.dumps(manifest, pretty=True), mode=0o600)
    return d


def install_shard(root: Path, manifest: dict[str, Any], weights_file: Path) -> Path:
    """Make this the stage's one shard under ``root``, its weights already on disk (downloaded
    beside ``root``, fsynced) and moved in by a rename: other holders go, and the old manifest
    goes before the new weights come in, so no manifest ever names the wrong weights."""
    d = root / shard_dir_name(manifest["stage"], manifest["fellow_id"])
    drop_other_holders(root, manifest["stage"], d)
    with contextlib.suppress(FileNotFoundError):
        (d / MANIFEST).unlink()
    d.mkdir(parents=True, exist_ok=True)
    os.replace(weights_file, d / WEIGHTS)
    fsync_dir(d)
    atomic_write(d / MANIFEST, jsonio.dumps(manifest, pretty=True), mode=0o600)
    return d
