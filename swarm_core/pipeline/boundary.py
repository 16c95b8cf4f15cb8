"""What a compression spec puts at each stage boundary, as objects: the trainable modules on
either side (a learned bottleneck's halves) and a codec for each side of each direction.

A :class:`BoundaryCodec` codes what one stage sends on one direction of one link, or decodes
what it receives there, and may keep state per micro-batch slot (the frame's micro-batch
number): a fixed basis, error feedback, a per-sample reference. The sender's and the
receiver's state then move in lockstep, since every slot's frames cross in order. The
stateless codecs (``WireCodec``: casts, int8, fp8) are one object for every side and slot.

A spec's :class:`Boundary` is found through ``config.methods.BOUNDARY_FORMS`` (its ``impl``;
the default is this module's :class:`Boundary`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from swarm_core.config import methods
from swarm_core.config.schemas import ModelConfig
from swarm_core.pipeline.codecs import WireCodec, relative_l2
from swarm_core.pipeline.frames import Kind


class BoundaryCodec(Protocol):
    """One side of one direction of a boundary (see the module's docstring)."""

    @property
    def wire(self) -> WireCodec:
        """What its frames' headers say (codec byte and block), and the format's bytes."""
        ...

    def encode(self, x: torch.Tensor, slot: int = 0, step: int = 0,
               draw: int | None = None) -> list[memoryview]:
        """``x`` as the buffers of a frame for micro-batch ``slot`` of (0-based) ``step``: a
        codec that draws random numbers keys them by ``draw`` (the micro-batch's place in
        the step's whole batch, which chain-wired replicas do not share: replica r's slot i
        of M is r x M + i; None: ``slot``) and ``step``, so a step trained again (a routed
        redo, a resumed run) draws what it drew the first time, and replicas draw apart as
        one process over the whole batch does."""
        ...

    def decode(self, payload: bytes | bytearray | memoryview, shape: tuple[int, ...],
               device: torch.device | None = None, slot: int = 0) -> torch.Tensor:
        """A float32 tensor of ``shape`` from a frame for micro-batch ``slot``."""
        ...


class Frame(Protocol):
    """A fixed module every stage holds alike (see :meth:`Boundary.frame_module`)."""

    def enter(self, x: torch.Tensor, tokens: torch.Tensor, first: bool) -> torch.Tensor:
        """The stream at a stage's start, from its input ``x`` (the first stage: the
        embedding's output; the others: what crossed) and the micro-batch's ids."""
        ...

    def leave(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """What crosses to the next stage, from the stream at this stage's end."""
        ...

    def project_(self, t: torch.Tensor, axis: int) -> None:
        """A residual writer (or its gradient) made one the frame carries, in place."""
        ...


class Boundary:
    """The default: a learned bottleneck's halves where the spec names a width, and the
    model's stateless wire codec both ways."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.width = cfg.compression_spec.bottleneck_dim
        self.format = WireCodec.of(cfg)

    def sender_module(self) -> nn.Module | None:
        """What the stage before the boundary runs last (trained with it)."""
        from swarm_core.pipeline.model import BottleneckDown

        return None if self.width is None else BottleneckDown(self.cfg, self.width)

    def receiver_module(self) -> nn.Module | None:
        """What the stage after the boundary runs first (trained with it)."""
        from swarm_core.pipeline.model import BottleneckUp

        return None if self.width is None else BottleneckUp(self.cfg, self.width)

    def frame_module(self, vocab: int) -> Frame | None:
        """A fixed module every stage holds, the same on each (built under the part seed
        ``subspace``): what crosses then is ``frame.leave(x, tokens)``, and a stage starts
        from ``frame.enter(x, tokens, first)``; ``frame.project_`` keeps the residual
        writers where it can carry them (``StageModule.constrain_``). None: no frame."""
        return None

    def codec(self, kind: Kind, sending: bool) -> BoundaryCodec:
        """The codec of one side (``sending`` or receiving) of ``kind``'s direction (ACT
        forward, GRAD backward). Each call of a stateful boundary's gives an object of its
        own."""
        return self.format

    @property
    def exact(self) -> bool:
        """What crosses is what was sent (the single-process model then skips the codec)."""
        return self.format.exact

    def simulator(self) -> BoundarySimulator:
        """The boundary in one process (the reference model), forward and backward."""
        return BoundarySimulator(self)


class BoundarySimulator:
    """One boundary's wire in one process: each direction's sending and receiving sides,
    coded and decoded in turn, as the pipeline's two stages do."""

    def __init__(self, boundary: Boundary) -> None:
        self.sides = {kind: (boundary.codec(kind, True), boundary.codec(kind, False))
                      for kind in (Kind.ACT, Kind.GRAD)}

    def roundtrip(self, kind: Kind, x: torch.Tensor, slot: int, step: int = 0) -> torch.Tensor:
        send, recv = self.sides[kind]
        if send is recv and isinstance(send, WireCodec):  # (stateless: no bytes needed)
            return send.roundtrip(x)
        payload = bytearray().join(send.encode(x.detach(), slot, step))
        return recv.decode(payload, tuple(x.shape), x.device, slot)


def decoded_error(x: torch.Tensor, bufs: list[memoryview], wire: WireCodec) -> float:
    """||d - x|| / ||x||, d what the receiver decodes from the frame ``bufs`` that was coded
    from ``x`` in format ``wire``: the error of what actually crossed, so a sender that
    rounds stochastically, or keeps state, is measured as it coded (its format's own
    round trip, ``wire.relative_error``, rounds to nearest and would understate it). Every
    receiving side today is its stateless wire format, so decoding here is what the far side
    does. 0 for an exact format; NaN for a tensor that is not finite."""
    if wire.exact:
        return 0.0
    return relative_l2(x, lambda v: wire.decode(bytearray().join(bufs), tuple(v.shape), v.device))


def make_boundary(cfg: ModelConfig) -> Boundary:
    """The boundary a model's compression spec names (its registered ``impl``, else the
    default)."""
    grammar = cfg.compression_spec.form
    impl = next((f.impl for f in methods.BOUNDARY_FORMS if f.grammar == grammar and f.impl), "")
    if not impl:
        return Boundary(cfg)
    made: Boundary = methods.load(impl)(cfg)
    return made
