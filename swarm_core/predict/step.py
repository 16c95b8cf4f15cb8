"""The step time a run should take, and which link holds it back.

The model (written down in ``docs/decisions.md``, "A predictor of the step"):

* compute: the schedule's critical path over each stage's measured forward, backward and
  optimiser times, transfers taken as free (``critical_path``): C;
* each shaped link (a fellow's tx or rx bucket today) carries B bytes a step and takes
  L + 8B/R (``network.Link.seconds``): T_link;
* **perfect overlap**: every transfer hides behind compute and behind the other links, so
  ``step_seconds = max(C, max T_link)``. It is how Streaming DiLoCo's utilisation-vs-
  bandwidth analysis credits communication overlapped with compute, what this data plane
  aims at (sends are queued, a stage computes the next micro-batch while the last one
  leaves, the replicas' rings run on threads of their own) and the bound issue 40's target
  names; a lower bound of the real step, which also pays the fill and drain a link cannot
  overlap. ``step_seconds_no_overlap = C + max T_link`` is the other end: compute, then
  communication, as the DiLoCo scaling-law paper's wall-clock estimate adds them (arXiv
  2503.09799, appendix A).
* ``step_seconds_simulated``: the schedule played out with each frame queued on its sender's
  link (``critical_path.simulate_step``), so the link idles where the schedule leaves it idle:
  before the first activation and after the last gradient (about (M+1)/M of the link's time
  with two stages), and under 1F1B wherever a stage waits for a gradient before its next
  forward (which can take it past ``no_overlap``); never below perfect overlap. Its ring
  bytes are only in the perfect-overlap floor.

Utilisation is compute over the step: a stage's own compute (M (f + b) + its optimiser), and
the run's C / step. The bandwidth a link needs for a utilisation u is the one at which its
time equals C / u: R = 8B / (C/u - L); none where its latency alone is longer than C / u.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.pipeline.wire_math import link_bytes
from swarm_core.predict.critical_path import (
    Hop,
    StageTimes,
    compute_critical_path,
    simulate_step,
)
from swarm_core.predict.network import Network
from swarm_core.predict.traffic import LinkLoad, link_loads, step_flows

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
    step_seconds: float  # perfect overlap
    step_seconds_no_overlap: float
    step_seconds_simulated: float
    bound_by: str  # a link's name, or "compute"
    stages: list[StagePrediction]
    links: list[LinkPrediction]

    @property
    def utilisation(self) -> float:
        return self.compute_seconds / self.step_seconds if self.step_seconds > 0 else 1.0


def mbps_for(utilisation: float, compute_s: float, nbytes: float, latency_s: float
             ) -> float | None:
    """Mbit/s at which a link of ``nbytes`` a step and ``latency_s`` takes C / u (so bounds
    the step at utilisation u); None if no rate is enough (its latency alone is longer)."""
    if nbytes <= 0:
        return 0.0
    room = compute_s / utilisation - latency_s
    return 8 * nbytes / room / 1e6 if room > 0 else None


def predict(shape: RunShape, times: Sequence[StageTimes],
            sync_bytes: Sequence[float] = ()) -> Prediction:
    """The run's step at perfect overlap, from each stage's measured ``times`` (its slowest
    replica's: all run alike on one machine) and each stage's ring bytes a step."""
    if len(times) != shape.stages:
        raise ValueError(f"{len(times)} stage timings for {shape.stages} stages")
    t = shape.training
    compute = compute_critical_path(t.schedule, times, t.micro_batches, t.grad_clip > 0)
    loads = link_loads(step_flows(shape.model, t, shape.stages, shape.replicas, sync_bytes),
                       shape.network, shape.replicas)
    busiest: LinkLoad | None = max(loads, key=lambda x: x.seconds, default=None)
    link_s = busiest.seconds if busiest is not None else 0.0
    step = max(compute, link_s)
    bound = busiest if busiest is not None and link_s > compute else None
    links = [LinkPrediction(
        name=x.name, nbytes=x.nbytes, seconds=x.seconds, bound=x is bound, mbps=x.link.mbps,
        latency_s=x.link.latency_s, carries=x.carries,
        mbps_for={f"{u * 100:g}": mbps_for(u, compute, x.nbytes, x.link.latency_s)
                  for u in UTILISATIONS}) for x in loads]
    simulated = simulate_step(t.schedule, times, t.micro_batches, t.grad_clip > 0,
                              _frame_hop(shape))
    stages = [StagePrediction(s, st.per_step(t.micro_batches),
                              st.per_step(t.micro_batches) / step if step > 0 else 1.0)
              for s, st in enumerate(times)]
    return Prediction(run=shape.name, network=shape.network.name, schedule=t.schedule,
                      compute_seconds=compute, step_seconds=step,
                      step_seconds_no_overlap=compute + link_s,
                      step_seconds_simulated=max(simulated, step),
                      bound_by=bound.name if bound is not None else "compute",
                      stages=stages, links=links)


def _frame_hop(shape: RunShape) -> Hop:
    """One micro-batch's frame from stage s (replica 0's chain) to its neighbour: its seconds
    on the slowest of the sender's tx, the receiver's rx and the pair's own cap, and the
    pair's latency."""
    net, m = shape.network, shape.training.micro_batches

    def hop(stage: int, kind: str) -> tuple[float, float]:
        src, dst = (stage, 0), (stage + 1 if kind == "F" else stage - 1, 0)
        rates = [x.mbps for x in (net.tx(src), net.rx(dst), net.pair(src, dst))
                 if x.mbps is not None]
        frame = link_bytes(shape.model, shape.training, src, dst, shape.stages,
                           shape.replicas) / m
        busy = 8 * frame / (min(rates) * 1e6) if rates else 0.0
        return busy, max(net.tx(src).latency_s, net.pair(src, dst).latency_s)

    return hop
