"""A swarm-wired job's layout (issue 34 point 3, the ground SWARM's rebalancing stands on):
which cells each stage has, when its stages need not have the same number of them.

A job's batch is ``replicas`` data shares of ``micro_batches`` micro-batches each (R x M),
fixed by the job. Its **layout** lists, per stage, the sorted ids of the stage's cells (its
slots): by default every stage has ids 0..R-1, one cell per share. A stage may have fewer
(ids a subset of 0..R-1) or more (ids R, R+1, ... that exist at that stage only); every
stage has id 0, whose chain evaluates and checkpoints as a uniform job's replica 0 does.
A cell's id says which cells of the stages either side it has a chain link to (the same id);
otherwise it is a name.

Under a layout other than the uniform one:

* routes: every stage deals all R x M micro-batches to its cells by the route weights
  (``routing.route_plan``), stage 0 included, even where its ids are the shares';
* the gradient mean: a stage group sums its members' gradients and divides by the job's
  shares (R), not by its member count: each of the step's micro-batches was run by one cell
  of each stage, so the group's sum is the whole batch's, whatever the number of cells
  (``Ring.divisor``);
* the per-step NORM exchange (clipping's global norm, measured routes' table): see
  :class:`NormRelay`.

Only ``sync.mode: dp`` is allowed: the divisor above is dp's mean; a periodic sync's
replicas train apart, which routed micro-batches already rule out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from swarm_core.contract.job import route_weights_error
from swarm_core.contract.placement import (  # (torch-free, for the leader too)
    Layout,
    complete,
    normal_layout,
)
from swarm_core.pipeline.frames import Kind
from swarm_core.pipeline.transport import PeerLink

if TYPE_CHECKING:
    from swarm_core.pipeline.stage import StageLinks, StageSpec


def check_layout(layout: Sequence[Sequence[int]], stages: int, shares: int,
                 sync_mode: str = "dp", wiring: str = "swarm") -> Layout | None:
    """A layout as the job runs it: None where it is the uniform one (every stage the
    shares' ids: today's job, frame for frame). Raises ValueError naming what is wrong: its
    shape by ``contract.placement.normal_layout`` (the leader checks a job's by it too)."""
    out = normal_layout(layout, stages, shares)  # (PlacementError: a ValueError, one line)
    if out is None:
        return None
    if wiring != "swarm":
        raise ValueError("layout: stages of unequal cells need wiring swarm")
    if sync_mode != "dp":
        raise ValueError(f"layout: stages of unequal cells need sync.mode dp, not {sync_mode}")
    return out


def check_weights(weights: Sequence[Sequence[float]] | None, stages: int, width: int) -> None:
    """A layout's route weights are by id: one row a stage, one weight an id it names (a
    stage's own ids are read; the rest fill the row). Raises ValueError otherwise."""
    why = None if weights is None else route_weights_error(weights, stages, width, "by cell id")
    if why is not None:
        raise ValueError(f"route_weights: {why}")



def ring_neighbours(spec: StageSpec, members: Sequence[int]) -> tuple[int, int]:
    """The members before and after ``spec``'s cell round its group's ring."""
    rank, n = list(members).index(spec.replica), len(members)
    return members[(rank - 1) % n], members[(rank + 1) % n]


def hears_norm(spec: StageSpec, peer: int) -> bool:
    """Whether the route link to ``peer`` of the stage either side carries this cell's NORM
    relay (see :class:`NormRelay`): an incomplete cell's link to id 0."""
    return peer == 0 and not complete(spec.layout, spec.replica)


@attrs.define
class NormRelay:
    """How a cell without a whole chain takes part in the per-step NORM exchange.

    The rule: every whole chain (an id with a cell at every stage; id 0's always is) runs the
    exchange along its own chain links as a uniform job does; a cell whose id misses some
    stage runs none and hears the result (the total and the table) from id 0's cell of the
    stage before (stage 0's: of stage 1), over the route link it has to it anyway; each id-0
    cell tells those of its neighbours, after its own chain's exchange. Why this is right:
    after dp's mean every member of a stage group holds the same gradients (the same bytes)
    and the same confirmed row of measured times, so any whole chain's sum is every chain's,
    and the relay adds no link. Why this rule: it keeps a uniform job's frames as they are
    (no relay), needs no new ring round, and each incomplete cell waits on one frame."""

    source: PeerLink | None = None  # an incomplete cell: where the result comes from
    sinks: list[PeerLink] = attrs.field(factory=list)  # an id-0 cell: whom it tells

    def send(self, step: int, buf: list[float]) -> None:
        for link in self.sinks:
            link.send_floats(Kind.NORM, step, RELAY_FRAME, buf)


RELAY_FRAME = 2  # its frames' number (the chain's own are 0, up, and 1, down)


def norm_relay(spec: StageSpec, links: StageLinks) -> NormRelay | None:
    """The cell's part in relaying the NORM exchange's result (None: a uniform job's, or a
    whole chain's cell with no incomplete neighbour to tell)."""
    layout, k = spec.layout, spec.stage
    if layout is None:
        return None
    if not complete(layout, spec.replica):
        return NormRelay(source=links.ups[0] if k > 0 else links.downs[0])
    if spec.replica != 0:
        return None
    sinks = [links.downs[r] for r in layout[k + 1] if not complete(layout, r)] \
        if k + 1 < spec.num_stages else []
    if k == 1:
        sinks += [links.ups[r] for r in layout[0] if not complete(layout, r)]
    return NormRelay(sinks=sinks) if sinks else None
