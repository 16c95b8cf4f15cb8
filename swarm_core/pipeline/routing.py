"""SWARM wiring's routes (issue 34): which replica of each stage runs each micro-batch of a step.

Under ``wiring: swarm`` a micro-batch is not tied to its replica's chain: replica r of stage 0
reads its share of the step's windows (global micro-batches r*M .. r*M + M - 1), and at every
later stage the step's R*M micro-batches are dealt to the stage's replicas by SWARM's rule
(yandex-research/swarm, ``src/moe/client/balancer.py``, ``ExpertBalancer``): each goes to the
peer whose queue of expected work ends first, that queue then growing by the task's size over
the peer's throughput, ties broken at random; the first of a step go one to each peer. Here
the throughputs are the stage's ``weights`` and the deal is a plan every cell computes alike
from the job's seed and the step, so no frame says where a micro-batch goes next and no cell
waits on a queue: each cell knows which micro-batches it runs, who sends each and whom it
sends it to. As SWARM's balancer takes its tasks, the micro-batches are dealt in the order
they reach the stage (the replicas' shares interleaved, the order every cell runs them in:
``RoutedStep``), the seeded tie-breaks making the wiring stochastic: of equal peers, which
takes which of each slot's micro-batches is drawn a step. (A first version dealt them in a
seeded shuffle: a cell could be dealt two of one slot's micro-batches and none of another's,
and idle in the forward phase; played out, 10-26 % longer steps where the stages' cells are
equal, docs/decisions.md.)
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from typing import Any

from swarm_core.contract.placement import slot_count, stage_ids

Plan = list[list[int]]  # plan[stage][g]: the replica of that stage that runs micro-batch g


def arrival(g: int, micro_batches: int) -> tuple[int, int]:
    """Where micro-batch ``g`` comes in a stage's step: its replica's shares side by side,
    each one's first, then each one's second... (stage 0's replicas make them so)."""
    return g % micro_batches, g // micro_batches


def deal(weights: Sequence[float], order: Sequence[int], rng: random.Random) -> dict[int, int]:
    """Each of ``order`` to the replica whose expected work ends first (SWARM's balancer,
    unit tasks): its queue then grows by 1 / its weight. Returns micro-batch -> replica."""
    speeds = [max(float(w), 1e-9) for w in weights]
    if not speeds:
        raise ValueError("no replicas to route to")
    queue = [(0.0, rng.random(), r) for r in range(len(speeds))]
    heapq.heapify(queue)
    dealt = {}
    for g in order:
        ends, _tie, r = heapq.heappop(queue)
        dealt[g] = r
        heapq.heappush(queue, (ends + 1.0 / speeds[r], rng.random(), r))
    return dealt


def route_plan(seed: int, step: int, num_stages: int, replicas: int, micro_batches: int,
               weights: Sequence[Sequence[float]] | None = None,
               members: Sequence[int] | None = None,
               layout: Sequence[Sequence[int]] | None = None) -> Plan:
    """The step's routes: stage 0 runs each replica's own share; stage k >= 1 deals the
    ``replicas * micro_batches`` micro-batches by ``weights[k]`` (equal where None), each
    replica at least one where there are as many micro-batches as replicas. ``members``: the
    replicas left after some left the job (all where None): the shares of those that left
    are run by nobody (-1), the rest dealt to those left, so the step's batch shrinks to the
    survivors' shares as a chain-wired job's does. ``layout`` (``pipeline/layout``): each
    stage's cell ids, by which ``weights`` are indexed; every stage deals to its own (those
    of ``members``), stage 0 too, even where its ids are the shares' (a peer moved there may
    be a slow one: its share is dealt by weight, not run at its pace)."""
    n = replicas * micro_batches
    live = list(range(replicas)) if members is None else sorted(members)
    shares = [g // micro_batches if g // micro_batches in live else -1 for g in range(n)]
    plan = []
    for k in range(num_stages):
        ids = live if layout is None else \
            [r for r in layout[k] if members is None or r in members]
        if k == 0 and layout is None:
            plan.append(shares)
            continue
        rng = random.Random(f"swarm-route/{seed}/{step}/{k}")
        order = sorted((g for g in range(n) if shares[g] >= 0),
                       key=lambda g: arrival(g, micro_batches))
        dealt = deal([1.0 if weights is None else weights[k][r] for r in ids], order, rng)
        plan.append([ids[dealt[g]] if g in dealt else -1 for g in range(n)])
    return plan


class ThroughputEstimate:
    """Each cell's throughput as SWARM's balancer estimates a peer's (hivemind's
    ``PerformanceEMA``: an exponential moving average of seconds per sample, ``alpha`` 0.1,
    divided by 1 - (1 - alpha)^n so the first samples are not pulled toward zero). A sample is
    a cell's compute seconds per micro-batch in one step (link waits left out, emulated
    slowdown in). Every cell feeds it the same table in the same order, so every cell holds
    the same weights: plain Python floats, no threads, nothing timed here."""

    def __init__(self, stages: int, replicas: int,
                 given: Sequence[Sequence[float]] | None = None, alpha: float = 0.1,
                 layout: Sequence[Sequence[int]] | None = None) -> None:
        self.alpha = alpha
        self.layout = layout  # each stage's cell ids (None: all ``replicas``, every stage)
        # (a layout's given rows may name more ids than it has: a grid's, around a move)
        self.given = [list(map(float, row[:replicas])) for row in given] \
            if given is not None else [[1.0] * replicas for _ in range(stages)]
        self.ema = [[0.0] * replicas for _ in range(stages)]
        self.updates = [[0] * replicas for _ in range(stages)]

    def update(self, seconds: Sequence[Sequence[float]]) -> None:
        """One step's seconds per micro-batch by stage and replica (NaN or <= 0: no sample)."""
        a = self.alpha
        for k, row in enumerate(seconds):
            for r, x in enumerate(row):
                if not x > 0:  # (NaN too: a cell that ran nothing says nothing)
                    continue
                self.ema[k][r] = a * x + (1 - a) * self.ema[k][r]
                self.updates[k][r] += 1

    def weights(self, members: Sequence[int] | None = None) -> list[list[float]]:
        """Per stage, each replica's micro-batches per second; the given weights for a stage
        until each of its replicas (of ``members``, where some left) has a sample (the
        scales differ). A replica that left keeps its given weight: no plan deals to it."""
        out = []
        for k, row in enumerate(self.ema):
            ids = range(len(self.given[k])) if self.layout is None else self.layout[k]
            live = [r for r in ids if members is None or r in members]
            if min(self.updates[k][r] for r in live) == 0:
                out.append(list(self.given[k]))
                continue
            out.append([(1 - (1 - self.alpha) ** n) / e if n else g
                        for e, n, g in zip(row, self.updates[k], self.given[k], strict=True)])
        return out


    def measured(self, layout: Sequence[Sequence[int]]) -> list[dict[int, float]] | None:
        """Per stage, each of its cells' measured micro-batches per second (by id); None
        until every cell of ``layout`` has a sample (a rebalancing decision waits for it).
        (What the rule reads; ``carried`` reads ``_speeds``, the estimate itself.)"""
        return self._speeds(layout)

    def _speeds(self, layout: Sequence[Sequence[int]]) -> list[dict[int, float]] | None:
        if any(self.updates[k][r] == 0 for k, ids in enumerate(layout) for r in ids):
            return None
        a = self.alpha
        return [{r: (1 - (1 - a) ** self.updates[k][r]) / self.ema[k][r] for r in ids}
                for k, ids in enumerate(layout)]

    def kept(self, after: Sequence[Sequence[int]] | None, shares: int,
             arrived: tuple[int, int] | None = None) -> ThroughputEstimate:
        """The estimate under the layout ``after``: every cell of it keeps its samples and its
        prior (``arrived``, a cell new there, has neither: see ``carried``); cells it lacks
        are gone (a cell-wise departure)."""
        out = ThroughputEstimate(len(self.ema), slot_count(after, shares), None, self.alpha,
                                 after)
        for k in range(len(self.ema)):
            for r in stage_ids(after, k, shares):
                if (k, r) != arrived and r < len(self.ema[k]):
                    out.given[k][r] = self.given[k][r]
                    out.ema[k][r], out.updates[k][r] = self.ema[k][r], self.updates[k][r]
        return out

    def carried(self, peer: tuple[int, int, int, int],
                after: Sequence[Sequence[int]] | None, shares: int) -> ThroughputEstimate:
        """The estimate under the layout ``after`` that a peer's move (source, cell, target,
        new id) makes: a peer's speed is the peer's, so every cell that stays keeps its
        samples, and the moved peer's speed goes with it, scaled as the rebalancing rule
        predicts it (``contract.rebalance.choose_move``: by the ratio of the two stages'
        fastest cells) and counted as one sample, so its first own sample there weighs about
        as much (``measured`` counts it as one too). Without it the stage it joins would be
        dealt equally until every cell had a sample: a step at the pace of its slowest cell
        (``weights``). Where some cell of the job had no sample yet, the peer comes with
        none. The given weights (measured routes' prior) go alike, unscaled."""
        source, cell, target, new_id = peer
        before = [range(len(row)) if self.layout is None else self.layout[k]
                  for k, row in enumerate(self.ema)]
        out = self.kept(after, shares, arrived=(target, new_id))
        out.given[target][new_id] = self.given[source][cell]
        speeds = self._speeds(before)
        if speeds is not None:
            speed = speeds[source][cell] * max(speeds[target].values()) \
                / max(speeds[source].values())
            out.ema[target][new_id], out.updates[target][new_id] = self.alpha / speed, 1
        return out


def runs(plan: Plan, stage: int, replica: int) -> list[int]:
    """The micro-batches cell (stage, replica) runs this step, in order."""
    return [g for g, r in enumerate(plan[stage]) if r == replica]


class RoutedStep:
    """One routed cell's step: the micro-batches the plan gives it, in what order it runs
    them, and which replica either side each comes from and goes to."""

    def __init__(self, plan: Plan, stage: int, replica: int, micro_batches: int) -> None:
        self.plan, self.stage, self.replica = plan, stage, replica
        # In one order every cell shares: the replicas' shares interleaved (each replica's
        # first micro-batch, then each one's second...), the order stage 0's replicas make
        # them in side by side, so a routed cell starts on whichever comes first.
        self.mine = sorted(runs(plan, stage, replica), key=lambda g: arrival(g, micro_batches))

    @property
    def first(self) -> int:
        """The micro-batch whose frames measure the step's codec error."""
        return self.mine[0]

    def ops(self) -> list[tuple[str, int]]:
        """Its forwards in the shared order, then their backwards in reverse: GPipe's order,
        in which every cell's frames of a kind arrive in the order their senders send them,
        so no two cells wait on each other."""
        return [("F", g) for g in self.mine] + [("B", g) for g in reversed(self.mine)]

    def neighbour(self, g: int, up: bool) -> int:
        """The replica of the stage before (``up``) or after that runs micro-batch ``g``."""
        return self.plan[self.stage - 1 if up else self.stage + 1][g]

    def pieces(self, windows: Any, replicas: int, micro_batches: int) -> dict[int, Any]:
        """Its micro-batches of the step's whole batch of ``windows`` (a tensor), by global
        index g: replica g // M's share, its (g % M)-th piece."""
        chunks = windows.chunk(replicas * micro_batches)
        return {g: chunks[g] for g in self.mine}
