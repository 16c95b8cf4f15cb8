"""A warm start's weights (``training.warm_start``): every stage shard of the source job's
checkpoint, fetched from the leader and united into the glued model's state.

Shards name their parameters as the glued model does (global block indices, no stage
prefix), so the union holds the whole model whatever the source's split, and each cell of the
new job takes its own stage's entries from it (``pipeline.stage.own_part``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import torch

from swarm_core.artifacts import shards
from swarm_core.artifacts.shards import ShardError
from swarm_core.contract.placement import MAX_STAGES

# (job_id, step, stage) -> (manifest, weights.npz) of one stage of a checkpoint
FetchWeights = Callable[[str, int, int], Awaitable[tuple[dict[str, Any], bytes]]]


async def warm_weights(fetch: FetchWeights, job_id: str, step: int) -> dict[str, torch.Tensor]:
    """The union of the weights of every stage of ``job_id``'s checkpoint at ``step``; the
    stage count is the first shard's manifest's. A shard that is not the one asked for, or
    two shards that hold one name with different values, is a ShardError."""
    manifest, raw = await fetch(job_id, step, 0)
    num_stages = manifest.get("num_stages")
    if not isinstance(num_stages, int) or not 1 <= num_stages <= MAX_STAGES:
        raise ShardError(f"{job_id} step {step}: stage 0's manifest names no stage count "
                         f"(num_stages {num_stages!r})")
    union: dict[str, torch.Tensor] = {}
    for stage in range(num_stages):
        if stage:
            manifest, raw = await fetch(job_id, step, stage)
        _check_manifest(manifest, job_id, step, stage, num_stages)
        _add(union, shards.weights_from_checkpoint(manifest, raw), stage)
        del raw  # (one stage's archive held at a time)
    return union


def _check_manifest(manifest: dict[str, Any], job_id: str, step: int, stage: int,
                    num_stages: int) -> None:
    said = (manifest.get("job_id"), manifest.get("step"), manifest.get("stage"),
            manifest.get("num_stages"))
    if said != (job_id, step, stage, num_stages):
        raise ShardError(f"asked for {job_id} step {step} stage {stage} of {num_stages}, the "
                         f"manifest says {said[0]} step {said[1]} stage {said[2]} of {said[3]}")


def _add(union: dict[str, torch.Tensor], part: dict[str, torch.Tensor], stage: int) -> None:
    # (no two stages' shards should name one tensor; if they do, they must agree)
    for name, t in part.items():
        held = union.setdefault(name, t)
        if held is not t and not torch.equal(held, t):
            raise ShardError(f"stage {stage} holds another {name!r} than an earlier stage")
