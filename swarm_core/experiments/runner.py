"""Running an experiment config against a leader: preflight, queue, monitor, write artifacts.

Used by ``swarm sweep`` and ``exp/scripts/run_experiment.py``. Client side only: everything goes
through :class:`swarm_core.client.SwarmClient`.

Per run, ``<runs_dir>/<run_id>/``: ``manifest.json``, ``config_resolved.json``,
``topology_snapshot.json``, ``train_progress.ndjson``, ``metrics_summary.json``; all written
atomically. With tracking (TensorBoard by default when installed), ``tb/`` too, written while
the run trains.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

import swarm_core
from swarm_core import jsonio
from swarm_core.artifacts.fetch import FetchError, fetch_export
from swarm_core.client import ApiError, ClientError, LeaderUnreachable, SwarmClient
from swarm_core.config.profiles import ResolvedExperiment, RunSpec
from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.config.traces import ChurnScript
from swarm_core.contract import (
    CodecErrors,
    JobInfo,
    Placement,
    ProgressRecord,
    Restart,
    link_changes_in_all,
    stage_of_label,
)
from swarm_core.contract.metrics import MetricName
from swarm_core.experiments.replay import (
    FellowProcesses,
    ReplayError,
    check_processes,
    local_processes,
    replay_for,
)
from swarm_core.experiments.report import link_mbps
from swarm_core.experiments.summary import MetricsSummary, Threshold, summary_json
from swarm_core.paths import atomic_write
from swarm_core.pipeline.wire_math import (
    run_wire_bytes,
    step_boundary_bytes,
    uncompressed_model,
)
from swarm_core.protocol import FellowInfo, JobState
from swarm_core.schema import SchemaError, structure, unstructure
from swarm_core.tracking import Tracking, TrackingError, TrackingUnavailable
from swarm_core.tracking.run_log import TB_DIR, RunLog, open_sinks, settled

TERMINAL = {s.value for s in JobState if s.terminal}
# How long a run's churn/trace replay may take to wind up once its job has ended (it sees the
# end within a second; a fellow it owes a restart is started before it returns).
REPLAY_END_S = 30.0
SCRIPTS = Path(__file__).resolve().parents[2] / "exp" / "scripts"


class ExperimentError(Exception):
    pass


@attrs.define
class RunState:
    spec: RunSpec
    run_id: str
    run_dir: Path
    job_id: str | None = None
    state: str = "QUEUED"
    last_step: int = 0
    last_loss: float | None = None
    note: str = ""
    reported: tuple[str, int] = ("", -1)

    def run_name_base(self) -> str:
        """The run's name without a ``-rN`` repeat suffix."""
        name = self.spec.run_name
        head, _, tail = name.rpartition("-r")
        return head if head and tail.isdigit() and self.spec.repeat == int(tail) else name


def _write(path: Path, data: Any) -> None:
    atomic_write(path, jsonio.dumps(data, pretty=True))


def git_commit(start: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=start, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def active(fellows: list[FellowInfo]) -> list[FellowInfo]:
    return [f for f in fellows if f.status.live]


async def preflight(client: SwarmClient, exp: ResolvedExperiment) -> list[FellowInfo]:
    """The cluster_profile against the leader's active fellows; fails before anything runs."""
    fellows = active(await client.fellows())
    if not fellows:
        raise ExperimentError(
            f"the leader at {client.base_url} has no active fellow; start some (swarm fellow, "
            "or swarm restart-cluster) - runs never execute standalone")
    biggest = max(exp.runs, key=lambda r: r.fellows)
    need = biggest.fellows
    if len(fellows) < need:
        names = ", ".join(f"{f.fellow_id}:{f.name}" for f in fellows)
        # (a sweep's replicas axis, not the profile, may be what asks for more)
        who = "cluster_profile" if biggest.replicas == exp.profile.cluster_profile.replicas \
            else f"run {biggest.run_name} ({biggest.stages}x{biggest.replicas})"
        raise ExperimentError(
            f"{who} wants {need} fellow(s); the leader at {client.base_url} has "
            f"{len(fellows)} active ({names})")
    return fellows


def run_ids(exp: ResolvedExperiment, stamp: str) -> list[str]:
    return [f"{stamp}-{exp.config.name}-{r.index:02d}-{r.run_name}" for r in exp.runs]


class Experiment:
    def __init__(self, client: SwarmClient, exp: ResolvedExperiment, *,
                 runs_dir: Path | None = None, on_line: Callable[[str], None] = print,
                 skip_netem: bool = False, poll_s: float = 1.0,
                 stamp: str | None = None, names: list[str] | None = None,
                 stop_on_failure: bool = False, tracking: Tracking | None = None,
                 on_update: Callable[[RunState, str | None], None] | None = None,
                 processes: FellowProcesses | None = None) -> None:
        self.client = client
        self.exp = exp
        self.runs_dir = runs_dir or exp.runs_dir
        self.on_line = on_line
        self.skip_netem = skip_netem
        self.poll_s = poll_s
        self.commit = git_commit(Path(exp.config_path).resolve().parent)
        # Stamped ids are claimed (new folders) at start; given names reuse theirs.
        stamp = stamp or time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self._stamp = None if names else stamp
        ids = names or run_ids(exp, stamp)
        self.states = [RunState(spec, rid, self.runs_dir / rid)
                       for spec, rid in zip(exp.runs, ids, strict=True)]
        self.stop_on_failure = stop_on_failure
        self.fellows_at_start: list[FellowInfo] = []
        self.tracking = tracking if tracking is not None else Tracking.default()
        # Each open run after each poll, with its progress line when it would be printed
        # (a progress bar per run uses it); by default, that line goes to on_line.
        self.on_update = on_update
        self._logs: dict[str, RunLog] = {}  # the tracking of runs that are open
        self._untracked: set[str] = set()  # runs whose tracking failed (said once)
        # Kills and joins of a churn replay: the local cluster's processes unless given.
        self.processes = processes
        self._replays: dict[str, asyncio.Task[None]] = {}  # run id -> its trace/churn replay
        self.warm_up_job: str | None = None  # (sweep.warm_up's, while it trains)

    @property
    def sequential(self) -> bool:
        """Kernel shaping must wrap each run, so such sweeps queue one run at a time."""
        return any(r.tc_profile for r in self.exp.runs) and not self.skip_netem

    # phases ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Preflight, write each run's static artifacts, queue every run (unless sequential).
        All or nothing: when the leader refuses a run, the runs queued before it are cancelled
        and ExperimentError says which run and why."""
        self.fellows_at_start = await preflight(self.client, self.exp)
        self._check_churn()
        warm_up = self.exp.config.sweep.warm_up
        if warm_up is not None:
            await self._warm_up(warm_up.steps)
        try:
            if self._stamp is not None:
                self._claim_run_dirs(self._stamp)
            for st in self.states:
                self._write_static(st)
        except OSError as exc:
            raise ExperimentError(f"cannot write run artifacts under {self.runs_dir}: "
                                  f"{exc.strerror or exc}") from None
        if self.sequential:
            return
        for st in self.states:
            try:
                await self._submit(st)
            except ClientError as exc:
                cancelled: list[str] = []
                with contextlib.suppress(ClientError):
                    cancelled = await self.cancel_open()
                for other in self.states:
                    if other.job_id and other.job_id in cancelled:
                        other.state = "CANCELLED"
                    other.note = f"sweep not queued: run {st.spec.index + 1} was refused"
                    with contextlib.suppress(OSError):
                        self._write_manifest(other)
                undone = f"; cancelled the {len(cancelled)} run(s) queued before it" \
                    if cancelled else ""
                raise ExperimentError(f"run {st.spec.index + 1}/{len(self.states)} "
                                      f"{st.spec.run_name}: the leader refused it: {exc}{undone}"
                                      ) from None

    async def run(self) -> list[RunState]:
        """Queue (or, with tc profiles, run one by one) and monitor until every run ends."""
        if self.sequential:
            for st in self.states:
                tc = st.spec.tc_profile
                log: dict[str, Any] = {"tc_profile": tc}
                try:
                    if tc:  # (a thread: the script may take a while; the loop keeps going)
                        log["setup"] = await asyncio.to_thread(netem, "setup", tc)
                    await self._submit(st)
                    await self._monitor([st])
                except ExperimentError as exc:
                    st.state, st.note = "FAILED", str(exc)
                    self._write_manifest(st)
                    self.on_line(f"[{st.spec.index + 1}/{len(self.states)}] "
                                 f"{st.spec.run_name} FAILED: {exc}")
                finally:
                    if tc:
                        log["cleanup"] = await asyncio.to_thread(netem, "cleanup", tc, False)
                        _write(st.run_dir / "netem.json", log)
        else:
            await self._monitor(self.states)
        for task in self._replays.values():  # (a run that never finalized: nothing to play)
            task.cancel()
        self.close_tracking()
        return self.states

    def close_tracking(self) -> None:
        """Close what tracking is still open (a sweep that stops early, or is interrupted)."""
        for st in self.states:
            log = self._logs.pop(st.run_id, None)
            if log is not None:
                with contextlib.suppress(TrackingError):
                    log.close(st.state)

    def open_jobs(self) -> list[str]:
        """The jobs this sweep queued that have not ended: its warm-up's, its runs'."""
        runs = [st.job_id for st in self.states if st.job_id and st.state not in TERMINAL]
        return ([self.warm_up_job] if self.warm_up_job else []) + runs

    async def cancel_open(self) -> list[str]:
        cancelled = []
        if self.warm_up_job is not None:
            with contextlib.suppress(Exception):  # (finished in the meantime)
                await self.client.cancel(self.warm_up_job)
                cancelled.append(self.warm_up_job)
        for st in self.states:
            if st.job_id and st.state not in TERMINAL:
                try:
                    await self.client.cancel(st.job_id)
                    cancelled.append(st.job_id)
                except Exception:  # already finished in the meantime
                    continue
        return cancelled

    # tracking --------------------------------------------------------------------------------
    def _log(self, st: RunState, job: JobInfo) -> RunLog | None:
        """The run's tracking, opened when first needed (so a sweep of a hundred queued runs
        holds one or two event files open, not a hundred); None once it has failed."""
        log = self._logs.get(st.run_id)
        if log is not None or st.run_id in self._untracked:
            return log
        try:
            log = RunLog(st.run_id, open_sinks(self.tracking, st.run_dir / TB_DIR,
                                               self.exp.config.name, st.run_id))
            log.begin(self._resolved(st), job.started_at)
        except (TrackingUnavailable, TrackingError) as exc:
            self._tracking_failed(st, exc)
            return None
        self._logs[st.run_id] = log
        return log

    def _tracking_failed(self, st: RunState, exc: Exception) -> None:
        """Tracking is a copy of what the run directory holds: its failure is said once and
        the run goes on."""
        self._untracked.add(st.run_id)
        log = self._logs.pop(st.run_id, None)
        if log is not None:
            with contextlib.suppress(TrackingError, OSError):
                log.close("FAILED")
        self.on_line(f"{st.run_id}: tracking stopped: {exc}")

    def _feed(self, log: RunLog, job: JobInfo, lines: list[dict[str, Any]]) -> None:
        log.restarts([unstructure(r) for r in job.restarts])
        log.link_changes([unstructure(c) for c in job.link_changes])
        log.progress(lines)

    async def _track(self, st: RunState, job: JobInfo) -> None:
        """Give the run's tracking the steps that settled since the last poll."""
        log = self._log(st, job)
        if log is None or st.job_id is None:
            return
        try:
            log.restarts([unstructure(r) for r in job.restarts])  # (may move log.step back)
            try:
                records = await self.client.progress(st.job_id, after=log.step)
            except ClientError:
                return  # the next poll, or the run's end, fills it in
            cells = len(job.placement.stages) if job.placement else len(job.fellows)
            self._feed(log, job, [progress_line(r) for r in settled(records, cells)])
            log.flush()
        except (TrackingError, OSError) as exc:
            self._tracking_failed(st, exc)

    def _track_end(self, st: RunState, job: JobInfo, progress: list[dict[str, Any]]) -> None:
        """The rest of the run, as its ``train_progress.ndjson`` holds it, then closed."""
        log = self._log(st, job)
        if log is None:
            return
        try:
            self._feed(log, job, progress)
            self._logs.pop(st.run_id, None)
            log.close(job.state)
        except (TrackingError, OSError) as exc:
            self._tracking_failed(st, exc)

    # internals -------------------------------------------------------------------------------
    def _check_churn(self) -> None:
        """A churn script that kills fellows needs their processes: refused up front where
        there are none (a remote cluster), before anything is queued."""
        for st in self.states:
            if st.spec.churn is None:
                continue
            script = structure(st.spec.churn, ChurnScript)
            if script.kills and self.processes is None:
                self.processes = local_processes(self.client.base_url)
            try:
                check_processes(script, st.spec.run_name, self.client.base_url,
                                self.processes)
            except ReplayError as exc:
                raise ExperimentError(str(exc)) from None

    async def _warm_up(self, steps: int) -> None:
        """``sweep.warm_up``: the first run's job (without its variant's overrides),
        ``steps`` long, trained before the grid (unshaped and data parallel: it only makes
        the weights every run starts from, and no method of the grid is favoured); each run
        then warm-starts from its last checkpoint,
        which its ``config_resolved.json`` names (``training.warm_start``)."""
        name = f"{self.exp.config.name}-warm-up"
        try:
            job = await self.client.submit(self.exp.warm_up(steps).job(name))
        except (ClientError, SchemaError) as exc:
            raise ExperimentError(f"the warm-up job ({steps} steps of run 1): {exc}") from None
        self.warm_up_job = job.job_id
        self.on_line(f"[warm-up] {name} {job.job_id} {job.state}: {steps} steps, then every "
                     "run from its weights")
        said = (job.state, -1)
        while job.state not in TERMINAL:
            await _sleep(self.poll_s)
            with contextlib.suppress(LeaderUnreachable):
                job = await self.client.job(job.job_id)
            if (job.state, job.last_step // 25) != said:
                said = (job.state, job.last_step // 25)
                loss = "-" if job.last_loss is None else f"{job.last_loss:.4f}"
                self.on_line(f"[warm-up] {job.job_id} {job.state} step {job.last_step} "
                             f"loss {loss}")
        self.warm_up_job = None  # (over: nothing of it to cancel)
        try:  # (its final view beside the runs: what they started from)
            self.runs_dir.mkdir(parents=True, exist_ok=True)
            _write(self.runs_dir / f"{name}-{job.job_id}.json", unstructure(job))
        except OSError as exc:
            raise ExperimentError(f"cannot write the warm-up's record under {self.runs_dir}: "
                                  f"{exc.strerror or exc}") from None
        if job.state != "COMPLETED":
            raise ExperimentError(f"the warm-up job {job.job_id} ended {job.state}: "
                                  f"{job.reason}; no run was queued")
        for st in self.states:
            st.spec = attrs.evolve(st.spec, training={
                **st.spec.training, "warm_start": {"job_id": job.job_id, "step": steps}})

    async def _submit(self, st: RunState) -> None:
        job = await self.client.submit(st.spec.job(st.run_id))
        st.job_id, st.state, st.note = job.job_id, job.state, job.waiting_for
        self._write_manifest(st)
        replay = replay_for(self.client, job.job_id, st.run_dir, st.spec.network,
                            st.spec.churn, st.spec.seed, self.processes, self.on_line)
        if replay is not None:
            self._replays[st.run_id] = asyncio.create_task(replay.run())

    async def _end_replay(self, st: RunState) -> None:
        """Let the run's replay see its job's end and write its timeline (a fellow it owes
        a restart is started first); cut off if it takes long."""
        task = self._replays.pop(st.run_id, None)
        if task is None:
            return
        try:
            await asyncio.wait_for(task, REPLAY_END_S)
        except TimeoutError:
            self.on_line(f"{st.run_id}: the churn/trace replay did not end in "
                         f"{REPLAY_END_S:g} s; cut off")
        except Exception as exc:  # (the run stands; its replay's failure is said)
            self.on_line(f"{st.run_id}: the churn/trace replay failed: {exc}")

    async def _monitor(self, states: list[RunState]) -> None:
        total = len(self.states)
        lost = False
        while True:
            try:
                jobs = await self._our_jobs(states)
            except LeaderUnreachable as exc:
                # The runs live on the leader; a restart or a network blip is waited out.
                if not lost:
                    self.on_line(f"leader unreachable ({exc}); still waiting for it")
                lost = True
                await _sleep(self.poll_s)
                continue
            if lost:
                self.on_line("leader reachable again")
                lost = False
            open_runs = 0
            for st in states:
                job = jobs.get(st.job_id or "")
                if job is None or st.state in TERMINAL:
                    continue
                st.state, st.last_step, st.last_loss = job.state, job.last_step, job.last_loss
                st.note = job.waiting_for or job.reason
                key = (st.state, st.last_step // 5)
                line = None
                if key != st.reported:
                    st.reported = key
                    loss = "-" if st.last_loss is None else f"{st.last_loss:.4f}"
                    why = f" ({st.note})" if st.note and st.state != "RUNNING" else ""
                    line = (f"[{st.spec.index + 1}/{total}] {st.spec.run_name} "
                            f"{st.job_id} {st.state} step {st.last_step} loss {loss}{why}")
                if self.on_update is not None:
                    self.on_update(st, line)
                elif line is not None:
                    self.on_line(line)
                if st.state == "RUNNING" and self.tracking.enabled:
                    await self._track(st, job)
                if st.state in TERMINAL:
                    await self._finalize(st)
                    if st.state != "COMPLETED" and self.stop_on_failure:
                        cancelled = await self.cancel_open()
                        if cancelled:
                            self.on_line(f"stopping after {st.spec.run_name} {st.state}: "
                                         f"cancelled {' '.join(cancelled)}")
                else:
                    open_runs += 1
            if not open_runs:
                return
            await _sleep(self.poll_s)

    async def _our_jobs(self, states: list[RunState]) -> dict[str, JobInfo]:
        """The jobs of our open runs, without the leader's whole history (a leader may hold
        thousands of finished jobs): the queue in two small listings (one job runs at a
        time), and one request for each of ours that left it since the last poll."""
        jobs = {j.job_id: j for state in ("RUNNING", "PENDING")
                for j in await self.client.jobs(state)}
        for st in states:
            if st.job_id and st.job_id not in jobs and st.state not in TERMINAL:
                try:
                    jobs[st.job_id] = await self.client.job(st.job_id)
                except ApiError as exc:
                    if exc.status != 404:
                        raise
        return jobs

    def _claim_run_dirs(self, stamp: str) -> None:
        """New run folders for every run: a sweep started in the same second as another of the
        same config (a second console, a double launch) takes ``<stamp>-2`` and so on, rather
        than writing into the other's folders."""
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1000):
            ids = run_ids(self.exp, stamp if n == 1 else f"{stamp}-{n}")
            made: list[Path] = []
            try:
                for rid in ids:
                    (self.runs_dir / rid).mkdir()
                    made.append(self.runs_dir / rid)
            except FileExistsError:
                for d in made:
                    d.rmdir()
                continue
            for st, rid in zip(self.states, ids, strict=True):
                st.run_id, st.run_dir = rid, self.runs_dir / rid
            return
        raise ExperimentError(f"no free run folder name under {self.runs_dir} for stamp {stamp}")

    def _resolved(self, st: RunState) -> dict[str, Any]:
        """The run's ``config_resolved.json``."""
        return {
            "run_id": st.run_id, "experiment": self.exp.config.name,
            "job": unstructure(st.spec.job(st.run_id)), "network_profile": st.spec.network,
            "tc_profile": st.spec.tc_profile, "seed": st.spec.seed, "repeat": st.spec.repeat,
            "churn": st.spec.churn, "variant": st.spec.variant,
            "sources": {"config": self.exp.config_path, "config_sha256": self.exp.sha256,
                        "training_profile": self.exp.training_path,
                        "model_profile": st.spec.model_source},
        }

    def _write_static(self, st: RunState) -> None:
        d = st.run_dir
        d.mkdir(parents=True, exist_ok=True)
        _write(d / "config_resolved.json", self._resolved(st))
        _write(d / "topology_snapshot.json", self._topology(st, None))
        self._write_manifest(st)

    def _topology(self, st: RunState, placement: Placement | None) -> dict[str, Any]:
        return {
            "requested": {"fellows": st.spec.fellows, "stages": st.spec.stages,
                          "replicas": st.spec.replicas, **st.spec.wiring},
            "active_fellows_at_start": [
                {"fellow_id": f.fellow_id, "name": f.name, "host": f.host,
                 "devices": f.devices, "status": f.status} for f in self.fellows_at_start],
            "actual": unstructure(placement),
        }

    def _write_manifest(self, st: RunState) -> None:
        _write(st.run_dir / "manifest.json", {
            "run_id": st.run_id, "experiment": self.exp.config.name,
            "description": self.exp.config.description, "status": st.state,
            "job_id": st.job_id, "leader_url": self.client.base_url, "note": st.note,
            "config_source": self.exp.config_path, "git_commit": self.commit,
            "silentswarm_version": swarm_core.__version__, "written_at": time.time(),
            "host": os.uname().nodename,
        })

    async def _finalize(self, st: RunState) -> None:
        assert st.job_id is not None
        await self._end_replay(st)
        job = await self.client.job(st.job_id)
        records = await self.client.progress(st.job_id)
        progress = [progress_line(r) for r in records]
        atomic_write(st.run_dir / "train_progress.ndjson",
                     b"".join(jsonio.dumps(line) + b"\n" for line in progress))
        if self.tracking.enabled:
            self._track_end(st, job, progress)
        _write(st.run_dir / "topology_snapshot.json", self._topology(st, job.placement))
        _write(st.run_dir / "metrics_summary.json", summarize(st, job, records))
        st.note = job.reason
        if self.exp.profile.artifacts.export and job.latest_shard_pushes:
            try:
                await fetch_export(self.client, st.job_id, st.run_dir / "model_export")
            except (FetchError, ClientError) as exc:
                # The run stands; only its copy of the export is missing, and it says why.
                st.note = "; ".join(n for n in (st.note, f"model export not copied: {exc}")
                                    if n)
                self.on_line(f"{st.run_id}: model export not copied: {exc}")
        self._write_manifest(st)


# ProgressRecord's fields a train_progress.ndjson line leaves out, each with its reason:
# ``stages_reported`` is the leader's note of which cells it has joined into the step while it
# gathers it (a record with fewer than all is not settled), bookkeeping rather than a figure.
PROGRESS_NOT_WRITTEN = frozenset({MetricName.STAGES_REPORTED})
# The order the lines had before their fields came from the class, kept so a line reads as it
# always did (step and loss first); readers go by name. A field not named here follows, in the
# class's order.
_LINE_ORDER = (MetricName.STEP, MetricName.LOSS, MetricName.TOKENS_PER_S, MetricName.WIRE_BYTES,
               MetricName.SYNC_BYTES, MetricName.STEP_SECONDS, MetricName.EVAL_LOSS,
               MetricName.PERPLEXITY, MetricName.LR, MetricName.ACTIVATION_PEAK_BYTES,
               MetricName.WAIT_SECONDS, MetricName.STAGE_SECONDS, MetricName.CODEC_ERROR,
               MetricName.TS)


def _progress_fields() -> tuple[str, ...]:
    names = [f.name for f in attrs.fields(ProgressRecord) if f.name not in PROGRESS_NOT_WRITTEN]
    return (*(n for n in _LINE_ORDER if n in names), *(n for n in names if n not in _LINE_ORDER))


# The fields of a train_progress.ndjson line, in order (null where a step lacks one): every
# field of ProgressRecord but those above, so a metric is named once and a new one is written
# without being listed. ``wire_bytes`` is the pipeline's links, ``sync_bytes`` the stage groups'
# synchronisation (null for one replica, and for a DiLoCo step that did not sync);
# ``replica_losses`` each replica's loss, whose mean ``loss`` is (null for one replica).
PROGRESS_FIELDS = _progress_fields()


def progress_line(rec: ProgressRecord) -> dict[str, Any]:
    """One line of a run's ``train_progress.ndjson``."""
    return {k: unstructure(getattr(rec, k)) for k in PROGRESS_FIELDS}


def summarize(st: RunState, job: JobInfo, records: list[ProgressRecord]) -> dict[str, Any]:
    """The run's ``metrics_summary.json``, as JSON."""
    return summary_json(build_summary(st, job, records))


def build_summary(st: RunState, job: JobInfo, records: list[ProgressRecord]) -> MetricsSummary:
    """What the run came to, from the job's record and its steps'."""
    model = structure(st.spec.model, ModelConfig)
    training = structure(st.spec.training, TrainingConfig)
    losses = [r.loss for r in records if r.loss is not None]
    wire = [r.wire_bytes for r in records if r.wire_bytes]
    m = job.metrics
    plain = structure({**st.spec.model, "compression": "none", "bottleneck_dim": None,
                       "wire_dtype": "fp32"}, ModelConfig)
    measured = sum(wire) / len(wire) if wire else None
    # (every stage of every replica's chain: a fellow of several slots holds several stages)
    stages, replicas = st.spec.stages, st.spec.replicas
    # (a swarm layout's NORM frames and measured routes' table, in both: see wire_math)
    layout = st.spec.wiring.get("layout")
    routes = st.spec.wiring.get("routing") == "measured" and st.spec.wiring.get(
        "wiring") == "swarm" and (replicas > 1 or layout is not None)  # (StageSpec.routed)
    moved = [(c.moved.at, c.moved.source, c.moved.cell, c.moved.target, c.moved.new_id)
             for c in job.membership if c.moved is not None and c.moved.new_id is not None]
    uncompressed = run_wire_bytes(plain, training, stages, replicas, layout, routes, moved)
    act, grad = step_boundary_bytes(model, training, stages, replicas)
    plain_boundary = sum(step_boundary_bytes(uncompressed_model(model), training, stages,
                                             replicas))
    final = losses[-1] if losses else None
    wall = (job.finished_at - job.started_at) if job.finished_at and job.started_at else None
    summary = MetricsSummary(
        run_id=st.run_id, job_id=job.job_id, status=job.state, reason=job.reason,
        steps_expected=training.steps, steps_recorded=len(records),
        final_loss=final, best_loss=min(losses) if losses else None,
        eval_loss=m.eval_loss, perplexity=m.perplexity,
        wall_time_s=wall, tokens_per_s=m.tokens_per_s,
        wire_bytes_per_step=measured,
        expected_wire_bytes_per_step=run_wire_bytes(model, training, stages, replicas, layout,
                                                    routes, moved),
        uncompressed_wire_bytes_per_step=uncompressed,
        compression_ratio=(uncompressed / measured) if measured else None,
        act_bytes_per_step=act, grad_bytes_per_step=grad,
        boundary_ratio=plain_boundary / (act + grad) if act + grad else None,
        compression=st.spec.compression, network_profile=st.spec.network.get("name"),
        link_mbps=link_mbps(st.spec.network),
        latency_ms=st.spec.network.get("latency_ms") or 0.0,
        model=st.spec.model.get("name"), seed=st.spec.seed, repeat=st.spec.repeat,
        fellows=st.spec.fellows,
        activation_peak_bytes_by_stage=peaks_by_stage(records, stages),
        wait_fraction_by_stage=wait_by_stage(records, stages, training, job.restarts,
                                             replicas),
        codec_error_by_stage=codec_error_by_stage(records, stages),
        link_changes=list(job.link_changes),
        link_changes_total=link_changes_in_all(job.link_changes, job.link_changes_total),
        restarts=list(job.restarts), membership=list(job.membership), thresholds={},
        emulated_slowdown_by_cell=slowdown_by_cell(records), transport=training.transport,
        optimizer=training.optimizer, wiring=job.topology.wiring,
        routing=job.topology.routing if job.topology.wiring == "swarm" else None,
        variant=st.spec.variant, warm_start=None if training.warm_start is None else
        training.warm_start.job_id + (f"@{training.warm_start.step}"
                                      if training.warm_start.step else ""))
    summarize_grid(summary, st.spec, training, records, m.sync_bytes_per_step)
    if training.max_final_loss is not None:
        met = final is not None and math.isfinite(final) and final <= training.max_final_loss
        summary.thresholds = {"max_final_loss": Threshold(
            limit=training.max_final_loss, value=final, met=met)}
    if summary.thresholds:
        summary.thresholds_met = job.state == "COMPLETED" and all(
            t.met for t in summary.thresholds.values())
    return summary


def summarize_grid(summary: MetricsSummary, spec: RunSpec, training: TrainingConfig,
                   records: list[ProgressRecord], reported: float | None) -> None:
    """The run's grid and synchronisation, into its summary: its shape, its sync mode
    (``none`` for one replica), DiLoCo's inner steps, and what the stage groups' sync sent:
    per step over every step recorded (a DiLoCo step that did not sync sent nothing, so this
    is the per-inner-step figure that compares with dp's), the fellows' own figure when no
    step recorded any, and in all; with the pipeline's bytes, the run's total on the wire."""
    mode = spec.sync_mode
    periodic = mode != "none" and training.sync.periodic
    synced = [r.sync_bytes for r in records if r.sync_bytes is not None]
    per_step = sum(synced) / len(records) if synced and records else reported
    wire_total = sum(r.wire_bytes for r in records)
    sync_total = sum(synced) if mode != "none" else 0
    summary.stages, summary.replicas, summary.sync_mode = spec.stages, spec.replicas, mode
    if periodic:
        summary.inner_steps = training.sync.inner_steps
        summary.overlap_steps = training.sync.overlap_steps
    if mode != "none":
        summary.sync_compression = training.sync.compression
        summary.sync_bytes_per_step, summary.sync_bytes_total = per_step, sync_total
        summary.sync_density = training.sync.density if mode == "sparseloco" else None
        summary.sync_topk = training.sync.topk if mode == "demo" else None
        summary.sync_fragments = training.sync.fragments if periodic else None
    summary.total_bytes = wire_total + sync_total


def slowdown_by_cell(records: list[ProgressRecord]) -> dict[str, float] | None:
    """The largest emulated compute slowdown each cell ran a step at, by its label; None when
    none was slowed (see swarm_core.pipeline.pace)."""
    out: dict[str, float] = {}
    for r in records:
        for cell, x in (r.slowdown or {}).items():
            out[cell] = max(out.get(cell, 1.0), float(x))
    return out or None


def peaks_by_stage(records: list[ProgressRecord],
                   num_stages: int) -> list[int | None] | None:
    """The largest activation memory each stage held in any step, by stage index (None for a
    stage that never reported it); None when no stage did."""
    peaks: dict[int, int] = {}
    for r in records:
        for stage, n in (r.activation_peak_bytes or {}).items():
            k = stage_of_label(stage)  # (the largest of its replicas)
            peaks[k] = max(peaks.get(k, 0), int(n))
    return [peaks.get(s) for s in range(num_stages)] if peaks else None


def wait_by_stage(records: list[ProgressRecord], num_stages: int,
                  training: TrainingConfig | None = None,
                  restarts: list[Restart] | None = None,
                  replicas: int = 1) -> list[float | None] | None:
    """The share of its step time each stage spent blocked on its links, by stage index: its
    wait_seconds over its own stage_seconds, summed over the steady steps, i.e. leaving out
    the first step of the run and of each resume (``restarts``: the job's) and, given
    ``training``, the step after each eval and shard push: those also wait for the neighbours
    to start or to finish their pause (every step when no other is left; ``replicas`` under
    DiLoCo push at outer steps). None for a stage
    that never reported; None when no stage did."""
    starts = {min((r.step for r in records), default=1) - 1,
              *(r.resume_step for r in restarts or [])}
    tc = training or TrainingConfig()
    outer = tc.sync.drifts(replicas)

    def paused(step: int) -> bool:
        return any(tc.follows_a_pause(step, s, outer) for s in starts)

    steady = [r for r in records if not paused(r.step)] or records
    waits: dict[int, float] = {}
    spans: dict[int, float] = {}
    for r in steady:
        spent = r.stage_seconds or {}
        for stage, w in (r.wait_seconds or {}).items():
            span = spent.get(stage)
            if isinstance(span, int | float) and span > 0:
                k = stage_of_label(stage)  # (its replicas' waits over their spans)
                waits[k] = waits.get(k, 0.0) + float(w)
                spans[k] = spans.get(k, 0.0) + float(span)
    if not waits:
        return None
    return [min(1.0, waits[s] / spans[s]) if s in waits else None for s in range(num_stages)]


def codec_error_by_stage(records: list[ProgressRecord],
                         num_stages: int) -> list[CodecErrors | None] | None:
    """Each stage's mean relative error of what its wire codec sent, over the steps, in the
    directions it sends, by stage index; None for a stage that never reported; None when no
    stage did (a run from before the field)."""
    sums: dict[int, dict[str, list[float]]] = {}
    for r in records:
        for stage, errs in (r.codec_error or {}).items():
            for k, v in unstructure(errs).items():
                sums.setdefault(stage_of_label(stage), {}).setdefault(k, []).append(float(v))
    if not sums:
        return None
    return [CodecErrors(**{k: sum(v) / len(v) for k, v in sums[s].items()}) if s in sums
            else None for s in range(num_stages)]


def netem(action: str, tc: dict[str, Any], check: bool = True) -> str:
    """Run exp/scripts/{setup,cleanup}_netem.sh for one tc profile; returns what it said."""
    script = SCRIPTS / f"{action}_netem.sh"
    argv = ["bash", str(script)]
    if tc.get("netns"):
        argv += ["--netns", tc["netns"]]
    if tc.get("dev"):
        argv += ["--dev", tc["dev"]]
    if action == "setup":
        argv += ["--rate-mbit", str(tc["rate_mbit"]), "--delay-ms", str(tc.get("delay_ms", 0)),
                 "--loss-pct", str(tc.get("loss_pct", 0))]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise ExperimentError(f"{script.name} did not finish in 60 s") from None
    except OSError as exc:
        raise ExperimentError(f"{script.name}: cannot run bash: {exc.strerror}") from None
    if proc.returncode != 0 and check:
        last = (proc.stderr or proc.stdout).strip().splitlines()
        raise ExperimentError(f"{script.name} failed: {last[-1] if last else proc.returncode}")
    return (proc.stdout + proc.stderr).strip()


async def _sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)
