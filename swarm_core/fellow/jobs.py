"""What a fellow runs when START arrives, by job kind.

``smoke`` is a control-plane check: it walks the job through RUNNING steps to COMPLETED without
training anything, so a new cluster can be shown to dispatch, report and finish. ``train`` runs
this fellow's pipeline stage (:mod:`swarm_core.pipeline.stage`) in a thread, streaming each
step's loss, tokens/s and wire bytes back to the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import traceback
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs

from swarm_core.artifacts.layout import names_optimizer
from swarm_core.protocol import JobStatusUpdate, SmokeTraining, perplexity
from swarm_core.schema import SchemaError, structure

log = logging.getLogger(__name__)

SNAPSHOTS_IN_FLIGHT = 2  # checkpoint copies a stage may have waiting for the shard writer

Report = Callable[[JobStatusUpdate], Awaitable[None]]
# (job_id, stage, manifest, weights.npz bytes, optimizer.npz bytes or None)
PushShard = Callable[[str, int, dict[str, Any], bytes, bytes | None], Awaitable[None]]
Checkpoint = tuple[dict[str, Any], bytes, bytes | None]


@attrs.define
class Progress:
    """What the fellow's heartbeat says about the job in hand."""

    job_id: str | None = None
    stage: int | None = None
    step: int = 0
    loss: float | None = None
    tokens_per_s: float = 0.0


class JobRefused(Exception):
    pass


_loaded: dict[tuple, weakref.ref] = {}
_loads: dict[tuple, threading.Lock] = {}  # one per corpus: a second stage waits for the first
_lookup = threading.Lock()


def _corpus_key(training: Any, seq_len: int) -> tuple:
    """What the loaded data depends on, the files' sizes and times included: an edited or added
    file is a new corpus."""
    from swarm_core.data.datasets import DataError, textfiles_paths

    files: tuple = ()
    if training.dataset == "textfiles":
        try:
            files = tuple((f, (st := os.stat(f)).st_mtime_ns, st.st_size)
                          for f in textfiles_paths(training.dataset_paths))
        except (DataError, OSError):
            files = ()  # the load says what is wrong
    return (training.dataset, tuple(training.dataset_paths), files, training.tokenizer,
            training.bpe_vocab_size, training.validation_fraction, training.real_min_tokens,
            seq_len)


def shared_token_data(training: Any, seq_len: int, tokens: bool) -> Any:
    """``load_token_data``, once per process for the stages that run in it at the same time
    (a fellow's device slots): they share one copy of the corpus, freed with the last of them.
    A stage that reads no tokens takes a loaded copy if there is one."""
    from swarm_core.data import load_token_data

    key = _corpus_key(training, seq_len)

    def cached() -> Any:
        for want in ((True, False) if not tokens else (True,)):
            ref = _loaded.get((*key, want))
            if ref is not None and (data := ref()) is not None:
                return data
        return None

    with _lookup:
        data = cached()
        if data is not None:
            return data
        if not tokens and training.tokenizer == "byte":
            return load_token_data(training, seq_len, tokens=False)  # nothing to read
        lock = _loads.setdefault((*key, tokens), threading.Lock())
    with lock:
        with _lookup:
            data = cached()
        if data is None:
            data = load_token_data(training, seq_len, tokens=tokens)
            with _lookup:
                for k in [k for k, r in _loaded.items() if r() is None]:
                    del _loaded[k]
                    _loads.pop(k, None)
                _loaded[(*key, tokens)] = weakref.ref(data)
        return data


class ShardWriteError(OSError):
    """A checkpoint's shard could not be written to this fellow's disk."""


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
    shaper: Any = None  # swarm_core.pipeline.links.LinkShaper (torch-side, imported lazily)
    listener: Any = None  # swarm_core.pipeline.listener.DataListener
    threads: int = 1
    fellow_name: str = ""
    push_shard: PushShard | None = None
    # (job_id, step, stage) -> (manifest, weights.npz, optimizer.npz or None) from the leader
    fetch_checkpoint: Callable[[str, int, int], Awaitable[Checkpoint]] | None = None
    links: LinkOverrides | None = None  # the daemon's; None: this job's own view of the shaper


async def run_smoke(start: dict[str, Any], ctx: JobContext) -> None:
    try:
        smoke = structure(start.get("training") or {}, SmokeTraining, "training")
    except SchemaError as exc:
        raise JobRefused(f"smoke job: {exc}") from None
    steps, step_s = smoke.steps, smoke.step_seconds
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        await asyncio.sleep(step_s)
        ctx.progress.step = step
        await ctx.report(JobStatusUpdate(fellow_id=ctx.fellow_id, state="RUNNING", step=step,
                                         stage=ctx.progress.stage))
    elapsed = time.monotonic() - t0
    await ctx.report(JobStatusUpdate(
        fellow_id=ctx.fellow_id, state="COMPLETED", step=steps, stage=ctx.progress.stage,
        message=f"smoke: {steps} control-plane round trips in {elapsed:.2f}s",
    ))


def import_engine() -> None:
    """Load the training engine (torch and friends). The daemon calls this in a thread at start
    so that the first START does not pay for it."""
    import swarm_core.artifacts.shards
    import swarm_core.data
    import swarm_core.pipeline.stage  # noqa: F401


async def run_train(start: dict[str, Any], ctx: JobContext) -> None:
    # Importing torch takes seconds; in a worker thread, so heartbeats keep flowing meanwhile.
    await asyncio.to_thread(import_engine)
    from swarm_core.artifacts.shards import (
        ShardError,
        build_manifest,
        npz_bytes,
        optimizer_from_checkpoint,
        state_arrays,
        weights_from_checkpoint,
        write_shard,
    )
    from swarm_core.config.schemas import ModelConfig, TrainingConfig
    from swarm_core.data import DataError, TokenData
    from swarm_core.pipeline.devices import DeviceError, resolve_device
    from swarm_core.pipeline.optim import optimizer_arrays
    from swarm_core.pipeline.stage import (
        ResumeError,
        StageSpec,
        StageStopped,
        StepReport,
        run_stage,
    )

    try:
        model = structure(start.get("model") or {}, ModelConfig, "$.model")
        training = structure(start.get("training") or {}, TrainingConfig, "$.training")
        # The fellow's --threads is what its machine can give; the job's number is for the
        # single-process reference.
        training = attrs.evolve(training, threads=ctx.threads)
        stage = int(start["stage"])
        stages = start["placement"]["stages"]
        if not 0 <= stage < len(stages):
            raise IndexError(f"stage {stage} of a {len(stages)}-stage placement")
        mine = stages[stage]
        layers = (int(mine["layers"]["start"]), int(mine["layers"]["stop"]))
        downstream = stages[stage + 1]["data_addr"] if stage + 1 < len(stages) else None
        if stage + 1 < len(stages) and not (isinstance(downstream, str) and ":" in downstream):
            raise ValueError(f"stage {stage + 1} has no data address to dial: {downstream!r}")
        here = mine.get("fellow_id")
        spec = StageSpec(job_id=start["job_id"], key=start["key"], stage=stage,
                         num_stages=len(stages), layers=layers, downstream_addr=downstream,
                         model=model, training=training, device=str(mine.get("device", "cpu")),
                         local_up=here is not None and stage > 0
                         and stages[stage - 1].get("fellow_id") == here,
                         local_down=here is not None and stage + 1 < len(stages)
                         and stages[stage + 1].get("fellow_id") == here)
    except (SchemaError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise JobRefused(f"bad START payload: {exc}") from None
    if model.tie_weights and spec.num_stages > 1 and stage == 0:
        log.warning("%s: tie_weights is off: the embedding and the LM head are on different "
                    "stages (0 and %d)", spec.job_id, spec.num_stages - 1)
    try:
        # In a thread: a first touch of a GPU creates its context, which takes seconds.
        await asyncio.to_thread(resolve_device, spec.device, model.dtype)
    except DeviceError as exc:
        raise JobRefused(f"cannot run stage {stage} on {exc}") from None

    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[JobStatusUpdate | None] = asyncio.Queue()
    stop = threading.Event()
    fid = ctx.fellow_id
    attempt = int(start.get("attempt") or 0)

    def on_step(rep: StepReport) -> None:  # runs in the stage thread
        ctx.progress.step = rep.step
        if rep.loss is not None:
            ctx.progress.loss = rep.loss
        ctx.progress.tokens_per_s = rep.tokens_per_s
        upd = JobStatusUpdate(fellow_id=fid, state="RUNNING", step=rep.step, loss=rep.loss,
                              tokens_per_s=rep.tokens_per_s, attempt=attempt,
                              stage=stage,
                              metrics={"wire_tx_bytes": rep.wire_tx_bytes,
                                       "step_seconds": rep.seconds, "lr": rep.lr,
                                       "activation_peak_bytes": rep.activation_peak_bytes,
                                       "wait_seconds": rep.wait_seconds,
                                       "codec_error": rep.codec_error})
        loop.call_soon_threadsafe(updates.put_nowait, upd)

    def on_eval(step: int, loss: float) -> None:
        upd = JobStatusUpdate(fellow_id=fid, state="RUNNING", step=step, attempt=attempt,
                              stage=stage,
                              metrics={"eval_loss": loss, "perplexity": perplexity(loss)})
        loop.call_soon_threadsafe(updates.put_nowait, upd)

    async def reporter() -> None:
        # One at a time and in order, so the leader never sees step 5 after step 6.
        while (upd := await updates.get()) is not None:
            await ctx.report(upd)

    export_root = _export_root(training.export_dir, spec.job_id) / "shards"
    # Snapshots of (step, weights, optimiser state), written to disk and pushed in order.
    snapshots: asyncio.Queue[tuple[int, dict, dict] | None] = asyncio.Queue()
    written: asyncio.Queue[Checkpoint | None] = asyncio.Queue()
    holder: dict[str, Any] = {}
    # A checkpoint costs the stage thread only a copy of its state; the writer serialises,
    # hashes and fsyncs it (seconds for a large stage) while training goes on, and the pusher
    # sends what was written. At most SNAPSHOTS_IN_FLIGHT copies wait for the writer: a stage
    # that checkpoints faster than it can write waits instead of piling them up.
    in_flight = threading.BoundedSemaphore(SNAPSHOTS_IN_FLIGHT)
    write_failed: list[str] = []  # why the first write failed, until one raises it
    abandon = threading.Event()  # the job ended without completing: drop what is pending

    def on_checkpoint(step: int, module: Any, opt: Any) -> None:  # runs in the stage thread
        while not in_flight.acquire(timeout=0.5):
            if stop.is_set():
                raise StageStopped()
        if write_failed:  # a write the writer could not do fails the stage, as it used to
            in_flight.release()
            raise ShardWriteError(write_failed.pop())
        snapshot = (step, state_arrays(module), optimizer_arrays(opt, module))
        loop.call_soon_threadsafe(snapshots.put_nowait, snapshot)

    def write(step: int, arrays: dict, opt_arrays: dict) -> Checkpoint:  # a worker thread
        try:
            weights = npz_bytes(arrays)
            optimizer = npz_bytes(opt_arrays)
            data = holder["data"]
            manifest = build_manifest(
                job_id=spec.job_id, stage=stage, num_stages=spec.num_stages, fellow_id=fid,
                fellow_name=ctx.fellow_name, layers=layers, step=step,
                model=start.get("model") or {}, seed=training.seed,
                vocab_size=model.vocab_size or data.vocab_size,
                tokenizer=data.tokenizer.spec(), arrays=arrays, weights=weights,
                slot=int(mine.get("slot", 0)), device=spec.device,
                training=start.get("training"), optimizer=optimizer)
            write_shard(export_root, manifest, weights, optimizer)
            return manifest, weights, optimizer
        except Exception as exc:
            # Noted before the copy's slot is freed, so the stage's next checkpoint sees it.
            # (A new exception is raised there: this one's traceback holds the writer's
            # frames, which the stage's clean-up would clear.)
            write_failed.append(f"cannot write the shard of step {step}: "
                                f"{type(exc).__name__}: {exc}")
            raise
        finally:
            in_flight.release()

    async def writer() -> None:
        while (snapshot := await snapshots.get()) is not None:
            if write_failed or abandon.is_set():
                in_flight.release()  # dropped: the stage raises, or has ended
                continue
            try:
                item = await asyncio.to_thread(write, *snapshot)
            except Exception:
                continue  # noted by write(): raised by the stage, or once it has ended
            del snapshot
            written.put_nowait(item)
        written.put_nowait(None)

    async def pusher() -> None:
        while (item := await written.get()) is not None:
            if ctx.push_shard is None or abandon.is_set():
                continue
            try:
                await ctx.push_shard(spec.job_id, stage, *item)
            except Exception:
                # The shard is on this fellow's disk either way: a push that fails in a way
                # nobody foresaw must not fail a job that trained, nor stop the later pushes.
                log.exception("%s: shard push of stage %d failed", spec.job_id, stage)

    resume_step = int(start.get("resume_step") or 0)
    initial: Checkpoint | None = None
    if resume_step:
        if ctx.fetch_checkpoint is None:
            raise JobRefused("cannot resume: no way to fetch checkpoints")
        initial = await ctx.fetch_checkpoint(spec.job_id, resume_step, stage)

    def load() -> TokenData:
        # In the stage's thread while its links are being opened (see run_stage).
        data = shared_token_data(training, model.seq_len, tokens=spec.reads_tokens)
        holder["data"] = data
        if model.vocab_size is not None and model.vocab_size < data.vocab_size:
            # Token ids beyond the embedding would fail the first forward with an IndexError
            # (and the other stages with a closed link): say why instead, on every stage.
            raise JobRefused(f"model vocab_size {model.vocab_size} is smaller than the "
                             f"{training.tokenizer} tokenizer's {data.vocab_size} tokens")
        return data

    def work() -> dict[str, Any]:
        state = opt_state = None
        if initial is not None:
            manifest, weights, optimizer = initial
            try:
                state = weights_from_checkpoint(manifest, weights)
                # A checkpoint from before optimiser state was pushed, or a leader that kept
                # none, resumes with fresh moments: the run continues, not exactly as it would.
                if optimizer is None and names_optimizer(manifest):
                    log.warning("%s: no optimiser state at step %d from the leader; resuming "
                                "with fresh moments", spec.job_id, resume_step)
                else:
                    opt_state = optimizer_from_checkpoint(manifest, optimizer)
            except ShardError as exc:
                raise JobRefused(f"cannot resume from step {resume_step}: {exc}") from None
        try:
            return run_stage(spec, load, ctx.shaper, ctx.listener, stop, on_step, on_eval,
                             connect_timeout=training.frame_timeout_s,
                             on_checkpoint=on_checkpoint, start_step=resume_step,
                             initial_state=state, initial_optimizer=opt_state)
        except BaseException as exc:
            # The traceback holds the stage's frames, and through them its model, optimiser
            # and activations; the awaiting frame holds the exception: a cycle that only a
            # full garbage collection frees, long after the next job wanted the memory.
            traceback.clear_frames(exc.__traceback__)
            state = opt_state = None  # this frame is still running: clear_frames skips it
            if isinstance(exc, ResumeError):
                raise JobRefused(f"cannot resume from step {resume_step}: {exc}") from None
            raise

    ctx.progress.stage = stage
    links = ctx.links or LinkOverrides(ctx.shaper)
    if training.link is not None:
        links.hold(training.link)
    side_tasks = [asyncio.create_task(reporter()), asyncio.create_task(writer()),
                  asyncio.create_task(pusher())]
    fut = loop.run_in_executor(None, work)
    completed = False
    try:
        metrics = await asyncio.shield(fut)
        completed = True
    except asyncio.CancelledError:
        stop.set()
        # Let the stage thread finish before this job counts as stopped: a thread still in
        # accept() would otherwise take the next job's connection.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(fut), training.frame_timeout_s)
        raise
    except DataError as exc:
        raise JobRefused(str(exc)) from None
    finally:
        if not completed:
            abandon.set()  # nobody wants the shards of a job that ended early
        updates.put_nowait(None)
        snapshots.put_nowait(None)
        outcomes: list[Any] = []
        try:
            # The final shard reaches the leader before the stage says COMPLETED; the side
            # tasks are waited for even if one of them failed. A job that ended early waits
            # for a write under way only so long: a hung disk must not keep the fellow busy.
            tasks = asyncio.gather(*side_tasks, return_exceptions=True)
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                outcomes = await (tasks if completed else
                                  asyncio.wait_for(tasks, training.frame_timeout_s))
        finally:
            # Whatever happened above, the fellow's own limits come back for the next job.
            if training.link is not None:
                links.release()
        fut = None  # an exception from it holds this frame: no cycle back through fut
    # Only a completed run raises its side tasks' errors: otherwise the stage's own error (a
    # neighbour it blames, a cancellation) is what the job ends with.
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    if write_failed:  # the final shard: the job did not deliver its export
        raise ShardWriteError(write_failed.pop())
    metrics["shard_dir"] = str(export_root)
    metrics.pop("losses", None)
    await ctx.report(JobStatusUpdate(
        fellow_id=fid, state="COMPLETED", step=training.steps, attempt=attempt, stage=stage,
        loss=metrics.get("final_loss"), tokens_per_s=metrics.get("tokens_per_s"),
        message=f"stage {stage} finished", metrics=metrics,
    ))


def _export_root(export_dir: str | None, job_id: str) -> Path:
    """Where this fellow writes its shards: always under its own runs directory."""
    from swarm_core.paths import swarm_home

    runs = (swarm_home() / "runs").resolve()
    root = (runs / (export_dir or ".") / job_id / "model_export").resolve()
    # resolve() follows symlinks: a link planted inside runs/ cannot lead out of it.
    if not root.is_relative_to(runs):
        raise JobRefused(f"export_dir {export_dir!r} leads outside {runs}")
    return root


async def run_job(start: dict[str, Any], ctx: JobContext) -> None:
    kind = start.get("kind")
    if kind == "smoke":
        await run_smoke(start, ctx)
    elif kind == "train":
        await run_train(start, ctx)
    else:
        raise JobRefused(f"unknown job kind {kind!r}")
