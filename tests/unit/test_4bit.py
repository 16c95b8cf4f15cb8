"""``int4`` and ``fp4`` (e2m1): 4-bit codes two to a byte with a float32 scale per row or
block, registered as elements for the replicas' sync compression (``int4_b64``, ``fp4``):
pseudo-gradients first. fp4 is not a boundary spec; int4 is, in blocks (``fixed_int4_bB``:
the unrotated row beside ``hadamard_int4``, tests/unit/test_hadamard.py)."""

from __future__ import annotations

import pytest
import torch

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.data import load_token_data
from swarm_core.pipeline import codecs
from swarm_core.pipeline.codecs import Codec
from swarm_core.pipeline.frames import HEADER_SIZE
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.model import StageModule
from swarm_core.pipeline.stage import StageResult
from swarm_core.schema import SchemaError, structure
from tests.unit.test_ring import _all_reduce, _check_means

MODEL = dict(d_model=32, n_layers=3, n_heads=2, seq_len=16)


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


@pytest.mark.parametrize("codec", [Codec.INT4, Codec.FP4])
@pytest.mark.parametrize("shape, block", [((6, 64), 0), ((6, 64), 16), ((7,), 0), ((3, 5), 0)])
def test_4bit_codes_pack_two_a_byte_after_their_scales(codec, shape, block):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    payload = b"".join(bytes(b) for b in codecs.encode(x, codec, block))
    n = x.numel()
    groups = n // (block or shape[-1])
    assert len(payload) == codecs.payload_size(shape, codec, block) == groups * 4 + (n + 1) // 2
    y = codecs.decode(bytearray(payload), shape, codec, block=block)
    assert torch.equal(y, codecs.roundtrip(x, codec, block))
    # Each element within half a step of the grid at its magnitude: int4's step is the
    # scale; e2m1's largest is 2 scales (between 4 and 6).
    scale = x.abs().reshape(-1, block or shape[-1]).amax(dim=1, keepdim=True) / \
        (7 if codec is Codec.INT4 else 6)
    err = (y - x).abs().reshape(scale.shape[0], -1)
    assert bool((err <= scale * (0.5 if codec is Codec.INT4 else 1.0) * (1 + 1e-6)).all())


def test_fp4_rounds_to_the_nearest_e2m1_value_ties_to_even():
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.75, 0.0, 0.1, -6.0]])
    assert codecs.roundtrip(x, Codec.FP4).tolist() == [
        [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, 0.0, 0.0, -6.0]]
    grid = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -3.0]]) * 0.37
    assert torch.allclose(codecs.roundtrip(grid, Codec.FP4), grid, rtol=1e-6, atol=0)


def test_int4_codes_are_the_integers_minus_7_to_7_of_the_scale():
    x = torch.tensor([[7.0, -7.0, 3.0, 0.5, 1.5, -2.5, 0.0]])
    assert codecs.roundtrip(x, Codec.INT4).tolist() == [[7.0, -7.0, 3.0, 0.0, 2.0, -2.0, 0.0]]


@pytest.mark.parametrize("compression", ["int4_b64", "fp4_b32", "fp4"])
def test_a_4bit_ring_leaves_every_member_the_same_mean(compression):
    gen = torch.Generator().manual_seed(0)
    tensors = [[torch.randn(40, 16, generator=gen), torch.randn(320, generator=gen)]
               for _ in range(3)]
    got = _all_reduce(tensors, compression)
    _check_means(tensors, got, compression, 0.5)


def test_int4_sync_sends_half_a_byte_an_element_and_trains(data):
    """dp over 2 replicas with int4 gradients in blocks of 64: each replica sends exactly its
    ring's bytes (half a byte an element, a scale a block, R-1 confirmations)."""
    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 8, "batch_size": 8, "micro_batches": 2, "eval_batches": 0,
                    "lr": 1e-3, "sync": {"compression": "int4_b64"}}, TrainingConfig)
    res = run_local_pipeline(mc, tc, data, 1, replicas=2, timeout=120)
    assert all(isinstance(r, StageResult) for r in res.values()), res
    n = sum(p.numel() for p in StageModule(mc, data.vocab_size, 0, 0, 3, 0, 1).parameters())
    padded = -(-n // 64) * 64  # (the ring's buffer: whole blocks)
    for r in res.values():
        assert isinstance(r, StageResult)
        m = r.metrics
        frames = 2
        expected = frames * HEADER_SIZE + padded // 2 + (padded // 64) * 4 + (HEADER_SIZE + 4)
        assert m.sync_tx_bytes_per_step == m.expected_sync_tx_bytes_per_step == expected
    losses = res[0].losses  # type: ignore[union-attr]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("spec", ["fixed_fp4", "fixed_fp4_b32", "learned_dim8_fp4"])
def test_fp4_codes_are_not_boundary_specs(spec):
    """(int4 in blocks is: the row beside the rotated low-bit boundary, its own method.)"""
    with pytest.raises(SchemaError, match="unknown compression"):
        structure({**MODEL, "compression": spec}, ModelConfig)
