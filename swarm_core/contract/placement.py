"""Placement: layers to stages by weight, stages to fellows and their device slots.

Torch-free: the leader plans placements when it dispatches a job, and the fellow reads its own
entry from the START it receives. ``placement_plan.json`` is a :class:`Placement` unstructured.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import attrs

from swarm_core.schema import checking, sparse

if TYPE_CHECKING:
    from swarm_core.config.network import LinkMatrix


class PlacementError(ValueError):
    pass


# Per stage, the sorted ids of its cells (``pipeline/layout``): a swarm job's stages may hold
# different numbers of cells. Defined here, torch-free, since the leader places by it too.
Layout = tuple[tuple[int, ...], ...]
MAX_STAGES = 1024  # (as Topology.stages is bounded)
MAX_CELL_ID = 256  # a layout's ids (and a move's): below this, as a job's replicas are


def layout_cells(layout: Layout) -> list[tuple[int, int]]:
    """(stage, id) of every cell of ``layout`` in placement order: id by id, each id's stages
    in order, absent cells skipped. For the uniform layout that is the grid's order (replica r
    of stage k at r x stages + k), so a uniform job's indices never move."""
    return list(_cell_index(layout))


@functools.lru_cache(maxsize=64)
def _cell_index(layout: Layout) -> dict[tuple[int, int], int]:
    """Each cell's place in ``layout_cells`` order (a report's lookup, every report: cached
    per layout, which a job changes only at a move)."""
    width = slot_count(layout, 0)
    sets = [set(ids) for ids in layout]
    cells = [(k, i) for i in range(width) for k, ids in enumerate(sets) if i in ids]
    return {c: n for n, c in enumerate(cells)}


def stage_ids(layout: Sequence[Sequence[int]] | None, stage: int, shares: int) -> list[int]:
    """The ids of a stage's cells, sorted (the grid's ``0..shares-1`` without a layout)."""
    return list(range(shares)) if layout is None else list(layout[stage])


def slot_count(layout: Sequence[Sequence[int]] | None, shares: int) -> int:
    """How many ids the job names (a table of ids is this wide): the largest, plus one."""
    return shares if not layout else 1 + max(max(ids) for ids in layout)


def cell_count(layout: Sequence[Sequence[int]] | None, stages: int, replicas: int) -> int:
    """The cells (device slots) a job fills: its layout's, else stages x replicas."""
    return stages * replicas if layout is None else sum(len(ids) for ids in layout)


def complete(layout: Sequence[Sequence[int]] | None, replica: int) -> bool:
    """Whether id ``replica`` has a cell at every stage (a whole chain)."""
    return layout is None or all(replica in ids for ids in layout)


def normal_layout(layout: Sequence[Sequence[int]] | None, num_stages: int,
                  replicas: int) -> Layout | None:
    """``layout`` checked and sorted, or None where it is the uniform grid (every stage ids
    0..replicas-1), so that a uniform job's placement is today's to the byte. Raises
    PlacementError in one line naming what is wrong."""
    if layout is None:
        return None
    if len(layout) != num_stages:
        raise PlacementError(f"layout: {len(layout)} stages listed for a {num_stages}-stage job")
    out = tuple(tuple(sorted(int(i) for i in ids)) for ids in layout)
    for k, ids in enumerate(out):
        if not ids:
            raise PlacementError(f"layout: stage {k} has no cells (each needs cell 0)")
        if len(set(ids)) != len(ids):
            raise PlacementError(f"layout: stage {k}'s ids {list(ids)} repeat (ids must be "
                                 "distinct and >= 0)")
        if ids[0] < 0:
            raise PlacementError(f"layout: stage {k}'s ids {list(ids)} go below 0 (ids must "
                                 "be distinct and >= 0)")
        if ids[0] != 0:
            raise PlacementError(f"layout: stage {k} has no cell 0 (its ids: {list(ids)}; "
                                 "id 0's chain evaluates and checkpoints)")
    uniform = tuple(range(replicas))
    return None if all(ids == uniform for ids in out) else out


def split_layers(n_layers: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges, one per weight, by largest remainder.

    The counts always sum to ``n_layers``. All-zero weights count as equal; a zero weight among
    positive ones gets no layers (its stage keeps only what sits at its edges).
    """
    if not weights:
        raise PlacementError("need at least one stage")
    if any(w < 0 for w in weights):
        raise PlacementError(f"stage weights must be >= 0, got {list(weights)}")
    total = float(sum(weights))
    ws = [1.0] * len(weights) if total == 0 else [float(w) for w in weights]
    total = sum(ws)
    quotas = [n_layers * w / total for w in ws]
    counts = [int(q) for q in quotas]
    short = n_layers - sum(counts)
    # Largest remainder first; ties go to the earlier stage so the plan is deterministic.
    order = sorted(range(len(ws)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:short]:
        counts[i] += 1
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


@attrs.frozen
class LayerRange:
    """Global transformer blocks ``[start, stop)`` of one stage."""

    start: int
    stop: int

    def __attrs_post_init__(self) -> None:
        if checking() and not 0 <= self.start <= self.stop:
            raise PlacementError(f"layer range {self.start}-{self.stop} is not 0 <= start <= stop")

    def as_tuple(self) -> tuple[int, int]:
        return (self.start, self.stop)


@sparse  # (``site`` None is left out: a job without a link matrix's JSON is as it was)
@attrs.define
class StagePlacement:
    """One cell of a placed job, (stage, replica): the fellow and device slot that run it, its
    layers, and the address its neighbours dial."""

    stage: int
    fellow_id: int
    name: str
    slot: int
    device: str
    layers: LayerRange
    data_addr: str | None = None  # (None: left out of its JSON, as ``site``)
    replica: int = 0
    # Its site under the job's link matrix (``config.network``; None without one), named
    # where the job was placed: a rebalancing move keeps it (the peer keeps its fellow).
    site: str | None = None

    @property
    def label(self) -> str:
        """How reports and records name the cell: "k" for a job of one replica, "k.r" else
        (see Placement.label)."""
        return f"{self.stage}.{self.replica}"


def stage_of_label(label: str) -> int:
    """The stage of a cell's label ("k" or "k.r", as StagePlacement.label writes it): what a
    per-stage figure of a job of replicas is gathered by."""
    return int(str(label).partition(".")[0])


@sparse  # (``layout`` None is left out: a uniform job's JSON is as it was before layouts)
@attrs.define
class Placement:
    """Every cell of a placed job, in ``stages`` (the name is the one-replica layout's).

    Without ``layout``, a grid of ``num_stages`` stages by ``replicas`` replicas: replica 0's
    stages in order, then replica 1's. Replica r of stage k feeds replica r of stage k+1; the
    replicas of one stage form its group.

    With ``layout`` (a swarm job whose stages hold different cells, ``pipeline/layout``):
    stage k has the cells of ``layout[k]``'s ids, listed id by id (``layout_cells``); a cell's
    ``replica`` is its id. ``replicas`` stays the job's data shares (its batch), which the ids
    need not match; a cell feeds the same id at the next stage only where that stage has it."""

    num_stages: int
    n_layers: int
    stages: list[StagePlacement]
    replicas: int = 1
    layout: Layout | None = None

    def __attrs_post_init__(self) -> None:
        # Normalised whatever the checking: a uniform layout is the grid, so it must read as
        # None everywhere (JSON, equality, every method's arithmetic path).
        self.layout = normal_layout(self.layout, self.num_stages, self.replicas)
        if checking():
            self._check_cells()

    def _check_cells(self) -> None:
        got = [(s.stage, s.replica) for s in self.stages]
        if self.layout is None:
            if got != [(i % self.num_stages, i // self.num_stages)
                       for i in range(self.num_stages * self.replicas)]:
                raise PlacementError(f"a {self.num_stages}-stage, {self.replicas}-replica "
                                     "placement must list each replica's stages 0.."
                                     f"{self.num_stages - 1} in order, replica by replica")
        elif got != layout_cells(self.layout):
            raise PlacementError(f"a placement of layout {[list(ids) for ids in self.layout]} "
                                 "must list its cells id by id, each id's stages in order")

    @property
    def width(self) -> int:
        """How many ids the widest use of an id spans: the shares for a grid, else the
        largest id + 1."""
        return self.replicas if self.layout is None else 1 + max(max(i) for i in self.layout)

    def ids(self, stage: int) -> list[int]:
        """The ids of ``stage``'s cells, in order (a grid: every replica)."""
        return list(range(self.replicas)) if self.layout is None else list(self.layout[stage])

    def has(self, stage: int, replica: int = 0) -> bool:
        """Whether the job has the cell (stage, id)."""
        return 0 <= stage < self.num_stages and replica in self.ids(stage)

    def index(self, stage: int, replica: int = 0) -> int:
        """Where the cell is in ``stages`` (the stage itself, for one replica)."""
        if self.layout is None:
            return replica * self.num_stages + stage
        try:
            return _cell_index(self.layout)[(stage, replica)]
        except KeyError:
            raise PlacementError(f"no cell {stage}.{replica} in layout "
                                 f"{[list(ids) for ids in self.layout]}") from None

    def cell(self, stage: int, replica: int = 0) -> StagePlacement:
        return self.stages[self.index(stage, replica)]

    def site(self, stage: int, replica: int) -> str | None:
        """The site the placement names for cell (stage, id), if any (``LinkMatrix.site_of``
        reads it first)."""
        return self.cell(stage, replica).site if self.has(stage, replica) else None

    def label(self, stage: int, replica: int = 0) -> str:
        """"k" for a grid of one replica, "k.r" else: a layout always names the id, since
        even one share's layout has several cells at some stage."""
        if self.layout is None and self.replicas == 1:
            return str(stage)
        return self.cell(stage, replica).label

    @property
    def fellows(self) -> list[int]:
        """The fellow of each cell, in ``stages`` order (a fellow with several slots
        repeats)."""
        return [s.fellow_id for s in self.stages]

    def fellows_of(self, stage: int | None = None, replica: int | None = None,
                   members: Collection[int] | None = None) -> list[int]:
        """The fellows that hold the cells of ``stage`` (a stage group) and/or ``replica`` (a
        replica's chain), each once (a fellow's link is shaped as one, whatever cells it
        holds); neither: every fellow of the job. With ``members`` (the replicas that train
        now), only theirs: a replica that left holds nothing of the job any more."""
        return list(dict.fromkeys(c.fellow_id for c in self.stages
                                  if (stage is None or c.stage == stage)
                                  and (replica is None or c.replica == replica)
                                  and (members is None or c.replica in members)))

    def holds(self, fellow_id: int, stage: int, replica: int = 0) -> bool:
        """Whether this fellow runs this cell (a fellow may run several)."""
        if self.layout is not None:
            return self.has(stage, replica) and self.cell(stage, replica).fellow_id == fellow_id
        return 0 <= stage < self.num_stages and 0 <= replica < self.replicas \
            and self.cell(stage, replica).fellow_id == fellow_id

    def replicas_held(self, fellow_id: int, stage: int) -> list[int]:
        """The replicas (a layout's: ids) of ``stage`` this fellow runs."""
        ids = range(self.replicas) if self.layout is None or not 0 <= stage < self.num_stages \
            else self.layout[stage]
        return [r for r in ids if self.holds(fellow_id, stage, r)]

    def downstream(self, stage: int, replica: int = 0) -> StagePlacement | None:
        """The cell this one's chain link feeds: None at the last stage, and under a layout
        where the next stage lacks this id (the cell has route links only there)."""
        return self._neighbour(stage + 1, replica)

    def upstream(self, stage: int, replica: int = 0) -> StagePlacement | None:
        return self._neighbour(stage - 1, replica)

    def _neighbour(self, stage: int, replica: int) -> StagePlacement | None:
        if not 0 <= stage < self.num_stages:
            return None
        if self.layout is not None and replica not in self.layout[stage]:
            return None
        return self.cell(stage, replica)

    def group(self, stage: int) -> list[StagePlacement]:
        """The cells of one stage, by replica (a layout's: by id)."""
        return [self.cell(stage, r) for r in self.ids(stage)]

    def ring(self, stage: int, replica: int, step: int = 1) -> StagePlacement | None:
        """The cell ``step`` places round the stage group's ring from (stage, replica), in
        id order (a grid's: replica (r + step) % R); None for a stage of one cell."""
        ids = self.ids(stage)
        if len(ids) == 1:
            return None
        return self.cell(stage, ids[(ids.index(replica) + step) % len(ids)])

    def moved(self, source: int, cell: int, target: int, new_id: int) -> Placement:
        """The placement after a rebalancing move (``contract/rebalance.Move``): cell ``cell``
        of stage ``source`` becomes cell ``new_id`` of stage ``target``. The peer keeps its
        fellow, slot, device and listener (its neighbours dial the same address) and takes
        the target stage's layers. Every cell computes the same move in band, so each holder
        of the placement reaches the same one. PlacementError (one line) for a move that does
        not fit: a cell that is not there, an id the target has, a stage left without id 0."""
        if not self.has(source, cell):
            raise PlacementError(f"move: no cell {source}.{cell} to move")
        if not 0 <= target < self.num_stages or target == source:
            raise PlacementError(f"move: stage {target} is not another stage of the job")
        if new_id < 0 or self.has(target, new_id):
            raise PlacementError(f"move: stage {target} already has a cell {new_id}")
        shape = [[i for i in self.ids(k) if (k, i) != (source, cell)]
                 for k in range(self.num_stages)]
        shape[target].append(new_id)
        after = normal_layout(shape, self.num_stages, self.replicas)  # (refuses losing id 0)
        arrived = attrs.evolve(self.cell(source, cell), stage=target, replica=new_id,
                               layers=self.group(target)[0].layers)
        by_place = {(c.stage, c.replica): c for c in self.stages}
        del by_place[(source, cell)]
        by_place[(target, new_id)] = arrived
        # (id by id whether or not the result is the grid: for the grid that is its order)
        order = layout_cells(tuple(tuple(ids) for ids in shape))
        return Placement(self.num_stages, self.n_layers, [by_place[c] for c in order],
                         self.replicas, after)

    def without(self, cells: Collection[tuple[int, int]]) -> Placement:
        """The placement after the cells (stage, id) ``cells`` left a swarm job (a cell-wise
        departure, ``contract.membership.cell_orders``): every other cell where it was.
        PlacementError (one line) where a stage would lose its cell 0, or a cell is not
        there."""
        for k, r in cells:
            if not self.has(k, r):
                raise PlacementError(f"no cell {k}.{r} to leave")
        shape = [[i for i in self.ids(k) if (k, i) not in cells]
                 for k in range(self.num_stages)]
        after = normal_layout(shape, self.num_stages, self.replicas)  # (refuses losing id 0)
        return Placement(self.num_stages, self.n_layers,
                         [c for c in self.stages if (c.stage, c.replica) not in cells],
                         self.replicas, after)

    def same_fellow(self, a: StagePlacement | None, b: StagePlacement | None) -> bool:
        """Two cells in one fellow (another device slot): their link never leaves the
        machine."""
        return a is not None and b is not None and a.fellow_id == b.fellow_id

    def group_of(self, stage: int, replica: int
                 ) -> tuple[tuple[str | None, ...], tuple[bool, ...]]:
        """What the cell (stage, replica) needs to ring its stage group: where each replica
        of the stage listens, and which of them run in the cell's own fellow."""
        mine = self.cell(stage, replica)
        group = self.group(stage)
        return (tuple(c.data_addr for c in group),
                tuple(self.same_fellow(mine, c) for c in group))


@attrs.define
class FellowSlots:
    fellow_id: int
    name: str
    devices: list[str]
    data_addr: str | None = None
    data_addrs: list[str] = attrs.field(factory=list)  # one per slot, when the fellow has them

    def addr(self, slot: int) -> str | None:
        return self.data_addrs[slot] if slot < len(self.data_addrs) else self.data_addr


def plan(fellows: Sequence[FellowSlots], num_stages: int, n_layers: int,
         weights: Sequence[float] | None = None, slots_per_fellow: int | None = None,
         replicas: int = 1, layout: Sequence[Sequence[int]] | None = None,
         network: LinkMatrix | None = None) -> Placement:
    """Cell (stage k, replica r) goes to the (r x num_stages + k)-th free slot, filling each
    fellow's slots before the next fellow's, so a replica's neighbouring stages share a machine
    where they can (the pipeline's links, every micro-batch, stay local; a stage group's
    synchronisation, once a step or fewer, crosses). With ``layout`` (per stage, its cells'
    ids; ``replicas`` the job's shares), the i-th cell in ``layout_cells`` order takes the i-th
    slot: an id's chain still shares a machine where it can. ``network``: the job's link
    matrix, whose site each cell then keeps (``StagePlacement.site``)."""
    if num_stages < 1:
        raise PlacementError("need at least one stage")
    weights = list(weights) if weights is not None else [1.0] * num_stages
    if len(weights) != num_stages:
        raise PlacementError(f"{len(weights)} stage weights for {num_stages} stages")
    shape = normal_layout(layout, num_stages, replicas)
    cells = _grid_cells(num_stages, replicas) if shape is None else layout_cells(shape)
    slots = _free_slots(fellows, slots_per_fellow)
    if len(slots) < len(cells):
        raise PlacementError(f"{_shape_text(num_stages, replicas, shape)} need {len(cells)} "
                             f"device slots, the fellows offer {len(slots)}")
    ranges = split_layers(n_layers, weights)
    stages = [StagePlacement(k, f.fellow_id, f.name, slot, device, LayerRange(*ranges[k]),
                             f.addr(slot), r,
                             None if network is None else network.site_of(k, r, num_stages))
              for (k, r), (f, slot, device) in zip(cells, slots, strict=False)]
    return Placement(num_stages, n_layers, stages, replicas, shape)


def _grid_cells(num_stages: int, replicas: int) -> list[tuple[int, int]]:
    return [(i % num_stages, i // num_stages) for i in range(num_stages * replicas)]


def _free_slots(fellows: Sequence[FellowSlots], slots_per_fellow: int | None
                ) -> list[tuple[FellowSlots, int, str]]:
    """Every usable (fellow, slot, device), each fellow's slots before the next fellow's."""
    slots = []
    for f in fellows:
        usable = f.devices if slots_per_fellow is None else f.devices[:slots_per_fellow]
        slots += [(f, i, d) for i, d in enumerate(usable)]
    return slots


def _shape_text(num_stages: int, replicas: int, layout: Layout | None) -> str:
    if layout is not None:
        return f"{num_stages} stages of cells {'+'.join(str(len(ids)) for ids in layout)}"
    return f"{num_stages} stages" if replicas == 1 else \
        f"{num_stages} stages x {replicas} replicas"
