"""How the leader learns that a peer moved between stages (issue 34 point 3, placement-cells
step 6): from the cells' own step reports, since every cell makes the move in band.

Every step report of a job whose peers move names the moves its cell had made (``epoch``)
and the latest (``moved``). The first report the leader reads of a new epoch (a stayer's or
the moved peer's new cell's: whichever comes first) tells it the move: the leader makes it on
its placement (``Placement.moved``, as every cell did), records it in the job's membership
(``MembershipChange.moved``, from its first step on) and writes the placement plan. A late
report of an earlier epoch (the moved peer's old cell, say) is read against the placement
of its epoch, rebuilt by undoing the later moves (a move undone is the move back).

A job that recovers resumes from its checkpoint on the placement in force at that step: moves
made after it are undone (``rewound``), for its cells to make again, and the new attempt's
cells count their moves from 0 (``JobRecord.moves_base``: the moves made before it).
"""

from __future__ import annotations

import time

from swarm_core.contract.membership import MembershipChange
from swarm_core.contract.metrics import JobStatusUpdate
from swarm_core.contract.placement import Placement, PlacementError
from swarm_core.contract.rebalance import PeerMove
from swarm_core.leader.records import JobRecord


class MoveRefused(ValueError):
    """A report's move that does not fit the job (one line: what is wrong)."""


def moving(job: JobRecord) -> bool:
    """Whether the job's peers may move (its reports' ``epoch`` counts moves, not regroups:
    such a job never regroups)."""
    topo = job.spec.topology
    return bool(topo.moves) or topo.rebalance_every is not None


def moves_of(job: JobRecord) -> list[PeerMove]:
    """The moves the job has made, in order (its epochs 1, 2, ...)."""
    return [c.moved for c in job.membership if c.moved is not None]


def placement_at(job: JobRecord, epoch: int | None) -> Placement:
    """The placement the job had after ``epoch`` moves of this attempt (None: now)."""
    assert job.placement is not None
    made = moves_of(job)
    if epoch is None or job.moves_base + epoch >= len(made) or not moving(job):
        return job.placement
    return _undone(job.placement, made[job.moves_base + epoch:])


def _undone(p: Placement, later: list[PeerMove]) -> Placement:
    for m in reversed(later):  # (a move undone is the move back)
        assert m.new_id is not None
        p = p.moved(m.target, m.new_id, m.source, m.cell)
    return p


def rewound(job: JobRecord, step: int) -> tuple[Placement, list[MembershipChange]]:
    """What a job that resumes from its checkpoint of ``step`` runs on: the placement in
    force for its step ``step`` (0-based: moves made before it stay; later ones are undone,
    for its cells to make again) and its membership without the undone moves."""
    assert job.placement is not None
    later = [c for c in job.membership if c.moved is not None and c.moved.at > step]
    if not moving(job) or not later:
        return job.placement, list(job.membership)
    placement = _undone(job.placement, [c.moved for c in later if c.moved is not None])
    return placement, [c for c in job.membership if c not in later]


def news(job: JobRecord, upd: JobStatusUpdate) -> tuple[PeerMove, Placement] | None:
    """The move ``upd`` tells the leader of, and the placement it makes; None where it tells
    none (no move, or one known). Raises MoveRefused for one that cannot be the job's next."""
    if not moving(job):
        return None
    made = len(moves_of(job)) - job.moves_base  # (this attempt's)
    if upd.epoch is None or upd.epoch <= made or job.placement is None:
        return None
    m = upd.moved
    if upd.epoch > made + 1 or m is None or m.new_id is None:
        raise MoveRefused(f"a report of step {upd.step} under move {upd.epoch} of a job "
                          f"that has made {made}, without the move it needs")
    if not 0 < m.at <= upd.step:  # (the moved peer tells it as it leaves: at step ``at``)
        raise MoveRefused(f"move {upd.epoch}: before step {m.at}, reported at step "
                          f"{upd.step}")
    try:
        return m, job.placement.moved(m.source, m.cell, m.target, m.new_id)
    except PlacementError as exc:
        raise MoveRefused(str(exc)) from None


def made(job: JobRecord, move: PeerMove, placement: Placement) -> MembershipChange:
    """Make ``move`` the job's: its placement and its membership's next change, taken from
    the move's step on (1-based: the first step trained under it)."""
    epoch = len(moves_of(job)) - job.moves_base + 1
    change = MembershipChange(step=move.at + 1, epoch=epoch,
                              members=sorted({c.replica for c in placement.stages}),
                              reason="rebalance", at=time.time(), moved=move)
    job.placement = placement
    job.epoch = epoch
    job.membership.append(change)
    return change
