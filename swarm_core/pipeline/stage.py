"""One stage of a pipeline job on one fellow: links, schedule, optimiser step, evaluation.

Runs in a thread of its own (torch releases the GIL), so the fellow's asyncio loop keeps
heartbeating while the stage computes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract import CodecErrors, StageMetrics, StageStart, perplexity
from swarm_core.contract.membership import RegroupOrder
from swarm_core.contract.placement import Placement, StagePlacement, slot_count, stage_ids
from swarm_core.contract.rebalance import PeerMove
from swarm_core.data import TokenData
from swarm_core.pipeline.boundary import BoundaryCodec, decoded_error, make_boundary
from swarm_core.pipeline.devices import resolve_device
from swarm_core.pipeline.frames import FLAG_EVAL, FLAG_HEARD, Kind
from swarm_core.pipeline.heap import keep_large_blocks
from swarm_core.pipeline.layout import (
    Layout,
    NormRelay,
    hears_norm,
    norm_relay,
    ring_neighbours,
)
from swarm_core.pipeline.links import LinkShaper
from swarm_core.pipeline.listener import DataListener, Expected
from swarm_core.pipeline.memory import ActivationMeter
from swarm_core.pipeline.model import StageModule, dropout_rng, lm_loss
from swarm_core.pipeline.move import LayoutMove, Mover, arrive, mover_of, relink
from swarm_core.pipeline.optim import (
    OptimizerStateError,
    clip_scale,
    grad_sq_sum,
    load_optimizer_arrays,
    lr_at,
    make_optimizer,
    optimizer_arrays,
    scale_grads,
    set_lr,
    split_outer,
)
from swarm_core.pipeline.pace import Pace
from swarm_core.pipeline.peers import cell_label, peer_shaper, peer_states
from swarm_core.pipeline.replica_group import (
    STUCK_AFTER,
    Coordinator,
    ReplicaGroup,
    plus,
    ring_tag,
)
from swarm_core.pipeline.replica_group import StageDropped as StageDropped  # (what a run ends in)
from swarm_core.pipeline.reroute import LINK_FAULTS, Rerouter
from swarm_core.pipeline.route_meter import RouteMeter, chain_table
from swarm_core.pipeline.routing import RoutedStep, route_plan
from swarm_core.pipeline.schedules import hurried_backwards, ops_for
from swarm_core.pipeline.selective import LinkCodecs, boundary_formats
from swarm_core.pipeline.syncs import GroupSync
from swarm_core.pipeline.transport import Liveness, PeerLink, connect
from swarm_core.pipeline.wgrad import WeightGradQueue, attach
from swarm_core.pipeline.wire_math import (
    NORM_PAYLOAD,
    boundary_width,
    expected_wire_bytes,
)

log = logging.getLogger(__name__)

# The activation meter hooks every tensor autograd saves, in Python: ~2 ms a micro-batch on the
# bench model (1-2 % of a step; a quarter of a tiny model's). What a step holds is set by the
# shapes and the schedule, and only deferred W passes (which fill waits) move it, so the meter
# runs on a runner's first step and every METER_EVERY-th; the steps between repeat its peak.
METER_EVERY = 10

# How long a stage may take to load its data and build its model once its links are up, in
# frame timeouts (an hour by default): a cold BPE tokenizer on a large corpus takes minutes.
PREPARE_AFTER = 60


class StageStopped(Exception):
    """The leader said STOP (or the job was cancelled)."""


def check_stop(liveness: Liveness, stop: threading.Event) -> None:
    """Before every op: the compute thread is moving; raises StageStopped once told to."""
    liveness.touch()
    if stop.is_set():
        raise StageStopped()


@attrs.define
class StepReport:
    step: int  # 1-based: steps completed
    loss: float | None
    seconds: float
    tokens: int
    wire_tx_bytes: int
    lr: float
    # Peak bytes held for backward during the latest metered step (see METER_EVERY).
    activation_peak_bytes: int = 0
    # Of ``seconds``, the time the stage sat blocked on its links: waiting for a neighbour's
    # frame (its compute, the network, the pipeline's bubble) or for its own sends to drain.
    wait_seconds: float = 0.0
    # Relative L2 error the wire codec put on what this stage sent, micro-batch 0: "act"
    # (activations downstream) and "grad" (gradients upstream), of the frame as the receiver
    # decodes it (boundary.decoded_error); 0 on an fp32 wire.
    codec_error: CodecErrors = attrs.field(factory=CodecErrors)
    # With replicas: what the group's gradient average sent, and the seconds it took.
    sync_tx_bytes: int | None = None
    sync_seconds: float | None = None
    # An emulated slowdown (pace.py): the largest factor of the step's ops, None without one,
    # and the seconds its padding slept (part of ``seconds``).
    slowdown: float | None = None
    padded_seconds: float = 0.0
    # Swarm wiring: the step's micro-batches the route gave this cell (None: a chain's M),
    # and the membership it trained the step under (a step trained again after a regroup
    # replaces what the leader had of it).
    micro_batches: int | None = None
    epoch: int | None = None
    # A job whose peers move between stages: the latest move made (``epoch`` counts them),
    # so whoever reads any cell's report learns the layout it ran under.
    moved: PeerMove | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def figures(self) -> StageMetrics:
        """What the stage reports of this step."""
        return StageMetrics(wire_tx_bytes=self.wire_tx_bytes, step_seconds=self.seconds,
                            lr=self.lr, activation_peak_bytes=self.activation_peak_bytes,
                            wait_seconds=self.wait_seconds, codec_error=self.codec_error,
                            sync_tx_bytes=self.sync_tx_bytes, sync_seconds=self.sync_seconds,
                            slowdown=self.slowdown,
                            micro_batches=None if self.micro_batches is None
                            else float(self.micro_batches))

    @property
    def wait_fraction(self) -> float:
        return _ratio(self.wait_seconds, self.seconds)


class ResumeError(ValueError):
    """The checkpoint a stage was asked to resume from does not fit it."""


def trained_names(module: torch.nn.Module) -> list[str]:
    """The names of the parameters a stage trains, in the order of its ``params`` (and of
    DiLoCo's outer step)."""
    return [n for n, p in module.named_parameters() if p.requires_grad]


@attrs.frozen
class StageCheckpoint:
    """What a cell hands its checkpointer between two optimiser steps. The group's first
    member (``leads``) writes its stage's shard; under DiLoCo every other member hands over
    its own optimiser state too, since each replica's AdamW moments are its own (data
    parallel's are the same in every replica, the weights at an outer step too)."""

    step: int
    module: StageModule
    opt: torch.optim.Optimizer
    replica: int = 0
    leads: bool = True
    members: tuple[int, ...] = (0,)
    sync: GroupSync | None = None

    @property
    def replica_states(self) -> tuple[int, ...]:
        """The other replicas whose own optimiser states belong with the stage's shard."""
        if self.sync is None or not self.sync.own_state:
            return ()
        return tuple(m for m in self.members if m != self.replica)

    def optimizer_arrays(self) -> dict[str, np.ndarray]:
        """AdamW's state and the sync algorithm's (DiLoCo's outer momentum), keyed by
        parameter name."""
        arrays = optimizer_arrays(self.opt, self.module)
        if self.sync is not None:
            arrays.update(self.sync.checkpoint_state(trained_names(self.module)))
        return arrays


@attrs.define
class StageSpec:
    job_id: str
    key: str
    stage: int
    num_stages: int
    layers: tuple[int, int]
    downstream_addr: str | None
    model: ModelConfig
    training: TrainingConfig
    device: str = "cpu"
    # The neighbour upstream / downstream runs in this same fellow (another device slot): that
    # link never leaves the machine, so the fellow's link shaping and counters leave it out.
    local_up: bool = False
    local_down: bool = False
    # Data parallel: this stage is replica ``replica`` of ``replicas``; its group's ring
    # sends to the next replica at ``ring_next_addr`` (``local_ring``: both ring neighbours
    # in this fellow).
    replica: int = 0
    replicas: int = 1
    ring_next_addr: str | None = None
    local_ring: bool = False
    # Every replica of this stage (by id: None where the stage lacks the id): where it
    # listens, and whether it runs in this fellow; a regroup rings the members that are left.
    group_addrs: tuple[str | None, ...] = ()
    group_local: tuple[bool, ...] = ()
    join: RegroupOrder | None = None  # it joins a running group (see StageStart.join)
    # The fellow of every cell, at id x num_stages + stage (the grid's placement order; None
    # where a layout lacks the cell): whom a link matrix's pair shaper names as the peer
    # (``swarm set-speed --to``).
    cell_fellows: tuple[int | None, ...] = ()
    # Swarm wiring (``routed``): micro-batches go to any replica of the next stage by the
    # step's route plan (swarm_core.pipeline.routing), over a link to each of them; where
    # each replica of the next stage listens, and which replicas either side run here.
    wiring: str = "chain"
    route_weights: list[list[float]] | None = None
    routing: str = "given"  # or "measured": see measures_routes
    down_addrs: tuple[str | None, ...] = ()
    down_local: tuple[bool, ...] = ()
    up_local: tuple[bool, ...] = ()
    # Swarm wiring whose stages have unequal cells (pipeline/layout): each stage's cell ids;
    # ``replica`` is then this cell's id and ``replicas`` the job's data shares. None: every
    # stage's ids are 0..replicas-1.
    layout: Layout | None = None
    # The placement the START gave (and a move changed: ``placed``); None for a spec built
    # by hand, which never moves.
    placement: Placement | None = None
    # Peers moved between stages (pipeline/move): given in advance, or decided every
    # ``rebalance_every`` steps from measured routes.
    moves: tuple[PeerMove, ...] = ()
    rebalance_every: int | None = None

    @property
    def routed(self) -> bool:
        return self.wiring == "swarm" and (self.replicas > 1 or self.layout is not None)

    def ids(self, stage: int) -> list[int]:
        """The ids of a stage's cells (its group's members at the start)."""
        return stage_ids(self.layout, stage, self.replicas)

    @property
    def measures_routes(self) -> bool:
        """Whether the route deals by throughput measured in the run (SWARM's), agreed by
        every cell each step over its group's ring and its chain."""
        return self.routed and self.routing == "measured"

    @property
    def reads_tokens(self) -> bool:
        """Inputs go to the first stage and targets to the last; those between read none,
        unless the boundary needs the ids on every stage (a subspace spec's E(tokens))."""
        return self.stage in (0, self.num_stages - 1) \
            or self.model.compression_spec.every_stage_reads_tokens

    @property
    def local_batch(self) -> int:
        """The windows of a step this replica trains on: its share of the batch."""
        return self.training.batch_size // self.replicas

    @property
    def leads(self) -> bool:
        """Replica 0: the one that evaluates and checkpoints for its group (whose replicas
        hold the same weights)."""
        return self.replica == 0

    @classmethod
    def from_start(cls, start: StageStart, threads: int | None = None) -> StageSpec:
        """The stage a train START describes. ``threads``: what this fellow's machine gives a
        stage (the job's own number is for the single-process reference)."""
        training = start.train
        assert training is not None and start.model is not None, "a train START"
        if threads is not None:
            training = attrs.evolve(training, threads=threads)
        return cls(job_id=start.job_id, key=start.key, stage=start.stage,
                   num_stages=start.num_stages, layers=start.mine.layers.as_tuple(),
                   model=start.model, training=training, device=start.mine.device,
                   replica=start.replica, replicas=start.replicas, join=start.join,
                   wiring=start.wiring, route_weights=start.route_weights,
                   routing=start.routing, moves=tuple(start.moves or ()),
                   rebalance_every=start.rebalance_every,
                   **_addressing(start.placement, start.stage, start.replica))

    def placed(self, placement: Placement) -> None:
        """This cell under the placement a move made (``Placement.moved``): its neighbours,
        group and layout, in place, since its runner, group and links hold this spec."""
        for name, value in _addressing(placement, self.stage, self.replica).items():
            setattr(self, name, value)


def _addressing(p: Placement, k: int, replica: int) -> dict[str, Any]:
    """What a placement says of where cell (k, replica) sits: its chain's and ring's
    neighbours, every cell of its stage and the stages either side (by id, so a layout's
    absent ids read None: a grid's are its replicas), every cell's fellow, and the layout."""
    mine = p.cell(k, replica)
    ids = range(p.width)

    def at(stage: int) -> list[StagePlacement | None]:
        return [p.cell(stage, r) if p.has(stage, r) else None for r in ids] \
            if 0 <= stage < p.num_stages else []

    own, after, before = at(k), at(k + 1), at(k - 1)
    down, ring_next = p.downstream(k, replica), p.ring(k, replica)
    return {"downstream_addr": None if down is None else down.data_addr,
            "local_up": p.same_fellow(mine, p.upstream(k, replica)),
            "local_down": p.same_fellow(mine, down),
            "ring_next_addr": None if ring_next is None else ring_next.data_addr,
            "local_ring": p.same_fellow(mine, ring_next)
            and p.same_fellow(mine, p.ring(k, replica, -1)),
            "group_addrs": tuple(None if c is None else c.data_addr for c in own),
            "group_local": tuple(p.same_fellow(mine, c) for c in own),
            "down_addrs": tuple(None if c is None else c.data_addr for c in after),
            "down_local": tuple(p.same_fellow(mine, c) for c in after),
            "up_local": tuple(p.same_fellow(mine, c) for c in before),
            "cell_fellows": tuple(p.cell(s, r).fellow_id if p.has(s, r) else None
                                  for r in ids for s in range(p.num_stages)),
            "layout": p.layout, "placement": p}


def chain_sq_sum(local: float, up: PeerLink | None, down: PeerLink | None, step: int,
                 timeout: float, relay: NormRelay | None = None) -> float:
    """A chain's sum of ``local`` over its stages: up the pipe (each stage adds its own to
    what came from below), then the total back down (and a layout's relay: see layout)."""
    return chain_table(local, (), 0, 0, up, down, step, timeout, relay)[0]


Tokens = tuple[torch.Tensor, ...] | dict[int, torch.Tensor]


def step_tokens(spec: StageSpec, data: TokenData, step: int, route: RoutedStep | None,
                device: torch.device) -> tuple[Tokens, Tokens]:
    """A step's token ids by micro-batch, on ``device``, where the stage reads them: inputs
    on the first stage (every stage, where the boundary recomputes E(tokens)), targets on the
    last; the stages between read none. Replica r takes the r-th share of the step's windows,
    so the group together trains on the whole batch; a routed cell (swarm wiring) may run any
    replica's micro-batches, so it takes those its route gives it, by global index."""
    t, m = spec.training, spec.training.micro_batches
    first, last = spec.stage == 0, spec.stage == spec.num_stages - 1
    inputs = first or spec.model.compression_spec.every_stage_reads_tokens
    if not spec.reads_tokens:
        return (), ()
    x, y = data.batch(step, t.batch_size, spec.model.seq_len, t.seed)
    if route is not None:
        return ({g: c.to(device) for g, c in route.pieces(x, spec.replicas, m).items()}
                if inputs else {},
                {g: c.to(device) for g, c in route.pieces(y, spec.replicas, m).items()}
                if last else {})
    if spec.replicas > 1:
        share = slice(spec.replica * spec.local_batch, (spec.replica + 1) * spec.local_batch)
        x, y = x[share], y[share]
    return (x.to(device).chunk(m) if inputs else (), y.to(device).chunk(m) if last else ())


def frame_shape(spec: StageSpec) -> tuple[int, int, int]:
    """Every ACT and GRAD frame at a stage's boundaries: one micro-batch, boundary-wide."""
    t, m = spec.training, spec.model
    return (spec.local_batch // t.micro_batches, m.seq_len, boundary_width(m))


def eval_shape(spec: StageSpec) -> tuple[int, int, int]:
    """An evaluation frame: a micro-batch of the whole batch, whatever the replicas."""
    t, m = spec.training, spec.model
    return (t.batch_size // t.micro_batches, m.seq_len, boundary_width(m))


@attrs.define
class StageLinks:
    """A stage's links: its pipeline neighbours, and its group's ring (replicas)."""

    up: PeerLink | None = None
    down: PeerLink | None = None
    ring_next: PeerLink | None = None
    ring_prev: PeerLink | None = None
    # Swarm wiring: the links to and from the other replicas of the stages either side (by
    # replica; a cell's own chain's are ``up`` and ``down``).
    ups: dict[int, PeerLink] = attrs.field(factory=dict)
    downs: dict[int, PeerLink] = attrs.field(factory=dict)
    relay: NormRelay | None = None  # a layout's NORM relay (pipeline/layout), over the above

    def all(self) -> list[PeerLink]:
        return [x for x in (self.up, self.down, self.ring_next, self.ring_prev,
                            *self.ups.values(), *self.downs.values()) if x is not None]

    def close(self) -> None:
        for link in self.all():
            link.close()

    def dead_peer(self, replica: int) -> int | None:
        """The replica of a pipeline neighbour whose link closed without a FAREWELL (its
        process likely ended): ``replica``'s own chain's, or the other replica's a swarm
        link reaches; None where none did."""
        for link in (self.up, self.down):
            if link is not None and link.died:
                return replica
        for other, link in (*self.ups.items(), *self.downs.items()):
            if link.died:
                return other
        return None


def open_links(spec: StageSpec, shaper: LinkShaper, listener: DataListener | None,
               stop: threading.Event, timeout: float, liveness: Liveness,
               members: Sequence[int] | None = None, epoch: int = 0) -> StageLinks:
    """Dial the next stage (and the next replica on the group's ring) and take the dials of
    the previous ones. ``shaper`` shapes and counts the links that leave the fellow; a link to
    a stage in the same fellow (``spec.local_up``, ``local_down``, ``local_ring``) gets an
    unshaped one of its own. (The ring's frame limit is set once the stage knows its size.)
    ``members`` and ``epoch``: swarm wiring's pipe links anew after a regroup, to the
    replicas left only, under the new membership's tag (the ring is the group's to open)."""
    m, t = spec.model, spec.training
    # A frame from a neighbour is at most one boundary tensor (or a norm): a header that
    # claims more is refused before its buffer is allocated.
    # (a link compress_when leaves out sends as spec none does: its frames may be larger)
    # (measured routing's norm frames carry the throughput table too: see route_meter)
    norm = NORM_PAYLOAD * (1 + spec.num_stages * slot_count(spec.layout, spec.replicas)
                           if spec.measures_routes else 1)
    limit = max(norm, *(w.payload_size(shape) for w in boundary_formats(m, t)
                                for shape in (frame_shape(spec), eval_shape(spec))))
    # A link left idle for a quarter of the frame timeout gets a pulse: a neighbour waits out
    # our checkpoint or our wait on the stage beyond, not our death, a frozen process or a
    # compute thread that has shown no progress for STUCK_AFTER frame timeouts.
    pulse = t.frame_timeout_s / 4
    tag = ring_tag(spec.job_id, epoch)
    links = StageLinks()
    # (a joiner rings the members later; after a regroup the group rings them)
    ringed = len(spec.ids(spec.stage)) > 1 and spec.join is None and members is None
    peers = range(slot_count(spec.layout, spec.replicas)) if members is None else members

    expected = _expected(spec, shaper, limit, ringed, peers)
    # The listener answers handshakes while this stage dials: both ends of a handshake prove
    # the key, so a ring's replicas dialling each other would otherwise wait on each other.
    accepted: dict[str, Any] = {}
    cancel = threading.Event()

    def take() -> None:
        assert listener is not None
        try:
            accepted["links"] = listener.accept_many(spec.key, tag, expected, timeout,
                                                     abort=stop, pulse_s=pulse,
                                                     liveness=liveness, cancel=cancel,
                                                     transport=t.transport)
        except BaseException as exc:  # (re-raised in the stage's thread below)
            accepted["error"] = exc

    acceptor = threading.Thread(target=take, name="stage-accept", daemon=True)
    if expected:
        acceptor.start()
    try:
        _dial(spec, shaper, links, ringed, tag, limit, peers,
              dict(timeout=timeout, abort=stop, pulse_s=pulse, liveness=liveness,
                   transport=t.transport))
    except BaseException:
        cancel.set()
        raise
    finally:
        if expected:
            acceptor.join()
            got = accepted.get("links") or {}
            links.up, links.ring_prev = got.get("up"), got.get("ring")
            links.ups = {r: got[f"route{r}"] for r in range(slot_count(spec.layout,
                                                                       spec.replicas))
                         if f"route{r}" in got}
            if "error" in accepted or cancel.is_set():
                links.close()
    if "error" in accepted:
        raise accepted["error"]
    links.relay = norm_relay(spec, links)
    return links


def _expected(spec: StageSpec, shaper: LinkShaper, limit: int, ringed: bool,
              peers: Iterable[int]) -> list[Expected]:
    """The peers a stage takes the dials of: the stage before (its chain's, and with swarm
    wiring every other replica of it) and the previous replica on its group's ring."""
    expected = []
    if spec.stage > 0 and spec.replica in spec.ids(spec.stage - 1):  # (its chain's, if any)
        expected.append(Expected("up", spec.stage - 1, None,
                                 peer_shaper(spec, shaper, spec.stage - 1, spec.replica,
                                             spec.local_up),
                                 limit, (Kind.ACT, Kind.NORM)))
    if ringed:
        prev = ring_neighbours(spec, spec.ids(spec.stage))[0]
        expected.append(Expected("ring", spec.stage, prev,
                                 peer_shaper(spec, shaper, spec.stage, prev, spec.local_ring),
                                 receives=(Kind.SYNC,)))
    if spec.routed and spec.stage > 0:
        for r in peers:
            if r != spec.replica and r in spec.ids(spec.stage - 1):  # (its chain's: "up")
                expected.append(Expected(f"route{r}", spec.stage - 1, r,
                                         peer_shaper(spec, shaper, spec.stage - 1, r,
                                                     spec.up_local[r]),
                                         limit, (Kind.ACT, *_norm(spec, r)), route=True))
    return expected


def _dial(spec: StageSpec, shaper: LinkShaper, links: StageLinks, ringed: bool, tag: int,
          limit: int, peers: Iterable[int], common: dict[str, Any]) -> None:
    """Dial the next stage (its chain's, and with swarm wiring every other replica of it)
    and the next replica on the group's ring, into ``links``."""
    if spec.stage < spec.num_stages - 1 and spec.replica in spec.ids(spec.stage + 1):
        assert spec.downstream_addr is not None
        links.down = connect(spec.downstream_addr, spec.key, spec.stage, tag,
                             peer_shaper(spec, shaper, spec.stage + 1, spec.replica,
                                         spec.local_down),
                             max_payload=limit, receives=(Kind.GRAD, Kind.NORM), **common)
    for r in peers if spec.routed and spec.stage < spec.num_stages - 1 else ():
        if r != spec.replica and r in spec.ids(spec.stage + 1):
            addr = spec.down_addrs[r]
            assert addr is not None
            links.downs[r] = connect(
                addr, spec.key, spec.stage, tag,
                peer_shaper(spec, shaper, spec.stage + 1, r, spec.down_local[r]),
                max_payload=limit, receives=(Kind.GRAD, *_norm(spec, r)),
                route=(spec.replica, r), **common)
    if ringed:
        assert spec.ring_next_addr is not None
        nxt = ring_neighbours(spec, spec.ids(spec.stage))[1]
        links.ring_next = connect(spec.ring_next_addr, spec.key, spec.stage, tag,
                                  peer_shaper(spec, shaper, spec.stage, nxt, spec.local_ring),
                                  receives=(), ring=(spec.replica, nxt), **common)


def _norm(spec: StageSpec, peer: int) -> tuple[Kind, ...]:
    """NORM on a route link where a layout's relay comes over it (see pipeline/layout)."""
    return (Kind.NORM,) if hears_norm(spec, peer) else ()


class _LinkOpener:
    """``open_links`` in a thread of its own, begun before the stage loads its data and builds
    its model, so the neighbours are linked however long each stage takes to prepare, instead
    of timing out on a dial that a slow tokenizer held back. Until the stage takes the links,
    preparing counts as progress (its links pulse), for up to PREPARE_AFTER frame timeouts."""

    def __init__(self, spec: StageSpec, shaper: LinkShaper, listener: DataListener | None,
                 stop: threading.Event, timeout: float, liveness: Liveness,
                 move: LayoutMove | None = None) -> None:
        self._links: StageLinks | None = None
        self._error: BaseException | None = None
        self._taken = threading.Event()
        # (a cell a layout's move adds links as the cells that stay re-link: pipeline/move)
        self._members = None if move is None else range(move.width)
        self._epoch = 0 if move is None else move.epoch
        self._thread = threading.Thread(
            target=self._run, args=(spec, shaper, listener, stop, timeout, liveness),
            name="stage-links", daemon=True)
        self._thread.start()

    def _run(self, spec: StageSpec, shaper: LinkShaper, listener: DataListener | None,
             stop: threading.Event, timeout: float, liveness: Liveness) -> None:
        try:
            self._links = open_links(spec, shaper, listener, stop, timeout, liveness,
                                     self._members, self._epoch)
        except BaseException as exc:  # handed to the stage's thread by result()
            self._error = exc
            return
        frame_timeout = spec.training.frame_timeout_s
        until = time.monotonic() + PREPARE_AFTER * frame_timeout
        while not self._taken.wait(min(1.0, frame_timeout / 8)) and time.monotonic() < until:
            liveness.touch()

    def result(self) -> StageLinks:
        self._taken.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._links is not None
        return self._links

    def discard(self) -> None:
        """After the stage failed first: wait for the thread (its dial or accept ends on the
        stage's stop) and close whatever it opened."""
        self._taken.set()
        self._thread.join()
        if self._links is not None:
            self._links.close()


@attrs.define
class _Step:
    """What one training step holds while its micro-batches run."""

    step: int
    # Token ids by micro-batch: the replica's share in order, or (routed) by global index.
    xs: tuple[torch.Tensor, ...] | dict[int, torch.Tensor]
    ys: tuple[torch.Tensor, ...] | dict[int, torch.Tensor]
    metered: bool
    inputs: dict[int, torch.Tensor] = attrs.field(factory=dict)
    outputs: dict[int, torch.Tensor] = attrs.field(factory=dict)
    held: dict[int, Any] = attrs.field(factory=dict)  # the meter's tokens, until backward
    loss_sum: float = 0.0
    errors: CodecErrors = attrs.field(factory=CodecErrors)
    # Whether this cell, or one upstream in its chain, had been told of a replica joining when
    # the step began (its ACT frames say so), and whether any cell of the chain had (the GRAD
    # frames from downstream say so): see StageRunner._chain_heard.
    heard: bool = False
    chain_heard: bool = False
    # Swarm wiring: the step's route, as this cell runs it (None: a chain).
    route: RoutedStep | None = None
    # Where this cell's micro-batch i sits in the step's whole batch, less i: a chain-wired
    # replica r's are r x M on (a routed step's indices are the whole batch's already). Keys
    # dropout's masks and stochastic rounding's draws, so replicas draw apart, as one
    # process over the whole batch does.
    draw_base: int = 0


class StageRunner:
    def __init__(self, spec: StageSpec, data: TokenData, shaper: LinkShaper,
                 stop: threading.Event, liveness: Liveness | None = None,
                 pace: Pace | None = None) -> None:
        keep_large_blocks()  # per-micro-batch tensors reuse warm pages (see heap.py)
        self.spec = spec
        self.data = data
        self.shaper = shaper
        self.stop = stop
        self.pace = pace  # None: computes at its own speed
        m = spec.model
        vocab = m.vocab_size or data.vocab_size
        self.device = resolve_device(spec.device, m.dtype)
        # Built on the CPU under the part seeds, then moved: the same weights on any device.
        self.module = StageModule(m, vocab, spec.training.seed, spec.layers[0], spec.layers[1],
                                  spec.stage, spec.num_stages).to(self.device)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.meter = ActivationMeter(self.module.parameters())
        self.first = spec.stage == 0
        self.last = spec.stage == spec.num_stages - 1
        t = spec.training
        self.ops = ops_for(t.schedule, spec.stage, spec.num_stages, t.micro_batches)
        self.last_backward = max(n for n, (op, _i) in enumerate(self.ops) if op != "F")
        # Split backward only where it pays (see hurried_backwards): none on the first stage of
        # GPipe, whose Linears then stay plain.
        # (swarm wiring's ops change every step: its W passes run with their B passes)
        self.hurried = hurried_backwards(self.ops, self.first) \
            if t.split_backward and spec.num_stages > 1 and not spec.routed else frozenset()
        self.wgrad: WeightGradQueue | None = None
        if self.hurried:
            self.wgrad = WeightGradQueue(self.meter)
            attach(self.module, self.wgrad)
        # Deferred W passes hold a micro-batch's layer inputs and output gradients each; beyond
        # this many the stage runs one at once (memory stays in 1F1B's class).
        self.max_deferred = max(2, spec.num_stages)
        self.opt = make_optimizer(self.module, spec.training, grouped=spec.replicas > 1)
        # Each side of each direction of its boundaries (a stateful codec keeps its own state),
        # per link: compress_when may leave a link out (pipeline/selective.py).
        self.codecs = LinkCodecs(spec, make_boundary(m))
        self.metered_steps = 0  # steps the activation meter ran on (see METER_EVERY)
        self.frame_shape = frame_shape(spec)
        self.up: PeerLink | None = None
        self.down: PeerLink | None = None
        self.links = StageLinks()
        self.liveness = liveness or Liveness(STUCK_AFTER * spec.training.frame_timeout_s)
        # (its stop check holds no reference to the runner: a stage that ends early frees
        # its model at once, without waiting for the garbage collector)
        self.group = ReplicaGroup(spec, self.module, self.opt, shaper, stop, self.liveness,
                                  functools.partial(check_stop, self.liveness, stop))
        # Measured routing (SWARM's): what this cell times, tells and learns each step.
        self.meter_routes = RouteMeter.of(spec) if spec.measures_routes else None
        self.rerouter: Rerouter | None = None  # swarm wiring's regroup (run_stage sets it)
        self.last_move: PeerMove | None = None  # (what its step reports name: pipeline/move)

    @property
    def sync(self) -> GroupSync | None:
        """The group's sync algorithm (None: a job of one replica)."""
        return self.group.sync

    def take_links(self, links: StageLinks) -> None:
        """The stage's links, once open; with replicas, its group's ring over two of them."""
        self.links = links
        self.up, self.down = links.up, links.down
        self.group.start(self.params, self.device, links.ring_next, links.ring_prev)
        if self.meter_routes is not None and self.sync is not None:
            self.sync.own = 0.0  # (its confirmations tell the group its time from now on)

    def checkpoint(self, step: int, final: bool = False) -> StageCheckpoint:
        """The cell's state after step ``step`` for its checkpointer. The last step's is the
        export alone: no run resumes from it, so no other replica's state goes with it."""
        return StageCheckpoint(step, self.module, self.opt, self.spec.replica, self.leads,
                               (self.spec.replica,) if final else tuple(self.group.members),
                               self.sync)

    def checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint is taken after global step ``step`` (1-based), short of the
        last: where the replicas hold one set of weights (see TrainingConfig.checkpoint_after)."""
        t = self.spec.training
        return t.checkpoint_after(step, self.sync is not None and t.sync.periodic)

    @property
    def leads(self) -> bool:
        return self.group.leads

    def pipe_links(self) -> list[PeerLink]:
        """The links of the pipeline (not the group's ring): the chain's, and swarm wiring's
        to the other replicas either side."""
        return [x for x in (self.up, self.down, *self.links.ups.values(),
                            *self.links.downs.values()) if x is not None]

    def sent(self) -> int:
        """Bytes this stage gave its own links to send (a fellow may run several stages):
        counted as queued, so a step's frames still crossing as the next begins are its own."""
        return sum(link.queued for link in self.pipe_links())

    def waited(self) -> float:
        """Seconds this stage has spent blocked on its links."""
        return sum(link.waited for link in self.pipe_links())

    def close(self) -> None:
        self.group.shut()
        self.links.close()

    # training --------------------------------------------------------------------------------
    def _check_stop(self) -> None:
        check_stop(self.liveness, self.stop)

    def train_step(self, step: int) -> StepReport:
        """Global step ``step`` (0-based): all micro-batches of this replica's share, the
        group's gradient average, clipping, one optimiser step."""
        t = self.spec.training
        if self.rerouter is not None:
            self.rerouter.check(step)
        tx0, wait0 = self.sent(), self.waited()
        t0 = time.perf_counter()
        lr = lr_at(step, t)
        set_lr(self.opt, lr)
        self.module.train()
        st = self._begin(step)
        ops = self.ops if st.route is None else st.route.ops()
        last_backward = self.last_backward if st.route is None else len(ops) - 1
        slowdown, padded, busy = None, 0.0, 0.0
        for n, (op, i) in enumerate(ops):
            self._check_stop()
            op_t0, op_wait0 = time.perf_counter(), self.waited()
            if op == "F":
                self._forward(st, i)
            else:
                if n == last_backward and self.sync is not None and self.wgrad is None:
                    # (deferred W passes would add to gradients the ring already took)
                    self.sync.arm(step, t.frame_timeout_s)
                self._backward(st, i)
            # The op's compute: its wall time less its link waits (a neighbour's pace is not
            # this stage's compute: padding it would slow the stage twice, and measured
            # routes would charge this cell for it).
            compute = (time.perf_counter() - op_t0) - (self.waited() - op_wait0)
            busy += compute
            if self.pace is not None and self.pace.slowdown > 1.0:
                slowdown = max(slowdown or 1.0, self.pace.slowdown)
                pad_t0 = time.perf_counter()
                padded += self.pace.pad(max(0.0, compute), self.stop, self._check_stop)
                busy += time.perf_counter() - pad_t0  # (the emulated slowdown, as slept)
        if self.meter_routes is not None and st.route is not None:
            assert self.sync is not None
            self.sync.own = RouteMeter.per_micro_batch(busy, len(st.route.mine))
        sync_bytes, sync_s = self._finish(step, self._chain_heard(st))
        seconds = time.perf_counter() - t0
        ran = None if st.route is None else len(st.route.mine)
        windows = self.spec.local_batch if ran is None \
            else ran * self.spec.local_batch // t.micro_batches
        # (a routed cell's loss is the mean over the micro-batches it ran: the step's is the
        # replicas' mean weighted by them, contract.metrics.step_loss)
        loss = None if not self.last else st.loss_sum if ran is None \
            else st.loss_sum * t.micro_batches / ran if ran else None
        return StepReport(step=step + 1, loss=loss,
                          seconds=seconds, tokens=windows * self.spec.model.seq_len,
                          micro_batches=ran,
                          wire_tx_bytes=self.sent() - tx0, lr=lr,
                          activation_peak_bytes=self.meter.peak,
                          wait_seconds=self.waited() - wait0, codec_error=st.errors,
                          sync_tx_bytes=sync_bytes, sync_seconds=sync_s,
                          slowdown=slowdown, padded_seconds=padded,
                          epoch=None if st.route is None else self.group.epoch,
                          moved=self.last_move)

    def _begin(self, step: int) -> _Step:
        """A step's state: its share of the batch, the meter, nothing carried over from a step
        that did not finish (no pending weight passes, no gradients half accumulated)."""
        spec, t = self.spec, self.spec.training
        m = t.micro_batches
        weights = spec.route_weights if self.meter_routes is None \
            else self.meter_routes.weights(self.group.dealt)
        route = RoutedStep(route_plan(t.seed, step, spec.num_stages, spec.replicas, m,
                                      weights, self.group.dealt, spec.layout), spec.stage,
                           spec.replica, m) if spec.routed else None
        xs, ys = step_tokens(spec, self.data, step, route, self.device)
        metered = self.metered_steps == 0 or step % METER_EVERY == 0
        if metered:
            self.meter.start_step()
            self.metered_steps += 1
        self.opt.zero_grad(set_to_none=True)
        if self.wgrad is not None:
            self.wgrad.clear()
            self.wgrad.meter = self.meter if metered else None
        return _Step(step, xs, ys, metered, heard=bool(self.group.told()), route=route,
                     draw_base=0 if route is not None else spec.replica * m)

    def _link(self, st: _Step, g: int, up: bool) -> PeerLink | None:
        """The link micro-batch ``g`` comes in on (``up``) or leaves by: its chain's, or
        (routed) that to the replica either side the step's route gives it."""
        chain = self.up if up else self.down
        if st.route is None or (self.first if up else self.last):
            return chain
        r = st.route.neighbour(g, up)
        return chain if r == self.spec.replica else (self.links.ups if up
                                                     else self.links.downs)[r]

    def _forward(self, st: _Step, i: int) -> None:
        t, wq = self.spec.training, self.wgrad
        if self.first:
            inp = st.xs[i]
        else:
            up = self._link(st, i, up=True)
            assert up is not None
            self._fill_wait(up, Kind.ACT)
            head, inp = up.recv_tensor(Kind.ACT, st.step, i, t.frame_timeout_s, self.device,
                                       self.frame_shape,
                                       codec=self.codecs.pick(Kind.ACT, False, up, self.links))
            st.heard |= bool(head.flags & FLAG_HEARD)
            inp.requires_grad_(True)
            st.inputs[i] = inp
        if wq is not None:
            wq.splitting = i in self.hurried  # (the rest train as plain Linears)
        saving = self.meter.saving if st.metered else contextlib.nullcontext
        with dropout_rng(self.module, st.step, st.draw_base + i), saving():
            out = self.module(inp, st.xs[i] if st.xs else None)
            if self.last:  # the loss's saved log-probabilities count too
                loss = lm_loss(out, st.ys[i]) / t.micro_batches
        if self.last:
            st.loss_sum += float(loss.detach())
            st.outputs[i] = loss
            return
        down = self._link(st, i, up=False)
        assert down is not None
        codec = self.codecs.pick(Kind.ACT, True, down, self.links)
        bufs = self._send(down, Kind.ACT, st, i, out, codec, FLAG_HEARD if st.heard else 0)
        if i == (0 if st.route is None else st.route.first):  # (once a step: one more decode)
            st.errors.act = decoded_error(out, bufs, codec.wire)
        st.outputs[i] = out
        if st.metered:
            st.held[i] = self.meter.hold(out)

    def _backward(self, st: _Step, i: int) -> None:
        t, wq = self.spec.training, self.wgrad
        grad = None
        if not self.last:
            down = self._link(st, i, up=False)
            assert down is not None
            self._fill_wait(down, Kind.GRAD)
            head, grad = down.recv_tensor(
                Kind.GRAD, st.step, i, t.frame_timeout_s, self.device, self.frame_shape,
                codec=self.codecs.pick(Kind.GRAD, False, down, self.links))
            st.chain_heard |= bool(head.flags & FLAG_HEARD)
        hurry = wq is not None and i in self.hurried
        if wq is not None and not hurry:
            # A fused backward (its forward ran plain): the pending W passes first, so
            # gradients still add up in micro-batch order.
            wq.drain()
        with wq.capture() if wq is not None and hurry else contextlib.nullcontext():
            st.outputs.pop(i).backward(grad)
        st.held.pop(i, None)
        if not self.first:
            up = self._link(st, i, up=True)
            assert up is not None
            inp = st.inputs.pop(i)
            assert inp.grad is not None
            codec = self.codecs.pick(Kind.GRAD, True, up, self.links)
            bufs = self._send(up, Kind.GRAD, st, i, inp.grad, codec,
                              FLAG_HEARD if self._chain_heard(st) else 0)
            if i == (0 if st.route is None else st.route.first):  # (as a rounding sender sent)
                st.errors.grad = decoded_error(inp.grad, bufs, codec.wire)
        if wq is not None and len(wq) > self.max_deferred:
            wq.run_batch()

    @staticmethod
    def _send(link: PeerLink, kind: Kind, st: _Step, i: int, x: torch.Tensor,
              codec: BoundaryCodec, flags: int) -> list[memoryview]:
        """``x`` coded once and queued on ``link``; the frame's buffers, from which the codec
        error is measured (``decoded_error``)."""
        bufs = codec.encode(x, i, st.step, st.draw_base + i)
        link.send_coded(kind, st.step, i, tuple(x.shape), codec.wire, bufs, x, flags)
        return bufs

    def _chain_heard(self, st: _Step) -> bool:
        """Whether a cell of this chain had been told of a replica joining when the step
        began: the last stage knows from its own and its ACT frames, the others from the GRAD
        frames it sends back."""
        return st.heard if self.last else st.chain_heard

    def _finish(self, step: int, heard: bool = False) -> tuple[int | None, float | None]:
        """The gradients complete, averaged over the group, clipped over every stage; one
        optimiser step; the step's frames out. Returns what the group's sync sent and took
        (None without replicas)."""
        t, group = self.spec.training, self.group
        if self.wgrad is not None:
            self.wgrad.drain()
        # (an algorithm whose direction replaces the gradients takes them clipped)
        first = group.sync is not None and group.sync.clips_first
        if first:
            self._constrain_and_clip(step)
        synced = group.before_step(step, heard)
        if self.meter_routes is not None:
            self.meter_routes.heard(group.sync.told if group.sync else None,
                                    group.members)
        if not first:
            self._constrain_and_clip(step)
        if self.rerouter is not None:
            self.rerouter.keep(step)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.rerouter is not None:
            self.rerouter.stepped(step)
        if group.sync is not None:
            # Where a checkpoint follows, the replicas must hold one set of weights: an outer
            # step there does not overlap the steps after it.
            synced = plus(synced, group.after_step(step, heard, self.checkpoint_due(step + 1)))
        self.module.constrain_()  # (after every change of the weights: steps, outer steps)
        _flush_step(self, step)
        # Not after the last step: the joiner would have nothing to train (every member sees
        # the same step, so none takes it in; the leader calls the join off, issue 40).
        if group.admit_after and step + 1 < t.steps:
            group.admit_safely(step)
        return synced if synced is not None else (None, None)

    def _constrain_and_clip(self, step: int) -> None:
        """A subspace spec's residual writers' gradients projected (``constrain_``), then all
        clipped. Not before the group's mean: data parallel's ring may still be sending the
        gradients' buffers (the projection is linear, so it commutes with the mean)."""
        self.module.constrain_(grads=True)
        self._clip(step)

    def _clip(self, step: int) -> None:
        """The gradients scaled to the global norm ``grad_clip`` over every stage (measured
        routing's table goes along that exchange, which then runs without clipping too)."""
        clip = self.spec.training.grad_clip
        if clip > 0:
            scale_grads(self.params, clip_scale(self._global_sq(step), clip))
        elif self.meter_routes is not None:
            self.meter_routes.exchange(0.0, self.up, self.down, step,
                                       self.spec.training.frame_timeout_s, self.links.relay)

    def _fill_wait(self, link: PeerLink, kind: Kind) -> None:
        """Before blocking on a frame, spend the wait on deferred W passes."""
        wq = self.wgrad
        if wq is None:
            return
        while not link.ready(kind) and wq.run_one():
            self._check_stop()

    def _global_sq(self, step: int) -> float:
        """Sum of squared gradients over every stage (along the chain's links)."""
        timeout = self.spec.training.frame_timeout_s
        if self.meter_routes is not None:
            return self.meter_routes.exchange(grad_sq_sum(self.params), self.up, self.down,
                                              step, timeout, self.links.relay)
        return chain_sq_sum(grad_sq_sum(self.params), self.up, self.down, step, timeout,
                            self.links.relay)


def _flush_step(r: StageRunner, step: int) -> None:
    """The step's frames out (swarm wiring: a fault here is raised at the next step, after
    this one's report). A chain's links stay open into the next step, so frames still
    crossing an added latency need not be waited for; the last step's must be out before
    the links close, as must a swarm layout's before a move relinks."""
    t = r.spec.training
    in_flight = not r.spec.routed and step + 1 < t.steps
    for link in r.pipe_links():
        if r.rerouter is not None:
            r.rerouter.flush(link, t.frame_timeout_s)
        else:
            link.flush(t.frame_timeout_s, in_flight=in_flight)


@torch.no_grad()
def evaluate(runner: StageRunner, step: int) -> float | None:
    """Validation loss on the fixed held-out batches (the last stage returns it). The
    replicas of a stage hold the same weights: the first replica's chain evaluates for
    all, on the micro-batches a job of one replica evaluates on."""
    t = runner.spec.training
    if t.eval_batches == 0 or not runner.leads:
        return None
    runner.module.eval()
    timeout = t.frame_timeout_s
    mb = t.batch_size // t.micro_batches
    batches: list[tuple[Any, Any]] = \
        runner.data.eval_batches(t.eval_batches, mb, runner.spec.model.seq_len) \
        if runner.spec.reads_tokens else [(None, None)] * t.eval_batches
    total = 0.0
    for i, (x, y) in enumerate(batches):
        runner._check_stop()
        if runner.first:
            inp = x.to(runner.device)
        else:
            assert runner.up is not None
            _, inp = runner.up.recv_tensor(Kind.ACT, step, 1_000_000 + i, timeout,
                                         runner.device, eval_shape(runner.spec), FLAG_EVAL,
                                         runner.codecs.pick(Kind.ACT, False, runner.up,
                                                          runner.links))
        out = runner.module(inp, None if x is None else x.to(runner.device))
        if runner.last:
            total += float(lm_loss(out, y.to(runner.device)))
        else:
            assert runner.down is not None
            runner.down.send_tensor(Kind.ACT, step, 1_000_000 + i, out,
                                  runner.codecs.pick(Kind.ACT, True, runner.down, runner.links),
                                  flags=FLAG_EVAL)
    for link in (runner.up, runner.down):
        if link is not None:
            link.flush(timeout)
    return total / len(batches) if runner.last else None


@attrs.define
class StageResult:
    """What a stage's run ends with: its figures for the leader, and its losses by step (the
    last stage's; empty elsewhere) for tests and benchmarks."""

    metrics: StageMetrics
    losses: list[float] = attrs.field(factory=list)
    epoch: int = 0  # the membership its group finished under (the leader's word for a joiner)
    # Swarm wiring: the micro-batches each step's loss is the mean over (see step_loss).
    micro_batches: list[int] = attrs.field(factory=list)
    # A layout's move took this cell's peer to another stage (pipeline/move): whose cell it
    # starts next, from the move's step.
    moved: LayoutMove | None = None


def run_stage(spec: StageSpec, data: TokenData | Callable[[], TokenData], shaper: LinkShaper,
              listener: DataListener | None, stop: threading.Event,
              on_step: Callable[[StepReport], None],
              on_eval: Callable[[int, float], None] | None = None,
              connect_timeout: float = 60.0,
              on_checkpoint: Callable[[StageCheckpoint], None] | None = None,
              start_step: int = 0,
              initial_state: dict[str, torch.Tensor] | None = None,
              initial_optimizer: dict[str, np.ndarray] | None = None,
              own_keys: bool = False,
              coordinator: Coordinator | None = None,
              inbox: list[tuple[RegroupOrder, Any]] | None = None,
              pace: Pace | None = None, move: LayoutMove | None = None,
              rebalance: Mover | None = None) -> StageResult:
    """Train all steps of one stage; returns its final figures (loss and eval on the last).

    ``on_checkpoint(StageCheckpoint)`` runs every ``shard_push_interval_steps`` (under DiLoCo
    at the next outer step) and after the last step, between optimiser steps, so it sees
    consistent weights and state.
    ``initial_state`` and ``initial_optimizer`` (from a checkpoint at ``start_step``) resume a
    run: with both, the steps after it are bit for bit those of the uninterrupted run (dropout
    masks depend on the seed, stage, step and micro-batch alone). A checkpoint that does not fit
    this stage raises :class:`ResumeError`. ``own_keys``: ``initial_state`` may hold more
    than this stage (a warm start's union of another split's shards): the stage takes its own
    parameters from it, every one of them, and leaves the rest.

    ``data`` may be a loader, called in this thread once the links are being opened (a BPE
    tokenizer trained on a cold cache can take longer than the neighbours' dial timeout; the
    links pulse meanwhile, for up to PREPARE_AFTER frame timeouts).
    A stage that fails before its links are up sets ``stop``, which ends their dial.

    ``coordinator``: with replicas, where the cell asks what to do when its group's ring
    breaks (a member died); without one, a broken ring fails the stage.

    ``pace``: an emulated slowdown (the fellow's, set live); None computes at full speed.

    ``move``: the job's layout changes at a step boundary (``pipeline/move``): this cell
    re-links there, stops there, or (one the move adds) starts there with its stage's state.
    ``rebalance``: such moves made as the run goes (``move.Rebalance``, decided in band, or
    ``move.GivenMoves``; default: what the spec's START names, ``move.mover_of``); a cell
    whose peer moves ends with the move in its result's ``moved``."""
    torch.set_num_threads(spec.training.threads)
    liveness = Liveness(STUCK_AFTER * spec.training.frame_timeout_s)
    arrives = move is not None and move.arrives(spec)
    opener = _LinkOpener(spec, shaper, listener, stop, connect_timeout, liveness,
                         move if arrives else None)
    try:
        runner = StageRunner(spec, data() if callable(data) else data, shaper, stop, liveness,
                             pace)
        group = runner.group
        # Swarm wiring routes every chain's micro-batches over every replica: a lost cell
        # breaks the whole step, which the survivors redo together (pipeline/reroute), not
        # only the ring of its group.
        group.coordinator = None if spec.routed else coordinator
        # (not where peers move: a move's epochs are not a regroup's; such a job's lost
        # cell ends it, for the leader to resume it)
        if spec.routed and coordinator is not None and not spec.moves \
                and spec.rebalance_every is None:
            runner.rerouter = Rerouter(runner, coordinator, start_step)
        group.listener, group.inbox = listener, inbox
        _restore(runner, initial_state, initial_optimizer, own_keys)
        initial_state = initial_optimizer = None  # (loaded: not held for the run)
    except BaseException:
        stop.set()
        opener.discard()
        raise
    try:
        runner.take_links(opener.result())
        if spec.join is not None and spec.replicas > 1:
            start_step = runner.group.join()
        if arrives:
            assert move is not None
            start_step = arrive(runner, move)
        return _train(runner, on_step, on_eval, on_checkpoint, start_step, move,
                      rebalance or mover_of(spec))
    finally:
        runner.close()


def _restore(runner: StageRunner, state: dict[str, torch.Tensor] | None,
             optimizer: dict[str, np.ndarray] | None, own_keys: bool = False) -> None:
    try:
        if state is not None:
            if own_keys:
                state = own_part(runner.module, state)
            runner.module.load_state_dict(state, strict=True)
        if optimizer is not None:
            inner, outer = split_outer(optimizer)
            load_optimizer_arrays(runner.opt, runner.module, inner)
            params = dict(runner.module.named_parameters())
            for key, arr in outer.items():
                name, _, field = key.rpartition(".")
                if name not in params or tuple(arr.shape) != tuple(params[name].shape):
                    raise OptimizerStateError(f"{field.replace('_', ' ')} {name!r} does not "
                                              "fit this stage's parameters")
            runner.group.resume = outer or None
    except (RuntimeError, OptimizerStateError) as exc:
        # load_state_dict lists every missing and unexpected key: the first line says enough.
        raise ResumeError(str(exc).strip().splitlines()[0]) from None


def own_part(module: torch.nn.Module, state: dict[str, torch.Tensor]
             ) -> dict[str, torch.Tensor]:
    """The entries of ``state`` that ``module`` holds, every one of them (ResumeError naming
    the first it lacks). Entries one tensor of the module holds under two names (tied
    weights) must agree: loading both would keep whichever came last."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ResumeError(f"the weights hold no {missing[0]!r}{more}")
    by_storage: dict[tuple[int, int], str] = {}
    for k, t in own.items():
        if not t.numel():
            continue  # (no storage to share)
        first = by_storage.setdefault((t.data_ptr(), t.numel()), k)
        if first != k and not torch.equal(state[first], state[k]):
            raise ResumeError(f"{first!r} and {k!r} are one tied tensor here, but the "
                              "weights hold two different ones")
    return {k: state[k] for k in own}


def _train(runner: StageRunner, on_step: Callable[[StepReport], None],
           on_eval: Callable[[int, float], None] | None,
           on_checkpoint: Callable[[StageCheckpoint], None] | None,
           start_step: int, move: LayoutMove | None = None,
           rebalance: Mover | None = None) -> StageResult:
    t = runner.spec.training
    reports: list[StepReport] = []
    t0 = time.perf_counter()
    moved = None
    if runner.spec.join is not None and on_checkpoint is not None \
            and runner.checkpoint_due(start_step):
        # A joiner taken in at a checkpoint's step: its members name it in that checkpoint
        # (it may even lead now), so it hands over the state it took from its donor.
        _checkpoint(runner, on_checkpoint, start_step)
    step = start_step
    while step < t.steps:
        if rebalance is not None and (step > start_step or rebalance.at_start):
            move = rebalance.decide(runner, step) or move
        if move is not None and step == move.at and move.was(runner.spec):
            if not move.stays(runner.spec):
                moved = move
                break  # (the move takes this cell's peer to another stage)
            relink(runner, move)
        try:
            rep = runner.train_step(step)
            step += 1
            reports.append(rep)
            on_step(rep)
            # The replicas of a stage hold the same weights: the first member checkpoints for
            # its group (and under DiLoCo each member its own optimiser state).
            if on_checkpoint is not None and runner.checkpoint_due(rep.step):
                _checkpoint(runner, on_checkpoint, rep.step)
            if t.eval_every and rep.step % t.eval_every == 0 and rep.step != t.steps:
                ev = evaluate(runner, rep.step)
                if ev is not None and on_eval is not None:
                    on_eval(rep.step, ev)
        except LINK_FAULTS as exc:  # (swarm wiring: a lost cell broke the step; see reroute)
            rerouter = runner.rerouter
            if rerouter is None or rerouter.applied + 1 >= t.steps:
                raise
            step = rerouter.regroup(exc)
            del reports[step - start_step:]  # (a step undone is reported again)
    eval_loss = evaluate(runner, t.steps)
    wall = time.perf_counter() - t0
    if on_checkpoint is not None and runner.leads:
        on_checkpoint(runner.checkpoint(t.steps, final=True))
    result = _summary(runner, reports, wall, start_step)
    result.moved = moved
    if eval_loss is not None:
        result.metrics.eval_loss, result.metrics.perplexity = eval_loss, perplexity(eval_loss)
        if on_eval is not None:
            on_eval(t.steps, eval_loss)
    return result


def _checkpoint(runner: StageRunner, on_checkpoint: Callable[[StageCheckpoint], None],
                step: int) -> None:
    ck = runner.checkpoint(step)
    if ck.leads or (ck.sync is not None and ck.sync.own_state):
        # (where each replica's state is its own, every member hands over its part)
        on_checkpoint(ck)


def _summary(runner: StageRunner, reports: list[StepReport], wall: float,
             start_step: int) -> StageResult:
    spec = runner.spec
    t = spec.training
    losses = [r.loss for r in reports if r.loss is not None]
    # Link waits of steps that follow a start, an eval or a shard push are partly the
    # neighbours' own pause; the run's share leaves them out (all of them: a short run).
    outer = runner.sync is not None and t.sync.periodic
    steady = [r for r in reports if not t.follows_a_pause(r.step, start_step, outer)] \
        or reports

    def mean_error(direction: str) -> float | None:
        values = [getattr(r.codec_error, direction) for r in reports]
        return statistics.fmean(values) if values and values[0] is not None else None

    metrics = StageMetrics(
        steps=len(reports), wall_s=wall,
        tokens_per_s=sum(r.tokens for r in reports) / wall if wall > 0 else 0.0,
        wire_tx_bytes_per_step=(sum(r.wire_tx_bytes for r in reports) / len(reports)
                                if reports else 0.0),
        expected_wire_tx_bytes_per_step=expected_wire_bytes(
            spec.model, t, spec.stage, spec.num_stages, spec.replicas, spec.replica,
            spec.layout, spec.measures_routes),
        activation_peak_bytes=max((r.activation_peak_bytes for r in reports), default=0),
        wait_fraction=_ratio(sum(r.wait_seconds for r in steady),
                             sum(r.seconds for r in steady)),
        codec_error=CodecErrors(act=mean_error("act"), grad=mean_error("grad")),
        slowdown=max((r.slowdown for r in reports if r.slowdown is not None), default=None),
        micro_batches=statistics.fmean(ran) if (
            ran := [r.micro_batches for r in reports if r.micro_batches is not None]) else None)
    if losses:
        metrics.final_loss, metrics.best_loss = losses[-1], min(losses)
    sent = runner.codecs.sent() if t.compress_when is not None else None
    metrics.link_codecs = sent
    if t.network is not None:
        metrics.peer_links = [attrs.evolve(p, codec=(sent or {}).get(p.peer)) for p in
                              peer_states(runner.shaper, spec.job_id,
                                          cell_label(spec.stage, spec.replica))]
    if runner.sync is not None and reports:
        metrics.sync_tx_bytes_per_step = sum(r.sync_tx_bytes or 0 for r in reports) / len(reports)
        metrics.sync_fraction = _ratio(sum(r.sync_seconds or 0.0 for r in reports),
                                       sum(r.seconds for r in reports))
        outer = t.sync.periodic
        metrics.expected_sync_tx_bytes_per_step = sum(
            runner.sync.planned_bytes(r.step - 1, r.step == t.steps,
                                      t.checkpoint_after(r.step, outer))
            for r in reports if t.sync.syncs_after(r.step, t.steps)) / len(reports)
    return StageResult(metrics, losses, runner.group.epoch,
                       [r.micro_batches for r in reports
                        if r.loss is not None and r.micro_batches is not None])


def _ratio(part: float, whole: float) -> float:
    return min(1.0, part / whole) if whole > 0 else 0.0
