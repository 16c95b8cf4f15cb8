"""The START a stage receives: its job, its place in the placement, the job key and attempt.

The leader builds these with :func:`stage_starts` (one per stage; a fellow with several device
slots gets one for each) and the fellow structures the signal's payload back into a
:class:`StageStart` once, where it arrives. Tests build theirs through the same function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract.job import (
    JobKind,
    JobSubmit,
    SmokeTraining,
    Topology,
    kind_parts,
    register_kind_hooks,
)
from swarm_core.contract.membership import RegroupOrder
from swarm_core.contract.placement import (
    FellowSlots,
    Placement,
    StagePlacement,
    plan,
)
from swarm_core.contract.rebalance import PeerMove
from swarm_core.protocol import split_host_port
from swarm_core.schema import FieldError, checking, converter, lenient_converter


@attrs.define
class StageStart:
    """Run replica ``replica`` of stage ``stage`` of job ``job_id`` (attempt ``attempt``, from
    ``resume_step``)."""

    job_id: str
    kind: JobKind
    name: str
    stage: int
    num_stages: int
    placement: Placement
    key: str  # the data plane admits only connections that present it
    model: ModelConfig | None = None
    training: TrainingConfig | SmokeTraining | None = None
    attempt: int = 0
    resume_step: int = 0
    replica: int = 0
    # A replica that joins a running job: the membership it joins (it takes its state from
    # the order's donor, at the group's next operation boundary).
    join: RegroupOrder | None = None
    # How micro-batches travel (the job's topology.wiring) and a swarm route's weights.
    wiring: Literal["chain", "swarm"] = "chain"
    route_weights: list[list[float]] | None = None
    routing: Literal["given", "measured"] = "given"
    # Peers moved between stages (a swarm layout job's): given in advance, or decided in band
    # every ``rebalance_every`` steps (measured routes).
    moves: list[PeerMove] | None = None
    rebalance_every: int | None = None

    def __attrs_post_init__(self) -> None:
        self.model, self.training = kind_parts(self.kind, self.model, self.training)
        if not checking():
            return
        p = self.placement
        if not 0 <= self.stage < p.num_stages:
            raise FieldError(f"stage {self.stage} of a {p.num_stages}-stage placement", "stage")
        if p.layout is not None and not p.has(self.stage, self.replica):
            raise FieldError(f"no cell {self.stage}.{self.replica} in the placement's layout "
                             f"{[list(ids) for ids in p.layout]}", "replica")
        if p.layout is None and not 0 <= self.replica < p.replicas:
            raise FieldError(f"replica {self.replica} of a {p.replicas}-replica placement",
                             "replica")
        if self.num_stages != p.num_stages:
            raise FieldError(f"{self.num_stages} stages, the placement lists {p.num_stages}",
                             "num_stages")
        if self.kind == "train":
            peers: list[StagePlacement | None] = \
                [self.placement.downstream(self.stage, self.replica)]
            if self.wiring == "swarm" and self.stage + 1 < p.num_stages:
                peers = list(p.group(self.stage + 1))  # (routed: it dials every one of them)
            if len(p.ids(self.stage)) > 1 and self.join is None:  # (a group: a ring)
                peers.append(self.ring_next)
            for peer in peers:
                if peer is not None and (peer.data_addr is None
                                         or split_host_port(peer.data_addr) is None):
                    what = f"stage {peer.stage}" if p.replicas == 1 else \
                        f"stage {peer.stage} replica {peer.replica}"
                    raise FieldError(f"{what} has no data address to dial: "
                                     f"{peer.data_addr!r}", "placement")
        if self.attempt < 0 or self.resume_step < 0:
            raise FieldError("attempt and resume_step must be >= 0", "attempt")

    @property
    def mine(self) -> StagePlacement:
        return self.placement.cell(self.stage, self.replica)

    @property
    def replicas(self) -> int:
        return self.placement.replicas

    @property
    def downstream_addr(self) -> str | None:
        down = self.placement.downstream(self.stage, self.replica)
        return None if down is None else down.data_addr

    @property
    def local_up(self) -> bool:
        """The stage upstream runs in this same fellow (another device slot)."""
        return self.placement.same_fellow(
            self.mine, self.placement.upstream(self.stage, self.replica))

    @property
    def local_down(self) -> bool:
        return self.placement.same_fellow(
            self.mine, self.placement.downstream(self.stage, self.replica))

    @property
    def ring_next(self) -> StagePlacement | None:
        """The cell of this stage that this one sends its share of the group's
        synchronisation to (the next around the ring, in id order); None for a stage of one
        cell."""
        return self._ring(+1)

    @property
    def local_ring(self) -> bool:
        """The ring's neighbours run in this same fellow: its links never leave it."""
        return self.placement.same_fellow(self.mine, self.ring_next) \
            and self.placement.same_fellow(self.mine, self._ring(-1))

    def _ring(self, step: int) -> StagePlacement | None:
        return self.placement.ring(self.stage, self.replica, step)

    def after_move(self, source: int, cell: int, target: int, new_id: int,
                   at: int, placement: Placement | None = None) -> StageStart:
        """What this cell runs from step ``at`` on, once every cell has decided the same move
        in band (``Placement.moved``): the moving peer's fellow gets its new cell's START
        without a word from the leader (its state comes round the new ring from the target's
        cell 0, as a joiner's does); any other cell, itself under the moved placement.
        ``placement``: the placement after the move as the cell that made it had it
        (``LayoutMove.placement``); a fellow passes it, since its START predates the moves
        its cell stayed through (re-addressed in place: ``StageSpec.placed``). Default: this
        START's placement, moved."""
        if placement is None:
            placement = self.placement.moved(source, cell, target, new_id)
        if (self.stage, self.replica) != (source, cell):
            return attrs.evolve(self, placement=placement)
        return attrs.evolve(self, stage=target, replica=new_id, placement=placement,
                            resume_step=at, join=None)

    @property
    def train(self) -> TrainingConfig | None:
        return self.training if isinstance(self.training, TrainingConfig) else None


for _conv in (converter, lenient_converter):
    register_kind_hooks(StageStart, _conv)


def stage_starts(job_id: str, spec: JobSubmit, placement: Placement, key: str, *,
                 attempt: int = 0, resume_step: int = 0) -> list[StageStart]:
    """The START of every cell of a placed job, in the placement's order."""
    return [StageStart(job_id=job_id, kind=spec.kind, name=spec.name, stage=s.stage,
                       num_stages=placement.num_stages, placement=placement, key=key,
                       model=spec.model, training=spec.training, attempt=attempt,
                       resume_step=resume_step, replica=s.replica,
                       wiring=spec.topology.wiring, route_weights=spec.topology.route_weights,
                       routing=spec.topology.routing, moves=spec.topology.moves,
                       rebalance_every=spec.topology.rebalance_every)
            for s in placement.stages]


def chain_starts(model: ModelConfig, training: TrainingConfig, addrs: Sequence[str | None],
                 devices: Sequence[str] | None = None, *, job_id: str = "job-local",
                 key: str = "k" * 32, weights: Sequence[float] | None = None,
                 replicas: int = 1, wiring: Literal["chain", "swarm"] = "chain",
                 route_weights: list[list[float]] | None = None,
                 routing: Literal["given", "measured"] = "given",
                 layout: Sequence[Sequence[int]] | None = None) -> list[StageStart]:
    """The STARTs of a train job whose i-th cell (replica i // stages of stage i % stages)
    runs on fellow i, listening at ``addrs[i]`` on ``devices[i]``: planned and built by the
    leader's own code (for a pipeline run without a leader, and for tests). Layers split
    equally unless ``weights`` say otherwise. ``layout``: a swarm job whose stages hold
    unequal cells (``pipeline/layout``): the i-th cell is then the i-th of ``layout_cells``,
    the job's batch still ``replicas`` shares, and the route weights are by id."""
    devs = list(devices or ["cpu"] * len(addrs))
    fellows = [FellowSlots(s, f"fellow-{s}", [dev], addr)
               for s, (addr, dev) in enumerate(zip(addrs, devs, strict=True))]
    stages = len(addrs) // replicas if layout is None else len(layout)
    topology = Topology(stages=stages, replicas=replicas, wiring=wiring,
                        route_weights=route_weights, routing=routing,
                        layout=None if layout is None else [list(ids) for ids in layout])
    spec = JobSubmit(name=job_id, kind="train", model=model, training=training,
                     topology=topology)
    placement = plan(fellows, stages, model.n_layers, weights, replicas=replicas,
                     layout=topology.layout, network=training.network)
    return stage_starts(job_id, spec, placement, key)
