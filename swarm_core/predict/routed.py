"""A swarm-wired step played out cell by cell (issue 40's predictor for issue 34's wiring):
each stage deals the step's R x M micro-batches to its cells (``routing.route_plan``: given
weights, or the cells' speeds where the routes are measured), and each cell runs its own in
GPipe's order (``routing.RoutedStep.ops``: the forwards, then their backwards in reverse).

An F of micro-batch g on stage s needs stage s-1's F of g, on whichever cell ran it; a B of g
needs stage s+1's B of g. A cell runs one op at a time, an emulated slowdown multiplying its
forwards and backwards (``pipeline/pace`` pads those, not the optimiser step, after the
op's frame is queued: the padding delays the cell, not its frame). With a ``hop``
each frame waits for the frames its sender cell sent before (one queue per sender, as its
sends are queued) and arrives a latency after it leaves. Where the cells share a machine of
fewer cores than cells, an op also waits for a core (the ready op goes first, on the core
free first), as ``critical_path`` plays a chain.

A step's deal depends on the step (its tie-breaks are seeded by it), so a prediction averages
a few steps' plans (``PLANS``).
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Callable, Mapping, Sequence

import attrs

from swarm_core.pipeline.routing import Plan, RoutedStep, route_plan, runs
from swarm_core.predict.critical_path import StageTimes, needed_op

PLANS = 4  # steps whose deals a prediction averages
Cell = tuple[int, int]  # (stage, id)
# A frame from stage s's cell ``src`` (F: to stage s+1, B: to stage s-1) to cell ``dst``
# there: the seconds it holds the sender's link, and the latency after it.
CellHop = Callable[[int, str, int, int], tuple[float, float]]


def route_weights(stages: int, width: int, routing: str,
                  given: Sequence[Sequence[float]] | None,
                  slowdowns: Mapping[Cell, float]) -> list[list[float]] | None:
    """The weights each stage deals by, by cell id (``width`` of them: the replicas, or a
    layout's ids): measured routes converge to each cell's speed (one over its seconds a
    micro-batch: 1 / its slowdown, the stage's own time being common to its cells); given
    ones are the job's (None: equal)."""
    if routing == "measured":
        return [[1.0 / slowdowns.get((s, r), 1.0) for r in range(width)]
                for s in range(stages)]
    return None if given is None else [list(map(float, row)) for row in given]


@attrs.define
class RoutedRun:
    """A routed job's steps to play out: its deals (one a step) and its cells' speeds."""

    plans: list[Plan]
    times: tuple[StageTimes, ...]
    micro_batches: int
    slowdowns: Mapping[Cell, float] = attrs.field(factory=dict)
    clipped: bool = True
    cores: int | None = None

    @classmethod
    def of(cls, seed: int, stages: int, replicas: int, micro_batches: int,
           times: Sequence[StageTimes], weights: Sequence[Sequence[float]] | None,
           slowdowns: Mapping[Cell, float], clipped: bool = True,
           cores: int | None = None, layout: Sequence[Sequence[int]] | None = None
           ) -> RoutedRun:
        plans = [route_plan(seed, step, stages, replicas, micro_batches, weights, None, layout)
                 for step in range(PLANS)]
        return cls(plans, tuple(times), micro_batches, dict(slowdowns), clipped, cores)

    def step(self, hop: CellHop | None = None) -> float:
        """Seconds of a step, the mean over the plans."""
        return statistics.fmean(self._played(plan, hop) for plan in self.plans)

    def dealt(self) -> list[dict[int, float]]:
        """Per stage, each cell's micro-batches a step (the mean over the plans)."""
        stages = len(self.times)
        ids = [sorted({r for plan in self.plans for r in plan[s] if r >= 0})
               for s in range(stages)]
        return [{r: statistics.fmean(len(runs(plan, s, r)) for plan in self.plans)
                 for r in ids[s]} for s in range(stages)]

    def compute(self) -> list[float]:
        """Per stage, its busiest cell's compute a step (its dealt micro-batches at its pace,
        and its optimiser step), the mean over the plans."""
        out = []
        for s, t in enumerate(self.times):
            per_plan = [max(len(runs(plan, s, r)) * (t.forward + t.backward)
                            * self.slowdowns.get((s, r), 1.0)
                            for r in set(plan[s]) - {-1}) for plan in self.plans]
            out.append(statistics.fmean(per_plan) + t.optimizer)
        return out

    def _played(self, plan: Plan, hop: CellHop | None) -> float:
        stages, m = len(self.times), self.micro_batches
        cells = [(s, r) for s in range(stages) for r in sorted(set(plan[s]) - {-1})]
        ops = {c: RoutedStep(plan, c[0], c[1], m).ops() for c in cells}
        done: dict[tuple[str, int, int], float] = {}  # (kind, stage, g) -> at the neighbour
        free = dict.fromkeys(cells, 0.0)
        link_free = dict.fromkeys(cells, 0.0)
        pos = dict.fromkeys(cells, 0)
        pool = [0.0] * (len(cells) if self.cores is None else min(self.cores, len(cells)))
        for _ in range(sum(map(len, ops.values()))):
            best: tuple[float, Cell] | None = None
            for c in cells:
                if pos[c] == len(ops[c]):
                    continue
                kind, g = ops[c][pos[c]]
                need = needed_op(kind, c[0], g, stages)
                if need is not None and need not in done:
                    continue
                ready = max(free[c], done[need] if need is not None else 0.0)
                if best is None or ready < best[0]:
                    best = (ready, c)
            if best is None:
                raise ValueError(f"a routed step of {stages} stages deadlocks")
            ready, c = best
            (s, r), (kind, g) = c, ops[c][pos[c]]
            start = max(ready, heapq.heappop(pool))
            computed = start + self.times[s].op(kind)
            heapq.heappush(pool, computed)  # (a slowdown's padding is slept, off the core)
            free[c] = start + self.times[s].op(kind) * self.slowdowns.get(c, 1.0)
            # (its frame is queued as the op is computed: the padding sleeps after it)
            end, to = computed, s + 1 if kind == "F" else s - 1
            if hop is not None and 0 <= to < stages:
                busy, latency = hop(s, kind, r, plan[to][g])
                link_free[c] = max(end, link_free[c]) + busy
                end = link_free[c] + latency
            done[(kind, s, g)] = end
            pos[c] += 1
        if self.clipped and stages > 1:  # (every cell waits for the global norm)
            return max(free.values()) + max(t.optimizer for t in self.times)
        return max(free[c] + self.times[c[0]].optimizer for c in cells)
