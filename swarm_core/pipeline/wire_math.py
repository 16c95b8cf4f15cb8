"""What crosses a stage boundary, in bytes, without torch: codecs, widths, bytes per step.

The stage runner, the leader-side planner and the experiment runner (compression ratios in
``metrics_summary.json``) all count bytes with these functions.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Self

import attrs

from swarm_core.config.methods import BY_WIRE_ID, ELEMENTS, ROTATED, Element
from swarm_core.config.network import Placed
from swarm_core.config.schemas import ModelConfig, SyncConfig, TrainingConfig
from swarm_core.config.selective import Cell, boundary_compresses
from swarm_core.contract.placement import complete, slot_count
from swarm_core.pipeline.frames import HEADER_SIZE

NORM_PAYLOAD = 8  # one float64 per NORM frame


class Codec(enum.IntEnum):
    """A frame header's codec byte: ``methods.ELEMENTS``' wire ids, by name."""

    FP32 = 1
    FP16 = 2
    BF16 = 3
    # Symmetric absmax: the fp32 scales, then the codes. One scale per row (the last
    # dimension), or with a block B (the frame's codec_arg) one per B consecutive elements.
    INT8 = 4
    FP8 = 5  # float8 e4m3, scaled as INT8
    INT4 = 6  # 4-bit codes, two a byte, scaled as INT8
    FP4 = 7  # float4 e2m1, likewise
    # A tile of B (the codec_arg) rotated by a fixed randomized Hadamard transform, then its
    # scale and 4-bit (2-bit) codes; the tiles' scales first, as INT8's blocks.
    HADAMARD_INT4 = 8
    HADAMARD_INT2 = 9

    @property
    def element(self) -> Element:
        return BY_WIRE_ID[int(self)]

    @property
    def scaled(self) -> bool:
        """Codes with float32 scales, per row or per block (the frame's codec_arg)."""
        return self.element.scaled


CODEC_NAMES = {e.name: Codec(e.wire_id) for e in (*ELEMENTS.values(), *ROTATED.values())}


def payload_size(shape: tuple[int, ...], codec: Codec, block: int = 0) -> int:
    """Bytes of a ``shape`` tensor's payload under ``codec`` (``block``: a scaled codec's
    scale block, 0 for one scale per row)."""
    return codec.element.payload_size(shape, block)


@attrs.frozen
class WireFormat:
    """How tensors cross a stage boundary: the codec, and a scaled codec's block (0: one scale
    per row; carried in each frame's header as its codec_arg). Built once from the model's spec;
    :class:`swarm_core.pipeline.codecs.WireCodec` adds the coding itself."""

    codec: Codec = Codec.FP32
    block: int = 0

    @classmethod
    def of(cls, cfg: ModelConfig) -> Self:
        """What a model's compression spec and wire dtype put on its boundaries."""
        comp = cfg.compression_spec
        return cls(CODEC_NAMES[comp.element or cfg.wire_dtype], comp.block)

    @classmethod
    def of_sync(cls, sync: SyncConfig) -> Self:
        """How a stage group's ring codes what it averages (``sync.compression``)."""
        name, block = sync.codec
        return cls(CODEC_NAMES[name], block)

    @property
    def exact(self) -> bool:
        """fp32: what crosses is what was sent."""
        return self.codec is Codec.FP32

    def payload_size(self, shape: tuple[int, ...]) -> int:
        return payload_size(shape, self.codec, self.block)


def boundary_width(cfg: ModelConfig) -> int:
    """Values per token that cross a boundary: a bottleneck's or a subspace's K, else d."""
    comp = cfg.compression_spec
    if comp.subspace is not None:
        return comp.subspace
    return comp.bottleneck_dim if comp.bottleneck_dim is not None else cfg.d_model


def link_format(model: ModelConfig, training: TrainingConfig, src: Cell, dst: Cell,
                num_stages: int, placed: Placed | None = None) -> WireFormat:
    """How cell ``src`` codes what it sends cell ``dst`` across a stage boundary: the model's
    spec, or spec ``none``'s where ``training.compress_when`` leaves the link out (the
    cells' sites by ``placed`` first, where it names them: a moved peer's)."""
    if boundary_compresses(training, src, dst, num_stages, placed):
        return WireFormat.of(model)
    return WireFormat.of(attrs.evolve(model, compression="none", bottleneck_dim=None))


def link_bytes(model: ModelConfig, training: TrainingConfig, src: Cell, dst: Cell,
               num_stages: int, replicas: int = 1, norm: bool = True,
               placed: Placed | None = None) -> int:
    """Bytes cell ``src`` sends its pipeline neighbour ``dst`` in one training step, headers
    included: its micro-batches' ACT (forward) or GRAD (backward) frames in the link's own
    format (``link_format``), and (``norm``) with clipping the norm exchange's frame."""
    mb = training.batch_size // replicas // training.micro_batches
    shape = (mb, model.seq_len, boundary_width(model))
    wire = link_format(model, training, src, dst, num_stages, placed)
    sent = training.micro_batches * (HEADER_SIZE + wire.payload_size(shape))
    return sent + (HEADER_SIZE + NORM_PAYLOAD if norm and training.grad_clip > 0 else 0)


def norm_bytes(training: TrainingConfig, stage: int, num_stages: int, replica: int = 0,
               layout: Sequence[Sequence[int]] | None = None, width: int = 1,
               measured: bool = False) -> int:
    """Bytes of the NORM frames cell (``stage``, ``replica``) sends in one step. The exchange
    runs with clipping, and always under measured routes, whose table rides it: each frame
    then holds the chain's sum and each stage's row of ``width`` figures
    (``route_meter.chain_table``; ``width`` the job's cell ids). A whole chain's cell sends
    one frame up and one down its chain; under a ``layout`` an id-0 cell also tells the
    incomplete cells beside it and an incomplete cell sends none (``layout.norm_relay``)."""
    if not (measured or training.grad_clip > 0):
        return 0
    if not complete(layout, replica):
        return 0
    frames = (stage > 0) + (stage < num_stages - 1)
    if layout is not None and replica == 0:
        if stage + 1 < num_stages:
            frames += sum(not complete(layout, r) for r in layout[stage + 1])
        if stage == 1:
            frames += sum(not complete(layout, r) for r in layout[0])
    values = 1 + (num_stages * width if measured else 0)
    return frames * (HEADER_SIZE + NORM_PAYLOAD * values)


def expected_wire_bytes(model: ModelConfig, training: TrainingConfig, stage: int,
                        num_stages: int, replicas: int = 1, replica: int = 0,
                        layout: Sequence[Sequence[int]] | None = None,
                        measured: bool = False) -> int:
    """Bytes replica ``replica`` of this stage sends its pipeline neighbours in one training
    step (a stage group's synchronisation is counted apart): its micro-batches' frames
    (a routed cell's, had the route dealt it its share: M of them) and its NORM frames
    (``norm_bytes``; ``layout`` and ``measured``: a swarm-wired job's)."""
    width = slot_count(layout, replicas)
    return sum(link_bytes(model, training, (stage, replica), (peer, replica), num_stages,
                          replicas, norm=False)
               for peer in (stage + 1, stage - 1) if 0 <= peer < num_stages) \
        + norm_bytes(training, stage, num_stages, replica, layout, width, measured)


def step_boundary_bytes(model: ModelConfig, training: TrainingConfig, num_stages: int,
                        replicas: int = 1) -> tuple[int, int]:
    """Bytes of the ACT frames forward and of the GRAD frames backward that all stages (every
    replica's chain) put on the pipeline's links in one step, headers included; the NORM
    frames of gradient clipping are in ``step_wire_bytes`` only. Every spec codes both
    directions alike, so the two are equal but where ``compress_when`` selects by an
    asymmetric rate; they are counted apart so that a figure reads the direction it means."""
    mb = training.batch_size // replicas // training.micro_batches
    shape = (mb, model.seq_len, boundary_width(model))
    act = grad = 0
    for r in range(replicas):
        for s in range(num_stages - 1):
            a, b = (s, r), (s + 1, r)
            act += HEADER_SIZE + link_format(model, training, a, b, num_stages).payload_size(shape)
            grad += HEADER_SIZE + link_format(model, training, b, a, num_stages).payload_size(
                shape)
    return act * training.micro_batches, grad * training.micro_batches


def run_wire_bytes(model: ModelConfig, training: TrainingConfig, num_stages: int,
                   replicas: int = 1, layout: Sequence[Sequence[int]] | None = None,
                   measured: bool = False,
                   moves: Sequence[tuple[int, int, int, int, int]] = ()) -> float:
    """``step_wire_bytes`` over a run whose peers moved: the mean over its steps of each
    step's, under the layout in force (``moves``: (at, source, cell, target, new_id), the
    0-based step each is made before, in order; a move adds relays and widens the measured
    table). Without moves, ``step_wire_bytes``."""
    if not moves:
        return step_wire_bytes(model, training, num_stages, replicas, layout, measured)
    now = [set(ids) for ids in layout] if layout else \
        [set(range(replicas)) for _ in range(num_stages)]
    total, since = 0.0, 0
    for at, source, cell, target, new_id in [*moves, (training.steps, -1, -1, -1, -1)]:
        at = min(at, training.steps)
        shape = [sorted(ids) for ids in now]
        total += (at - since) * step_wire_bytes(model, training, num_stages, replicas, shape,
                                                measured)
        since = at
        if source >= 0:
            now[source].discard(cell)
            now[target].add(new_id)
    return total / max(1, training.steps)


def uncompressed_model(model: ModelConfig) -> ModelConfig:
    """The same model with spec ``none`` on an fp32 wire: what a ratio "to none" divides."""
    return attrs.evolve(model, compression="none", bottleneck_dim=None, wire_dtype="fp32")


def step_wire_bytes(model: ModelConfig, training: TrainingConfig, num_stages: int,
                    replicas: int = 1, layout: Sequence[Sequence[int]] | None = None,
                    measured: bool = False) -> int:
    """Bytes all stages (every replica's chain) put on the pipeline's links in one step. A
    swarm ``layout``'s stages deal the same R x M micro-batches over their cells, so its
    frames are the grid's; its NORM frames are its own cells' (``norm_bytes``)."""
    frames = sum(link_bytes(model, training, (s, r), (peer, r), num_stages, replicas,
                            norm=False)
                 for r in range(replicas) for s in range(num_stages)
                 for peer in (s + 1, s - 1) if 0 <= peer < num_stages)
    width = slot_count(layout, replicas)
    cells = [(s, r) for s, ids in enumerate(layout) for r in ids] if layout else \
        [(s, r) for r in range(replicas) for s in range(num_stages)]
    return frames + sum(norm_bytes(training, s, num_stages, r, layout, width, measured)
                        for s, r in cells)
