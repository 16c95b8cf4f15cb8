"""SWARM's adaptive rebalancing (issue 34 point 3): which peer moves, from which stage to which.

SWARM parallelism (Ryabinin et al., arXiv 2301.11913, section 3.2) keeps a heterogeneous
pipeline balanced by moving peers between stages: periodically each stage's throughput is
compared, and a peer of the stage with the most throughput to spare moves to the stage that
bounds the pipeline (its "load" the highest), if that raises what the pipeline can do. A
swarm-wired step runs as fast as its slowest stage's summed throughput (every micro-batch
crosses every stage), so the rule here is: the bottleneck is the stage with the least summed
throughput; the mover the cell of another stage (of two cells or more; of equal moves, the
richest stage's) whose move leaves the highest bottleneck; and the move is made only where
it raises the bottleneck by ``min_gain`` (a move costs a state hand-off and a redealt plan,
and two stages within noise of each other must not trade a peer back and forth). A stage
keeps at least one cell.

Where this differs from SWARM: SWARM's stages are identical blocks, so a peer's throughput
is the same at any stage. Here the first stage holds the embedding and the last the head, so
a micro-batch costs each stage its own; a mover's throughput at its new stage is taken as
its share of its own stage's fastest cell's, times the new stage's fastest (each stage's
fastest cell standing for a full-speed peer there). Where the stages cost alike, that is
SWARM's own assumption.

Torch-free and deterministic: every cell of a job decides with it from the same measured
table (``pipeline/move.Rebalance``), and a leader could from the throughput cells report.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import attrs

from swarm_core.contract.placement import MAX_CELL_ID, MAX_STAGES, Placement
from swarm_core.validators import MAX_STEPS, bounded, meta, step_number

# A move must raise the bottleneck stage's throughput by 20 %: the capacity model leaves out
# what a move costs (a state hand-off, a plan redealt) and what a pipeline's schedule adds
# (fill, drain, whole micro-batches dealt). Measured (bench_hetero, S=2 x R=3, two stage-1
# peers slowed 4x): the first move (1.5 -> 2.0 units, +33 %) took the step from 0.525 to
# 0.409 s; with 10 % the rule then moved a slowed peer back to stage 0 (2.0 -> 2.25, +12.5 %
# on paper), and the step went back to 0.516 s. Again across fellow processes once stage 0
# dealt by weight (bench_rebalance_fellows, 32 steps): 0.463 -> 0.537 and 0.469 -> 0.478 s
# (a quarter-speed peer is dealt whole micro-batches: three of 24 take it 12 units, no fewer
# than a fast peer's eleven or twelve, so the bottleneck does not move).
MIN_GAIN = 0.2


@attrs.frozen
class Move:
    """Cell ``cell`` of stage ``source`` becomes a cell of stage ``target``: the throughput the
    rule expects of the pipeline before and after (micro-batches a second, its slowest
    stage's)."""

    source: int
    cell: int
    target: int
    before: float
    after: float

    @property
    def gain(self) -> float:
        return self.after / self.before if self.before > 0 else float("inf")


def capacity(throughput: Sequence[Mapping[int, float]]) -> float:
    """What a swarm-wired pipeline can do: its slowest stage's summed throughput."""
    return min(sum(cells.values()) for cells in throughput)


def choose_move(throughput: Sequence[Mapping[int, float]], min_gain: float = MIN_GAIN,
                keep: Collection[int] = (0,)) -> Move | None:
    """The move that raises the pipeline's capacity most, or None where none raises it by
    ``min_gain``. ``throughput``: per stage, each cell's micro-batches a second (cells by
    their id in the stage). ``keep``: cells that never move (cell 0 leads its stage: it
    evaluates and checkpoints for the group); of equal moves, the highest id's."""
    if len(throughput) < 2 or any(not cells for cells in throughput):
        return None
    totals = [sum(cells.values()) for cells in throughput]
    before = min(totals)
    target = min(range(len(totals)), key=lambda k: (totals[k], k))
    best: Move | None = None
    # (the donor: SWARM's is the stage with most to spare; here any stage of two cells or
    # more, the richest first where moves tie, so a stage of one never empties)
    for source in sorted(range(len(totals)), key=lambda k: (-totals[k], k)):
        if source == target or len(throughput[source]) < 2:
            continue
        scale = max(throughput[target].values()) / max(throughput[source].values())
        for cell, speed in sorted(throughput[source].items(), reverse=True):
            if cell in keep:
                continue
            moved = list(totals)
            moved[source] -= speed
            moved[target] += speed * scale
            after = min(moved)
            if best is None or after > best.after:
                best = Move(source, cell, target, before, after)
    if best is None or best.after < before * (1 + min_gain):
        return None
    return best


@attrs.frozen
class PeerMove:
    """A move given in advance (a job's ``topology.moves``; tests and experiments): before
    0-based step ``at``, cell ``cell`` of stage ``source`` becomes cell ``new_id`` of stage
    ``target`` (None: the smallest id that stage lacks), as a decided move would make it."""

    at: int = attrs.field(validator=step_number, metadata=meta(
        "the 0-based step it is made before", minimum=0, maximum=MAX_STEPS))
    source: int = attrs.field(validator=bounded(0, MAX_STAGES - 1), metadata=meta(
        "the stage the peer leaves", minimum=0, maximum=MAX_STAGES - 1))
    cell: int = attrs.field(validator=bounded(0, MAX_CELL_ID - 1), metadata=meta(
        "its cell id there (never 0: cell 0 leads its stage)", minimum=0,
        maximum=MAX_CELL_ID - 1))
    target: int = attrs.field(validator=bounded(0, MAX_STAGES - 1), metadata=meta(
        "the stage it joins", minimum=0, maximum=MAX_STAGES - 1))
    new_id: int | None = attrs.field(default=None, validator=bounded(0, MAX_CELL_ID - 1),
                                     metadata=meta("its cell id there; default: the smallest "
                                                   "that stage lacks", minimum=0,
                                                   maximum=MAX_CELL_ID - 1))


    def cells(self, sep: str = " -> ") -> str:
        """Its old cell to its new, as every surface writes it: "0.1 -> 1.2"."""
        new = "?" if self.new_id is None else str(self.new_id)
        return f"{self.source}.{self.cell}{sep}{self.target}.{new}"

    def undo(self, placement: Placement) -> Placement:
        """The placement before this move, from the one after it: a move undone is the move
        back (``Placement.moved`` keeps the peer's fellow, slot and listener either way)."""
        assert self.new_id is not None, "a move made has its new id"
        return placement.moved(self.target, self.new_id, self.source, self.cell)


def free_id(ids: Collection[int]) -> int:
    """The id a peer takes at a stage of cells ``ids``: the smallest it lacks (every cell of
    a job computes the same one)."""
    return min(set(range(len(ids) + 1)) - set(ids))


def moves_error(moves: Sequence[PeerMove], layout: Sequence[Sequence[int]],
                steps: int) -> str | None:
    """What is wrong with moves given for a job of ``layout`` (per stage, its cells' ids)
    and ``steps`` steps, or None: each at a step boundary inside the run, in order, one a
    boundary, each of a cell there then (never cell 0) to another stage, to an id it lacks."""
    now = [set(ids) for ids in layout]
    last = 0
    for i, m in enumerate(moves):
        where = f"move {i} (before step {m.at})"
        if not last < m.at < steps:
            return (f"{where}: moves go at step boundaries inside the run, in order, one a "
                    f"boundary (after step {last}, before {steps})")
        if not (m.source < len(now) and m.target < len(now)) or m.source == m.target:
            return f"{where}: stages {m.source} -> {m.target} are not two of the job's"
        if m.cell == 0 or m.cell not in now[m.source]:
            return f"{where}: stage {m.source} has no cell {m.cell} to move (cell 0 stays)"
        new_id = free_id(now[m.target]) if m.new_id is None else m.new_id
        if new_id >= MAX_CELL_ID:
            return f"{where}: stage {m.target} has no id left below {MAX_CELL_ID}"
        if new_id in now[m.target]:
            return f"{where}: stage {m.target} already has a cell {new_id}"
        now[m.source].discard(m.cell)
        now[m.target].add(new_id)
        last = m.at
    return None
