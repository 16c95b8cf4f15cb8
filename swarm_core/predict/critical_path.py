"""The critical path of one training step: each stage's ops in its schedule's order, each op
waiting for the op it needs from a neighbour (and, where asked, for its frame to cross).

An F of micro-batch i on stage s needs stage s-1's F of i; a B of i needs stage s+1's B of i
(the last stage's own F of i comes before it in its order). A stage runs one op at a time.
With gradient clipping every stage waits for the global norm (all backwards done) before its
optimiser step, so the step ends at the last backward plus the slowest optimiser step;
without it each stage steps on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from swarm_core.pipeline.schedules import ops_for


@attrs.frozen
class StageTimes:
    """Seconds one stage spends on one micro-batch's forward and backward, and on the step's
    optimiser update (clipping's scaling included)."""

    forward: float
    backward: float
    optimizer: float = 0.0

    def per_step(self, micro_batches: int) -> float:
        """The stage's compute in one step: what its utilisation divides."""
        return micro_batches * (self.forward + self.backward) + self.optimizer


# Stage s sends a frame of kind F (activations) or B (gradients): the seconds it holds the
# sender's link, and the latency after it.
Hop = Callable[[int, str], tuple[float, float]]


def compute_critical_path(schedule: str, times: Sequence[StageTimes], micro_batches: int,
                          clipped: bool = True) -> float:
    """Seconds of one step with free, instantaneous transfers: the pipeline's fill, steady
    phase and drain as the schedule orders them (its bubble included)."""
    return simulate_step(schedule, times, micro_batches, clipped)


def simulate_step(schedule: str, times: Sequence[StageTimes], micro_batches: int,
                  clipped: bool = True, hop: Hop | None = None) -> float:
    """Seconds of one step, each op as soon as its stage is free and its input is there.
    With ``hop``, each frame a stage sends waits for the frames it sent before on its link
    (one queue per sender, as its sends are queued) and arrives a latency after it leaves:
    the link idles where the schedule leaves it idle (the fill and the drain), which perfect
    overlap does not count. Without, transfers are instantaneous (the compute critical path).
    """
    stages = len(times)
    link_free = [0.0] * stages
    plans = [ops_for(schedule, s, stages, micro_batches) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> end
    free = [0.0] * stages
    pos = [0] * stages
    left = sum(map(len, plans))
    while left:
        progressed = False
        for s in range(stages):
            while pos[s] < len(plans[s]):
                kind, i = plans[s][pos[s]]
                need = (("F", s - 1, i) if s > 0 else None) if kind == "F" else \
                    (("B", s + 1, i) if s < stages - 1 else None)
                if need is not None and need not in done:
                    break  # (the neighbour's op comes later in the sweep)
                ready = done[need] if need is not None else 0.0
                took = times[s].forward if kind == "F" else times[s].backward
                free[s] = max(free[s], ready) + took
                done[(kind, s, i)] = free[s]
                sends = s < stages - 1 if kind == "F" else s > 0
                if hop is not None and sends:
                    busy, latency = hop(s, kind)
                    link_free[s] = max(free[s], link_free[s]) + busy
                    done[(kind, s, i)] = link_free[s] + latency  # (when the neighbour has it)
                pos[s] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule!r} deadlocks with {stages} stages and "
                             f"{micro_batches} micro-batches")
    if clipped and stages > 1:
        return max(free) + max(t.optimizer for t in times)
    return max(f + t.optimizer for f, t in zip(free, times, strict=True))
