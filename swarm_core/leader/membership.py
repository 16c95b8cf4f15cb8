"""A job of several replicas loses one and trains on: the leader's half of a regroup.

When a member of a stage group dies, the survivors' ring breaks; each survivor asks
``POST /jobs/{id}/regroup`` with where it stands and waits for the answer, while the cells of
the dead member's chain fail (their pipeline link broke) and its fellow goes stale. A round
is decided once every cell of the current members has asked or is known lost (a FAILED
report, a fellow gone stale or away), or when the heartbeat timeout has passed since the
round began (a cell still silent by then is lost, unless its fellow says it runs it: a
DiLoCo replica may train many inner steps before its next synchronisation). A cell that
completed asks nothing: its group's last synchronisation, with every member, is behind it.
:func:`regroup_orders` gives each asking cell its order, the lost replicas leave, and the
change is recorded (the job's ``membership``, the step's progress record, a
``job.membership`` event). Where no replica is left, or the reports do not fit together, the
job recovers as a job of one replica does (:meth:`Liveness.lost`). Where the survivors
have all completed, the lost replicas leave without a regroup and the job completes, unless
a stage's final shard, which only its group's first member writes, never reached the leader.

A swarm-wired dp job's round is cell by cell (``Membership.cellwise``, ``_decide_cells``): a
lost cell other than its stage's cell 0 leaves alone, the job's placement taken down to the
layout without it and its batch kept; the round is decided, recorded and answered at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import attrs

from swarm_core.contract.events import JobMembership
from swarm_core.contract.membership import (
    MembershipChange,
    MembersSignal,
    RegroupConflict,
    RegroupOrder,
    RegroupReport,
    cell_departure,
    cell_orders,
    cellwise_layout,
    departure,
    group_orders,
    routed_orders,
)
from swarm_core.contract.metrics import JobStatusUpdate
from swarm_core.contract.placement import Placement, layout_cells
from swarm_core.leader.errors import ApiError
from swarm_core.leader.records import CellOrder, DecidedRegroup, JobRecord, StoredJoin
from swarm_core.protocol import JobState
from swarm_core.schema import unstructure

if TYPE_CHECKING:
    from swarm_core.leader.queue import JobQueue

Cell = tuple[int, int]  # (stage, replica)
V = TypeVar("V")


def _put(table: dict[str, V], key: str, value: V | None) -> None:
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value


@attrs.define
class RegroupRound:
    """A regroup being gathered. Leader-local until its survivors are decided (a restarted
    leader starts one anew as the survivors ask again); from then on stored with the job
    (``JobRecord.regroup``) until every group has its orders."""

    since: float  # monotonic
    reports: dict[Cell, RegroupReport] = attrs.field(factory=dict)
    lost: dict[int, str] = attrs.field(factory=dict)  # replica -> why it is out
    # (a cell-wise job's: each lost cell, for the rule that drops it alone; see cellwise)
    lost_cells: dict[Cell, str] = attrs.field(factory=dict)
    decided: asyncio.Event = attrs.field(factory=asyncio.Event)  # (a new one each wave)
    # Once the replicas that go on are decided: they, the new epoch, and the stage groups
    # whose orders are given (a group whose cells were all held up behind their chains'
    # regroups reports later, at its own next synchronisation).
    members: list[int] | None = None
    epoch: int = 0
    ordered: set[int] = attrs.field(factory=set)
    before: list[int] = attrs.field(factory=list)  # the members the round began with
    reason: str = ""  # why the replicas that leave are out (once decided)


@attrs.define
class Joining:
    """Spare fellows told to join as ``replica`` (one a stage: the replica's chain), the
    survivors told to take it in at their next synchronisation (stored with the job as
    ``JobRecord.joining``: a restarted leader knows it)."""

    replica: int
    fellow_ids: tuple[int, ...]
    order: RegroupOrder

    def who(self) -> str:
        ids = ", ".join(str(f) for f in self.fellow_ids)
        return f"fellow{'s' if len(self.fellow_ids) > 1 else ''} {ids}"


@attrs.define
class Answers:
    """The orders of the last decided round, for cells that ask again (a lost answer)."""

    epoch: int = 0
    orders: dict[Cell, RegroupOrder] = attrs.field(factory=dict)


def _check_steps(job: JobRecord, rep: RegroupReport) -> None:
    """A report's steps are steps of the job (0-based): the change recorded from them is a
    step of it, which the leader can store and a curve can be read against."""
    steps = job.spec.training.steps if job.spec.training is not None else 0
    for name, value, lo in (("op_step", rep.op_step, 0), ("synced_step", rep.synced_step, -1)):
        if not lo <= value < steps:
            raise ApiError(400, f"{name} must be a step of the job ({lo} to {steps - 1}), "
                                f"got {value}", field=f"$.{name}")


def _recorded_cellwise(job: JobRecord, rep: RegroupReport) -> RegroupOrder | None:
    """A survivor's order in the cell-wise round the job's last change records, where it asks
    for it under the membership before (a leader restarted between deciding the round and
    the cell's fetch of its answer: the answers lived in the old leader's memory). The round
    is decided, recorded and answered at once, so the record holds the whole order: its
    epoch and ids, the step every survivor trains again and the layout the placement was
    left with (``cell_orders``)."""
    last = job.membership[-1] if job.membership else None
    p = job.placement
    # (``job.epoch``: the change is the job's latest membership, of this attempt: a job that
    # recovered starts its epochs again below the changes it keeps on record)
    if job.state is not JobState.RUNNING or job.recovering is not None or last is None \
            or not last.cells_left or last.epoch != job.epoch \
            or last.epoch != rep.epoch + 1 or p is None or not p.has(rep.stage, rep.replica):
        return None  # (a job that ended or recovers forgot its answers: 409 to the cell)
    return RegroupOrder(last.epoch, list(last.members), redo_step=last.step - 1,
                        layout=[p.ids(k) for k in range(p.num_stages)])


class Membership:
    def __init__(self, queue: JobQueue) -> None:
        self.queue = queue
        self.rounds: dict[str, RegroupRound] = {}
        self.answers: dict[str, Answers] = {}
        self.joining: dict[str, Joining] = {}
        # Fellows whose cell of the job failed while they stayed up: not taken back into it
        # (what failed may fail again), unless they restart.
        self.failed: dict[str, set[int]] = {}

    @staticmethod
    def replicated(job: JobRecord) -> bool:
        """Whether a replica of the job may leave it (or join) while the others train on: a
        train job of a grid of several replicas, or a swarm job whose cells leave one by one
        (``cellwise``: a layout's too). Not where peers move between stages (one may come): a
        lost cell is not regrouped, the job recovers (or fails) as a whole."""
        p, topo = job.placement, job.spec.topology
        if Membership.cellwise(job):
            return True
        return job.kind == "train" and p is not None and p.replicas > 1 and p.layout is None \
            and not topo.moves and topo.rebalance_every is None

    @staticmethod
    def cellwise(job: JobRecord) -> bool:
        """Whether a lost cell of the job leaves alone, the cells of its id at other stages
        training on and the job's batch kept (SWARM's: a lost peer costs throughput, not
        data): a swarm-wired dp train job of several cells whose peers do not move. A lost
        cell 0 (its stage's evaluator and checkpointer) takes its replica with it, as
        before, where the job's cells are still the grid (see ``_decide_cells``). (A swarm
        job of several cells syncs every step: its submission is refused otherwise.)"""
        p, topo = job.placement, job.spec.topology
        # (once a replica left by that rule its cells stay, done, in the grid: the rule of
        # whole replicas goes on deciding)
        return job.kind == "train" and p is not None and topo.wiring == "swarm" \
            and (p.replicas > 1 or p.layout is not None) \
            and not topo.moves and topo.rebalance_every is None \
            and (job.members is None or set(job.members) >= {c.replica for c in p.stages})

    def members(self, job: JobRecord) -> list[int]:
        """The replicas that train (once a round has decided who goes on, those); under a
        layout, every id (none leaves)."""
        assert job.placement is not None
        rnd = self.rounds.get(job.job_id)
        if rnd is not None and rnd.members is not None:
            return rnd.members
        return list(range(job.placement.width)) if job.members is None else job.members

    def left(self, job: JobRecord, replica: int) -> bool:
        """Whether the replica is out of the job: a decided regroup dropped it, or a spare's
        join as it was called off, and no spare is joining as it now. What its cells still
        send comes too late: taken, a replica that no longer trains would put its loss, its
        step or its export over the survivors'."""
        if not self.replicated(job) or replica in self.members(job):
            return False
        joining = self.joining.get(job.job_id)
        if joining is not None and joining.replica == replica:
            return False
        # A replica leaves with its cells counted done (_leave); spares joining as one are
        # in self.joining, stored with the job, so a restarted leader knows them too.
        p = job.placement
        assert p is not None
        return all(p.index(s, replica) in job.done_stages
                   for s in range(job.num_stages) if p.has(s, replica))

    def as_now(self, job_id: str) -> Callable[[], None]:
        """A function that puts the job's regroup state back as it is now (a change the store
        refused, see ``leader/undo.py``)."""
        rnd = self.rounds.get(job_id)
        rnd = None if rnd is None else attrs.evolve(
            rnd, reports=dict(rnd.reports), lost=dict(rnd.lost),
            lost_cells=dict(rnd.lost_cells), ordered=set(rnd.ordered),
            members=None if rnd.members is None else list(rnd.members), before=list(rnd.before))
        answers = self.answers.get(job_id)
        answers = None if answers is None else Answers(answers.epoch, dict(answers.orders))
        joining = self.joining.get(job_id)
        failed = self.failed.get(job_id)
        failed = None if failed is None else set(failed)

        def undo() -> None:
            if rnd is not None and rnd.decided.is_set():
                rnd.decided = asyncio.Event()  # (whoever it woke asks again)
            _put(self.rounds, job_id, rnd)
            _put(self.answers, job_id, answers)
            _put(self.joining, job_id, joining)
            _put(self.failed, job_id, failed)

        return undo

    # what cells say ----------------------------------------------------------------------------
    def report(self, job: JobRecord, rep: RegroupReport) -> RegroupOrder | None:
        """Take a survivor's report; its order once the round is decided (None: not yet)."""
        if job.state is not JobState.RUNNING or job.recovering is not None:
            raise ApiError(409, f"job {job.job_id} is not running", code="job_not_running")
        if job.placement is not None and job.placement.layout is not None \
                and not self.cellwise(job):
            raise ApiError(409, f"job {job.job_id} runs a swarm layout (stages of unequal "
                                "cells): a lost cell is not regrouped, the job recovers from "
                                "its checkpoint or fails", code="layout_no_regroup")
        if not self.replicated(job) or not self.queue.holds(job, rep.fellow_id, rep.stage,
                                                              rep.replica):
            raise ApiError(409, f"fellow {rep.fellow_id} does not hold stage {rep.stage} "
                                f"replica {rep.replica} of {job.job_id}", code="not_in_job")
        if rep.attempt != job.attempt:
            raise ApiError(409, f"attempt {rep.attempt} of {job.job_id} was replaced",
                           code="job_not_running")
        _check_steps(job, rep)
        order = self.answer(job, rep)
        if order is not None:
            return order  # (it asked again: its answer was lost)
        joining = self.joining.get(job.job_id)
        if joining is not None and rep.epoch == joining.order.epoch:
            self.joined(job, rep.op_step)  # (the group took it in; its first report is late)
        rnd = self.rounds.get(job.job_id)
        if rnd is not None and rnd.members is not None and rep.epoch == rnd.epoch:
            # A break under the membership this round made, before every group has its
            # orders: the next round's, once this one closes (the cell asks again).
            return None
        if rep.epoch < job.epoch and self._same_members_since(job, rep.epoch):
            # A group that trained on through a regroup in which nobody left (its own ring
            # held): it still trains with the members there are.
            rep = attrs.evolve(rep, epoch=job.epoch)
        if rep.epoch != job.epoch:
            raise ApiError(409, f"membership {rep.epoch} of {job.job_id} is over (now "
                                f"{job.epoch})", code="job_not_running")
        job.active_at = time.monotonic()
        rnd = self._round(job)
        rnd.reports[(rep.stage, rep.replica)] = rep
        self._decide(job, final=False)
        return self.answer(job, rep)

    @staticmethod
    def superseded(job: JobRecord, upd: JobStatusUpdate) -> bool:
        """A swarm-wired cell's report of a step it trained under a membership that a later
        change took that step back from (the survivors trained it again): late, not kept.
        Never of a job whose peers move: its epochs count moves, which retrain no step (and
        start again from 0 at each attempt)."""
        topo = job.spec.topology
        if topo.moves or topo.rebalance_every is not None:
            return False
        return upd.state == "RUNNING" and upd.epoch is not None and any(
            c.epoch > upd.epoch and upd.step >= c.step for c in job.membership)

    @staticmethod
    def _same_members_since(job: JobRecord, epoch: int) -> bool:
        """Whether every membership after ``epoch`` came of a regroup in which nobody left
        (a ring that timed out): only the groups that broke moved to it."""
        return all(not c.departed and not c.joined for c in job.membership if c.epoch > epoch)

    def answer(self, job: JobRecord, rep: RegroupReport) -> RegroupOrder | None:
        answers = self.answers.get(job.job_id)
        if answers is None:
            return _recorded_cellwise(job, rep)
        if answers.epoch != rep.epoch + 1:
            return None
        return answers.orders.get((rep.stage, rep.replica))

    async def wait(self, job: JobRecord, timeout: float) -> None:
        rnd = self.rounds.get(job.job_id)
        if rnd is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rnd.decided.wait(), timeout)

    # what the leader sees ---------------------------------------------------------------------
    def cell_lost(self, job: JobRecord, stage: int, replica: int, reason: str,
                  failed_fellow: int | None = None) -> bool:
        """A cell failed (on ``failed_fellow``, which is up) or its fellow is gone. Its replica
        leaves if another one is left to train on: True. False: the caller recovers the job
        as it would without replicas."""
        if not self.replicated(job):
            return False
        if job.state is not JobState.RUNNING or job.recovering is not None:
            # (another cell of the same fellow ended the job, or began its recovery: a round
            # begun now would end it again)
            return True
        if failed_fellow is not None:
            self.failed.setdefault(job.job_id, set()).add(failed_fellow)
        joining = self.joining.get(job.job_id)
        if joining is not None and joining.replica == replica:
            self._abort_join(job)  # (the joiner failed before the group took it in)
            return True
        assert job.placement is not None
        if self.cellwise(job):
            if not job.placement.has(stage, replica):
                return True  # (it left already: a late word from it)
            rnd = self._round(job)
            rnd.lost_cells.setdefault((stage, replica), reason)
            if rnd.members is not None:  # (the round went to whole replicas: see _decide_cells)
                rnd.lost.setdefault(replica, reason)
            if len(rnd.lost_cells) == len(job.placement.stages):
                self.forget(job)
                return False
            self._decide(job, final=False)
            return True
        members = self.members(job)
        if replica not in members:
            self._leave(job, [replica])  # (it left already: a late word from it)
            return True
        rnd = self._round(job)
        rnd.lost.setdefault(replica, reason)
        if not [r for r in members if r not in rnd.lost]:
            self.forget(job)
            return False
        self._decide(job, final=False)
        return True

    def out(self, job: JobRecord, replica: int) -> bool:
        """Whether the replica has left the job or is being dropped from it (its cells are
        not to be started again)."""
        rnd = self.rounds.get(job.job_id)
        joining = self.joining.get(job.job_id)
        if joining is not None and joining.replica == replica:
            return False
        return replica not in self.members(job) or (rnd is not None and replica in rnd.lost)

    def fellow_restarted(self, job: JobRecord, fellow_id: int) -> None:
        """A new process under the fellow's name: it may be taken back into the job."""
        self.failed.get(job.job_id, set()).discard(fellow_id)

    def fellow_lost(self, job: JobRecord, fellow_id: int, reason: str) -> bool:
        """Every cell of a fellow that is gone (see cell_lost)."""
        assert job.placement is not None
        cells = [(s.stage, s.replica) for s in job.placement.stages if s.fellow_id == fellow_id
                 and job.placement.index(s.stage, s.replica) not in job.done_stages]
        return all(self.cell_lost(job, s, r, reason) for s, r in cells) if cells else True

    def check(self, job: JobRecord) -> None:
        """A round older than the heartbeat timeout is decided: a cell silent so long is
        lost. One whose ring neighbour saw it close the link is lost after a heartbeat."""
        rnd = self.rounds.get(job.job_id)
        if rnd is None:
            return
        age = time.monotonic() - rnd.since
        if age >= self.queue.liveness.hold_s():
            self._decide(job, final=True)
        elif age >= self.queue.registry.heartbeat_interval_s:
            self._decide(job, final=False)

    def forget(self, job: JobRecord) -> None:
        """The job ended, or recovers: wake whoever waits (they are answered 409)."""
        if job.regroup is not None or job.joining is not None:
            # (a restarted leader must not take the round, or the join, up again)
            job.regroup = job.joining = None
            self.queue.save(job)
        rnd = self.rounds.pop(job.job_id, None)
        if rnd is not None:
            rnd.decided.set()
        self.answers.pop(job.job_id, None)
        self.joining.pop(job.job_id, None)
        self.failed.pop(job.job_id, None)

    # the decision -----------------------------------------------------------------------------
    @staticmethod
    def _done(job: JobRecord, stage: int, replica: int) -> bool:
        """Whether the cell completed (or its replica left): it will not ask for a regroup.
        A member completes past its group's last synchronisation, which every member of the
        group took part in: nothing of the group's training is missing."""
        assert job.placement is not None
        return job.placement.index(stage, replica) in job.done_stages

    def _at_work(self, job: JobRecord, stage: int, replica: int) -> bool:
        """Whether the cell's fellow is up and says it runs the cell (this attempt)."""
        assert job.placement is not None
        rec = self.queue.registry.find(job.placement.cell(stage, replica).fellow_id)
        return rec is not None and self.queue.registry.status(rec).live and any(
            c.job_id == job.job_id and c.stage == stage and c.replica == replica
            and c.attempt == job.attempt for c in rec.running)

    def _held_up(self, job: JobRecord, rnd: RegroupRound, stage: int, replica: int) -> bool:
        """A silent cell of a chain that has asked: held up behind it (its pipeline neighbour
        waits for the order), if its fellow runs it and has heartbeated since the round
        began (a cell that died at the same moment has not)."""
        assert job.placement is not None
        rec = self.queue.registry.find(job.placement.cell(stage, replica).fellow_id)
        return rec is not None and rec.last_seen is not None and rec.last_seen > rnd.since \
            and self._at_work(job, stage, replica)

    def restore(self, job: JobRecord) -> None:
        """A leader that restarted under a decided round: the groups still to ask get the
        orders the round gives, and the change is recorded once all have them. Under a
        join: the members are told again (what was queued for them died with the old
        leader), and the join is recorded when the group reports it."""
        joined = job.joining
        if joined is not None and self.replicated(job):
            self.joining[job.job_id] = Joining(joined.replica, tuple(joined.fellow_ids),
                                               joined.order)
            self._tell_members(job, joined.order)
        stored = job.regroup
        if stored is None or not self.replicated(job):
            return
        self.rounds[job.job_id] = RegroupRound(
            time.monotonic(), reports={(r.stage, r.replica): r for r in stored.reports},
            members=list(stored.members), epoch=stored.epoch, ordered=set(stored.ordered),
            before=list(stored.before), reason=stored.reason)
        self.answers[job.job_id] = Answers(stored.epoch, {
            (o.stage, o.replica): o.order for o in stored.orders})

    def _store(self, job: JobRecord, rnd: RegroupRound) -> None:
        """The decided round as it stands, with the job (see ``DecidedRegroup``)."""
        assert rnd.members is not None
        answers = self.answers[job.job_id]
        job.regroup = DecidedRegroup(
            rnd.epoch, list(rnd.members), list(rnd.before), rnd.reason, sorted(rnd.ordered),
            list(rnd.reports.values()),
            [CellOrder(s, r, order) for (s, r), order in answers.orders.items()])
        self.queue.save(job)

    def _round(self, job: JobRecord) -> RegroupRound:
        rnd = self.rounds.get(job.job_id)
        if rnd is None:
            self._abort_join(job)  # (the survivors regroup first; a spare may join after)
            rnd = self.rounds[job.job_id] = RegroupRound(time.monotonic())
        return rnd

    # a spare joins ----------------------------------------------------------------------------
    def maybe_join(self, job: JobRecord) -> None:
        """A replica left and as many ready fellows as the job has stages are free: they
        join as that replica's chain, each cell taking its state from the first member of its
        stage group. Every group takes it in after the same step: its chains carry the word
        that a cell was told of it in their frames (FLAG_HEARD), so all groups hear of it at
        the same synchronisation."""
        if not self.replicated(job) or job.members is None \
                or job.placement is None or job.placement.layout is not None \
                or job.job_id in self.rounds or job.job_id in self.joining \
                or job.state is not JobState.RUNNING or job.recovering is not None \
                or job.spec.train is None or job.spec.topology.wiring == "swarm":
            # (swarm wiring: a joiner would need every neighbour's links anew, which only a
            # regroup opens; its survivors train on without the replica that left)
            return
        train = job.spec.train
        # (no synchronisation is left to take it in at; an overlapped outer step's result,
        # where a joiner comes in, lands overlap_steps after it)
        sync = train.sync
        if job.last_step >= train.steps - (sync.period + sync.lag):
            return
        assert job.placement is not None
        left = [r for r in range(job.placement.replicas) if r not in job.members]
        failed = self.failed.get(job.job_id, set())
        spares = [f for f in self.queue.registry.ready()
                  if f.data_addr and f.assigned_job is None and f.fellow_id not in failed]
        stages = job.num_stages
        if not left or len(spares) < stages:
            return
        r, spares = left[0], spares[:stages]
        new = {id(job.placement.cell(k, r)): attrs.evolve(
            job.placement.cell(k, r), fellow_id=spare.fellow_id, name=spare.name, slot=0,
            device=spare.devices[0], data_addr=spare.data_addr)
            for k, spare in enumerate(spares)}
        job.placement = attrs.evolve(job.placement, stages=[
            new.get(id(c), c) for c in job.placement.stages])
        cells = [job.placement.index(k, r) for k in range(stages)]
        job.done_stages = [i for i in job.done_stages if i not in cells]
        order = RegroupOrder(job.epoch + 1, sorted([*job.members, r]), donor=job.members[0])
        self.joining[job.job_id] = Joining(r, tuple(f.fellow_id for f in spares), order)
        job.joining = StoredJoin(r, [f.fellow_id for f in spares], order)
        for index, spare in zip(cells, spares, strict=True):
            spare.assigned_job = job.job_id
            self.queue.registry.send(spare, "START", job.job_id,
                                     unstructure(self.queue.start_of(job, index)))
        self._tell_members(job, order)
        self.queue.files.placement(job)
        self.queue.save(job)

    def _tell_members(self, job: JobRecord, order: RegroupOrder) -> None:
        """Each member's cells: take the joiner in by ``order`` at their next
        synchronisation (a member told twice takes it in once: it ignores a membership it
        is past)."""
        assert job.placement is not None and job.members is not None
        for c in job.placement.stages:
            if c.replica in job.members:
                rec = self.queue.registry.find(c.fellow_id)
                if rec is not None:
                    self.queue.registry.send(rec, "MEMBERS", job.job_id, unstructure(
                        MembersSignal(c.stage, c.replica, job.attempt, order, job.placement)))

    def joined(self, job: JobRecord, step: int) -> None:
        """The group took the joiner in: from ``step`` on it trains with it."""
        joining = self.joining.pop(job.job_id, None)
        job.joining = None
        if joining is None:
            return
        order = joining.order
        change = MembershipChange(step=step, epoch=order.epoch, members=order.members,
                                  joined=[joining.replica],
                                  reason=f"{joining.who()} joined as replica "
                                         f"{joining.replica}", at=time.time())
        job.epoch, job.members = order.epoch, order.members
        job.membership.append(change)
        self.queue.progress.membership(job, change)
        self.queue.save(job)
        self.queue.hub.publish(JobMembership(job.job_id, change))

    def _abort_join(self, job: JobRecord, why: str = "its replica left the job") -> None:
        joining = self.joining.pop(job.job_id, None)
        job.joining = None
        if joining is None:
            return
        self._leave(job, [joining.replica], why)

    def finished(self, job: JobRecord, replica: int, epoch: int | None) -> None:
        """A member's cell completed under membership ``epoch``. A spare told to join under
        a later one was not taken in, and no longer can be: its group is past its last
        synchronisation (a join is only agreed at one, and not after the last step). The
        join is off and the spare stopped, so the job completes without it (before, it
        waited for the spare's cell until the spare gave up, and then for ever)."""
        joining = self.joining.get(job.job_id)
        if joining is None or epoch is None or replica == joining.replica \
                or epoch >= joining.order.epoch:
            return
        self._abort_join(job, f"its group finished the job at membership {epoch} without "
                              f"taking it in")

    def _decide(self, job: JobRecord, final: bool) -> None:
        """First the replicas that go on (once each member's chain has reported or is lost),
        then each stage group's orders (once every cell of its survivors has reported)."""
        rnd = self.rounds[job.job_id]
        if rnd.members is None and self.cellwise(job) and self._decide_cells(job, rnd, final):
            return
        if rnd.members is None and not self._decide_members(job, rnd, final):
            return
        assert rnd.members is not None
        if final:  # (a group still to report whose cell is not at work will not)
            for s in range(job.num_stages):
                for r in rnd.members:
                    if s not in rnd.ordered and (s, r) not in rnd.reports \
                            and not self._done(job, s, r) and not self._at_work(job, s, r):
                        rnd.lost.setdefault(r, f"stage {s} replica {r} did not report "
                                               "within the heartbeat timeout")
        if any(r in rnd.lost for r in rnd.members):
            # A survivor lost before its group had its orders: the change being made no
            # longer holds; the job recovers as a chain does.
            self._fail_round(job)
            return
        ordered = len(rnd.ordered)
        if any(rep.routed for rep in rnd.reports.values()) and not self._order_routed(job, rnd):
            return
        for s in range(job.num_stages):
            if s in rnd.ordered or any((s, r) not in rnd.reports for r in rnd.members):
                continue
            try:
                orders = group_orders({r: rnd.reports[(s, r)] for r in rnd.members}, s,
                                      rnd.members, rnd.epoch)
            except RegroupConflict:
                self._fail_round(job)
                return
            rnd.ordered.add(s)
            self.answers[job.job_id].orders.update(orders)
        rnd.decided.set()
        rnd.decided = asyncio.Event()
        # Where a replica left, every group finds its ring broken and asks; where none did
        # (a ring timed out), the groups that broke are all there is to order.
        needed = set(range(job.num_stages)) if rnd.members != rnd.before else \
            {s for s, _r in rnd.reports}
        # (a group that finished the job has no synchronisation left to take an order at)
        needed -= {s for s in range(job.num_stages)
                   if all(self._done(job, s, r) for r in rnd.members)}
        if rnd.ordered >= needed:
            del self.rounds[job.job_id]
            self._record_departure(job, rnd)
        elif len(rnd.ordered) > ordered:
            self._store(job, rnd)  # (orders given: a restarted leader must give the same)

    def _decide_cells(self, job: JobRecord, rnd: RegroupRound, final: bool) -> bool:
        """A cell-wise job's round (see ``cellwise``): once every cell has reported or is
        lost, the lost cells leave alone and every other trains on from the earliest step a
        survivor had not applied (``contract.membership.cell_orders``), decided, recorded
        and answered at once. True where the round is handled here (decided, waiting, or
        failed); False where a lost cell 0 of a grid leaves the rule of whole replicas to
        decide it (``_decide_members``)."""
        p = job.placement
        assert p is not None
        lost = rnd.lost_cells
        silent = [(c.stage, c.replica) for c in p.stages
                  if (c.stage, c.replica) not in lost and (c.stage, c.replica) not in rnd.reports
                  and not self._done(job, c.stage, c.replica)]
        # A silent cell of an id whose link closed without a farewell died, once a heartbeat
        # has gone by for its own report, unless its fellow has heartbeated since the round
        # began and runs it (a report names an id, not a stage: the id's other cells live
        # on, and may be slow to report); one silent past the timeout whose fellow does not
        # say it runs it, too.
        closed = {rep.closed_by for rep in rnd.reports.values() if rep.closed_by is not None}
        waited = time.monotonic() - rnd.since >= self.queue.registry.heartbeat_interval_s
        for s, r in silent:
            fid = p.cell(s, r).fellow_id
            if waited and r in closed and not self._held_up(job, rnd, s, r):
                lost.setdefault((s, r), f"fellow {fid} (stage {s} replica {r}) closed its "
                                        "link without a farewell and did not report")
            elif final and not self._at_work(job, s, r):
                lost.setdefault((s, r), f"stage {s} replica {r} did not report within the "
                                        "heartbeat timeout")
        if any(r == 0 for _s, r in lost):
            # (known at once: the rule of whole replicas decides it, or none can)
            if p.layout is None:
                for (_s, r), why in lost.items():
                    rnd.lost.setdefault(r, why)
                return False
            self._fail_round(job)
            return True
        if any(c not in lost for c in silent):
            return True
        survivors = [(c.stage, c.replica) for c in p.stages if (c.stage, c.replica) not in lost]
        done = [c for c in survivors if self._done(job, *c)]
        if done:
            if len(done) == len(survivors):
                self._cells_finished_without(job, rnd)
            else:  # (a survivor that finished the job cannot redo its last step)
                self._fail_round(job)
            return True
        after = cellwise_layout(p.layout, p.num_stages, p.replicas, lost) \
            or tuple(tuple(p.ids(k)) for k in range(p.num_stages))
        try:
            orders = cell_orders(rnd.reports, after, job.epoch + 1)
        except RegroupConflict:
            self._fail_round(job)
            return True
        self.answers[job.job_id] = Answers(job.epoch + 1, orders)
        del self.rounds[job.job_id]
        rnd.decided.set()
        change = cell_departure(orders, p.num_stages, lost, job.epoch + 1,
                                reason="; ".join(lost.values()), at=time.time())
        self._cells_leave(job, change)
        self._trained_again(job, change.step)
        self._announce(job, change)
        return True

    def _trained_again(self, job: JobRecord, step: int) -> None:
        """Swarm wiring trains ``step`` again: its record starts over, a checkpoint some
        cells took at it or after holds a state they have undone, and so does a stage's newest
        shard from then (the stage has none in the export until its next push)."""
        self.queue.progress.restart(job, step)
        self.queue.files.undone_checkpoints(job, step)
        for k in [k for k, push in job.latest_shard_pushes.items() if push.step >= step]:
            del job.latest_shard_pushes[k]

    def _announce(self, job: JobRecord, change: MembershipChange) -> None:
        """A recorded change into the step's progress record, the store and the events."""
        self.queue.progress.membership(job, change)
        self.queue.save(job)
        self.queue.hub.publish(JobMembership(job.job_id, change))

    def _cells_leave(self, job: JobRecord, change: MembershipChange) -> None:
        """The cells ``change`` names leave the job's placement (its plan rewritten); a
        fellow left holding none of it is free (a live one told to stop what it may still
        run). No survivor has completed: the job's done cells are none."""
        p = job.placement
        assert p is not None
        lost = [(k, r) for k, r in change.cells_left]
        fellows = dict.fromkeys(p.cell(k, r).fellow_id for k, r in lost)
        job.placement = p.without(lost)
        job.done_stages = []
        job.epoch, job.members, job.regroup = change.epoch, change.members, None
        job.membership.append(change)
        self.queue.files.placement(job)
        for fid in fellows:
            rec = self.queue.registry.find(fid)
            if rec is not None and rec.assigned_job == job.job_id \
                    and fid not in job.placement.fellows:
                rec.assigned_job = None
                self.queue.registry.send(rec, "STOP", job.job_id,
                                         {"reason": "its cell left the job",
                                          "attempt": job.attempt})

    def _cells_finished_without(self, job: JobRecord, rnd: RegroupRound) -> None:
        """Every survivor finished: the lost cells (none a cell 0, which writes its stage's
        export) leave the job, which completes on the next liveness check."""
        assert job.placement is not None
        steps = job.spec.training.steps if job.spec.training else job.last_step
        lost = rnd.lost_cells
        self.forget(job)
        kept = job.placement.without(list(lost))
        change = MembershipChange(step=steps + 1, epoch=job.epoch + 1,
                                  members=sorted({c.replica for c in kept.stages}),
                                  cells_left=[[k, r] for k, r in sorted(lost)],
                                  reason="; ".join(lost.values()), at=time.time(),
                                  stage_steps=[steps + 1] * job.num_stages)
        done = [(c.stage, c.replica) for i, c in enumerate(job.placement.stages)
                if i in job.done_stages]
        self._cells_leave(job, change)
        job.done_stages = [job.placement.index(k, r) for k, r in done]
        self.queue.progress.refresh(job)
        self.queue.save(job)
        self.queue.hub.publish(JobMembership(job.job_id, change))

    def _order_routed(self, job: JobRecord, rnd: RegroupRound) -> bool:
        """Swarm wiring: every survivor's cell redoes a step together, so all stage groups
        are ordered at once, when each cell has reported (``routed_orders``). False while
        some have not, or where the round failed."""
        assert rnd.members is not None
        stages = job.num_stages
        cells = [(s, r) for s in range(stages) for r in rnd.members]
        if any(self._done(job, s, r) for s, r in cells):
            self._fail_round(job)  # (a survivor finished the job: its last step stays)
            return False
        if any(c not in rnd.reports for c in cells):
            return False
        try:
            _members, orders = routed_orders({c: rnd.reports[c] for c in cells}, stages, (),
                                             rnd.epoch)
        except RegroupConflict:
            self._fail_round(job)
            return False
        rnd.ordered = set(range(stages))
        self.answers[job.job_id].orders.update(orders)
        return True

    def _record_departure(self, job: JobRecord, rnd: RegroupRound) -> None:
        """Every group has its orders: the change, with the step each stage took it at."""
        assert rnd.members is not None
        change = departure({c: rep for c, rep in rnd.reports.items() if c[1] in rnd.members},
                           self.answers[job.job_id].orders, job.num_stages, rnd.before,
                           rnd.members, rnd.epoch, reason=rnd.reason, at=time.time())
        job.epoch, job.members, job.regroup = rnd.epoch, rnd.members, None
        job.membership.append(change)
        if any(rep.routed for rep in rnd.reports.values()):
            self._trained_again(job, change.step)
        self._announce(job, change)

    def _decide_members(self, job: JobRecord, rnd: RegroupRound, final: bool) -> bool:
        """Who goes on: every member not lost. A silent cell whose chain has reported is
        held up behind it (its pipeline neighbour waits for its order) and is not waited
        for: its group reports at its own next synchronisation."""
        assert job.placement is not None
        stages = job.num_stages
        members = self.members(job)
        told = {r for _s, r in rnd.reports}
        silent = [(s, r) for s in range(stages) for r in members if r not in rnd.lost
                  and (s, r) not in rnd.reports and not self._done(job, s, r)
                  and not (r in told and self._held_up(job, rnd, s, r))]
        # A silent member its ring neighbour saw close the link has died (a process that
        # ends closes its sockets), once a heartbeat has gone by for its own report: no need
        # to wait out the heartbeat timeout.
        closed = {rep.closed_by for rep in rnd.reports.values() if rep.closed_by is not None}
        if time.monotonic() - rnd.since >= self.queue.registry.heartbeat_interval_s:
            for s, r in silent:
                if r in closed:
                    fid = job.placement.cell(s, r).fellow_id
                    rnd.lost.setdefault(r, f"fellow {fid} (stage {s} replica {r}) closed its "
                                           f"link without a farewell and did not report")
            silent = [(s, r) for s, r in silent if r not in rnd.lost]
        if final:
            # A member still at work is not lost for being silent: DiLoCo's replicas may
            # train many inner steps before their next synchronisation shows them the break.
            for s, r in silent:
                if not self._at_work(job, s, r):
                    rnd.lost.setdefault(r, f"stage {s} replica {r} did not report within "
                                           f"the heartbeat timeout")
            silent = [(s, r) for s, r in silent if r not in rnd.lost]
        if silent:
            return False
        survivors = [r for r in members if r not in rnd.lost]
        if survivors and all(self._done(job, s, r) for s in range(stages) for r in survivors):
            # Lost after the last synchronisation: the survivors finished, with the weights
            # the lost ones held. There is nobody to give orders to, and nothing to record a
            # step at (each replica trained every step).
            self._finished_without(job, rnd, [r for r in members if r not in survivors])
            return False
        reports = {c: rep for c, rep in rnd.reports.items() if c[1] in survivors}
        if not survivors or not reports:
            self._fail_round(job)
            return False
        left = [r for r in members if r not in survivors]
        rnd.before, rnd.members, rnd.epoch = members, survivors, job.epoch + 1
        rnd.reason = "; ".join(rnd.lost[r] for r in left if r in rnd.lost)
        self._leave(job, left)
        self.answers[job.job_id] = Answers(rnd.epoch, {
            c: RegroupOrder(rnd.epoch, survivors, drop=True)
            for c in rnd.reports if c[1] not in survivors})
        self._store(job, rnd)
        return True

    def _finished_without(self, job: JobRecord, rnd: RegroupRound, left: list[int]) -> None:
        """The survivors finished the job: the lost replicas leave it, their cells counted
        done, and the job completes on the next liveness check. Unless a lost one led a
        stage group whose final shard never reached the leader: no other member writes it
        (see ``StageCheckpoint``), so the job would complete without its export; it ends as
        a chain's lost stage does, naming what is missing."""
        missing = self._unexported(job, rnd, left)
        self.forget(job)
        if missing is not None:
            self.queue.liveness.lost(job, missing)
            return
        # Recorded as any departure (the job's members, its completion reason, the event),
        # at the step after the last: the lost replicas trained every step. No step's record
        # gets it, since no step was trained without them.
        steps = job.spec.training.steps if job.spec.training else job.last_step
        members = [r for r in self.members(job) if r not in left]
        change = MembershipChange(step=steps + 1, epoch=job.epoch + 1, members=members,
                                  left=list(left), at=time.time(),
                                  reason="; ".join(rnd.lost[r] for r in left if r in rnd.lost),
                                  stage_steps=[steps + 1] * job.num_stages)
        job.epoch, job.members = change.epoch, members
        job.membership.append(change)
        self.queue.progress.refresh(job)  # (no report follows to leave the lost ones out)
        self._leave(job, left, "the other replicas finished the job")
        self.queue.save(job)
        self.queue.hub.publish(JobMembership(job.job_id, change))

    def _unexported(self, job: JobRecord, rnd: RegroupRound, left: list[int]) -> str | None:
        """Why the job's export misses a stage's final shard that a lost replica was to
        push; None if none does."""
        assert job.placement is not None
        lead, steps = self.members(job)[0], job.spec.training.steps if job.spec.training else 0
        if lead not in left:
            return None
        for s in range(job.num_stages):
            pushed = job.latest_shard_pushes.get(str(s))
            if not self._done(job, s, lead) and (pushed is None or pushed.step < steps):
                return (f"replica {lead} was lost after the others finished, before its final "
                        f"shard of stage {s} (step {steps}, the job's export) reached the "
                        f"leader: {rnd.lost[lead]}")
        return None

    def _leave(self, job: JobRecord, left: list[int],
               why: str = "its replica left the job") -> None:
        """The cells of the replicas that left count as done; a fellow with nothing left of
        the job is free (a live one is told to stop what it may still run of it)."""
        assert job.placement is not None
        for cell in job.placement.stages:
            if cell.replica in left:
                index = job.placement.index(cell.stage, cell.replica)
                if index not in job.done_stages:
                    job.done_stages.append(index)
        for fid in dict.fromkeys(c.fellow_id for c in job.placement.stages
                                 if c.replica in left):
            rec = self.queue.registry.find(fid)
            if rec is not None and job.stages_done_by(fid) and rec.assigned_job == job.job_id:
                rec.assigned_job = None
                self.queue.registry.send(rec, "STOP", job.job_id,
                                         {"reason": why, "attempt": job.attempt})

    def _fail_round(self, job: JobRecord) -> None:
        rnd = self.rounds.get(job.job_id)
        reason = "; ".join(rnd.lost.values()) if rnd is not None and rnd.lost else \
            "the replicas' reports do not fit together"
        self.forget(job)
        self.queue.liveness.lost(job, f"no replica left to train on: {reason}")


def undone_from(job: JobRecord, since: float) -> int | None:
    """The earliest step (1-based) a swarm-wired job's survivors were told to train again at
    or after ``since`` (wall time): a checkpoint at it or past it that was on its way before
    then holds a state they undid. None where no such change came since."""
    if job.spec.topology.wiring != "swarm":
        return None
    steps = [c.step for c in job.membership if c.departed and c.at is not None
             and c.at >= since]
    return min(steps) if steps else None


def cell_index_at(job: JobRecord, placement: Placement, epoch: int | None, stage: int,
                  replica: int) -> int:
    """The cell's index among the cells its report was trained under (membership
    ``epoch``): a cell-wise departure after it took cells out of the placement, so the
    indices after them shifted; a late report of a step from before is indexed as the
    step's other reports were. Only this attempt's departures count (a resumed job starts
    its epochs again on the placement they left)."""
    since = job.restarts[-1].at if job.restarts else None
    gone = [(k, r) for ch in job.membership if epoch is not None and ch.epoch > epoch
            and ch.cells_left and (since is None or (ch.at is not None and ch.at > since))
            for k, r in ch.cells_left]
    if not gone:
        return placement.index(stage, replica)
    shape = [set(placement.ids(k)) for k in range(placement.num_stages)]
    for k, r in gone:
        shape[k].add(r)
    return layout_cells(tuple(tuple(sorted(ids)) for ids in shape)).index((stage, replica))
