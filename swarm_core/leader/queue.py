"""The job queue and the dispatcher: one job runs at a time, oldest PENDING first.

Liveness and recovery live in :mod:`swarm_core.leader.liveness`; per-step figures and the run
files in :mod:`swarm_core.leader.progress`. This module owns a job's state changes.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import secrets
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from swarm_core.artifacts.layout import RUN_MANIFEST
from swarm_core.artifacts.manifests import PushedManifest, ShardManifest
from swarm_core.config.schemas import WarmStart, job_shape_error, warm_start_mismatch
from swarm_core.contract import (
    FellowSlots,
    JobInfo,
    JobStatusUpdate,
    JobSubmit,
    LinkChange,
    Placement,
    PlacementError,
    ShardReceipt,
    StageMetrics,
    StageStart,
    link_changes_in_all,
    plan,
    stage_starts,
)
from swarm_core.contract.events import (
    JobMembership,
    JobShard,
    JobUpdate,
    JobUpdateType,
    MetricReport,
)
from swarm_core.contract.job import warm_split_mismatch
from swarm_core.contract.rebalance import PeerMove
from swarm_core.leader import moves
from swarm_core.leader.errors import ApiError
from swarm_core.leader.events import EventHub
from swarm_core.leader.liveness import Liveness
from swarm_core.leader.membership import Membership
from swarm_core.leader.moves import MoveRefused, Told
from swarm_core.leader.progress import ProgressBook, RunFiles
from swarm_core.leader.reconcile import Reconciler
from swarm_core.leader.records import JobRecord
from swarm_core.leader.registry import FellowRecord, FellowRegistry
from swarm_core.leader.store import Store, StoreWriteError
from swarm_core.leader.undo import kept
from swarm_core.leader.uploads import complete_checkpoints
from swarm_core.protocol import JobState, LinkLimits
from swarm_core.schema import SchemaError, unstructure
from swarm_core.validators import printable

log = logging.getLogger("swarm.leader")

MAX_LINK_CHANGES = 200
# The event a job's end publishes, by the state it ended in.
FINISHED_EVENTS: dict[JobState, JobUpdateType] = {
    JobState.COMPLETED: "job.completed", JobState.FAILED: "job.failed",
    JobState.CANCELLED: "job.cancelled"}


@attrs.define
class JobPage:
    jobs: list[JobRecord]
    next_after: str | None  # the last job listed, when more follow
    total: int  # the jobs of the asked states, on every page


def _seq(job: JobRecord) -> int:
    return job.seq


def _finish_key(job: JobRecord) -> tuple[float, int]:
    return (job.finished_at or job.created_at, job.seq)


def _past(pool: Any, order: str, cursor: JobRecord) -> Any:
    """The jobs of ``pool`` that come after ``cursor`` in ``order``."""
    if order == "finished":  # (by place: two jobs may finish within one clock tick)
        rest = iter(pool)
        for job in rest:
            if job is cursor:
                break
        return rest
    if order == "newest":
        return (j for j in pool if j.seq < cursor.seq)
    return (j for j in pool if j.seq > cursor.seq)


@attrs.define
class QueueOrder:
    running: JobRecord | None
    ahead: dict[str, int]  # pending job id -> pending jobs queued before it


class JobQueue:
    def __init__(self, store: Store, registry: FellowRegistry, hub: EventHub,
                 runs_dir: Path | None = None) -> None:
        self.store = store
        self.registry = registry
        self.hub = hub
        self.progress = ProgressBook(store)
        self.files = RunFiles(runs_dir)
        self.runs_dir = runs_dir
        self.liveness = Liveness(self, registry, runs_dir)
        self.membership = Membership(self)
        self.reconciler = Reconciler(self, registry)
        # Every job, and each open one by state, in queue order (rows load by seq, and a new
        # job has the highest); the finished ones in the order they finished. The dispatcher,
        # the queue's order and a console's listing of the running, the next pending and the
        # latest finished jobs thus never walk a history of thousands on a tick or request.
        self._jobs: dict[str, JobRecord] = {}
        self._pending: dict[str, JobRecord] = {}
        self._running: dict[str, JobRecord] = {}
        self._finished: dict[str, JobRecord] = {}
        self._finished_count: collections.Counter[JobState] = collections.Counter()
        self._order: QueueOrder | None = None  # built on demand, dropped when the queue moves
        self._unstored: dict[tuple[str, str], float] = {}  # (see not_stored)
        for row in store.load_jobs():
            try:
                job = JobRecord.from_row(row)
            except Exception as exc:
                # One row this leader cannot read must not keep it from starting: it stays in
                # the database as it is, and is named once.
                log.error("job %s left out: its stored record cannot be read: %s",
                          row.get("job_id", "?"), exc)
                continue
            self._jobs[job.job_id] = job
            if job.state is JobState.PENDING:
                self._pending[job.job_id] = job
            if job.state is JobState.RUNNING:
                self._running[job.job_id] = job
                # Its fellows get a heartbeat timeout to come back after a leader restart.
                self.liveness.watch(job)
                self.membership.restore(job)
                if job.recovering is not None:
                    continue  # (its fellows were told to stop: free for the resume to place)
                for fid in dict.fromkeys(job.fellows):
                    rec = self.registry.find(fid)
                    if rec is not None and not job.stages_done_by(fid):
                        rec.assigned_job = job.job_id
        for job in sorted((j for j in self._jobs.values() if j.state.terminal), key=_finish_key):
            self._finished[job.job_id] = job
            self._finished_count[job.state] += 1

    # queries ----------------------------------------------------------------------------------
    def get(self, job_id: str) -> JobRecord:
        job = self._jobs.get(job_id)
        if job is None:
            raise ApiError(404, f"no job {job_id!r}", code="unknown_job")
        return job

    def find(self, job_id: str | None) -> JobRecord | None:
        return self._jobs.get(job_id or "")

    def page(self, states: frozenset[JobState] | None = None, order: str = "queue",
             after: JobRecord | None = None, limit: int | None = None) -> JobPage:
        """The jobs in ``states`` (None: all) in ``order`` (see JOB_ORDERS), from the one
        after ``after``, at most ``limit``. It walks only the jobs it may list, and stops at
        the page's end: nothing is built for the jobs it leaves out."""
        newest = order == "newest"
        wanted = states
        if order == "finished":
            pool: Any = reversed(self._finished.values())
        elif states is not None and not any(s.terminal for s in states):
            parts = [sorted(self._running.values(), key=_seq, reverse=newest)
                     if s is JobState.RUNNING else
                     reversed(self._pending.values()) if newest else self._pending.values()
                     for s in states]
            pool = heapq.merge(*parts, key=_seq, reverse=newest)
            wanted = None  # (the pool holds just those)
        else:
            pool = reversed(self._jobs.values()) if newest else self._jobs.values()
        if after is not None:
            pool = _past(pool, order, after)
        if wanted is not None:
            pool = (j for j in pool if j.state in wanted)
        out = list(itertools.islice(pool, limit + 1 if limit is not None else None))
        more = limit is not None and len(out) > limit
        if more:
            del out[limit:]
        if states is None:
            total = len(self._finished if order == "finished" else self._jobs)
        else:
            total = sum(self.count(s) for s in states)
        return JobPage(out, out[-1].job_id if more else None, total)

    def count(self, state: JobState) -> int:
        if state is JobState.PENDING:
            return len(self._pending)
        if state is JobState.RUNNING:
            return len(self._running)
        return self._finished_count[state]

    def running(self) -> JobRecord | None:
        return next(iter(self._running.values()), None)

    def order(self) -> QueueOrder:
        """The running job and, per pending job, how many are ahead of it: built once per
        change of the queue (asking per job made listing n jobs cost n^2)."""
        if self._order is None:
            self._order = QueueOrder(self.running(),
                                     {jid: i for i, jid in enumerate(self._pending)})
        return self._order

    def info(self, job: JobRecord, with_history: bool = False,
             order: QueueOrder | None = None) -> JobInfo:
        spec = job.spec
        losses, evals = self.progress.histories(job) if with_history else ([], [])
        return JobInfo(
            job_id=job.job_id, name=spec.name, kind=spec.kind, state=job.state.value,
            created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
            last_step=job.last_step, last_loss=job.last_loss, fellows=job.fellows,
            topology=spec.topology, reason=job.reason, model=spec.model,
            training=spec.training, waiting_for=self.waiting_for(job, order),
            metrics=job.metrics,
            placement=job.placement,
            loss_history=losses, eval_history=evals,
            latest_shard_pushes=job.latest_shard_pushes, attempt=job.attempt,
            restarts=job.restarts, link_changes=job.link_changes,
            link_changes_total=link_changes_in_all(job.link_changes, job.link_changes_total),
            members=job.members, membership=job.membership,
        )

    def waiting_for(self, job: JobRecord, order: QueueOrder | None = None) -> str:
        if job.state is not JobState.PENDING:
            return ""
        order = order or self.order()
        if order.running is not None:
            return f"job {order.running.job_id} is running"
        ahead = order.ahead.get(job.job_id, 0)
        if ahead:
            return f"{ahead} job(s) ahead in the queue"
        ready = self.registry.ready()
        topo = job.spec.topology
        if topo.slots_per_fellow > 1:
            able = sum(1 for f in ready if len(f.devices) >= topo.slots_per_fellow)
            return (f"needs {topo.fellows} ready fellow(s) with {topo.slots_per_fellow} device "
                    f"slots, {able} ready")
        return f"needs {topo.fellows} ready fellow(s), {len(ready)} ready"

    def progress_rows(self, job_id: str, after: int = 0) -> list[dict[str, Any]]:
        """A job's per-step records (see ProgressBook.rows)."""
        self.get(job_id)
        return self.progress.rows(job_id, after)

    def holds(self, job: JobRecord, fellow_id: int, stage: int, replica: int = 0) -> bool:
        """Whether this fellow runs this cell of the job (a fellow may run several)."""
        return job.placement is not None and job.placement.holds(fellow_id, stage, replica)

    def holds_stage(self, job: JobRecord, fellow_id: int, stage: int) -> bool:
        """Whether this fellow runs some replica of this stage (and so may fetch its
        checkpoints)."""
        return job.placement is not None and bool(job.placement.replicas_held(fellow_id, stage))

    # mutations --------------------------------------------------------------------------------
    def kept(self, job: JobRecord, fellows: Iterable[FellowRecord] | None = None,
             whole: bool = False) -> contextlib.AbstractContextManager[None]:
        """A change of ``job`` that stays only if the store takes it (see ``leader/undo.py``);
        ``fellows`` whose assignment and signals it may change (default: the job's);
        ``whole``: its writes are one transaction."""
        if fellows is None:
            fellows = [r for fid in dict.fromkeys(job.fellows)
                       if (r := self.registry.find(fid)) is not None]
        return kept(self, job, fellows, whole)

    def forget_order(self) -> None:
        self._order = None

    def submit(self, spec: JobSubmit) -> JobRecord:
        train = spec.train
        if train is not None:
            assert spec.model is not None
            shape = job_shape_error(spec.model, train, spec.topology.num_stages,
                                    spec.topology.replicas, spec.topology.layout)
            if shape is not None:
                raise SchemaError(shape[0], f"$.{shape[1]}")
            if train.warm_start is not None:
                # (resolved here, so every cell and every restart loads the same checkpoint)
                spec.training = attrs.evolve(train, warm_start=self._warm_start(spec))
        seq = self.store.next_job_seq()
        job = JobRecord(job_id=f"job-{seq:06d}", seq=seq, spec=spec, state=JobState.PENDING,
                        created_at=time.time())
        self.store.insert_job(seq, job.row())
        self._jobs[job.job_id] = job
        self._pending[job.job_id] = job
        self._order = None
        self.event(job, "job.submitted")
        return job

    def _warm_start(self, spec: JobSubmit) -> WarmStart:
        """The submitted job's warm start with its step resolved: the source job is on this
        leader, has finished (a running job prunes its checkpoints as it trains), has a
        complete checkpoint at that step (left out: its newest) and the same model. Anything
        else is a 400 at ``$.training.warm_start``."""
        train, field = spec.train, "$.training.warm_start"
        assert train is not None and train.warm_start is not None and spec.model is not None
        want = train.warm_start
        source = self.find(want.job_id)
        if source is None:
            raise SchemaError(f"no job {want.job_id!r} on this leader to warm-start from",
                              field)
        if source.spec.train is None or source.spec.model is None:
            raise SchemaError(f"{want.job_id} is a {source.spec.kind} job: no weights to "
                              "warm-start from", field)
        if not source.state.terminal:
            raise SchemaError(f"{want.job_id} is {source.state.value}: warm-start from it once "
                              "it has ended (its checkpoints are pruned while it trains)", field)
        why = warm_start_mismatch(spec.model, train, source.spec.model, source.spec.train)
        if why is not None:
            raise SchemaError(f"{want.job_id}'s {why}; a warm start needs the same model in "
                              "every field but name", field)
        why = warm_split_mismatch(spec, source.spec, want.job_id)
        if why is not None:
            raise SchemaError(why, field)
        steps = [] if self.runs_dir is None else complete_checkpoints(
            self.runs_dir, source.job_id, source.num_stages)
        if want.step is None and not steps:
            raise SchemaError(f"{want.job_id} has no complete checkpoint to warm-start from",
                              field)
        if want.step is not None and want.step not in steps:
            held = ", ".join(map(str, sorted(steps))) or "none"
            raise SchemaError(f"{want.job_id} has no complete checkpoint at step {want.step} "
                              f"(it has: {held})", field)
        return WarmStart(source.job_id, want.step if want.step is not None else steps[0])

    def cancel(self, job_id: str) -> JobRecord:
        job = self.get(job_id)
        if job.state.terminal:
            raise ApiError(409, f"job {job_id} is already {job.state.value}",
                           code="job_finished")
        with self.kept(job):
            self.finish(job, JobState.CANCELLED, "cancelled by request")
        return job

    def status_update(self, job_id: str, fellow: FellowRecord, upd: JobStatusUpdate) -> JobRecord:
        job = self.get(job_id)
        taken = self._checked(job, upd)
        if taken is not None:
            with self.kept(job):
                self._take(job, fellow, *taken)
        return job

    def status_updates(self, job_id: str, fellow: FellowRecord,
                       updates: Sequence[JobStatusUpdate]) -> JobRecord:
        """A fellow's reports of several steps at once (RUNNING ones: a stage that trains
        faster than one report a step reaches the leader), taken in order as one change,
        stored in one transaction: all of them, or (refused, or the store refusing) none."""
        job = self.get(job_id)
        # (each checked once those before it are taken: a batch may span a peer's moves;
        # one refused puts back what those before it changed)
        with self.kept(job, whole=True), self.store.batch():
            for upd in updates:
                t = self._checked(job, upd)
                if t is not None:
                    self._take(job, fellow, *t, save=False)
            self.save(job, quiet=True)
        return job

    def _checked(self, job: JobRecord, upd: JobStatusUpdate
                 ) -> tuple[int, int, JobStatusUpdate, Told] | None:
        """A report's cell (stage, replica), the report and the move it tells the job of (a
        job whose peers move: ``leader/moves.py``), once it is known to be this fellow's and
        the job's; None for one to drop unread (an earlier attempt's). Raises ApiError (409)
        for one the job refuses. Taken before the next report is checked."""
        job_id = job.job_id
        if upd.fellow_id not in job.fellows:
            raise ApiError(409, f"fellow {upd.fellow_id} is not part of job {job_id}",
                           code="not_in_job", field="$.fellow_id")
        assert job.placement is not None
        if upd.stage is None:  # (a fellow of an older version: its first cell)
            first = job.placement.stages[job.fellows.index(upd.fellow_id)]
            upd = attrs.evolve(upd, stage=first.stage, replica=first.replica)
        stage, replica = upd.stage, upd.replica
        assert stage is not None
        stale = upd.attempt != job.attempt or job.recovering is not None
        try:  # (a job whose peers move: the placement the report's cell ran under)
            told = None if stale else moves.news(job, upd)
        except MoveRefused as exc:
            raise ApiError(409, f"job {job_id}: {exc}", code="bad_move",
                           field="$.moved") from None
        placed = job.placement if stale else \
            told[1] if told is not None else moves.placement_at(job, upd.epoch)
        if not placed.holds(upd.fellow_id, stage, replica):
            what = f"stage {stage}" + (f" replica {replica}" if replica else "")
            raise ApiError(409, f"fellow {upd.fellow_id} does not hold {what} of {job_id}",
                           code="not_in_job", field="$.stage")
        if job.state is not JobState.RUNNING:
            raise ApiError(409, f"job {job_id} is {job.state.value}, not RUNNING",
                           code="job_not_running")
        if stale:
            return None  # from before a restart, or while recovering: nothing to learn
        if self.membership.left(job, replica):
            raise ApiError(409, f"replica {replica} has left {job_id}: its stage {stage}'s "
                                "report comes too late", code="replica_left",
                           field="$.replica")
        return stage, replica, upd, told

    def _take(self, job: JobRecord, fellow: FellowRecord, stage: int, replica: int,
              upd: JobStatusUpdate, told: Told = None, save: bool = True) -> None:
        """A cell's report, checked: its step, figures and (a final one) its end.
        ``save``: a RUNNING one's job row written now (else by the caller, once a batch)."""
        assert job.placement is not None
        job.active_at = time.monotonic()
        if told is not None:
            self._moved(job, *told)
        joining = self.membership.joining.get(job.job_id)
        if joining is not None and replica == joining.replica and upd.step > 0:
            self.membership.joined(job, upd.step)  # (its first step with the group)
        job.last_step = max(job.last_step, upd.step)
        if upd.loss is not None and job.placement.layout is None \
                and job.placement.replicas == 1:
            job.last_loss = upd.loss  # (of several cells: their mean, once recorded)
        self.progress.merge(job, stage, replica, fellow.fellow_id, upd)
        if upd.state == "RUNNING" and upd.metrics != StageMetrics() \
                and job.kind == "train" and not self.membership.superseded(job, upd):
            self.progress.record(job, stage, replica, upd)
        self.hub.publish(MetricReport(
            job_id=job.job_id, fellow_id=fellow.fellow_id, stage=stage, step=upd.step,
            loss=upd.loss, tokens_per_s=upd.tokens_per_s, state=upd.state, metrics=upd.metrics,
            replica=replica if job.placement.replicas > 1 or job.placement.layout is not None
            else None, epoch=upd.epoch))
        if upd.state == "FAILED":
            self._failed(job, stage, replica, fellow, upd)
        elif upd.state == "COMPLETED":
            self._completed(job, stage, replica, fellow, upd)
        elif save:
            self.save(job, quiet=True)

    def _moved(self, job: JobRecord, move: PeerMove, placement: Placement) -> None:
        """A peer moved between stages, as a cell's report says: the job's placement, its
        membership's record and the placement plan follow (see leader/moves.py)."""
        change = moves.made(job, move, placement)
        self.progress.membership(job, change)
        self.files.placement(job)
        self.hub.publish(JobMembership(job.job_id, change))

    def _failed(self, job: JobRecord, stage: int, replica: int, fellow: FellowRecord,
                upd: JobStatusUpdate) -> None:
        # A fellow's words reach terminals (swarm job, watch, the console): shown, not obeyed.
        msg = f": {printable(upd.message)}" if upd.message else ""
        reason = f"fellow {fellow.fellow_id} ({fellow.name}) failed at step {upd.step}{msg}"
        # (of replicas, a link's failure names the neighbour that left, not this survivor)
        lost = self._blamed_neighbour(job, stage, replica, fellow, upd) or reason
        if self.membership.cell_lost(job, stage, replica, lost, fellow.fellow_id):
            self.save(job, quiet=True)
            return  # (its replica leaves; the others train on)
        blamed = upd.blames_stage
        # Only under resume_policy fail: a recovery waits out the heartbeat timeout anyway and
        # names the fellows it lost from their status.
        assert job.placement is not None
        # (under a layout the blamed stage may lack the cell's id: a route link's, then)
        if blamed is not None and abs(blamed - stage) == 1 and blamed < job.num_stages \
                and job.placement.has(blamed, replica) \
                and job.placement.index(blamed, replica) not in job.done_stages \
                and job.resume_policy == "fail":
            self.liveness.blamed(job, reason, stage, blamed)
        else:
            self.liveness.lost(job, reason)

    def _blamed_neighbour(self, job: JobRecord, stage: int, replica: int,
                          fellow: FellowRecord, upd: JobStatusUpdate) -> str | None:
        """Of a job of replicas, a cell that failed because the link to its neighbouring
        stage closed, broke or went quiet: why its replica is out, naming that neighbour's
        fellow (the likelier cause: the one that left), not the survivor that reported it.
        None where the report blames no neighbour of its own chain."""
        blamed, p = upd.blames_stage, job.placement
        if blamed is None or p is None or not self.membership.replicated(job) \
                or abs(blamed - stage) != 1 or blamed >= job.num_stages \
                or not p.has(blamed, replica):  # (a layout's route link: no chain there)
            return None
        other = p.cell(blamed, replica)
        if other.fellow_id == fellow.fellow_id:
            return None
        msg = f": {printable(upd.message)}" if upd.message else ""
        return (f"fellow {other.fellow_id} ({other.name}, stage {blamed} replica {replica}) "
                f"dropped out at step {upd.step}: its neighbour fellow {fellow.fellow_id} "
                f"({fellow.name}) lost the link to it{msg}")

    def _completed(self, job: JobRecord, stage: int, replica: int, fellow: FellowRecord,
                   upd: JobStatusUpdate) -> None:
        assert job.placement is not None
        cell = job.placement.index(stage, replica)
        if cell not in job.done_stages:
            job.done_stages.append(cell)
        if job.stages_done_by(fellow.fellow_id):
            fellow.assigned_job = None
        self.membership.finished(job, replica, upd.epoch)
        if not self.complete_if_done(job, upd.message):
            self.save(job)

    def complete_if_done(self, job: JobRecord, message: str = "") -> bool:
        """Complete the job once every cell is done: completed, or its replica left. (A
        replica leaves only while another trains on, so one cell at least completed.)"""
        assert job.placement is not None
        if len(set(job.done_stages)) < len(job.placement.stages):
            return False
        grid = f"{job.num_stages} stage(s)" + (
            f" x {job.placement.replicas} replicas" if job.placement.replicas > 1 else "") \
            if job.placement.layout is None else \
            f"{job.num_stages} stages, cells " + "+".join(
                str(len(ids)) for ids in job.placement.layout)
        if job.members is not None and len(job.members) < job.placement.replicas:
            grid += f" ({job.placement.replicas - len(job.members)} replica(s) left)"
        reason = printable(message) if job.kind == "smoke" else \
            f"all {grid} finished at step {job.last_step}"
        self.finish(job, JobState.COMPLETED, reason)
        return True

    def dispatch(self) -> JobRecord | None:
        """Start the oldest PENDING job if nothing runs and enough fellows are ready."""
        if self.running() is not None:
            return None
        # Called on every tick and fellow change: the first open job, not the whole history.
        job = next(iter(self._pending.values()), None)
        if job is None:
            return None
        topo = job.spec.topology
        able = [f for f in self.registry.ready() if len(f.devices) >= topo.slots_per_fellow]
        if len(able) < topo.num_fellows:
            return None
        try:
            with self.kept(job, able):
                self._start(job, able[:topo.num_fellows])
        except StoreWriteError as exc:
            self.not_stored(f"job {job.job_id} not started", exc)  # (the tick tries again)
            return None
        return job

    def _start(self, job: JobRecord, fellows: list[FellowRecord]) -> None:
        """Place the job on ``fellows`` and send their STARTs (or fail it, if it cannot be)."""
        topo = job.spec.topology
        stages = topo.num_stages
        train = job.spec.train
        try:
            # Neighbouring stages share a fellow where they can: its slots fill first.
            placement = plan([FellowSlots(f.fellow_id, f.name, list(f.devices), f.data_addr,
                                          list(f.data_addrs)) for f in fellows],
                             stages, job.spec.model.n_layers if job.spec.model else stages,
                             train.stage_weights if train else None,
                             slots_per_fellow=topo.slots_per_fellow, replicas=topo.replicas,
                             layout=topo.layout, network=train.network if train else None)
        except PlacementError as exc:
            self.finish(job, JobState.FAILED, f"placement failed: {exc}")
            return
        missing = [s.fellow_id for s in placement.stages if not s.data_addr]
        if train is not None and missing:
            self.finish(job, JobState.FAILED,
                        f"fellow(s) {missing} registered without a data-plane address")
            return
        try:
            starts = self.starts(job, placement, attempt=job.attempt, resume_step=0)
        except ValueError as exc:
            self.finish(job, JobState.FAILED, f"cannot start: {exc}")
            return
        job.state = JobState.RUNNING
        job.started_at = time.time()
        job.placement = placement
        job.data_key, job.resume_step = starts[0].key, 0
        self.files.placement(job)
        # Stored before the queue moves and the STARTs go: a write refused leaves only the
        # record to put back (see kept).
        self.save(job)
        del self._pending[job.job_id]
        self._running[job.job_id] = job
        self._order = None
        self.liveness.watch(job)
        self.send(job, starts)
        self.event(job, "job.started")

    def check_liveness(self) -> None:
        job = self.running()
        if job is None:
            return
        try:
            # (every fellow: a recovery or a join may start spares outside the job)
            with self.kept(job, self.registry.all()):
                self.liveness.check()
        except StoreWriteError as exc:
            self.not_stored(f"job {job.job_id}: what its fellows' state calls for", exc)

    def not_stored(self, what: str, exc: StoreWriteError) -> None:
        """Name a change a tick could not store (it tries again at the next tick): once a
        minute while the cause stays, not four times a second."""
        now = time.monotonic()
        key = (what, str(exc))
        if self._unstored.get(key, -60.0) + 60.0 <= now:
            self._unstored[key] = now
            log.error("%s: %s (tried again)", what, exc)

    def fellow_replaced(self, rec: FellowRecord) -> None:
        job = self.running()
        if job is None:
            self.liveness.fellow_replaced(rec)
            return
        with self.kept(job, self.registry.all()):
            self.liveness.fellow_replaced(rec)

    @staticmethod
    def shard_receipt(stage: int, fellow: FellowRecord, manifest: PushedManifest
                      ) -> ShardReceipt:
        # (a replica's own optimiser state carries no weights)
        weights = manifest if isinstance(manifest, ShardManifest) else None
        return ShardReceipt(
            stage=stage, fellow_id=fellow.fellow_id, step=manifest.step,
            weights_sha256=weights.weights_sha256 if weights else None,
            weights_bytes=weights.weights_bytes if weights else None,
            optimizer_bytes=manifest.optimizer_bytes,
            config_fingerprint=manifest.config_fingerprint,
            received_at=manifest.received_at)

    def shard_pushed(self, job: JobRecord, stage: int, fellow: FellowRecord,
                     manifest: ShardManifest) -> ShardReceipt:
        receipt = self.shard_receipt(stage, fellow, manifest)
        with self.kept(job):
            job.latest_shard_pushes[str(stage)] = receipt
            self.save(job, quiet=True)
            self.hub.publish(JobShard(job.job_id, receipt))
        return receipt

    def shard_withdrawn(self, job: JobRecord, stage: int, fellow_id: int) -> None:
        """The fellow's shard of ``stage`` was published over by a push the job refused (a
        redo undid its step meanwhile): the export names no shard of it from that fellow."""
        receipt = job.latest_shard_pushes.get(str(stage))
        if receipt is None or receipt.fellow_id != fellow_id:
            return
        with self.kept(job):
            del job.latest_shard_pushes[str(stage)]
            self.save(job, quiet=True)

    def link_set(self, fellow: FellowRecord, link: LinkLimits | None,
                 slowdown: float | None = None, to_fellow: int | None = None) -> str | None:
        """Note a set-speed in the running job of ``fellow``, if it runs one: the fellow applies
        it at once, so the job's record says from which step its link (None: unchanged) or its
        emulated slowdown changed. Returns that job's id."""
        job = self.find(fellow.assigned_job)
        if job is None or job.state is not JobState.RUNNING:
            return None
        with self.kept(job, ()):
            job.link_changes_total = link_changes_in_all(job.link_changes,
                                                         job.link_changes_total) + 1
            job.link_changes.append(LinkChange(at_step=job.last_step,
                                               fellow_id=fellow.fellow_id, link=link,
                                               at=time.time(), slowdown=slowdown,
                                               to_fellow=to_fellow))
            # A script setting speeds in a loop must not grow the record without end. The
            # first change stays: it is the step from which the run left its network profile.
            excess = len(job.link_changes) - MAX_LINK_CHANGES
            if excess > 0:
                del job.link_changes[1:1 + excess]
            self.save(job, quiet=True)
        return job.job_id

    # what the liveness checks share -----------------------------------------------------------
    def starts(self, job: JobRecord, placement: Placement, *, attempt: int,
               resume_step: int) -> list[StageStart]:
        """The START of each stage of ``job`` on ``placement``, under a new data-plane key;
        ValueError (a FieldError) if one cannot be made (a stage whose neighbour has no data
        address). The caller stores the key and resume step with the job it starts."""
        key = secrets.token_hex(16)  # the data plane admits only connections that present it
        return stage_starts(job.job_id, job.spec, placement, key, attempt=attempt,
                            resume_step=resume_step)

    def start_of(self, job: JobRecord, cell: int) -> StageStart:
        """The START that cell ``cell`` of the running job's current attempt was sent."""
        assert job.placement is not None and job.data_key
        start = stage_starts(job.job_id, job.spec, job.placement, job.data_key,
                             attempt=job.attempt, resume_step=job.resume_step)[cell]
        joining = self.membership.joining.get(job.job_id)
        if joining is not None and joining.replica == start.replica:
            start = attrs.evolve(start, join=joining.order)  # (it joins a running group)
        return start

    def send(self, job: JobRecord, starts: list[StageStart]) -> None:
        """One START per stage (a fellow with several slots gets one for each)."""
        for start in starts:
            fellow = self.registry.get(start.mine.fellow_id)
            fellow.assigned_job = job.job_id
            self.registry.send(fellow, "START", job.job_id, unstructure(start))

    def stop_fellows(self, job: JobRecord, reason: str) -> None:
        """Free the job's fellows and tell those still working on it to STOP."""
        for fid in dict.fromkeys(job.fellows):
            rec = self.registry.find(fid)
            if rec is not None and rec.assigned_job == job.job_id:
                rec.assigned_job = None
                self.registry.send(rec, "STOP", job.job_id, {"reason": reason})

    def finish(self, job: JobRecord, state: JobState, reason: str) -> None:
        """End ``job`` in ``state``; called inside a change that is ``kept``."""
        was = job.state
        job.state, job.reason, job.finished_at = state, reason, time.time()
        job.held, job.regroup = None, None
        # Stored before the queue moves, STOPs go or files are written: a write the store
        # refuses leaves only the record to put back (see kept), and the caller's retry
        # finds the job as it was.
        self.save(job)
        if was.terminal:  # (finished again: it moves to the end, counted once)
            self._finished_count[was] -= 1
            del self._finished[job.job_id]
        self._pending.pop(job.job_id, None)
        self._running.pop(job.job_id, None)
        self._finished[job.job_id] = job
        self._finished_count[state] += 1
        self._order = None
        self.membership.forget(job)
        if was is JobState.RUNNING:
            self.stop_fellows(job, reason)
            if job.kind == "train":
                self._final_files(job)
        self.event(job, FINISHED_EVENTS[state])

    def _final_files(self, job: JobRecord) -> None:
        try:
            self.files.write(job, "job_final.json", self.info(job, with_history=True))
            if job.latest_shard_pushes:
                self.files.write(job, f"model_export/{RUN_MANIFEST}",
                                 self.files.run_manifest(job))
        except StoreWriteError as exc:
            # The outcome is stored (the record is what every reader goes by): a summary the
            # disk has no room for is named, and the job's end stands.
            log.error("job %s ended; its run files are not written: %s", job.job_id, exc)

    def save(self, job: JobRecord, quiet: bool = False) -> None:
        self.store.save_job(job.row())
        if not quiet:
            self.event(job, "job.updated")

    def event(self, job: JobRecord, event_type: JobUpdateType) -> None:
        # (a copy of the fellows: the event is encoded later, the job's list may change)
        self.hub.publish(JobUpdate(
            event_type, job.job_id, name=job.spec.name, kind=job.spec.kind, state=job.state.value,
            last_step=job.last_step, last_loss=job.last_loss, fellows=list(job.fellows),
            reason=job.reason))
