"""The critical path of one training step: each stage's ops in its schedule's order, each op
waiting for the op it needs from a neighbour (and, where asked, for its frame to cross).

An F of micro-batch i on stage s needs stage s-1's F of i; a B of i needs stage s+1's B of i
(the last stage's own F of i comes before it in its order). A stage runs one op at a time.
With gradient clipping every stage waits for the global norm (all backwards done) before its
optimiser step, so the step ends at the last backward plus the slowest optimiser step;
without it each stage steps on its own.
"""

from __future__ import annotations

import heapq
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
    # An emulated slowdown (``pipeline/pace``): each forward and backward takes ``pace`` times
    # its compute, the padding slept (it holds no core: where stages share one, the others
    # compute meanwhile).
    pace: float = 1.0

    def per_step(self, micro_batches: int) -> float:
        """The stage's compute in one step, padding in: what its utilisation divides."""
        return micro_batches * (self.forward + self.backward) * self.pace + self.optimizer

    def op(self, kind: str) -> float:
        """One forward ("F") or backward's compute (on a core)."""
        return self.forward if kind == "F" else self.backward


# Stage s sends a frame of kind F (activations) or B (gradients): the seconds it holds the
# sender's link, and the latency after it.
Hop = Callable[[int, str], tuple[float, float]]


def compute_critical_path(schedule: str, times: Sequence[StageTimes], micro_batches: int,
                          clipped: bool = True, cores: int | None = None) -> float:
    """Seconds of one step with free, instantaneous transfers: the pipeline's fill, steady
    phase and drain as the schedule orders them (its bubble included)."""
    return simulate_step(schedule, times, micro_batches, clipped, cores=cores)


def simulate_step(schedule: str, times: Sequence[StageTimes], micro_batches: int,
                  clipped: bool = True, hop: Hop | None = None,
                  cores: int | None = None) -> float:
    """Seconds of one step, each op as soon as its stage is free and its input is there.
    With ``hop``, each frame a stage sends waits for the frames it sent before on its link
    (one queue per sender, as its sends are queued) and arrives a latency after it leaves:
    the link idles where the schedule leaves it idle (the fill and the drain), which perfect
    overlap does not count. Without, transfers are instantaneous (the compute critical path).
    ``cores``: where the stages share a machine that runs that many ops at once (fewer than
    the stages), an op also waits for a core: the ops are played out in the order they become
    ready, each on the core free first (a stage measured alone is no slower there, but three
    stages on two cores cannot all run at once). A stage's ``pace`` (an emulated slowdown)
    pads each op after its frame is queued (``pipeline/stage``: the pad sleeps after the op
    sent), holding no core."""
    cell_hop = None if hop is None else (lambda s, kind, *_ids: hop(s, kind))
    return simulate_chains(schedule, [times], micro_batches, clipped, cell_hop, cores)


def simulate_chains(schedule: str, chains: Sequence[Sequence[StageTimes]],
                    micro_batches: int, clipped: bool = True,
                    hop: Callable[..., tuple[float, float]] | None = None,
                    cores: int | None = None) -> float:
    """Seconds of a dp step of several chains (each its stages' times; a slowed cell's chain
    its own), which ends with the slowest chain: each played as ``simulate_step`` plays one,
    all sharing ``cores`` where given (every cell's ops on one machine), chain r's frames over
    its own links (``hop(stage, kind, r, r)``)."""
    stages = len(chains[0])
    plans = [ops_for(schedule, s, stages, micro_batches) for s in range(stages)]
    cells = [(r, s) for r in range(len(chains)) for s in range(stages)]

    def sent(r: int) -> Callable[..., tuple[float, float]] | None:
        return None if hop is None else (lambda s, kind: hop(s, kind, r, r))

    if cores is not None and cores < len(cells):
        free = _on_cores(plans, chains, hop, cores, schedule)
    else:
        free = {(r, s): end for r, ts in enumerate(chains)
                for s, end in enumerate(_on_own_cores(plans, ts, sent(r), schedule))}
    if clipped and stages > 1:
        return max(free.values()) + max(t.optimizer for ts in chains for t in ts)
    return max(free[(r, s)] + chains[r][s].optimizer for r, s in cells)


def needed_op(kind: str, s: int, i: int, stages: int) -> tuple[str, int, int] | None:
    """The neighbour's op that stage ``s``'s op ``kind`` of micro-batch ``i`` waits for."""
    if kind == "F":
        return ("F", s - 1, i) if s > 0 else None
    return ("B", s + 1, i) if s < stages - 1 else None


def _sent(done: dict[tuple[str, int, int], float], link_free: list[float], hop: Hop | None,
          kind: str, s: int, i: int, end: float, stages: int) -> None:
    """Op ``kind`` of ``i`` on ``s`` computed until ``end``: when its output is at the
    neighbour (its frame queued on the stage's link, then the latency), or at once without
    ``hop``."""
    done[(kind, s, i)] = end
    if hop is not None and (s < stages - 1 if kind == "F" else s > 0):
        busy, latency = hop(s, kind)
        link_free[s] = max(end, link_free[s]) + busy
        done[(kind, s, i)] = link_free[s] + latency


def _on_cores(plans: Sequence[Sequence[tuple[str, int]]],
              chains: Sequence[Sequence[StageTimes]],
              hop: Callable[..., tuple[float, float]] | None, cores: int,
              schedule: str) -> dict[tuple[int, int], float]:
    """Each cell's (chain, stage) last op's end, every chain's ops sharing ``cores``: the op
    ready first goes next, on the core free first."""
    stages = len(plans)
    cells = [(r, s) for r in range(len(chains)) for s in range(stages)]
    link_free = dict.fromkeys(cells, 0.0)
    done: dict[tuple[str, int, int, int], float] = {}  # (kind, chain, stage, i) -> there
    free = dict.fromkeys(cells, 0.0)
    pos = dict.fromkeys(cells, 0)
    pool = [0.0] * cores
    for _ in range(len(chains) * sum(map(len, plans))):
        best: tuple[float, tuple[int, int]] | None = None
        for r, s in cells:
            if pos[(r, s)] == len(plans[s]):
                continue
            kind, i = plans[s][pos[(r, s)]]
            need = needed_op(kind, s, i, stages)
            key = None if need is None else (need[0], r, need[1], need[2])
            if key is not None and key not in done:
                continue
            ready = max(free[(r, s)], done[key] if key is not None else 0.0)
            if best is None or ready < best[0]:
                best = (ready, (r, s))
        if best is None:
            raise ValueError(f"schedule {schedule!r} deadlocks with {stages} stages")
        ready, (r, s) = best
        kind, i = plans[s][pos[(r, s)]]
        t = chains[r][s]
        start = max(ready, heapq.heappop(pool))
        computed = start + t.op(kind)
        heapq.heappush(pool, computed)  # (the pace's padding is slept, off the core)
        free[(r, s)] = start + t.op(kind) * t.pace
        end = computed
        if hop is not None and (s < stages - 1 if kind == "F" else s > 0):
            busy, latency = hop(s, kind, r, r)
            link_free[(r, s)] = max(computed, link_free[(r, s)]) + busy
            end = link_free[(r, s)] + latency
        done[(kind, r, s, i)] = end
        pos[(r, s)] += 1
    return free


def _on_own_cores(plans: Sequence[Sequence[tuple[str, int]]], times: Sequence[StageTimes],
                  hop: Hop | None, schedule: str) -> list[float]:
    """Each stage's last op's end, every stage on cores of its own."""
    stages = len(times)
    link_free = [0.0] * stages
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> end
    free = [0.0] * stages
    pos = [0] * stages
    left = sum(map(len, plans))
    while left:
        progressed = False
        for s in range(stages):
            while pos[s] < len(plans[s]):
                kind, i = plans[s][pos[s]]
                need = needed_op(kind, s, i, stages)
                if need is not None and need not in done:
                    break  # (the neighbour's op comes later in the sweep)
                ready = done[need] if need is not None else 0.0
                start = max(free[s], ready)
                free[s] = start + times[s].op(kind) * times[s].pace
                _sent(done, link_free, hop, kind, s, i, start + times[s].op(kind), stages)
                pos[s] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule!r} deadlocks with {stages} stages")
    return free
