"""A train job's stage on this fellow: the stage thread and what it lends to the event loop.

:class:`TrainJob` runs the stage (:func:`swarm_core.pipeline.stage.run_stage`) in a thread, so
the fellow's loop keeps heartbeating while it computes. Its parts: a :class:`StepReporter` that
turns the thread's step and eval callbacks into ordered reports to the leader, and a
:class:`ShardCheckpointer` that copies the stage's state at each checkpoint, writes it to this
fellow's disk and pushes it to the leader while training goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import traceback
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import attrs

from swarm_core.artifacts import shards
from swarm_core.artifacts.layout import names_optimizer
from swarm_core.artifacts.shards import ShardError
from swarm_core.client import ApiError
from swarm_core.contract import (
    JobStatusUpdate,
    RegroupOrder,
    RegroupReport,
    StageMetrics,
    StageStart,
    perplexity,
)
from swarm_core.contract.metrics import MAX_REPORTS_AT_ONCE
from swarm_core.contract.rebalance import PeerMove
from swarm_core.data import DataError, TokenData
from swarm_core.fellow.corpus import shared_token_data
from swarm_core.fellow.jobs import Checkpoint, JobContext, JobRefused, LinkOverrides
from swarm_core.fellow.warm import warm_weights
from swarm_core.pipeline.devices import DeviceError, resolve_device
from swarm_core.pipeline.model import stage_state_names
from swarm_core.pipeline.move import LayoutMove
from swarm_core.pipeline.peers import cell_label
from swarm_core.pipeline.stage import (
    ResumeError,
    StageCheckpoint,
    StageDropped,
    StageSpec,
    StageStopped,
    StepReport,
    run_stage,
)
from swarm_core.schema import unstructure

log = logging.getLogger(__name__)

SNAPSHOTS_IN_FLIGHT = 2  # checkpoint copies a stage may have waiting for the shard writer
REGROUP_POLL_S = 5.0  # one wait of a regroup's long poll; the report is sent again after it

_T = TypeVar("_T")


async def _awaited(aw: Awaitable[_T]) -> _T:
    # run_coroutine_threadsafe takes only a coroutine; the regroup hook may be any awaitable.
    return await aw


class ShardWriteError(OSError):
    """A checkpoint's shard could not be written to this fellow's disk."""


class StepReporter:
    """The stage thread's step and eval callbacks, sent to the leader one at a time and in
    order, so it never sees step 5 after step 6."""

    def __init__(self, start: StageStart, ctx: JobContext,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.start, self.ctx, self.loop = start, ctx, loop
        self.updates: asyncio.Queue[JobStatusUpdate | None] = asyncio.Queue()

    def _update(self, **kw: Any) -> JobStatusUpdate:
        return JobStatusUpdate(fellow_id=self.ctx.fellow_id, attempt=self.start.attempt,
                               stage=self.start.stage, replica=self.start.replica, **kw)

    def on_step(self, rep: StepReport) -> None:  # the stage thread
        progress = self.ctx.progress
        progress.step = rep.step
        if rep.loss is not None:
            progress.loss = rep.loss
        progress.tokens_per_s = rep.tokens_per_s
        upd = self._update(state="RUNNING", step=rep.step, loss=rep.loss,
                           tokens_per_s=rep.tokens_per_s, metrics=rep.figures(),
                           epoch=rep.epoch, moved=rep.moved)
        self.loop.call_soon_threadsafe(self.updates.put_nowait, upd)

    def on_eval(self, step: int, loss: float) -> None:  # the stage thread
        upd = self._update(state="RUNNING", step=step,
                           metrics=StageMetrics(eval_loss=loss, perplexity=perplexity(loss)))
        self.loop.call_soon_threadsafe(self.updates.put_nowait, upd)

    async def run(self) -> None:
        # What queued while the last report was in flight goes in one request (a stage that
        # trains faster than one report a step would otherwise fall ever further behind).
        closing = False
        while not closing and (upd := await self.updates.get()) is not None:
            batch = [upd]
            while len(batch) < MAX_REPORTS_AT_ONCE and not self.updates.empty():
                more = self.updates.get_nowait()
                if more is None:
                    closing = True
                    break
                batch.append(more)
            if len(batch) > 1 and self.ctx.report_steps is not None:
                await self.ctx.report_steps(batch)
            else:
                for one in batch:
                    await self.ctx.report(one)

    def close(self) -> None:
        self.updates.put_nowait(None)

    async def completed(self, steps: int, metrics: StageMetrics, epoch: int) -> None:
        # (of replicas, the membership it finished under: the leader learns from it whether
        # a spare it told to join was taken in before the end)
        await self.ctx.report(self._update(
            state="COMPLETED", step=steps, loss=metrics.final_loss,
            tokens_per_s=metrics.tokens_per_s, message=f"stage {self.start.stage} finished",
            metrics=metrics, epoch=epoch if self.start.replicas > 1 else None))


@attrs.frozen
class _Snapshot:
    """A checkpoint's copy, taken in the stage thread: ``weights`` None for a member's own
    optimiser state alone."""

    step: int
    weights: dict[str, Any] | None
    params: dict[str, Any]
    optimizer: dict[str, Any]
    replica: int
    replica_states: tuple[int, ...]


class ShardCheckpointer:
    """A checkpoint costs the stage thread only a copy of its state; the writer serialises,
    hashes and fsyncs it (seconds for a large stage) while training goes on, and the pusher
    sends what was written. At most SNAPSHOTS_IN_FLIGHT copies wait for the writer: a stage
    that checkpoints faster than it can write waits instead of piling them up."""

    def __init__(self, start: StageStart, spec: StageSpec, ctx: JobContext, root: Path,
                 loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        self.start, self.spec, self.ctx, self.root = start, spec, ctx, root
        self.loop, self.stop = loop, stop
        self.data: TokenData | None = None  # set once the stage has loaded it
        self.snapshots: asyncio.Queue[_Snapshot | None] = asyncio.Queue()
        self.written: asyncio.Queue[Checkpoint | None] = asyncio.Queue()
        self.in_flight = threading.BoundedSemaphore(SNAPSHOTS_IN_FLIGHT)
        self.failed: list[str] = []  # why the first write failed, until one raises it
        self.abandoned = threading.Event()  # the job ended without completing: drop the rest

    def on_checkpoint(self, ck: StageCheckpoint) -> None:  # the stage thread
        while not self.in_flight.acquire(timeout=0.5):
            if self.stop.is_set():
                raise StageStopped()
        if self.failed:  # a write the writer could not do fails the stage
            self.in_flight.release()
            raise ShardWriteError(self.failed.pop())
        # A member that does not lead hands over only its own optimiser state (DiLoCo): the
        # weights are the first member's, which writes the stage's shard.
        snapshot = _Snapshot(ck.step, shards.state_arrays(ck.module) if ck.leads else None,
                             shards.param_shapes(ck.module), ck.optimizer_arrays(),
                             ck.replica, ck.replica_states)
        self.loop.call_soon_threadsafe(self.snapshots.put_nowait, snapshot)

    def _write(self, snap: _Snapshot) -> Checkpoint:  # a worker
        try:
            optimizer = shards.npz_bytes(snap.optimizer)
            if snap.weights is None:
                # Not this fellow's export (the stage's is the leading member's): only pushed.
                return self._replica_manifest(snap, optimizer), None, optimizer
            weights = shards.npz_bytes(snap.weights)
            manifest = self._manifest(snap, weights, optimizer)
            shards.write_shard(self.root, manifest, weights, optimizer)
            return manifest, weights, optimizer
        except Exception as exc:
            # Noted before the copy's slot is freed, so the stage's next checkpoint sees it.
            # (A new exception is raised there: this one's traceback holds the writer's
            # frames, which the stage's clean-up would clear.)
            self.failed.append(f"cannot write the shard of step {snap.step}: "
                               f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.in_flight.release()

    def _manifest(self, snap: _Snapshot, weights: bytes, optimizer: bytes) -> dict[str, Any]:
        start, spec, data = self.start, self.spec, self.data
        assert data is not None and start.model is not None and snap.weights is not None
        mine = start.mine
        return shards.build_manifest(
            job_id=start.job_id, stage=start.stage, num_stages=start.num_stages,
            fellow_id=self.ctx.fellow_id, fellow_name=self.ctx.fellow_name,
            layers=spec.layers, step=snap.step, model=unstructure(start.model),
            seed=spec.training.seed, vocab_size=self._vocab_size(),
            tokenizer=data.tokenizer.spec(), arrays=snap.weights, weights=weights,
            slot=mine.slot, device=spec.device, training=unstructure(start.training),
            optimizer=optimizer, replica=snap.replica, replica_states=snap.replica_states)

    def _replica_manifest(self, snap: _Snapshot, optimizer: bytes) -> dict[str, Any]:
        start = self.start
        assert start.model is not None
        return shards.replica_state_manifest(
            job_id=start.job_id, stage=start.stage, fellow_id=self.ctx.fellow_id,
            replica=snap.replica, step=snap.step, model=unstructure(start.model),
            seed=self.spec.training.seed, vocab_size=self._vocab_size(), params=snap.params,
            optimizer=optimizer)

    def _vocab_size(self) -> int:
        assert self.data is not None and self.start.model is not None
        return self.start.model.vocab_size or self.data.vocab_size

    async def write_all(self) -> None:
        while (snapshot := await self.snapshots.get()) is not None:
            if self.failed or self.abandoned.is_set():
                self.in_flight.release()  # dropped: the stage raises, or has ended
                continue
            try:
                item = await asyncio.to_thread(self._write, snapshot)
            except Exception:
                continue  # noted by _write: raised by the stage, or once it has ended
            del snapshot
            self.written.put_nowait(item)
        self.written.put_nowait(None)

    async def push_all(self) -> None:
        push = self.ctx.push_shard
        while (item := await self.written.get()) is not None:
            if push is None or self.abandoned.is_set():
                continue
            try:
                await push(self.start.job_id, self.start.stage, *item)
            except Exception:
                # The shard is on this fellow's disk either way: a push that fails in a way
                # nobody foresaw must not fail a job that trained, nor stop the later pushes.
                log.exception("%s: shard push of stage %d failed", self.start.job_id,
                              self.start.stage)

    def close(self, completed: bool) -> None:
        if not completed:
            self.abandoned.set()  # nobody wants the shards of a job that ended early
        self.snapshots.put_nowait(None)

    def raise_failure(self) -> None:
        if self.failed:  # the final shard: the job did not deliver its export
            raise ShardWriteError(self.failed.pop())


async def run_train(start: StageStart, ctx: JobContext) -> None:
    await TrainJob(start, ctx).run()


class TrainJob:
    """One stage of a train job on this fellow, from START to its COMPLETED report."""

    def __init__(self, start: StageStart, ctx: JobContext) -> None:
        self.start, self.ctx = start, ctx
        self.spec = StageSpec.from_start(start, threads=ctx.threads)
        self.training = self.spec.training
        self.stop = threading.Event()
        self.loop = asyncio.get_running_loop()
        self.reporter = StepReporter(start, ctx, self.loop)
        self.checkpointer = ShardCheckpointer(
            start, self.spec, ctx, export_root(self.training.export_dir, start.job_id) / "shards",
            self.loop, self.stop)
        self.initial: Checkpoint | None = None
        self.warm: dict[str, Any] | None = None  # a warm start's weights (see _prepare)
        self.own_state: tuple[dict[str, Any], bytes] | None = None  # (see _prepare)
        self.arriving: LayoutMove | None = None  # (see _moved)

    async def run(self) -> None:
        await self._prepare()
        self.ctx.progress.stage = self.start.stage
        links = self.ctx.links or LinkOverrides(self.ctx.shaper)
        if self.training.link is not None:
            links.hold(self.training.link)
        try:
            result = await self._train()
            while result.moved is not None:
                await self._moved(result.moved)
                result = await self._train()
        except StageDropped as exc:
            # The leader took this replica out of the job: nothing to report, and the
            # fellow is free for the next one.
            log.info("%s: %s", self.start.job_id, exc)
            return
        finally:
            if self.training.link is not None:
                # Whatever happened, the fellow's own limits come back for the next job.
                links.release()
            if self.ctx.shaper is not None and self.training.network is not None:
                # (the run's summary kept what its pairs moved; set-speed --to and the
                # heartbeat stop naming them)
                self.ctx.shaper.forget(self.start.job_id,
                                       cell_label(self.start.stage, self.start.replica))
        metrics = result.metrics
        metrics.shard_dir = str(self.checkpointer.root)
        await self.reporter.completed(self.training.steps, metrics, result.epoch)

    async def _moved(self, move: LayoutMove) -> None:
        """A move took this cell's peer (this fellow's slot) to another stage: it goes on
        as the cell the START every cell computed gives it (``StageStart.after_move``), its
        state handed round its new stage's ring; its steps so far are reported, and it
        reports as the new cell from the move's step on. The leader hears of the move from
        it before its heartbeat names the new cell (which the leader would otherwise stop as
        one its placement gives nobody): a report of the new cell, of no step's figures."""
        assert move.peer is not None
        if self.ctx.shaper is not None and self.training.network is not None:
            self.ctx.shaper.forget(self.start.job_id,
                                   cell_label(self.start.stage, self.start.replica))
        self.start = self.start.after_move(*move.peer, at=move.at, placement=move.placement)
        # (a resumed cell's checkpoint, a warm start's weights: its old stage's)
        self.initial = self.own_state = self.warm = None
        log.info("%s: this peer moves from stage %d cell %d to stage %d cell %d before step "
                 "%d", self.start.job_id, move.peer[0], move.peer[1], self.start.stage,
                 self.start.replica, move.at)
        await self.ctx.report(JobStatusUpdate(
            fellow_id=self.ctx.fellow_id, attempt=self.start.attempt, stage=self.start.stage,
            replica=self.start.replica, state="RUNNING", step=move.at, epoch=move.epoch,
            moved=PeerMove(move.at, *move.peer)))
        if self.ctx.moved is not None:
            self.ctx.moved(self.start)  # (the daemon files the task under the new cell)
        progress = self.ctx.progress
        progress.stage, progress.replica = self.start.stage, self.start.replica
        self.spec = StageSpec.from_start(self.start, threads=self.ctx.threads)
        self.reporter = StepReporter(self.start, self.ctx, self.loop)
        self.checkpointer = ShardCheckpointer(self.start, self.spec, self.ctx,
                                              self.checkpointer.root, self.loop, self.stop)
        self.arriving = move

    async def _prepare(self) -> None:
        """The checks and fetches before any thread starts: the device, the checkpoint."""
        start, spec = self.start, self.spec
        if spec.model.tie_weights and spec.num_stages > 1 and spec.stage == 0:
            log.warning("%s: tie_weights is off: the embedding and the LM head are on different "
                        "stages (0 and %d)", spec.job_id, spec.num_stages - 1)
        try:
            # In a thread: a first touch of a GPU creates its context, which takes seconds.
            await asyncio.to_thread(resolve_device, spec.device, spec.model.dtype)
        except DeviceError as exc:
            raise JobRefused(f"cannot run stage {spec.stage} on {exc}") from None
        if start.resume_step:
            if self.ctx.fetch_checkpoint is None:
                raise JobRefused("cannot resume: no way to fetch checkpoints")
            self.initial = await self.ctx.fetch_checkpoint(start.job_id, start.resume_step,
                                                           start.stage)
            own = self.initial[0].get("replica_states") or []
            if start.replica in own and self.ctx.fetch_replica_state is not None:
                # DiLoCo: this replica's AdamW moments are its own, pushed beside the shard.
                self.own_state = await self.ctx.fetch_replica_state(
                    start.job_id, start.resume_step, start.stage, start.replica)
        elif self.training.warm_start is not None and start.join is None:
            # (a joiner takes its group's state, whatever the job started from)
            self.warm = await self._warm_weights()

    async def _warm_weights(self) -> dict[str, Any]:
        """The source checkpoint's weights, of the stages that hold this cell's (see
        fellow/warm.py)."""
        warm = self.training.warm_start
        assert warm is not None
        if warm.step is None:  # (the leader resolves it at submit)
            raise JobRefused(f"cannot warm-start from {warm.job_id}: the leader named no step")
        fetch = self.ctx.fetch_weights
        if fetch is None:
            raise JobRefused(f"cannot warm-start from {warm.job_id}: no way to fetch its "
                             "checkpoint")
        spec = self.spec
        # (in a thread: building the module's names takes the part seeds' lock, which a
        # stage training with dropout on this fellow holds for a forward)
        wanted = await asyncio.to_thread(stage_state_names, spec.model, spec.layers[0],
                                         spec.layers[1], spec.stage, spec.num_stages)
        try:
            return await warm_weights(fetch, warm.job_id, warm.step, wanted,
                                      self.ctx.fetch_manifest)
        except (ShardError, ApiError) as exc:  # (ApiError: the leader's no, e.g. pruned)
            raise JobRefused(f"cannot warm-start from {warm.job_id} step {warm.step}: "
                             f"{exc}") from None

    async def _train(self) -> Any:
        """The stage thread beside the reporter, writer and pusher; the final shard reaches the
        leader before the stage says COMPLETED."""
        side = [asyncio.create_task(self.reporter.run()),
                asyncio.create_task(self.checkpointer.write_all()),
                asyncio.create_task(self.checkpointer.push_all())]  # (the pusher last)
        fut = self.loop.run_in_executor(None, self._work)
        completed = False
        try:
            result = await asyncio.shield(fut)
            completed = True
        except asyncio.CancelledError:
            self.stop.set()
            # Let the stage thread finish before this job counts as stopped: a thread still in
            # accept() would otherwise take the next job's connection.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(fut), self.training.frame_timeout_s)
            raise
        except DataError as exc:
            raise JobRefused(str(exc)) from None
        finally:
            outcomes = await self._wind_down(side, completed)
            del fut  # an exception from it holds this frame: no cycle back through fut
        # Only a completed run raises its side tasks' errors: otherwise the stage's own error
        # (a neighbour it blames, a cancellation) is what the job ends with.
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome
        self.checkpointer.raise_failure()
        return result

    async def _wind_down(self, side: list[asyncio.Task], completed: bool) -> list[Any]:
        """Wait for the side tasks, even if one of them failed. A job that ended early waits
        for a write under way only so long: a hung disk must not keep the fellow busy."""
        self.checkpointer.close(completed)
        self.reporter.close()
        if not completed:
            # A stopped job's shards stay on this disk; an upload under way must not keep the
            # fellow busy (a recovery waits for every fellow it stopped to say it is free).
            side[2].cancel()
        tasks = asyncio.gather(*side, return_exceptions=True)
        # Only our own time limit is swallowed: a cancellation from outside (the fellow
        # stopping) must reach whoever cancelled, not end the job as if it had completed.
        with contextlib.suppress(TimeoutError):
            return await (tasks if completed else
                          asyncio.wait_for(tasks, self.training.frame_timeout_s))
        return []

    def _load(self) -> TokenData:
        """In the stage's thread while its links are being opened (see run_stage)."""
        model, training = self.spec.model, self.training
        data = shared_token_data(training, model.seq_len, tokens=self.spec.reads_tokens,
                                 roots=self.ctx.data_roots)
        self.checkpointer.data = data
        if model.vocab_size is not None and model.vocab_size < data.vocab_size:
            # Token ids beyond the embedding would fail the first forward with an IndexError
            # (and the other stages with a closed link): say why instead, on every stage.
            raise JobRefused(f"model vocab_size {model.vocab_size} is smaller than the "
                             f"{training.tokenizer} tokenizer's {data.vocab_size} tokens")
        return data

    def _restored(self) -> tuple[Any, Any]:
        """Weights and optimiser state of the checkpoint to resume from; (None, None) for a
        fresh run."""
        if self.warm is not None:
            return self.warm, None  # (weights only: the moments start fresh)
        if self.initial is None:
            return None, None
        manifest, weights, optimizer = self.initial
        step = self.start.resume_step
        assert weights is not None
        try:
            state = shards.weights_from_checkpoint(manifest, weights)
            if self.own_state is not None:
                return state, shards.optimizer_from_checkpoint(*self.own_state)
            if self.start.replica in (manifest.get("replica_states") or []):
                # Pushed, but the leader no longer has it: the first member's moments, as a
                # replica that joins takes its donor's.
                log.warning("%s: no optimiser state of replica %d at step %d; resuming with "
                            "the first member's", self.start.job_id, self.start.replica, step)
            # A checkpoint from before optimiser state was pushed, or a leader that kept none,
            # resumes with fresh moments: the run continues, not exactly as it would.
            if optimizer is None and names_optimizer(manifest):
                log.warning("%s: no optimiser state at step %d from the leader; resuming with "
                            "fresh moments", self.start.job_id, step)
                return state, None
            return state, shards.optimizer_from_checkpoint(manifest, optimizer)
        except ShardError as exc:
            raise JobRefused(f"cannot resume from step {step}: {exc}") from None

    def _coordinate(self, rep: RegroupReport) -> RegroupOrder:  # the stage thread
        """Ask the leader what to do now that the group's ring broke, until it says (a
        regroup takes at most the heartbeat timeout once every survivor has asked). The
        stage's own links pulse meanwhile: it waits, it is not dead."""
        regroup = self.ctx.regroup
        if regroup is None:
            raise StageStopped()
        rep = attrs.evolve(rep, fellow_id=self.ctx.fellow_id, attempt=self.start.attempt)
        deadline = time.monotonic() + 4 * self.training.frame_timeout_s
        while True:
            if self.stop.is_set():
                raise StageStopped()
            fut = asyncio.run_coroutine_threadsafe(
                _awaited(regroup(self.start.job_id, rep, REGROUP_POLL_S)), self.loop)
            try:
                answer = fut.result(REGROUP_POLL_S + 15.0)
            except Exception as exc:
                if time.monotonic() > deadline or getattr(exc, "status", None) == 409:
                    raise StageDropped(f"no regroup order for replica {rep.replica}: "
                                       f"{exc}") from None
                time.sleep(0.5)
                continue
            if answer.order is not None:
                return answer.order
            if time.monotonic() > deadline:
                raise StageDropped(f"no regroup order for replica {rep.replica} within "
                                   f"{4 * self.training.frame_timeout_s:g}s")

    def _work(self) -> Any:  # the stage thread
        warm = self.warm is not None
        # (popped into the call: once the stage has loaded them, no frame holds a checkpoint,
        # nor a warm start's whole source model, for the run)
        held = list(self._restored())
        self.warm = None
        try:
            return run_stage(self.spec, self._load, self.ctx.shaper, self.ctx.listener,
                             self.stop, self.reporter.on_step, self.reporter.on_eval,
                             connect_timeout=self.training.frame_timeout_s,
                             on_checkpoint=self.checkpointer.on_checkpoint,
                             start_step=self.start.resume_step, initial_state=held.pop(0),
                             initial_optimizer=held.pop(0), own_keys=warm,
                             coordinator=self._coordinate if self.spec.replicas > 1 else None,
                             inbox=self.ctx.progress.told, pace=self.ctx.pace,
                             move=self.arriving)
        except BaseException as exc:
            # The traceback holds the stage's frames, and through them its model, optimiser
            # and activations; the awaiting frame holds the exception: a cycle that only a
            # full garbage collection frees, long after the next job wanted the memory.
            traceback.clear_frames(exc.__traceback__)
            held.clear()  # this frame is still running: clear_frames skips it
            if isinstance(exc, ResumeError):
                raise JobRefused(f"{self._resumed_from(warm)}: {exc}") from None
            raise

    def _resumed_from(self, warm: bool) -> str:
        """What a checkpoint that does not fit this stage failed to do, for its refusal."""
        source = self.training.warm_start
        if warm and source is not None:
            return f"cannot warm-start from {source.job_id} step {source.step}"
        return f"cannot resume from step {self.start.resume_step}"


def export_root(export_dir: str | None, job_id: str) -> Path:
    """Where this fellow writes its shards: always under its own runs directory."""
    from swarm_core.paths import ensure_private_dir, swarm_home

    # 0700: what a fellow writes for its jobs is no other local user's to read.
    runs = ensure_private_dir(swarm_home() / "runs").resolve()
    root = (runs / (export_dir or ".") / job_id / "model_export").resolve()
    # resolve() follows symlinks: a link planted inside runs/ cannot lead out of it.
    if not root.is_relative_to(runs):
        raise JobRefused(f"export_dir {export_dir!r} leads outside {runs}")
    return root
