"""Placement: layers to stages by weight, stages to fellows and their device slots.

Torch-free: the leader plans placements when it dispatches a job, and the fellow reads its own
entry from the START it receives. ``placement_plan.json`` is a :class:`Placement` unstructured.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    """One stage of a placed job: the fellow and device slot that run it, its layers, and the
    address its upstream neighbour dials."""

    stage: int
    fellow_id: int
    name: str
    slot: int
    device: str
    layers: LayerRange
    data_addr: str | None


@attrs.define
class Placement:
    num_stages: int
    n_layers: int
    stages: list[StagePlacement]

    def __attrs_post_init__(self) -> None:
        if checking() and (len(self.stages) != self.num_stages or any(
                s.stage != k for k, s in enumerate(self.stages))):
            raise PlacementError(f"a {self.num_stages}-stage placement must list stages "
                                 f"0..{self.num_stages - 1} in order")

    @property
    def fellows(self) -> list[int]:
        """The fellow of each stage, by stage index (a fellow with several slots repeats)."""
        return [s.fellow_id for s in self.stages]

    def holds(self, fellow_id: int, stage: int) -> bool:
        """Whether this fellow runs this stage (a fellow may run several)."""
        return 0 <= stage < len(self.stages) and self.stages[stage].fellow_id == fellow_id

    def downstream(self, stage: int) -> StagePlacement | None:
        return self.stages[stage + 1] if stage + 1 < len(self.stages) else None

    def upstream(self, stage: int) -> StagePlacement | None:
        return self.stages[stage - 1] if stage > 0 else None

    def same_fellow(self, a: StagePlacement | None, b: StagePlacement | None) -> bool:
        """Two stages in one fellow (another device slot): their link never leaves the
        machine."""
        return a is not None and b is not None and a.fellow_id == b.fellow_id


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
         weights: Sequence[float] | None = None, slots_per_fellow: int | None = None
         ) -> Placement:
    """Stage k goes to the k-th free slot, filling each fellow's slots before the next fellow's,
    so neighbouring stages share a machine where they can."""
    if num_stages < 1:
        raise PlacementError("need at least one stage")
    weights = list(weights) if weights is not None else [1.0] * num_stages
    if len(weights) != num_stages:
        raise PlacementError(f"{len(weights)} stage weights for {num_stages} stages")
    slots = []
    for f in fellows:
        usable = f.devices if slots_per_fellow is None else f.devices[:slots_per_fellow]
        slots += [(f, i, d) for i, d in enumerate(usable)]
    if len(slots) < num_stages:
        raise PlacementError(f"{num_stages} stages need {num_stages} device slots, "
                             f"the fellows offer {len(slots)}")
    ranges = split_layers(n_layers, weights)
    stages = [
        StagePlacement(k, f.fellow_id, f.name, slot, device, LayerRange(*ranges[k]),
                       f.addr(slot))
        for k, (f, slot, device) in enumerate(slots[:num_stages])
    ]
    return Placement(num_stages, n_layers, stages)
