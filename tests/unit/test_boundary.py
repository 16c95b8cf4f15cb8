"""Boundary codecs as objects with state: a method registered by name in
``config.methods.BOUNDARY_FORMS`` gives each side of each direction of a boundary a codec of its
own, which may keep state per micro-batch slot; the pipeline and the single-process reference
both run it. The method here is a test's: each frame is the XOR of its float bits with the
previous frame of the same slot, exact only where the sender's and receiver's states move in
lockstep, per direction and per slot."""

from __future__ import annotations

import socket

import attrs
import pytest
import torch

from swarm_core.config import methods
from swarm_core.config.schemas import ModelConfig, TrainingConfig, parse_compression
from swarm_core.contract.placement import split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline import codecs
from swarm_core.pipeline.boundary import Boundary, make_boundary
from swarm_core.pipeline.frames import FrameError, Kind
from swarm_core.pipeline.links import LinkShaper
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.reference import train_reference
from swarm_core.pipeline.stage import StageResult
from swarm_core.pipeline.transport import PeerLink

MODEL = dict(d_model=32, n_layers=3, n_heads=2, seq_len=16)


class XorCodec:
    """One side: the bits of each frame XOR those of the slot's previous frame."""

    wire = codecs.FP32_WIRE

    def __init__(self) -> None:
        self.prev: dict[int, torch.Tensor] = {}

    def _turn(self, bits: torch.Tensor, slot: int, sent: bool) -> torch.Tensor:
        prev = self.prev.get(slot)
        out = bits ^ prev if prev is not None else bits.clone()
        self.prev[slot] = bits.clone() if sent else out.clone()
        return out

    def encode(self, x: torch.Tensor, slot: int = 0, step: int = 0,
               draw: int | None = None) -> list[memoryview]:
        bits = x.detach().float().contiguous().view(torch.int32)
        return [codecs.as_bytes(self._turn(bits, slot, sent=True))]

    def decode(self, payload, shape, device=None, slot: int = 0) -> torch.Tensor:
        got = torch.frombuffer(bytearray(payload), dtype=torch.int32).reshape(shape)
        return self._turn(got, slot, sent=False).view(torch.float32).to(device or "cpu")


class XorBoundary(Boundary):
    made: list[XorCodec] = []

    def codec(self, kind, sending):
        c = XorCodec()
        XorBoundary.made.append(c)
        return c

    @property
    def exact(self) -> bool:
        return False  # (the reference runs it too)


@pytest.fixture
def xor_form(monkeypatch):
    monkeypatch.setattr(methods, "BOUNDARY_FORMS", (*methods.BOUNDARY_FORMS, methods.BoundaryForm(
        "test_xor", "a test's stateful codec", f"{__name__}:XorBoundary")))
    XorBoundary.made = []


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


def test_a_registered_boundary_is_made_by_its_name(xor_form):
    c = parse_compression("test_xor", d_model=32)
    assert (c.form, c.element, c.bottleneck_dim) == ("test_xor", None, None)
    assert isinstance(make_boundary(ModelConfig(**MODEL, compression="test_xor")), XorBoundary)
    assert type(make_boundary(ModelConfig(**MODEL))) is Boundary


def test_a_stateful_codec_keeps_state_per_side_direction_and_slot(xor_form, data):
    """Three stages: every boundary's ACT and GRAD frames cross XORed with their slot's last;
    the losses are fp32's to 1e-5 only if each side of each direction has its own state."""
    mc = ModelConfig(**MODEL, compression="test_xor")
    tc = TrainingConfig(steps=5, batch_size=8, micro_batches=2, eval_batches=1)
    res = run_local_pipeline(mc, tc, data, 3)
    assert all(isinstance(r, StageResult) for r in res.values()), res
    ranges = split_layers(mc.n_layers, [1, 1, 1])
    plain, _ = train_reference(ModelConfig(**MODEL), tc, data, ranges)
    got = res[2].losses  # type: ignore[union-attr]
    assert max(abs(a - b) for a, b in zip(plain, got, strict=True)) <= 1e-5
    # Each stage took its sides: stage 0 two, stage 1 four, stage 2 two (and the slots of
    # training, 0 and 1, and of evaluation each kept apart).
    sides = [c for c in XorBoundary.made if c.prev]
    assert len(sides) == 8
    assert {0, 1, 1_000_000} <= set().union(*(c.prev for c in sides))
    # The single-process reference runs the same codec forward and backward.
    ref, _ = train_reference(mc, tc, data, ranges)
    assert max(abs(a - b) for a, b in zip(plain, ref, strict=True)) <= 1e-6


def test_a_frame_coded_otherwise_than_the_receiver_expects_is_refused():
    a, b = socket.socketpair()
    left = PeerLink(a, LinkShaper(), 0, "left", receives=set())
    right = PeerLink(b, LinkShaper(), 0, "right", receives={Kind.ACT})
    try:
        left.send_tensor(Kind.ACT, 0, 0, torch.ones(2, 4), codecs.WireCodec(codecs.Codec.INT8))
        with pytest.raises(FrameError, match="coded INT8 block 0, expected FP8 block 0"):
            right.recv_tensor(Kind.ACT, 0, 0, 5.0, codec=codecs.WireCodec(codecs.Codec.FP8))
    finally:
        left.close()
        right.close()


def test_the_learned_bottleneck_is_the_boundarys_and_trains_as_before(data):
    """The halves of ``learned_dim8`` come from the boundary object, under the same part seeds
    and names: the weights are those built before it owned them."""
    from swarm_core.pipeline.model import BottleneckDown, StageModule, seeded

    mc = ModelConfig(**MODEL, compression="learned_dim8")
    stage = StageModule(mc, data.vocab_size, 0, 0, 1, 0, 2)
    assert stage.down is not None and isinstance(stage.down["0"], BottleneckDown)
    before = seeded(0, "down0", lambda: BottleneckDown(mc, 8))
    for (n, p), (m, q) in zip(stage.down["0"].named_parameters(), before.named_parameters(),
                              strict=True):
        assert n == m and torch.equal(p, q)
    assert attrs.evolve(mc, compression="none").compression_spec.bottleneck_dim is None
