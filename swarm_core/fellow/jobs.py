"""What a fellow runs when START arrives, by job kind.

``smoke`` is a control-plane check: it walks the job through RUNNING steps to COMPLETED without
training anything, so a new cluster can be shown to dispatch, report and finish. ``train`` runs
this fellow's pipeline stage (:mod:`swarm_core.fellow.train`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from swarm_core.contract import (
    JobStatusUpdate,
    RegroupAnswer,
    RegroupReport,
    SmokeTraining,
    StageStart,
)

Report = Callable[[JobStatusUpdate], Awaitable[None]]
# (job_id, stage, manifest, weights.npz bytes, optimizer.npz bytes or None)
# (job_id, stage, manifest, weights.npz or None for a replica's own state, optimizer.npz)
PushShard = Callable[[str, int, dict[str, Any], bytes | None, bytes | None], Awaitable[None]]
Checkpoint = tuple[dict[str, Any], bytes | None, bytes | None]


@attrs.define
class Progress:
    """What the fellow's heartbeat says about the job in hand."""

    job_id: str | None = None
    stage: int | None = None
    step: int = 0
    replica: int = 0
    attempt: int = 0
    loss: float | None = None
    tokens_per_s: float = 0.0
    # Memberships the leader told this cell of (a replica joins): (order, (the group's data
    # addresses, which of them are this fellow's)); the stage thread takes them at its next
    # synchronisation.
    told: list[Any] = attrs.field(factory=list)


class JobRefused(Exception):
    pass


class LinkOverrides:
    """A fellow's link limits: the baseline SET_SPEED gives (live, and kept), and a job's own
    (``training.link``) for as long as any of its stages runs here. Stages of one job on one
    fellow share the shaper, so the baseline comes back when the last of them ends."""

    def __init__(self, shaper: Any) -> None:
        self.shaper = shaper
        self.baseline = shaper.limits()
        self.holders = 0

    def set_speed(self, limits: Any) -> None:
        self.baseline = limits
        self.shaper.apply(limits)

    def hold(self, limits: Any) -> None:
        self.holders += 1
        self.shaper.apply(limits)

    def release(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.shaper.apply(self.baseline)


@attrs.define
class JobContext:
    """What the daemon lends a job: identity, progress, reporting and the data plane."""

    fellow_id: int
    progress: Progress
    report: Report
    # Several RUNNING step reports at once, in order; None: each through ``report``.
    report_steps: Callable[[list[JobStatusUpdate]], Awaitable[None]] | None = None
    shaper: Any = None  # swarm_core.pipeline.links.LinkShaper (torch-side, imported lazily)
    listener: Any = None  # swarm_core.pipeline.listener.DataListener
    threads: int = 1
    fellow_name: str = ""
    push_shard: PushShard | None = None
    # (job_id, step, stage) -> (manifest, weights.npz, optimizer.npz or None) from the leader
    fetch_checkpoint: Callable[[str, int, int], Awaitable[Checkpoint]] | None = None
    # (job_id, step, stage) -> (manifest, weights.npz) of a checkpoint, without its optimiser
    # state: another job's, that this one warm-starts from (training.warm_start)
    fetch_weights: Callable[[str, int, int], Awaitable[tuple[dict[str, Any], bytes]]] | None = None
    # (job_id, step, stage) -> the manifest alone of such a checkpoint (its ``params`` say
    # which shards a cell needs); None: every shard is fetched
    fetch_manifest: Callable[[str, int, int], Awaitable[dict[str, Any]]] | None = None
    # (job_id, step, stage, replica) -> (manifest, optimizer.npz) of a replica's own state
    # (DiLoCo), or None where the leader holds none
    fetch_replica_state: Callable[[str, int, int, int],
                                  Awaitable[tuple[dict[str, Any], bytes] | None]] | None = None
    links: LinkOverrides | None = None  # the daemon's; None: this job's own view of the shaper
    # (job_id, report, wait_s) -> the leader's answer, when a stage group's ring broke
    regroup: Callable[[str, RegroupReport, float], Awaitable[RegroupAnswer]] | None = None
    # Directories (resolved) whose files jobs may read; the daemon's always, None only for a
    # job run in-process by its own user (tests, benchmarks).
    data_roots: tuple[str, ...] | None = None
    pace: Any = None  # swarm_core.pipeline.pace.Pace: the fellow's emulated slowdown, or None
    # A peer moved between stages: the cell's new START, for the daemon to file the running
    # job under (its heartbeat, MEMBERS and stops name the new cell)
    moved: Callable[[StageStart], None] | None = None


async def run_smoke(start: StageStart, ctx: JobContext) -> None:
    smoke = start.training
    assert isinstance(smoke, SmokeTraining)
    t0 = time.monotonic()
    for step in range(1, smoke.steps + 1):
        await asyncio.sleep(smoke.step_seconds)
        ctx.progress.step = step
        await ctx.report(JobStatusUpdate(fellow_id=ctx.fellow_id, state="RUNNING", step=step,
                                         stage=start.stage, replica=start.replica,
                                         attempt=start.attempt))
    elapsed = time.monotonic() - t0
    await ctx.report(JobStatusUpdate(
        fellow_id=ctx.fellow_id, state="COMPLETED", step=smoke.steps, stage=start.stage,
        replica=start.replica,
        attempt=start.attempt,
        message=f"smoke: {smoke.steps} control-plane round trips in {elapsed:.2f}s",
    ))


def import_engine() -> None:
    """Load the training engine (torch and friends). The daemon calls this in a thread at start
    so that the first START does not pay for it."""
    import swarm_core.fellow.train  # noqa: F401


async def run_job(start: StageStart, ctx: JobContext) -> None:
    if start.kind == "smoke":
        await run_smoke(start, ctx)
    else:
        # Importing torch takes seconds; in a worker thread, so heartbeats keep flowing.
        await asyncio.to_thread(import_engine)
        from swarm_core.fellow.train import run_train

        await run_train(start, ctx)
