"""The step time a run should take, and what holds it back.

The model (written down in ``docs/decisions.md``, "A predictor of the step"):

* compute: the schedule's critical path over each stage's measured forward, backward and
  optimiser times, transfers taken as free (``critical_path``): C;
* each shaped link (a fellow's tx or rx bucket today) carries B bytes a step and takes
  L + 8B/R (``network.Link.seconds``): T_link;
* ``step_seconds``, **the predicted step**: the schedule played out with each frame queued on
  its sender's link and arriving a latency later (``critical_path.simulate_step``), so the
  link idles where the schedule leaves it idle (before the first activation and after the
  last gradient: about (M+1)/M of the link's time with two stages; under 1F1B wherever a
  stage waits for a gradient before its next forward, which can take it past
  ``no_overlap``), and every hop of the schedule pays its latency; never below perfect
  overlap (its ring bytes are only in that floor). Over the scenario library it is within
  15 % of the measured step in 14 of 16 runs, where perfect overlap misses 12 of 16 by
  1.45-4.99x (``docs/decisions.md``, "The predictor over the scenario library").
* ``step_seconds_overlap``: **perfect overlap**, ``max(C, max T_link)``, the bound a perfect
  overlap of compute and transfer would reach: every transfer hidden behind compute and
  behind the other links, one latency a link. It is how Streaming DiLoCo's utilisation-vs-
  bandwidth analysis credits communication overlapped with compute and the bound issue 40's
  target names; a lower bound of the predicted step. ``step_seconds_no_overlap = C + max
  T_link`` is the other end: compute, then communication, as the DiLoCo scaling-law paper's
  wall-clock estimate adds them (arXiv 2503.09799, appendix A).
* ``latency_seconds``: what the links' latencies add to the predicted step, the step
  predicted again with every latency 0 taken from it.
* Stages that share one machine (``RunShape.cores``, as a local cluster runs them) and
  outnumber its cores: each op also waits for a core, in C and the played-out step alike
  (``critical_path.simulate_chains``: every chain where there are several); the calibration
  measures each stage alone.
* A swarm-wired run (or a layout) is played out cell by cell (``predict/routed``): each
  stage's deal by ``route_plan``, each cell's ops in its own order, its frames over the pairs
  the plan routes them; emulated slowdowns (``RunShape.slowdowns``) pace a cell's ops.

Utilisation is compute over the predicted step: a stage's own compute (M (f + b) + its
optimiser), and the run's C / step. The bandwidth a link needs for a utilisation u is an
analytic perfect-overlap figure: the rate at which its time equals C / u, R = 8B / (C/u - L);
none where its latency alone is longer than C / u (``mbps_for``).

What bounds the step (``bound_by``, ``bound_kind``): "latency" where the latencies add more to
the predicted step (``latency_seconds``) than the compute path takes (C) and than any link's
bytes take at its rate (8B/R). Each of the three is what the step would keep of that cause
with the others free: C and 8B/R are floors of their own, and what latency adds is what the
step loses without it; so "latency" says the step waits on its hops more than on compute or
on any rate, which more bandwidth cannot shorten. It names the pipeline boundary whose
latency alone adds the most (the step predicted again with only that boundary's latency, both
ways, at 0; replica 0's chain, as played out), where one boundary stands out (a uniform
chain's tie, and a ring's latency is in no boundary: just "latency"). Otherwise, as perfect
overlap has it: the busiest link where its time exceeds C, else "compute".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract.placement import slot_count, stage_ids
from swarm_core.pipeline.wire_math import link_bytes
from swarm_core.predict.critical_path import StageTimes, simulate_chains
from swarm_core.predict.network import Link, MatrixNetwork, Network
from swarm_core.predict.routed import RoutedRun, route_weights
from swarm_core.predict.traffic import LinkLoad, link_loads, routed_flows, step_flows

UTILISATIONS = (0.5, 0.9, 0.99)


@attrs.frozen
class RunShape:
    """What a prediction needs to know of a run besides the machine's speed."""

    name: str
    model: ModelConfig
    training: TrainingConfig
    stages: int
    replicas: int
    network: Network
    # Where every stage runs on one machine: its CPU cores (None: each stage a machine of its
    # own, as the calibration measured it).
    cores: int | None = None
    # ``swarm``: micro-batches routed between the stages' replicas, each step in GPipe's
    # order whatever the training's schedule (``pipeline/routing.RoutedStep.ops``), each
    # stage dealing the step's R x M by ``route_weights`` (by replica; None: equal) or, with
    # ``routing`` "measured", by its cells' speeds (``predict/routed``).
    wiring: str = "chain"
    route_weights: tuple[tuple[float, ...], ...] | None = attrs.field(
        default=None, converter=lambda w: None if w is None else tuple(map(tuple, w)))
    routing: str = "given"
    # Emulated slowdowns (``swarm set-speed --slowdown``), (stage, replica, factor) each: the
    # cell's forwards and backwards take that many times the stage's measured time.
    slowdowns: tuple[tuple[int, int, float], ...] = ()
    # A swarm layout (``pipeline/layout``): each stage's cell ids, ``replicas`` its shares;
    # None: the grid. Every stage deals its shares' micro-batches to its own cells.
    layout: tuple[tuple[int, ...], ...] | None = attrs.field(
        default=None, converter=lambda w: None if w is None else tuple(map(tuple, w)))
    # SWARM's rebalancing (``topology.rebalance_every``): a look every that many steps
    # (``predict/rebalance`` plays the moves its rule makes).
    rebalance_every: int | None = None

    def ids(self, stage: int) -> list[int]:
        """The ids of a stage's cells (the grid's replicas without a layout)."""
        return stage_ids(self.layout, stage, self.replicas)

    @property
    def placed(self) -> MatrixNetwork | None:
        """The cells' sites where the matrix's rule does not give them (a moved peer's)."""
        return self.network if isinstance(self.network, MatrixNetwork) else None

    @property
    def slowed(self) -> dict[tuple[int, int], float]:
        return {(s, r): x for s, r, x in self.slowdowns}

    @property
    def schedule(self) -> str:
        """The order the run's stages take their ops in."""
        return "gpipe" if self.wiring == "swarm" else self.training.schedule

    @property
    def ops_at_once(self) -> int | None:
        """How many ops the shared machine runs at once (each on the stage's torch threads)."""
        return None if self.cores is None else max(1, self.cores // self.training.threads)


@attrs.frozen
class LinkPrediction:
    name: str
    nbytes: float
    seconds: float
    bound: bool
    mbps: float | None
    latency_s: float
    carries: tuple[str, ...]
    mbps_for: dict[str, float | None]


@attrs.frozen
class StagePrediction:
    stage: int
    compute_seconds: float
    utilisation: float


@attrs.frozen
class Prediction:
    run: str
    network: str
    schedule: str
    compute_seconds: float  # C: the compute critical path
    step_seconds: float  # the predicted step: the schedule played out (>= perfect overlap)
    step_seconds_overlap: float  # the bound a perfect overlap of compute and transfer reaches
    step_seconds_no_overlap: float
    latency_seconds: float  # what the links' latencies add to step_seconds
    bound_by: str  # "compute", a link's name, "latency" or "latency stage a ↔ stage b"
    bound_kind: str  # "compute", "link" or "latency"
    stages: list[StagePrediction]
    links: list[LinkPrediction]
    # A routed run's deal: per stage, each cell's micro-batches a step (empty for a chain).
    deals: list[dict[int, float]] = attrs.field(factory=list)

    @property
    def utilisation(self) -> float:
        """C over the predicted step."""
        return self.compute_seconds / self.step_seconds if self.step_seconds > 0 else 1.0


def mbps_for(utilisation: float, compute_s: float, nbytes: float, latency_s: float
             ) -> float | None:
    """Mbit/s at which a link of ``nbytes`` a step and ``latency_s`` takes C / u, so that at
    perfect overlap it bounds the step at utilisation u; None if no rate is enough (its
    latency alone is longer). An analytic perfect-overlap figure, not the predicted step's:
    the schedule's fill and per-hop latencies (which no rate removes) come on top of it."""
    if nbytes <= 0:
        return 0.0
    room = compute_s / utilisation - latency_s
    return 8 * nbytes / room / 1e6 if room > 0 else None


def predict(shape: RunShape, times: Sequence[StageTimes],
            sync_bytes: Sequence[float] = ()) -> Prediction:
    """The run's predicted step (the schedule played out) beside its perfect-overlap bound,
    from each stage's measured ``times`` (its slowest replica's: all run alike on one
    machine) and each stage's ring bytes a step."""
    if len(times) != shape.stages:
        raise ValueError(f"{len(times)} stage timings for {shape.stages} stages")
    t = shape.training
    cores = shape.ops_at_once
    schedule = shape.schedule
    clipped = t.grad_clip > 0
    hop = _frame_hop(shape)
    routed = _routed(shape, times)
    chains = _chain_times(shape, times)
    played: Callable[[FrameHop | None], float]
    if routed is not None:
        played = routed.step
        per_stage = routed.compute()
    else:
        def played(over: FrameHop | None) -> float:
            return simulate_chains(schedule, chains, t.micro_batches, clipped, over, cores)

        per_stage = [max(ts[s].per_step(t.micro_batches) for ts in chains)
                     for s in range(shape.stages)]
    compute = played(None)
    flows = step_flows(shape.model, t, shape.stages, shape.replicas, sync_bytes) \
        if routed is None else routed_flows(shape.model, t, routed.plans, sync_bytes,
                                            shape.routing == "measured",
                                            [shape.ids(s) for s in range(shape.stages)],
                                            shape.placed)
    loads = link_loads(flows, shape.network, slot_count(shape.layout, shape.replicas))
    busiest: LinkLoad | None = max(loads, key=lambda x: x.seconds, default=None)
    link_s = busiest.seconds if busiest is not None else 0.0
    overlap = max(compute, link_s)
    simulated = played(hop)
    step = max(simulated, overlap)
    # The predicted step again with every latency 0 (the links' bytes at their rates alone):
    # what it loses is what the latencies add.
    transfer = max((Link(x.link.mbps).seconds(x.nbytes) for x in loads), default=0.0)
    latency = max(0.0, step - max(played(_without_latency(hop)), compute, transfer))
    kind = "latency" if latency > max(compute, transfer) else \
        "link" if busiest is not None and link_s > compute else "compute"
    bound = busiest if kind == "link" else None
    links = [LinkPrediction(
        name=x.name, nbytes=x.nbytes, seconds=x.seconds, bound=x is bound, mbps=x.link.mbps,
        latency_s=x.link.latency_s, carries=x.carries,
        mbps_for={f"{u * 100:g}": mbps_for(u, compute, x.nbytes, x.link.latency_s)
                  for u in UTILISATIONS}) for x in loads]
    stages = [StagePrediction(s, busy, busy / step if step > 0 else 1.0)
              for s, busy in enumerate(per_stage)]
    bound_by = bound.name if bound is not None else "compute"
    if kind == "latency":
        bound_by = _latency_boundary(shape.stages, step, overlap, hop, played)
    return Prediction(run=shape.name, network=shape.network.name, schedule=schedule,
                      compute_seconds=compute, step_seconds=step,
                      step_seconds_overlap=overlap, step_seconds_no_overlap=compute + link_s,
                      latency_seconds=latency, bound_by=bound_by, bound_kind=kind,
                      stages=stages, links=links,
                      deals=[] if routed is None else routed.dealt())


def _routed(shape: RunShape, times: Sequence[StageTimes]) -> RoutedRun | None:
    """A swarm-wired run of several cells a stage (or a layout), played out cell by cell;
    None for a chain."""
    if shape.wiring != "swarm" or (shape.replicas < 2 and shape.layout is None):
        return None
    t = shape.training
    weights = route_weights(shape.stages, slot_count(shape.layout, shape.replicas),
                            shape.routing, shape.route_weights, shape.slowed)
    # (measured routes run the chain's norm exchange every step, clipping or not: every
    # cell waits for it before its optimiser step)
    synced = t.grad_clip > 0 or shape.routing == "measured"
    return RoutedRun.of(t.seed, shape.stages, shape.replicas, t.micro_batches, times,
                        weights, shape.slowed, synced, shape.ops_at_once, shape.layout)


def _chain_times(shape: RunShape, times: Sequence[StageTimes]) -> list[list[StageTimes]]:
    """Each chain's stage times, its cells' slowdowns in them; a dp step waits for the
    slowest chain. One chain where none is slowed and each cell has a machine of its own
    (the chains run alike); every chain where they share cores (they compete for them)."""
    if not shape.slowdowns and (shape.ops_at_once is None or shape.replicas == 1):
        return [list(times)]
    slowed = shape.slowed
    return [[attrs.evolve(st, pace=slowed.get((s, r), 1.0)) for s, st in enumerate(times)]
            for r in range(shape.replicas)]


# A frame's hop (``critical_path.Hop`` for a chain, ``routed.CellHop`` between cells).
FrameHop = Callable[..., tuple[float, float]]


def _without_latency(hop: FrameHop, boundary: int | None = None) -> FrameHop:
    """``hop`` with no latency: on every frame, or only on those across ``boundary`` (between
    stages b and b + 1, both ways)."""

    def quick(stage: int, kind: str, *cells: int) -> tuple[float, float]:
        busy, latency = hop(stage, kind, *cells)
        across = stage - (kind == "B")  # (a gradient from b + 1 crosses boundary b)
        return busy, (0.0 if boundary is None or across == boundary else latency)

    return quick


def _latency_boundary(stages: int, step: float, floor: float, hop: FrameHop,
                      played: Callable[[FrameHop | None], float]) -> str:
    """"latency", and the boundary whose latency alone adds the most to the predicted
    ``step`` (the schedule played again with that boundary's latency 0, both ways, over the
    perfect-overlap ``floor``), where one adds more than every other (a uniform chain's
    boundaries tie, and a ring's latency is in no boundary: just "latency")."""
    adds = [step - max(played(_without_latency(hop, b)), floor) for b in range(stages - 1)]
    if not adds or max(adds) <= 0:
        return "latency"
    best = max(adds)
    tops = [b for b, x in enumerate(adds) if x >= best - 1e-9 * max(step, 1e-12)]
    return f"latency stage {tops[0]} ↔ stage {tops[0] + 1}" if len(tops) == 1 else "latency"


def _frame_hop(shape: RunShape) -> FrameHop:
    """One micro-batch's frame from stage s's cell ``src`` (a chain's: replica 0's) to its
    neighbour's cell ``dst``: its seconds on the slowest of the sender's tx, the receiver's rx
    and the pair's own cap, and the pair's latency."""
    net, m = shape.network, shape.training.micro_batches

    def hop(stage: int, kind: str, src_id: int = 0, dst_id: int = 0) -> tuple[float, float]:
        src = (stage, src_id)
        dst = (stage + 1 if kind == "F" else stage - 1, dst_id)
        rates = [x.mbps for x in (net.tx(src), net.rx(dst), net.pair(src, dst))
                 if x.mbps is not None]
        frame = link_bytes(shape.model, shape.training, src, dst, shape.stages,
                           shape.replicas, placed=shape.placed) / m
        busy = 8 * frame / (min(rates) * 1e6) if rates else 0.0
        return busy, max(net.tx(src).latency_s, net.pair(src, dst).latency_s)

    return hop
