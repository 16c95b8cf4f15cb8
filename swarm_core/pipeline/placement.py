"""Placement: layers to stages by weight, stages to fellows and their device slots.

Torch-free: the leader plans placements when it dispatches a job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs


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


@attrs.define
class StagePlacement:
    stage: int
    fellow_id: int
    name: str
    slot: int
    device: str
    layers: tuple[int, int]  # global [start, stop)
    data_addr: str | None


@attrs.define
class Placement:
    num_stages: int
    n_layers: int
    stages: list[StagePlacement]

    def to_json(self) -> dict[str, Any]:
        return {
            "num_stages": self.num_stages,
            "n_layers": self.n_layers,
            "stages": [
                {"stage": s.stage, "fellow_id": s.fellow_id, "name": s.name, "slot": s.slot,
                 "device": s.device, "layers": {"start": s.layers[0], "stop": s.layers[1]},
                 "data_addr": s.data_addr}
                for s in self.stages
            ],
        }


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
        StagePlacement(k, f.fellow_id, f.name, slot, device, ranges[k], f.addr(slot))
        for k, (f, slot, device) in enumerate(slots[:num_stages])
    ]
    return Placement(num_stages, n_layers, stages)
