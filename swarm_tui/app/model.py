"""The cluster as the console sees it: fellows, jobs and their recent history (no Textual).

The app feeds it full snapshots (``SwarmClient.fellows()`` / ``jobs()``, every few seconds) and
the events of the leader's stream; widgets read it. Timestamps the leader sends are its wall
clock; ``offset`` (leader minus local) is estimated from event timestamps, so ages and rates are
right even when the two clocks disagree. Byte rates come from successive cumulative counters,
over windows of at least ``MIN_RATE_WINDOW_S`` of leader time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from swarm_core.contract import (
    JobInfo,
    Topology,
    step_wait_share,
)
from swarm_core.contract.events import (
    Event,
    FellowReleased,
    FellowUpdate,
    Hello,
    JobMembership,
    JobShard,
    JobUpdate,
    MetricReport,
    SpeedSet,
    Unknown,
    read_event,
)
from swarm_core.contract.membership import MembershipChange
from swarm_core.contract.metrics import step_loss
from swarm_core.contract.placement import Placement, PlacementError
from swarm_core.protocol import ByteCounters, FellowInfo, FellowStatus, LinkLimits, PeerLinkState
from swarm_tui.fmt import describe_speed
from swarm_tui.grid import is_grid

HISTORY = 240  # samples kept per series (a heartbeat a second: four minutes)
EVENTS_KEPT = 60  # recent events kept per fellow
MIN_RATE_WINDOW_S = 0.5
REPLICA_STEPS_KEPT = 8  # steps whose replicas' losses are still coming in (the leader's too)
SAME_SAMPLE_S = 0.05  # a snapshot's last_heartbeat and that heartbeat's event ts differ by less
# Statuses the leader sets without hearing from a fellow.
NOT_HEARTBEATS = frozenset(s for s in FellowStatus if not s.reported)
LEFT = frozenset(s for s in FellowStatus if s.left)  # the leader refuses them a set-speed
TERMINAL_JOB_STATES = ("COMPLETED", "FAILED", "CANCELLED")
FellowEvent = FellowUpdate | SpeedSet | FellowReleased
LIVE = frozenset(s.value for s in FellowStatus if s.live)
LEAVING_GONE_S = 10.0  # "leaving" and silent this long: it has left
# Gone (stale, offline, left) and silent this long: out of the fellows view's default rows.
GONE_HIDDEN_S = 60.0


@attrs.define(eq=False)
class RateMeter:
    """Bytes per second from a cumulative counter sampled at leader timestamps."""

    value: int | None = None
    ts: float | None = None
    rate: float | None = None

    def sample(self, value: int, ts: float) -> bool:
        """Take a sample; True when the rate changed."""
        if self.value is None or self.ts is None or value < self.value:
            reset = self.value is not None and self.rate is not None
            self.value, self.ts = value, ts
            if reset:  # the counter went backwards: the fellow restarted
                self.rate = None
            return reset
        dt = ts - self.ts
        if dt < MIN_RATE_WINDOW_S:
            return False
        rate = (value - self.value) / dt
        self.value, self.ts = value, ts
        changed = rate != self.rate
        self.rate = rate
        return changed


@attrs.define(eq=False)
class FellowState:
    fellow_id: int
    name: str = ""
    host: str = ""
    pid: int = 0
    devices: list[str] = attrs.field(factory=list)
    threads: int = 1
    data_addr: str | None = None
    status: str = "unknown"
    note: str = ""  # why a live fellow may look stuck ("throttled link …"), from snapshots
    job_id: str | None = None
    stage: int | None = None
    step: int = 0
    loss: float | None = None
    tokens_per_s: float = 0.0
    tx_limit: float | None = None  # Mbit/s; None is unlimited
    rx_limit: float | None = None
    latency_ms: float = 0.0
    counters: dict[str, int] = attrs.field(factory=dict)
    # The links a job's link matrix shapes, per peer cell (as its last snapshot said).
    peers: list[PeerLinkState] = attrs.field(factory=list)
    registered_at: float | None = None  # leader clock
    hb_local: float | None = None  # local clock of the last heartbeat
    last_heard: float | None = None  # leader clock of the last heartbeat (a record's too)
    sample_ts: float | None = None  # leader clock of the newest counters sample
    tx: RateMeter = attrs.field(factory=RateMeter)
    rx: RateMeter = attrs.field(factory=RateMeter)
    # The newest step it reported for its job (metric events): heartbeats lag behind them,
    # and "left job at step N" should not name a step before its "completed at step M".
    reported_step: int = 0
    loss_hist: deque[tuple[int, float]] = attrs.field(factory=lambda: deque(maxlen=HISTORY))
    # (leader time, value) samples: the detail view plots them against time.
    tps_hist: deque[tuple[float, float]] = attrs.field(factory=lambda: deque(maxlen=HISTORY))
    tx_hist: deque[tuple[float, float]] = attrs.field(
        factory=lambda: deque(maxlen=HISTORY))  # Mbit/s
    rx_hist: deque[tuple[float, float]] = attrs.field(factory=lambda: deque(maxlen=HISTORY))
    # When a set-speed was sent to it (leader time): marks on those plots.
    speed_marks: deque[float] = attrs.field(factory=lambda: deque(maxlen=EVENTS_KEPT))
    events: deque[tuple[float, str]] = attrs.field(factory=lambda: deque(maxlen=EVENTS_KEPT))

    @property
    def stale(self) -> bool:
        return self.status in NOT_HEARTBEATS

    @property
    def tx_mbps(self) -> float | None:
        return None if self.tx.rate is None else self.tx.rate * 8 / 1e6

    @property
    def rx_mbps(self) -> float | None:
        return None if self.rx.rate is None else self.rx.rate * 8 / 1e6

    def log(self, ts: float, text: str) -> None:
        self.events.append((ts, text))

    # updates ----------------------------------------------------------------------------------
    def _progress(self, job_id: str | None, stage: int | None, step: int, loss: float | None,
                  tps: float, ts: float) -> None:
        if job_id != self.job_id:
            if job_id is not None:
                where = "" if stage is None else f" as stage {stage}"
                self.log(ts, f"joined {job_id}{where}")
            elif self.job_id is not None:
                self.log(ts, f"left {self.job_id} at step {max(self.step, self.reported_step)}")
            self.loss_hist.clear()
            self.reported_step = 0
            self.stage = stage
        elif stage is not None:
            self.stage = stage
        self.job_id, self.step, self.loss, self.tokens_per_s = job_id, step, loss, tps
        if loss is not None and job_id is not None and (
                not self.loss_hist or self.loss_hist[-1][0] < step):
            self.loss_hist.append((step, loss))

    def _status(self, status: str, ts: float) -> None:
        if status != self.status and self.status != "unknown":
            self.log(ts, f"status {self.status} -> {status}")
        self.status = status

    def _link(self, link: LinkLimits | None) -> None:
        if link is not None:
            self.tx_limit, self.rx_limit = link.tx_mbps, link.rx_mbps
            self.latency_ms = link.latency_ms

    def _counters(self, counters: ByteCounters | None, ts: float | None) -> None:
        if counters is None:
            return
        if ts is not None and self.sample_ts is not None and ts <= self.sample_ts:
            return
        self.counters = attrs.asdict(counters)
        if ts is None:
            return
        self.sample_ts = ts
        if self.tx.sample(self.counters.get("data_tx", 0), ts) and self.tx.rate is not None:
            self.tx_hist.append((ts, self.tx.rate * 8 / 1e6))
        if self.rx.sample(self.counters.get("data_rx", 0), ts) and self.rx.rate is not None:
            self.rx_hist.append((ts, self.rx.rate * 8 / 1e6))

    def apply_info(self, fi: FellowInfo, now: float) -> None:
        self.name, self.host, self.pid = fi.name, fi.host, fi.pid
        self.devices, self.threads, self.data_addr = list(fi.devices), fi.threads, fi.data_addr
        self.registered_at = fi.registered_at
        self.note = str(getattr(fi, "note", "") or "")
        ts = fi.last_heartbeat if fi.last_heartbeat is not None else fi.registered_at
        self.last_heard = ts if self.last_heard is None else max(self.last_heard, ts)
        self._status(fi.status, ts)  # the leader's judgement (stale) needs no heartbeat
        if fi.heartbeat_age_s is not None:
            hb = now - fi.heartbeat_age_s
            self.hb_local = hb if self.hb_local is None else max(self.hb_local, hb)
        if self.sample_ts is not None and ts < self.sample_ts - SAME_SAMPLE_S:
            return  # an event already brought a newer heartbeat than this snapshot holds
        self._progress(fi.current_job, fi.current_stage, fi.current_step, fi.last_loss,
                       fi.tokens_per_s, ts)
        self._link(fi.link)
        self.peers = list(fi.peers)
        self._counters(fi.counters, fi.last_heartbeat)

    def apply_event(self, ev: FellowEvent, ts: float, now: float) -> None:
        if isinstance(ev, SpeedSet):
            during = f" (recorded in job {ev.job_id})" if ev.job_id else ""
            self.speed_marks.append(ts)
            self.log(ts, "set-speed requested: " + describe_speed(
                None if ev.link_kept else ev.link, ev.slowdown) + during)
            return
        if isinstance(ev, FellowReleased):
            self.log(ts, "release requested")
            return
        if ev.name:
            self.name = ev.name
        if ev.type == "fellow.registered":
            self.log(ts, "registered")
        if ev.status:
            self._status(ev.status, ts)
        if ev.status in NOT_HEARTBEATS:
            return  # the leader's judgement, not news from the fellow
        self.hb_local = now
        self.last_heard = ts
        self._progress(ev.job_id, None, ev.step, ev.loss, ev.tokens_per_s, ts)
        self.tps_hist.append((ts, self.tokens_per_s))
        self._link(ev.link)
        self._counters(ev.counters, ts)


@attrs.define(eq=False)
class FellowProgress:
    """What one stage of a job last reported (from ``metric`` events), and its fellow."""

    fellow_id: int | None = None
    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    state: str = ""
    activation_bytes: int | None = None  # peak held for backward in its last step
    wait_fraction: float | None = None  # of its last step, blocked on its links
    # A job with replicas: what its stage group's synchronisation sent in its last step (the
    # run's mean, once it completed), and the share of the step it took.
    sync_bytes: float | None = None
    sync_fraction: float | None = None
    # Swarm wiring: the micro-batches its route gave it in its last step (the run's mean once
    # it completed).
    micro_batches: float | None = None


# Reports held for cells a job's placement lacks yet: a new cell's first steps, a few a cell.
UNPLACED_KEPT = 16


@attrs.define(eq=False)
class JobView:
    info: JobInfo
    # By cell, its index in the placement (the stage, for one replica: replica r of stage k
    # is r x stages + k): a fellow with several device slots runs several cells of one job,
    # each with its own memory and waits.
    per_stage: dict[int, FellowProgress] = attrs.field(factory=dict)
    partial: bool = False  # built from an event; the next snapshot fills it in
    # The whole recorded loss history came with GET /jobs/{id} (the list route carries none):
    # until then the curve holds only the points seen live.
    history_loaded: bool = False
    # A job with replicas: the last stage's loss of each replica, by step, for the newest
    # steps (the step's loss is their mean, as the leader records it: ProgressRecord), and
    # under swarm wiring the micro-batches each ran, which weigh it.
    replica_losses: dict[int, dict[int, float]] = attrs.field(factory=dict)
    replica_micro_batches: dict[int, dict[int, float]] = attrs.field(factory=dict)
    # Swarm wiring: the membership epoch each held step's losses were trained under.
    replica_epochs: dict[int, int] = attrs.field(factory=dict)
    # Reports of cells the placement lacks, newest last: a moved peer's new cell can report
    # before the move's event comes (its cell reports, the leader's event follows), and those
    # land once the move is made; a late report of a mover's old cell is let go then.
    unplaced: list[MetricReport] = attrs.field(factory=list)

    def take_info(self, ji: JobInfo, *, with_history: bool) -> None:
        """A newer record of the job. The list route has no loss history: the curve seen so
        far stays; one fetched with it replaces the curve, keeping live points past its end."""
        old, old_evals = self.info.loss_history, self.info.eval_history
        if with_history:
            last = ji.loss_history[-1][0] if ji.loss_history else -1
            ji.loss_history = list(ji.loss_history) + [p for p in old if p[0] > last]
            last = ji.eval_history[-1][0] if ji.eval_history else -1
            ji.eval_history = list(ji.eval_history) + [p for p in old_evals if p[0] > last]
            self.history_loaded = True
        else:
            ji.loss_history, ji.eval_history = old, old_evals
        moved = ji.placement != self.info.placement
        self._rekey(ji.placement)
        self.info, self.partial = ji, False
        if moved and self.unplaced:
            self._land_unplaced()

    def take_move(self, change: MembershipChange) -> None:
        """A peer moved between stages (``change.moved``), or cells of a swarm job left alone
        (``change.cells_left``): the placement as the leader made it (every party computes
        the same), until the next record says so itself."""
        m, p = change.moved, self.info.placement
        if p is None:
            return
        try:
            if m is not None and m.new_id is not None:
                moved = p.moved(m.source, m.cell, m.target, m.new_id)
            elif change.cells_left:
                moved = p.without([(k, r) for k, r in change.cells_left])
            else:
                return
        except PlacementError:
            return  # (already made: the record came first)
        self._rekey(moved)
        self.info.placement = moved
        self.info.fellows = moved.fellows
        self._land_unplaced()

    def _land_unplaced(self) -> None:
        """The placement changed: the reports held for cells it lacked land on the rows of
        those it has now (a move made them), their cell's figures only (the job's loss and
        steps took them as they came); the rest (a mover's old cell) are let go."""
        waiting, self.unplaced = self.unplaced, []
        for report in waiting:
            index = self.index_of(report.stage or 0, report.replica or 0)
            if index is not None and report.fellow_id is not None:
                self._cell_figures(index, report.fellow_id, report)

    def _rekey(self, new: Placement | None) -> None:
        """``per_stage`` re-keyed to ``new``'s indices, cell by (stage, id): a move shifts
        the cells after the mover's (a grid keeps its indices); a cell gone is dropped."""
        old = self.info.placement
        if old is None or new is None or (old.layout is None and new.layout is None) \
                or not self.per_stage:
            return
        cells = [(c.stage, c.replica) for c in old.stages]
        rekeyed = {}
        for index, fp in self.per_stage.items():
            if 0 <= index < len(cells) and new.has(*cells[index]):
                rekeyed[new.index(*cells[index])] = fp
        self.per_stage = rekeyed

    @property
    def job_id(self) -> str:
        return self.info.job_id

    @property
    def total_steps(self) -> int | None:
        steps = self.info.training.steps if self.info.training is not None else 0
        return steps if steps > 0 else None

    @property
    def terminal(self) -> bool:
        return self.info.state in TERMINAL_JOB_STATES

    @property
    def num_stages(self) -> int:
        p = self.info.placement
        return p.num_stages if p is not None else self.info.topology.num_stages

    @property
    def replicas(self) -> int:
        p = self.info.placement
        return p.replicas if p is not None else self.info.topology.replicas

    @property
    def grid(self) -> bool:
        """Whether the job's cells are named by stage and replica (its cell id under a
        layout): it has replicas, or stages of their own cells (a layout, peers that
        moved)."""
        return is_grid(self.info)

    def cell_of(self, index: int) -> tuple[int, int]:
        """(stage, replica) of the cell at this index of the placement (of one replica, the
        index is the stage; under a layout, the placement's cell there: (stage, id))."""
        p = self.info.placement
        if p is not None and 0 <= index < len(p.stages):
            return p.stages[index].stage, p.stages[index].replica
        if self.replicas == 1:
            return index, 0
        return index % self.num_stages, index // self.num_stages

    def index_of(self, stage: int, replica: int) -> int | None:
        """The index of the cell (stage, replica) in the placement; None for a cell the
        placement lacks (a moved peer's old cell, or its new one before the move is
        known)."""
        p = self.info.placement
        if p is not None:  # (a grid's cells are its replicas, a layout's its ids)
            return p.index(stage, replica) if p.has(stage, replica) else None
        return replica * self.num_stages + stage

    def label(self, stage: int, replica: int) -> str:
        """How the job's reports and records name the cell: "k" for a chain, "k.r" else
        (the placement's word where it has the cell)."""
        p = self.info.placement
        if p is not None and p.has(stage, replica):
            return p.label(stage, replica)
        return f"{stage}.{replica}" if self.grid else str(stage)

    def left_at(self, replica: int) -> int | None:
        """The step from which the replica has been out of the job (its newest departure,
        unless it joined again since); None while it trains."""
        at: int | None = None
        for ch in self.info.membership:
            if replica in ch.left:
                at = ch.step
            elif replica in ch.joined:
                at = None
        return at

    def apply_metric(self, report: MetricReport) -> None:
        fid, step, loss, stage = report.fellow_id, report.step, report.loss, report.stage
        known = True  # (a cell of the placement: not a moved peer's old cell)
        if stage is not None and (report.replica or self.grid):
            # (the cell's index; under a layout, from the placement, never arithmetic)
            stage = self.index_of(stage, report.replica or 0)
            known = stage is not None
            if not known:
                self.unplaced = [*self.unplaced, report][-UNPLACED_KEPT:]
        if stage is None and known and fid is not None and fid in self.info.fellows:
            stage = self.info.fellows.index(fid)  # a leader that does not name the stage
        if fid is not None and stage is not None:
            self._cell_figures(stage, fid, report)
        self.info.last_step = max(self.info.last_step, step)
        if self.grid:  # (the last stage's cells, by id: a layout's too)
            self._replica_loss(report)
        elif loss is not None:
            self.info.last_loss = loss
            hist = self.info.loss_history
            if not hist or hist[-1][0] < step:
                hist.append([step, loss])

    def _cell_figures(self, index: int, fid: int, report: MetricReport) -> None:
        """The figures of the cell at ``index`` (its row), from its report."""
        fp = self.per_stage.setdefault(index, FellowProgress())
        fp.fellow_id = fid
        fp.step, fp.state = report.step, report.state
        if report.loss is not None:
            fp.loss = report.loss
        if report.tokens_per_s is not None:
            fp.tokens_per_s = report.tokens_per_s
        figures = report.metrics
        peak = figures.activation_peak_bytes
        # (a COMPLETED report carries the whole run's peak under the same name)
        if peak is not None and fp.state == "RUNNING":
            fp.activation_bytes = peak
        wait_fraction = step_wait_share(figures.wait_seconds, figures.step_seconds)
        if wait_fraction is not None:
            fp.wait_fraction = wait_fraction
        if figures.sync_bytes is not None:
            fp.sync_bytes = figures.sync_bytes
        if figures.sync_share is not None:
            fp.sync_fraction = figures.sync_share
        if figures.micro_batches is not None:
            fp.micro_batches = figures.micro_batches
        evals = self.info.eval_history
        if figures.eval_loss is not None and (not evals or evals[-1][0] < report.step):
            evals.append([report.step, figures.eval_loss])

    def _replica_loss(self, report: MetricReport) -> None:
        """Of several replicas, the job's loss of a step is the mean of its replicas' (their
        last stage's first report of the step), as the leader records it and ``swarm job``
        shows it: one replica's loss is its row's, not the job's."""
        if report.loss is None or report.state != "RUNNING" or report.stage is None \
                or report.stage != self.num_stages - 1 \
                or report.metrics.wire_tx_bytes is None:
            return
        step = report.step
        held = self.replica_epochs.get(step)
        if report.epoch is not None and held is not None and report.epoch != held:
            if report.epoch < held:
                return  # (a late report of an attempt the step was trained again after)
            # (the step trained again after a membership change: its reports replace those
            # of the attempt given up)
            self.replica_losses.pop(step, None)
            self.replica_micro_batches.pop(step, None)
        if report.epoch is not None:
            self.replica_epochs[step] = report.epoch
        losses = self.replica_losses.setdefault(step, {})
        if (report.replica or 0) in losses:
            return  # (a cell's repeat of a step: the leader keeps its first report)
        losses[report.replica or 0] = report.loss
        if report.metrics.micro_batches is not None:  # (swarm wiring: uneven shares)
            self.replica_micro_batches.setdefault(step, {})[report.replica or 0] = \
                report.metrics.micro_batches
        for old in sorted(self.replica_losses)[:-REPLICA_STEPS_KEPT]:
            del self.replica_losses[old]
            self.replica_micro_batches.pop(old, None)
            self.replica_epochs.pop(old, None)
        mean = step_loss(losses, self.replica_micro_batches.get(step))
        self.info.last_loss = mean
        hist = self.info.loss_history
        if not hist or hist[-1][0] < step:
            hist.append([step, mean])
            return
        for point in reversed(hist[-REPLICA_STEPS_KEPT:]):  # (a replica's report of a step
            if point[0] == step:                           # already drawn: the new mean)
                point[1] = mean
                return


@attrs.define
class Change:
    """What an update touched: rows to redraw, and whether rows came or went."""

    fellows: set[int] = attrs.field(factory=set)
    jobs: set[str] = attrs.field(factory=set)
    fellow_rows: bool = False  # fellows added or removed
    job_rows: bool = False
    ages: bool = False  # time moved on: heartbeat and job ages

    def __bool__(self) -> bool:
        return bool(self.fellows or self.jobs or self.fellow_rows or self.job_rows or self.ages)

    def merge(self, other: Change) -> Change:
        self.fellows |= other.fellows
        self.jobs |= other.jobs
        self.fellow_rows |= other.fellow_rows
        self.job_rows |= other.job_rows
        self.ages |= other.ages
        return self


class ClusterModel:
    """Fellows and jobs, kept current from snapshots and events."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.fellows: dict[int, FellowState] = {}
        self.jobs: dict[str, JobView] = {}
        # Jobs of each state the leader holds beyond the console's window (the next pending
        # ones in line, the finished ones before the newest): counted, not listed.
        self.jobs_left_out: dict[str, int] = {}
        self.offset = 0.0  # leader clock minus local clock
        self.last_seq: int | None = None
        self.need_refresh = False  # an event was missed or named something unknown
        self.events_seen = 0

    def leader_now(self) -> float:
        return self.clock() + self.offset

    # snapshots --------------------------------------------------------------------------------
    def apply_fellows(self, infos: Iterable[FellowInfo]) -> Change:
        now = self.clock()
        change = Change()
        seen: set[int] = set()
        for fi in infos:
            seen.add(fi.fellow_id)
            st = self.fellows.get(fi.fellow_id)
            if st is None:
                st = self.fellows[fi.fellow_id] = FellowState(fi.fellow_id)
                change.fellow_rows = True
            st.apply_info(fi, now)
            change.fellows.add(fi.fellow_id)
        for fid in set(self.fellows) - seen:
            del self.fellows[fid]
            change.fellow_rows = True
        return change

    def apply_jobs(self, infos: Iterable[JobInfo], *,
                   left_out: dict[str, int] | None = None) -> Change:
        """The leader's listing: the jobs it names, updated or added; the others dropped."""
        change = Change()
        seen: set[str] = set()
        if left_out is not None:
            self.jobs_left_out = {k: n for k, n in left_out.items() if n > 0}
        for ji in infos:
            seen.add(ji.job_id)
            view = self.jobs.get(ji.job_id)
            if view is None:
                # (the list route has none; a curve begins live)
                ji.loss_history, ji.eval_history = [], []
                self.jobs[ji.job_id] = JobView(ji)
                change.job_rows = True
            else:
                view.take_info(ji, with_history=False)
            change.jobs.add(ji.job_id)
        for jid in set(self.jobs) - seen:
            del self.jobs[jid]
            change.job_rows = True
        return change

    def apply_job(self, ji: JobInfo, *, with_history: bool = True) -> Change:
        """One job on its own: fetched (the watch view), with its whole loss history, or as
        an action's answer (``with_history=False``: submit, cancel). Keeps the other jobs."""
        view = self.jobs.get(ji.job_id)
        if view is None:
            if not with_history:
                ji.loss_history, ji.eval_history = [], []
            self.jobs[ji.job_id] = JobView(ji, history_loaded=with_history)
            return Change(jobs={ji.job_id}, job_rows=True)
        view.take_info(ji, with_history=with_history)
        return Change(jobs={ji.job_id})

    # events -----------------------------------------------------------------------------------
    def apply_event(self, ev: Event | Mapping[str, Any]) -> Change:
        """One event of the leader's stream (a frame not yet read is read here, once)."""
        event = ev if isinstance(ev, Event) else read_event(ev)
        data = event.data
        now = self.clock()
        if event.ts is not None:
            ts = event.ts
            self.offset = ts - now
        else:
            ts = now + self.offset
        hello = isinstance(data, Hello)
        if event.seq is not None:
            if not hello and self.last_seq is not None and event.seq != self.last_seq + 1:
                self.need_refresh = True
                self._history_gap()
            self.last_seq = event.seq
        if hello:
            if self.events_seen:
                self._history_gap()  # a reconnect: whatever happened meanwhile is unseen
            return Change()
        self.events_seen += 1
        match data:
            case FellowUpdate() | SpeedSet() | FellowReleased():
                return self._fellow_event(data, ts, now)
            case MetricReport():
                return self._metric(data)
            case JobUpdate():
                return self._job_update(data)
            case JobShard() | JobMembership():
                return self._job_record(data)
            case Unknown(problem=problem) if problem:
                self.need_refresh = True  # what it said comes with the next snapshot
        return Change()

    def _history_gap(self) -> None:
        """Metrics were missed: a curve extended live has holes until fetched again."""
        for view in self.jobs.values():
            view.history_loaded = False

    def _fellow_event(self, ev: FellowEvent, ts: float, now: float) -> Change:
        fid = ev.fellow_id
        change = Change(fellows={fid})
        st = self.fellows.get(fid)
        if st is None:
            if not isinstance(ev, FellowUpdate):
                return Change()
            st = self.fellows[fid] = FellowState(fid)
            change.fellow_rows = True
            self.need_refresh = True  # host, devices and the rest come with the snapshot
        st.apply_event(ev, ts, now)
        return change

    def _metric(self, report: MetricReport) -> Change:
        jid = report.job_id
        view = self.jobs.get(jid) if jid is not None else None
        if view is None:
            self.need_refresh = True
            return Change()
        view.apply_metric(report)
        fid = report.fellow_id
        st = self.fellows.get(fid) if fid is not None else None
        if st is not None and st.job_id == jid:
            st.reported_step = max(st.reported_step, report.step)
        if st is not None and report.state in ("COMPLETED", "FAILED"):
            st.log(self.leader_now(), f"{jid}: {report.state.lower()} at step {report.step}")
        return Change(jobs={view.job_id})

    def _job_update(self, ev: JobUpdate) -> Change:
        jid = ev.job_id
        view = self.jobs.get(jid)
        change = Change(jobs={jid})
        if view is None:
            # (a job first seen in an event has its kind at once: a launch's rows read "train")
            info = JobInfo(job_id=jid, name=ev.name or jid, kind=ev.kind,
                           state=ev.state or "PENDING",
                           created_at=self.leader_now(), started_at=None, finished_at=None,
                           last_step=0, last_loss=None, fellows=[], topology=Topology(),
                           reason="")
            view = self.jobs[jid] = JobView(info, partial=True)
            change.job_rows = True
            self.need_refresh = True
        info = view.info
        if ev.name:
            info.name = ev.name
        if ev.state:
            info.state = ev.state
        info.reason, info.last_step, info.last_loss = ev.reason, ev.last_step, ev.last_loss
        info.fellows = list(ev.fellows)
        if info.state == "RUNNING" and info.started_at is None:
            info.started_at = self.leader_now()
        if info.state in TERMINAL_JOB_STATES and info.finished_at is None:
            info.finished_at = self.leader_now()
            self.need_refresh = True  # final metrics and history
        if info.state != "PENDING":
            info.waiting_for = ""
        return change

    def _job_record(self, ev: JobShard | JobMembership) -> Change:
        """A shard reached the leader, or replicas left or joined: of a job shown, the row
        may change; of another, nothing to show."""
        view = self.jobs.get(ev.job_id)
        if view is None:
            return Change()
        if isinstance(ev, JobMembership) and ev.change not in view.info.membership:
            view.info.membership.append(ev.change)  # (the snapshot's record says the same)
            if ev.change.moved is not None:  # (a move: nobody left; the cells changed)
                view.take_move(ev.change)
                return Change(jobs={ev.job_id}, fellows=set(view.info.fellows))
            if ev.change.cells_left:  # (cells left alone: the placement lost them)
                fellows = set(view.info.fellows)
                view.take_move(ev.change)
                view.info.members = list(ev.change.members)
                return Change(jobs={ev.job_id}, fellows=fellows)
            view.info.members = list(ev.change.members)
        return Change(jobs={ev.job_id})

    # queries ----------------------------------------------------------------------------------
    def heartbeat_age(self, st: FellowState) -> float | None:
        return None if st.hb_local is None else max(0.0, self.clock() - st.hb_local)

    def silent_for(self, st: FellowState) -> float | None:
        """Seconds since the fellow was last heard of (its heartbeat age, else its record's
        last heartbeat on the leader's clock: a fellow of a previous leader's cluster)."""
        age = self.heartbeat_age(st)
        if age is not None:
            return age
        return None if st.last_heard is None else max(0.0, self.leader_now() - st.last_heard)

    def shown_status(self, st: FellowState) -> str:
        """The status as shown: a fellow whose last word was "leaving" and that has been
        silent since (one of a previous cluster, kept in the leader's records) has left."""
        if st.status == "leaving":
            age = self.heartbeat_age(st)
            if age is not None and age > LEAVING_GONE_S:
                return "left"
        return st.status

    def gone(self, st: FellowState) -> bool:
        """Not in the cluster now: stale, offline, released, leaving or left."""
        return self.shown_status(st) not in LIVE

    def hidden(self, st: FellowState) -> bool:
        """Gone and silent for ``GONE_HIDDEN_S``: out of the default view (a toggle shows
        it; ``swarm forget`` drops its record)."""
        if not self.gone(st):
            return False
        silent = self.silent_for(st)
        return silent is None or silent > GONE_HIDDEN_S

    def shown_fellows(self, *, gone_too: bool = False) -> list[FellowState]:
        """The fellows the fellows view lists (by default, not those hidden)."""
        return [st for st in self.fellows.values() if gone_too or not self.hidden(st)]

    def counts(self, *, gone_too: bool = False) -> dict[str, int]:
        """By shown status, the fellows the fellows view lists: the counts agree with its
        rows (``hidden``: how many it leaves out)."""
        out: dict[str, int] = {}
        shown = self.shown_fellows(gone_too=gone_too)
        for st in shown:
            status = self.shown_status(st)
            out[status] = out.get(status, 0) + 1
        hidden = len(self.fellows) - len(shown)
        if hidden:
            out["hidden"] = hidden
        return out

    def forget(self, fellow_ids: Iterable[int]) -> Change:
        """Fellows the leader forgot: gone from the model at once."""
        change = Change()
        for fid in fellow_ids:
            if self.fellows.pop(fid, None) is not None:
                change.fellow_rows = True
        return change

    def job_counts(self) -> dict[str, int]:
        """Per state, the jobs the console holds and those the leader holds beyond them."""
        out: dict[str, int] = dict(self.jobs_left_out)
        for view in self.jobs.values():
            out[view.info.state] = out.get(view.info.state, 0) + 1
        return out

