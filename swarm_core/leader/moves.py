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
from swarm_core.contract.rebalance import PeerMove, free_id
from swarm_core.leader.records import JobRecord

# What a report tells the leader of a move it had not made: the move and the placement after
# it (None: nothing new).
Told = tuple[PeerMove, Placement] | None


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
    for m in reversed(later):
        p = m.undo(p)
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


def in_flight(job: JobRecord, fellow_id: int) -> dict[tuple[int, int], tuple[int, int]]:
    """Each cell this fellow left by a move of this attempt, to the cell it holds now in its
    place (a fellow that moved twice: both old cells to the last): until its heartbeat names
    the new cell it may still name an old one (a heartbeat sent as it moved, or the leader
    told by a stayer first), even once other peers have moved since. Empty for a fellow
    that never moved. One walk back over the moves (each move's mover is the fellow at its
    new cell in the placement after it)."""
    if not moving(job) or job.placement is None:
        return {}
    mine = moves_of(job)[job.moves_base:]
    p, movers = job.placement, []
    for m in reversed(mine):
        assert m.new_id is not None
        movers.append(p.cell(m.target, m.new_id).fellow_id if p.has(m.target, m.new_id)
                      else None)
        p = m.undo(p)
    became: dict[tuple[int, int], tuple[int, int]] = {}
    for m, mover in zip(mine, reversed(movers), strict=True):
        if mover != fellow_id:
            continue
        assert m.new_id is not None
        old, new = (m.source, m.cell), (m.target, m.new_id)
        became = {k: new if v == old else v for k, v in became.items()}
        became[old] = new
    held = {(c.stage, c.replica) for c in job.placement.stages if c.fellow_id == fellow_id}
    return {old: new for old, new in became.items() if new in held and old not in held}


def news(job: JobRecord, upd: JobStatusUpdate) -> Told:
    """The move ``upd`` tells the leader of, and the placement it makes; None where it tells
    none (no move, or one known). Raises MoveRefused for one that cannot be the job's next:
    two ahead, or told without its move; one that names another move for a known epoch;
    not after the attempt's last move and its resume step; not the next of the job's given
    moves, or not at a look of its rebalancing; one that does not fit the placement."""
    if not moving(job) or upd.epoch is None or job.placement is None:
        return None
    made = moves_of(job)
    mine = made[job.moves_base:]  # (this attempt's)
    m = upd.moved
    if upd.epoch <= len(mine):
        if m is not None and upd.epoch > 0 and m != mine[upd.epoch - 1]:
            raise MoveRefused(f"move {upd.epoch} of a report of step {upd.step} is not the "
                              f"one the job made ({_text(mine[upd.epoch - 1])})")
        return None
    if upd.epoch > len(mine) + 1 or m is None or m.new_id is None:
        raise MoveRefused(f"a report of step {upd.step} under move {upd.epoch} of a job "
                          f"that has made {len(mine)}, without the move it needs")
    after = max([job.resume_step - 1, *(c.at for c in made)]) if made else \
        job.resume_step - 1
    if not after < m.at <= upd.step:  # (the moved peer tells it as it leaves: at step ``at``)
        raise MoveRefused(f"move {upd.epoch} ({_text(m)}) must come after step {after} and "
                          f"at step {upd.step} or before")
    _check_rule(job, m, made)
    try:
        return m, job.placement.moved(m.source, m.cell, m.target, m.new_id)
    except PlacementError as exc:
        raise MoveRefused(str(exc)) from None


def _check_rule(job: JobRecord, m: PeerMove, made: list[PeerMove]) -> None:
    """The move is what the job's rule makes: its next given move, or one at a look."""
    assert job.placement is not None
    topo = job.spec.topology
    if topo.moves:
        given = next((g for g in topo.moves if not made or g.at > made[-1].at), None)
        if given is None or (given.at, given.source, given.cell, given.target) != \
                (m.at, m.source, m.cell, m.target) or m.new_id != (
                    free_id(job.placement.ids(m.target)) if given.new_id is None
                    else given.new_id):
            raise MoveRefused(f"{_text(m)} is not the job's next given move"
                              + ("" if given is None else f" ({_text(given)})"))
    elif topo.rebalance_every is not None and m.at % topo.rebalance_every:
        raise MoveRefused(f"{_text(m)}: rebalancing looks every {topo.rebalance_every} "
                          "steps")


def _text(m: PeerMove) -> str:
    return f"{m.cells()} before step {m.at}"


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
