"""What SWARM's rebalancing would make of a run (issue 34 point 3, through issue 40's
predictor): the moves its rule makes, look after look, and the step each leaves.

A job with ``topology.rebalance_every`` and measured routes looks every that many steps at
its cells' measured throughput and moves a peer where the rule of ``contract/rebalance``
finds one (``pipeline/move.Rebalance``). Measured routes converge to each cell's compute per
micro-batch, so here a cell's throughput is one over its stage's calibrated forward and
backward times its emulated slowdown; the rule decides on that table as the cells would,
and the moved peer keeps its slowdown (it keeps its fellow) at its new stage and id. Each
layout it leaves is then predicted as any layout is, so ``swarm predict`` says what a
rebalancing job's step becomes and why (a move raises the bottleneck stage's throughput,
not the pipeline's fill and drain).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from swarm_core.contract.placement import normal_layout
from swarm_core.contract.rebalance import PeerMove, choose_move, free_id
from swarm_core.predict.critical_path import StageTimes
from swarm_core.predict.network import MatrixNetwork
from swarm_core.predict.step import RunShape

MAX_MOVES = 8  # looks played at most (a rule that found a move at each would stop here)


@attrs.frozen
class RebalanceStep:
    """One look's move (``move.at``: the step it is made before) and the run after it."""

    move: PeerMove
    shape: RunShape


def rebalances(shape: RunShape) -> bool:
    """Whether the run moves peers by SWARM's rule (measured routes, a look every N)."""
    return shape.wiring == "swarm" and shape.routing == "measured" \
        and shape.rebalance_every is not None


def speeds(shape: RunShape, times: Sequence[StageTimes]) -> list[dict[int, float]]:
    """Per stage, each cell's micro-batches a second, as measured routes would learn them."""
    slowed = shape.slowed
    return [{r: 1.0 / ((t.forward + t.backward) * slowed.get((k, r), 1.0))
             for r in shape.ids(k)} for k, t in enumerate(times)]


def moved(shape: RunShape, move: PeerMove) -> RunShape:
    """``shape`` after ``move``: the peer's cell gone from its stage, a cell of its new id at
    the target, its slowdown and (under a link matrix) its site with it."""
    assert move.new_id is not None
    after = [[r for r in shape.ids(k) if (k, r) != (move.source, move.cell)]
             for k in range(shape.stages)]
    after[move.target].append(move.new_id)
    slowdowns = tuple((move.target, move.new_id, x) if (s, r) == (move.source, move.cell)
                      else (s, r, x) for s, r, x in shape.slowdowns)
    net = shape.network
    if isinstance(net, MatrixNetwork):  # (and its site: it keeps its fellow)
        net = net.moved((move.source, move.cell), (move.target, move.new_id))
    return attrs.evolve(shape, layout=normal_layout(after, shape.stages, shape.replicas),
                        slowdowns=slowdowns, network=net)


def plan_moves(shape: RunShape, times: Sequence[StageTimes],
               steps: int | None = None) -> list[RebalanceStep]:
    """The moves the rule makes at its looks (every ``rebalance_every`` steps, up to the
    run's ``steps``), each from the layout the one before left, until a look finds none."""
    if not rebalances(shape):
        return []
    every = shape.rebalance_every
    assert every is not None
    last = shape.training.steps if steps is None else steps
    out: list[RebalanceStep] = []
    at = every
    while at < last and len(out) < MAX_MOVES:
        found = choose_move(speeds(shape, times))
        if found is None:
            break
        move = PeerMove(at, found.source, found.cell, found.target,
                        free_id(shape.ids(found.target)))
        shape = moved(shape, move)
        out.append(RebalanceStep(move, shape))
        at += every
    return out
