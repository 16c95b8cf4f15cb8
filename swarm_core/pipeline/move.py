"""A peer moved between stages at a step boundary (issue 34 point 3: SWARM's rebalancing):
given in advance (a job's ``topology.moves``: ``GivenMoves``), or decided in band as the run
goes (``Rebalance``: every cell runs one rule on the same measured table). Across fellows the
moved fellow runs on as its new cell, from the START every cell computes
(``StageStart.after_move``), and the leader learns the move from the cells' reports
(``leader/moves.py``); in one process ``run_local_pipeline`` also takes a ``relayout`` (any
change of layout, each newcomer a thread of its own).

A move is a change of the job's layout (``pipeline/layout``) from a 0-based step ``at`` on:
the cells of ``before`` that ``after`` lacks stop after step ``at - 1`` (a peer leaving its
stage), the cells ``after`` adds start at step ``at`` (the same peer, at its new stage and
id), and every cell in both re-links there. In one process a moving peer is two cells of the
grid for a ``relayout`` (a thread of its own each), and one thread for a peer's move, as
across fellows one fellow's STARTs follow each other.

At the boundary every cell that stays closes its links and opens new ones under the new
layout and a new membership's handshake tag (``open_links(members=, epoch=)``, as a lost
cell's regroup does: no frame of the old links can reach the new ones), and its group rings
its new members afresh (``ReplicaGroup.reform``). A stage that gains cells then hands the
newcomers its state from its id-0 cell round the new ring (``ReplicaGroup.hand_state``, a
joiner's hand-off): the weights and the optimiser's state after step ``at - 1``, which every
member of a dp group holds alike. dp keeps nothing across steps; measured routes keep their
estimate, the moved peer's speed going with it (``ThroughputEstimate.carried``), so the
step after a move is dealt by what was measured, not equally.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import attrs

from swarm_core.contract.placement import Placement, slot_count, stage_ids
from swarm_core.contract.rebalance import MIN_GAIN, PeerMove, choose_move, free_id
from swarm_core.pipeline.layout import Layout, check_layout
from swarm_core.pipeline.route_meter import RouteMeter
from swarm_core.pipeline.routing import ThroughputEstimate

if TYPE_CHECKING:
    from swarm_core.pipeline.stage import StageRunner, StageSpec

log = logging.getLogger(__name__)

DONOR = 0  # the id whose cell hands a stage's state to its newcomers (every stage has it)
MOVE_EPOCH = 1  # the new links' membership (a lost cell's regroup is not built for layouts)


@attrs.frozen
class LayoutMove:
    """The job's layout ``before`` (None: uniform) up to step ``at``, ``after`` from it on;
    ``shares``: the job's data shares (R). ``placement``: the placement from ``at`` on
    (where each cell of ``after`` listens); ``peer``: a peer's move (``Placement.moved``'s
    source, cell, target and new id), where the move is one (a decided one always is)."""

    at: int
    before: Layout | None
    after: Layout | None
    shares: int
    epoch: int = MOVE_EPOCH  # the new links' membership (each move's its own)
    placement: Placement | None = attrs.field(default=None, eq=False, repr=False)
    peer: tuple[int, int, int, int] | None = None
    # Measured routes' estimate under the new layout (``ThroughputEstimate.carried``), as
    # every cell computed it when the move was decided; the moved peer's new cell takes it
    # from here (None: every cell starts afresh, as after a ``relayout``).
    routes: ThroughputEstimate | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def width(self) -> int:
        """The ids either layout names: the grid's width, the new links' peers."""
        return max(slot_count(self.before, self.shares), slot_count(self.after, self.shares))

    def was(self, spec: StageSpec) -> bool:
        return spec.replica in stage_ids(self.before, spec.stage, self.shares)

    def stays(self, spec: StageSpec) -> bool:
        return spec.replica in stage_ids(self.after, spec.stage, self.shares)

    def arrives(self, spec: StageSpec) -> bool:
        """A cell the move adds: it starts at step ``at``, with its stage's state."""
        return self.stays(spec) and not self.was(spec)

    def added(self) -> list[tuple[int, int]]:
        """The cells (stage, id) the move adds: where a moved peer goes."""
        return [(k, r) for k in range(len(self.after or self.before or ()))
                for r in stage_ids(self.after, k, self.shares)
                if r not in stage_ids(self.before, k, self.shares)]

    def gains(self, stage: int) -> bool:
        """Whether the stage gets a cell it did not have (its state is then handed round)."""
        return bool(set(stage_ids(self.after, stage, self.shares))
                    - set(stage_ids(self.before, stage, self.shares)))


def relink(runner: StageRunner, move: LayoutMove) -> None:
    """A cell that stays, after step ``move.at - 1``: new links and ring under the new
    layout, and its stage's state handed to any newcomer."""
    from swarm_core.pipeline.stage import open_links  # (stage imports this module)

    r, spec = runner, runner.spec
    group = r.group
    for link in r.pipe_links():  # (nothing it sent may be dropped by the close)
        link.flush(spec.training.frame_timeout_s)
    r.links.close()
    group.close()
    assert move.placement is not None, "a move names where its cells listen"
    spec.placed(move.placement)
    links = open_links(spec, r.shaper, group.listener, r.stop, spec.training.frame_timeout_s,
                       r.liveness, members=range(move.width), epoch=move.epoch)
    r.links = attrs.evolve(links, ring_next=None, ring_prev=None)  # (the group's, below)
    r.up, r.down = links.up, links.down
    _regroup(r, move)
    if move.gains(spec.stage):
        group.hand_state(DONOR, move.at - 1)


def arrive(runner: StageRunner, move: LayoutMove) -> int:
    """A cell the move adds, its links open: ring its stage and take the donor's state.
    Returns the step to train from (``move.at``)."""
    _regroup(runner, move)
    step = runner.group.take_state(DONOR)
    assert step + 1 == move.at, (step, move.at)
    return step + 1


def _regroup(r: StageRunner, move: LayoutMove) -> None:
    """The group's members under the new layout, a fresh sync over their new ring (room in
    its frames for a stage's state where one is handed round), the route estimate the move
    carried (``LayoutMove.routes``; fresh without one)."""
    spec, group = r.spec, r.group
    group.epoch, group.members = move.epoch, spec.ids(spec.stage)
    if move.peer is not None:
        r.last_move = PeerMove(move.at, *move.peer)
    group.reform(r.params, r.device, group.state_bound() if move.gains(spec.stage) else 0)
    if r.meter_routes is not None:
        # (every cell holds the same estimate from this step on, so all deal alike)
        r.meter_routes = RouteMeter.of(spec, move.routes)
        if group.sync is not None:
            group.sync.own = 0.0


def peer_move(runner: StageRunner, step: int, source: int, cell: int, target: int,
              new_id: int | None = None) -> LayoutMove:
    """The move of cell ``cell`` of stage ``source`` to stage ``target`` before ``step``, as
    every cell computes it from the placement it runs (``Placement.moved``; a new id None:
    the smallest the target lacks)."""
    spec = runner.spec
    assert spec.placement is not None, "a moved job's cell runs a START's placement"
    new_id = free_id(spec.placement.ids(target)) if new_id is None else new_id
    placement = spec.placement.moved(source, cell, target, new_id)
    after = [placement.ids(k) for k in range(spec.num_stages)]
    layout = check_layout(after, spec.num_stages, spec.replicas, spec.training.sync.mode,
                          spec.wiring)
    peer = (source, cell, target, new_id)
    meter = runner.meter_routes
    return LayoutMove(step, spec.layout, layout, spec.replicas, epoch=runner.group.epoch + 1,
                      placement=placement, peer=peer,
                      routes=None if meter is None
                      else meter.estimate.carried(peer, layout, spec.replicas))


@attrs.frozen
class Rebalance:
    """SWARM's adaptive rebalancing, decided in band (issue 34 point 3): every ``every``
    steps each cell looks at the throughput its measured routes hold (the same table in every
    cell: ``route_meter``), and where the rule of ``contract/rebalance`` moves a peer, every
    cell makes the same move at that step boundary, with no word from anyone; a moved peer
    takes the smallest id its new stage lacks, and keeps its fellow, slot and listener
    (``Placement.moved``). Measured routes only: given weights measure nothing."""

    every: int
    min_gain: float = MIN_GAIN
    at_start = False  # (a cell's first step has nothing measured to look at)

    def decide(self, runner: StageRunner, step: int) -> LayoutMove | None:
        """The move to make before step ``step``, if any."""
        spec, meter = runner.spec, runner.meter_routes
        if meter is None or step == 0 or step % self.every or step >= spec.training.steps:
            return None
        now = [stage_ids(spec.layout, k, spec.replicas) for k in range(spec.num_stages)]
        speeds = meter.estimate.measured(now)
        move = None if speeds is None else choose_move(speeds, self.min_gain)
        if move is None:
            return None
        made = peer_move(runner, step, move.source, move.cell, move.target)
        log.info("stage %d cell %d: rebalancing before step %d: stage %d's cell %d moves to "
                 "stage %d as cell %d (throughput %.3g -> %.3g micro-batches/s; measured %s)",
                 spec.stage, spec.replica, step, move.source, move.cell, move.target,
                 made.peer[3] if made.peer else -1, move.before, move.after,
                 [{r: round(v, 2) for r, v in row.items()} for row in speeds or ()])
        return made


@attrs.frozen
class GivenMoves:
    """Moves given in advance (``topology.moves``), made as a decided one is: every cell at
    the same boundary, from the same placement."""

    moves: tuple[PeerMove, ...]
    # (also before a cell's first step: a job resumed from the checkpoint of a move's step,
    # on a placement the leader had not learned the move in, makes it then)
    at_start = True

    def decide(self, runner: StageRunner, step: int) -> LayoutMove | None:
        p = runner.spec.placement
        assert p is not None
        for m in self.moves:
            # (one the placement has made already is not made again: a cell that arrived
            # by it, or resumed on a placement that has it)
            if m.at == step and p.has(m.source, m.cell) \
                    and (m.new_id is None or not p.has(m.target, m.new_id)):
                return peer_move(runner, step, m.source, m.cell, m.target, m.new_id)
        return None


Mover = Rebalance | GivenMoves


def mover_of(spec: StageSpec) -> Mover | None:
    """What moves peers in a cell's job, as its START says (None: the layout stays)."""
    if spec.moves:
        return GivenMoves(tuple(spec.moves))
    if spec.rebalance_every is not None and spec.measures_routes:
        return Rebalance(spec.rebalance_every)
    return None
