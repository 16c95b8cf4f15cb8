"""A warm start's weights (``training.warm_start``): the stage shards of the source job's
checkpoint that hold what a cell needs, fetched from the leader and united into the glued
model's state.

Shards name their parameters as the glued model does (global block indices, no stage
prefix), so the union holds the whole model whatever the source's split, and each cell of the
new job takes its own stage's entries from it (``pipeline.stage.own_part``). Each shard's
manifest lists its names (``params``), so a cell that knows its own names reads every
manifest first (a few kB each) and fetches only the shards that hold them: over a weak link a
cell of a deep pipeline need not pull the whole model to start.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any

import torch

from swarm_core.artifacts import shards
from swarm_core.artifacts.shards import ShardError
from swarm_core.contract.placement import MAX_STAGES

# (job_id, step, stage) -> (manifest, weights.npz) of one stage of a checkpoint
FetchWeights = Callable[[str, int, int], Awaitable[tuple[dict[str, Any], bytes]]]
# (job_id, step, stage) -> the manifest alone
FetchManifest = Callable[[str, int, int], Awaitable[dict[str, Any]]]


async def warm_weights(fetch: FetchWeights, job_id: str, step: int,
                       wanted: Collection[str] | None = None,
                       fetch_manifest: FetchManifest | None = None) -> dict[str, torch.Tensor]:
    """The union of the weights of ``job_id``'s checkpoint at ``step``: of every stage, or,
    given ``wanted`` (the names a cell takes) and ``fetch_manifest``, of the stages whose
    manifests list a wanted name no earlier stage's listed (a shard whose manifest lists no
    names is fetched). The stage count is stage 0's manifest's. A shard that is not the one
    asked for, or two shards that hold one name with different values, is a ShardError."""
    select = wanted is not None and fetch_manifest is not None

    async def read(stage: int) -> tuple[dict[str, Any], bytes | None]:
        # (selecting: the manifest alone, its shard fetched only where it holds a wanted name)
        if select:
            assert fetch_manifest is not None
            return await fetch_manifest(job_id, step, stage), None
        return await fetch(job_id, step, stage)

    got = await read(0)
    num_stages = _stage_count(got[0], job_id, step)
    union: dict[str, torch.Tensor] = {}
    held: set[str] = set()
    for stage in range(num_stages):
        if stage:
            got = await read(stage)
        (manifest, raw), got = got, ({}, None)  # (one stage's archive held at a time)
        _check_manifest(manifest, job_id, step, stage, num_stages)
        names = manifest.get("params")
        if select and isinstance(names, dict) and not (set(names) & set(wanted or ())) - held:
            continue
        if raw is None:
            manifest, raw = await fetch(job_id, step, stage)
            _check_manifest(manifest, job_id, step, stage, num_stages)
        part = shards.weights_from_checkpoint(manifest, raw)
        del raw
        _add(union, part, stage)
        held.update(part)
    return union


def _stage_count(manifest: dict[str, Any], job_id: str, step: int) -> int:
    num_stages = manifest.get("num_stages")
    if not isinstance(num_stages, int) or not 1 <= num_stages <= MAX_STAGES:
        raise ShardError(f"{job_id} step {step}: stage 0's manifest names no stage count "
                         f"(num_stages {num_stages!r})")
    return num_stages


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
