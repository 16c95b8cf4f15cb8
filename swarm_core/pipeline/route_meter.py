"""Measured routing's part in a routed cell's step (``topology.routing: measured``).

SWARM deals each micro-batch by the next stage's peers' measured throughput. Every cell must
deal the same plan, so every cell must hold the same measurements: each step, a cell times
its own compute per micro-batch; its group's ring confirmation carries each member's time
round the group (``ring.confirm_telling``), and the chain's gradient-norm exchange then
carries each stage's row up the pipe and the whole table back down (:func:`chain_table`).
After step t every cell holds the same table and feeds it to the same estimate, so step t+1's
plan is the same everywhere, with no frame saying where a micro-batch goes.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from swarm_core.contract.placement import slot_count
from swarm_core.pipeline.frames import Kind
from swarm_core.pipeline.layout import RELAY_FRAME, Layout, NormRelay
from swarm_core.pipeline.routing import ThroughputEstimate
from swarm_core.pipeline.transport import PeerLink

if TYPE_CHECKING:
    from swarm_core.pipeline.stage import StageSpec


def chain_table(local: float, row: Sequence[float], stage: int, stages: int,
                up: PeerLink | None, down: PeerLink | None, step: int, timeout: float,
                relay: NormRelay | None = None) -> tuple[float, list[list[float]]]:
    """A chain's sum of ``local`` over its stages (up the pipe, each stage adding its own to
    what came from below, then the total back down), with a table going along: each stage
    puts its ``row`` in on the way up, and the whole table comes back down with the total.
    Returns the total and the table by stage. An empty row is the plain sum
    (``chain_sq_sum``): one float64 a frame. ``relay``: a layout's cell without a whole
    chain hears both from id 0's chain, which tells it (``pipeline/layout.NormRelay``)."""
    width = len(row)
    count = 1 + stages * width
    if relay is not None and relay.source is not None:
        buf = relay.source.recv_floats(Kind.NORM, step, RELAY_FRAME, timeout, count)
        return buf[0], [buf[1 + k * width:1 + (k + 1) * width] for k in range(stages)]
    buf = [0.0] + [math.nan] * (stages * width) if down is None else \
        down.recv_floats(Kind.NORM, step, 0, timeout, count)
    buf[0] = local + buf[0]
    buf[1 + stage * width:1 + (stage + 1) * width] = [float(x) for x in row]
    if up is not None:
        up.send_floats(Kind.NORM, step, 0, buf)
        buf = up.recv_floats(Kind.NORM, step, 1, timeout, count)
    if down is not None:
        down.send_floats(Kind.NORM, step, 1, buf)
    if relay is not None:
        relay.send(step, buf)
    return buf[0], [buf[1 + k * width:1 + (k + 1) * width] for k in range(stages)]


class RouteMeter:
    """A routed cell's measured throughput: what it tells, what it learns, the weights it
    deals by."""

    def __init__(self, stage: int, stages: int, replicas: int,
                 given: Sequence[Sequence[float]] | None, layout: Layout | None = None) -> None:
        # (under a layout, rows are by cell id: as wide as the ids the job names)
        self.stage, self.stages, self.replicas = stage, stages, slot_count(layout, replicas)
        self.estimate = ThroughputEstimate(stages, self.replicas, given, layout=layout)
        self.row: list[float] = [math.nan] * self.replicas  # its group's, once confirmed

    @classmethod
    def of(cls, spec: StageSpec, estimate: ThroughputEstimate | None = None) -> RouteMeter:
        """A meter for a cell: fresh (at its start, and where every cell starts afresh), or
        holding ``estimate`` (a copy: one every cell computed alike, see ``move``)."""
        meter = cls(spec.stage, spec.num_stages, spec.replicas, spec.route_weights, spec.layout)
        if estimate is not None:
            meter.estimate = copy.deepcopy(estimate)
        return meter

    def under(self, spec: StageSpec) -> RouteMeter:
        """This meter for ``spec``'s layout, which some cells left (a cell-wise departure):
        each cell that stays keeps its samples and its group's figure; the prior is the
        job's."""
        out = RouteMeter.of(spec, self.estimate.kept(spec.layout, spec.replicas))
        for r in spec.ids(spec.stage):
            if r < len(self.row):
                out.row[r] = self.row[r]
        return out

    def weights(self, members: Sequence[int] | None = None) -> list[list[float]]:
        return self.estimate.weights(members)

    @staticmethod
    def per_micro_batch(busy: float, ran: int) -> float:
        """A step's sample: compute seconds per micro-batch (NaN where it ran none)."""
        return busy / ran if ran > 0 else math.nan

    def heard(self, told: Sequence[float] | None, members: Sequence[int]) -> None:
        """Its group's figures as confirmed (by rank on the ring), kept by replica."""
        self.row = [math.nan] * self.replicas
        for rank, value in enumerate(told or ()):
            self.row[members[rank]] = value

    def exchange(self, local: float, up: PeerLink | None, down: PeerLink | None, step: int,
                 timeout: float, relay: NormRelay | None = None) -> float:
        """The chain's sum of ``local`` (as ``chain_sq_sum``), the table learnt on the way
        and fed to the estimate."""
        total, table = chain_table(local, self.row, self.stage, self.stages, up, down, step,
                                   timeout, relay)
        self.estimate.update(table)
        return total
