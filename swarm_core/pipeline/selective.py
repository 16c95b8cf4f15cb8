"""Selective compression at a stage (issue 34 point 4): which codec each of its links uses.

``training.compress_when`` (config/selective.py) names the links a compression applies to;
every other link sends as spec ``none`` does. Both ends work the answer out from the job's
spec alone, so a receiver expects exactly the codec its sender codes with (the transport
refuses a frame whose header names another).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from swarm_core.config.network import Placed
from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.config.selective import boundary_compresses, group_compresses
from swarm_core.pipeline.boundary import Boundary, BoundaryCodec
from swarm_core.pipeline.codecs import WireCodec
from swarm_core.pipeline.frames import Kind
from swarm_core.pipeline.peers import cell_label
from swarm_core.pipeline.wire_math import WireFormat

if TYPE_CHECKING:
    from swarm_core.pipeline.stage import StageLinks, StageSpec
    from swarm_core.pipeline.transport import PeerLink


def plain_model(model: ModelConfig) -> ModelConfig:
    """The model with spec ``none``: what a link the rule leaves out sends (its wire_dtype)."""
    return attrs.evolve(model, compression="none", bottleneck_dim=None)


def boundary_formats(model: ModelConfig, training: TrainingConfig) -> tuple[WireFormat, ...]:
    """Every format a stage's boundary frames may come in (for a link's frame limit)."""
    coded = WireFormat.of(model)
    return (coded,) if training.compress_when is None \
        else (coded, WireFormat.of(plain_model(model)))


def wire_name(wire: WireFormat) -> str:
    """A format as a summary shows it: ``fp32``, ``int8``, ``int8_b64``."""
    name = wire.codec.element.name
    return f"{name}_b{wire.block}" if wire.block else name


class LinkCodecs:
    """A stage's codec for each side of each direction of its boundaries, link by link: the
    boundary's own (``Boundary.codec``) where the rule covers the link (or there is no rule),
    else the plain one of spec ``none``."""

    def __init__(self, spec: StageSpec, boundary: Boundary) -> None:
        self.spec = spec
        self.coded: dict[tuple[Kind, bool], BoundaryCodec] = {
            (kind, sending): boundary.codec(kind, sending)
            for kind in (Kind.ACT, Kind.GRAD) for sending in (True, False)}
        self.plain = WireCodec.of(plain_model(spec.model))
        self._chosen: dict[tuple[Kind, bool, int], BoundaryCodec] = {}

    def pick(self, kind: Kind, sending: bool, link: PeerLink, links: StageLinks
             ) -> BoundaryCodec:
        """The codec for ``kind``'s frames this stage sends (``sending``) or receives on
        ``link``, one of ``links``: its chain's, or (swarm wiring) that to another replica."""
        downstream = (kind is Kind.ACT) == sending  # (ACT out, GRAD in: the next stage's)
        side = links.downs if downstream else links.ups
        replica = next((r for r, x in side.items() if x is link), self.spec.replica)
        key = (kind, sending, replica)
        if key not in self._chosen:
            self._chosen[key] = self.coded[(kind, sending)] \
                if self.compresses(downstream, sending, replica) else self.plain
        return self._chosen[key]

    def compresses(self, downstream: bool, sending: bool, replica: int) -> bool:
        """Whether the link between this cell and ``replica``'s cell of the next stage
        (``downstream``) or the one before codes, in the direction ``sending`` says."""
        s = self.spec
        own, peer = (s.stage, s.replica), (s.stage + (1 if downstream else -1), replica)
        src, dst = (own, peer) if sending else (peer, own)
        return boundary_compresses(s.training, src, dst, s.num_stages, s.placement)

    def sent(self) -> dict[str, str]:
        """What this cell sends each peer cell it may send to, by the peer's label (``1.0``):
        its boundaries' frames, and its group's sync to the next member of its ring."""
        s = self.spec
        out: dict[str, str] = {}
        for downstream, stage in ((True, s.stage + 1), (False, s.stage - 1)):
            if 0 <= stage < s.num_stages:
                for r in s.ids(stage) if s.routed else (s.replica,):
                    fmt = self.coded[(Kind.ACT if downstream else Kind.GRAD, True)].wire \
                        if self.compresses(downstream, True, r) else self.plain
                    out[cell_label(stage, r)] = wire_name(fmt)
        ring = s.ids(s.stage)  # (its group's ring, in id order: a layout's ids too)
        if len(ring) > 1 and s.replica in ring:
            nxt = ring[(ring.index(s.replica) + 1) % len(ring)]
            out[cell_label(s.stage, nxt)] = wire_name(sync_codec(s))
        return out


def sync_codec(spec: StageSpec) -> WireCodec:
    """How this cell's group codes its sync (``group_codec`` over its stage's cells)."""
    return group_codec(spec.training, spec.stage, spec.ids(spec.stage), spec.num_stages,
                       spec.placement)


def group_codec(training: TrainingConfig, stage: int, ids: Sequence[int], num_stages: int,
                placed: Placed | None = None) -> WireCodec:
    """How stage ``stage``'s group of cells ``ids`` codes its sync: ``sync.compression``, or
    fp32 where the rule covers no link of the group (one answer for the group:
    ``group_compresses``)."""
    if group_compresses(training, stage, ids, num_stages, placed):
        return WireCodec.of_sync(training.sync)
    return WireCodec()
