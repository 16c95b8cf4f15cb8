"""Placement: layers to stages by weight, stages to fellows and their device slots.

Torch-free: the leader plans placements when it dispatches a job, and the fellow reads its own
entry from the START it receives. ``placement_plan.json`` is a :class:`Placement` unstructured.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import attrs

from swarm_core.schema import checking


class PlacementError(ValueError):
    pass


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
    data_addr: str | None
    replica: int = 0

    @property
    def label(self) -> str:
        """How reports and records name the cell: "k" for a job of one replica, "k.r" else
        (see Placement.label)."""
        return f"{self.stage}.{self.replica}"


def stage_of_label(label: str) -> int:
    """The stage of a cell's label ("k" or "k.r", as StagePlacement.label writes it): what a
    per-stage figure of a job of replicas is gathered by."""
    return int(str(label).partition(".")[0])


@attrs.define
class Placement:
    """Every cell of a job's grid, ``num_stages`` stages by ``replicas`` replicas, in
    ``stages`` (the name is the one-replica layout's): replica 0's stages in order, then
    replica 1's. Replica r of stage k feeds replica r of stage k+1; the replicas of one stage
    form its group."""

    num_stages: int
    n_layers: int
    stages: list[StagePlacement]
    replicas: int = 1

    def __attrs_post_init__(self) -> None:
        if checking() and (len(self.stages) != self.num_stages * self.replicas or any(
                (s.stage, s.replica) != (i % self.num_stages, i // self.num_stages)
                for i, s in enumerate(self.stages))):
            raise PlacementError(f"a {self.num_stages}-stage, {self.replicas}-replica "
                                 "placement must list each replica's stages 0.."
                                 f"{self.num_stages - 1} in order, replica by replica")

    def index(self, stage: int, replica: int = 0) -> int:
        """Where the cell is in ``stages`` (the stage itself, for one replica)."""
        return replica * self.num_stages + stage

    def cell(self, stage: int, replica: int = 0) -> StagePlacement:
        return self.stages[self.index(stage, replica)]

    def label(self, stage: int, replica: int = 0) -> str:
        return str(stage) if self.replicas == 1 else self.cell(stage, replica).label

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
        return 0 <= stage < self.num_stages and 0 <= replica < self.replicas \
            and self.cell(stage, replica).fellow_id == fellow_id

    def replicas_held(self, fellow_id: int, stage: int) -> list[int]:
        """The replicas of ``stage`` this fellow runs."""
        return [r for r in range(self.replicas) if self.holds(fellow_id, stage, r)]

    def downstream(self, stage: int, replica: int = 0) -> StagePlacement | None:
        return self.cell(stage + 1, replica) if stage + 1 < self.num_stages else None

    def upstream(self, stage: int, replica: int = 0) -> StagePlacement | None:
        return self.cell(stage - 1, replica) if stage > 0 else None

    def group(self, stage: int) -> list[StagePlacement]:
        """The replicas of one stage, by replica."""
        return [self.cell(stage, r) for r in range(self.replicas)]

    def same_fellow(self, a: StagePlacement | None, b: StagePlacement | None) -> bool:
        """Two cells in one fellow (another device slot): their link never leaves the
        machine."""
        return a is not None and b is not None and a.fellow_id == b.fellow_id

    def group_of(self, stage: int, replica: int
                 ) -> tuple[tuple[str | None, ...], tuple[bool, ...]]:
        """What the cell (stage, replica) needs to ring its stage group: where each replica
        of the stage listens, and which of them run in the cell's own fellow."""
        mine = self.cell(stage, replica)
        group = [self.cell(stage, r) for r in range(self.replicas)]
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
         replicas: int = 1) -> Placement:
    """Cell (stage k, replica r) goes to the (r x num_stages + k)-th free slot, filling each
    fellow's slots before the next fellow's, so a replica's neighbouring stages share a machine
    where they can (the pipeline's links, every micro-batch, stay local; a stage group's
    synchronisation, once a step or fewer, crosses)."""
    if num_stages < 1:
        raise PlacementError("need at least one stage")
    weights = list(weights) if weights is not None else [1.0] * num_stages
    if len(weights) != num_stages:
        raise PlacementError(f"{len(weights)} stage weights for {num_stages} stages")
    slots = []
    for f in fellows:
        usable = f.devices if slots_per_fellow is None else f.devices[:slots_per_fellow]
        slots += [(f, i, d) for i, d in enumerate(usable)]
    cells = num_stages * replicas
    if len(slots) < cells:
        grid = f"{num_stages} stages" if replicas == 1 else \
            f"{num_stages} stages x {replicas} replicas"
        raise PlacementError(f"{grid} need {cells} device slots, the fellows offer "
                             f"{len(slots)}")
    ranges = split_layers(n_layers, weights)
    stages = [
        StagePlacement(i % num_stages, f.fellow_id, f.name, slot, device,
                       LayerRange(*ranges[i % num_stages]), f.addr(slot), i // num_stages)
        for i, (f, slot, device) in enumerate(slots[:cells])
    ]
    return Placement(num_stages, n_layers, stages, replicas)
