"""``fp8`` (float8 e4m3, absmax scale per row or block): the codec, the boundary specs
``fixed_fp8[_bB]`` / ``learned_dimK_fp8[_bB]`` and the sync compression ``fp8[_bB]``.

FP8 is lossy, so there is no exactness against an fp32 process: the pipeline is checked against
the in-process simulation of the same boundary (the codec forward and backward), its bytes are
checked exactly, and its loss falls.
"""

from __future__ import annotations

import pytest
import torch

from swarm_core.config.schemas import ModelConfig, TrainingConfig, parse_compression
from swarm_core.contract.placement import split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline import codecs
from swarm_core.pipeline.codecs import Codec
from swarm_core.pipeline.frames import HEADER_SIZE
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.model import StageModule
from swarm_core.pipeline.reference import train_reference
from swarm_core.pipeline.stage import StageResult
from swarm_core.schema import SchemaError, structure
from tests.unit.test_ring import _all_reduce, _check_means

MODEL = dict(d_model=32, n_layers=3, n_heads=2, seq_len=16)


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


def _bytes(bufs: list[memoryview]) -> bytes:
    return b"".join(bytes(b) for b in bufs)


@pytest.mark.parametrize("block", [0, 16])
def test_fp8_codes_a_scale_per_row_or_block_and_a_byte_an_element(block):
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    payload = _bytes(codecs.encode(x, Codec.FP8, block))
    groups = 6 * (64 // block if block else 1)
    assert len(payload) == codecs.payload_size((6, 64), Codec.FP8, block) == groups * 4 + 6 * 64
    y = codecs.decode(bytearray(payload), (6, 64), Codec.FP8, block=block)
    # e4m3 keeps 3 mantissa bits: each element within 2^-4 of itself (the smallest, near the
    # subnormals of its scale, within a step of the grid there), the row's largest exact.
    scale = x.abs().reshape(-1, block or 64).amax(dim=1, keepdim=True) / 448
    err = (y - x).abs().reshape(-1, block or 64)
    assert bool((err <= torch.maximum(x.abs().reshape(err.shape) / 16, scale * 2**-9)).all())
    big = x.abs().reshape(-1, block or 64).argmax(dim=1)
    assert torch.allclose(y.reshape(err.shape).gather(1, big[:, None]),
                          x.reshape(err.shape).gather(1, big[:, None]), rtol=1e-6)
    assert torch.equal(codecs.roundtrip(x, Codec.FP8, block), y)


def test_fp8_keeps_the_small_elements_of_a_row_that_int8_loses():
    """An outlier sets a row's scale: int8's uniform grid then rounds the row's small
    elements to a few levels, e4m3's exponent keeps them to 2 significant digits."""
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(1))
    x[0, 0] = 1000.0
    small = slice(1, None)
    fp8 = (codecs.roundtrip(x, Codec.FP8) - x)[0, small].norm() / x[0, small].norm()
    int8 = (codecs.roundtrip(x, Codec.INT8) - x)[0, small].norm() / x[0, small].norm()
    assert fp8 < 0.1 < int8


def test_a_zero_row_and_an_empty_tensor_cross_fp8():
    z = torch.zeros(3, 8)
    assert torch.equal(codecs.roundtrip(z, Codec.FP8), z)
    assert codecs.payload_size((0, 8), Codec.FP8) == 0
    assert codecs.decode(bytearray(), (0, 8), Codec.FP8).shape == (0, 8)


@pytest.mark.parametrize("spec, dim, element, block", [
    ("fixed_fp8", None, "fp8", 0), ("fixed_fp8_b16", None, "fp8", 16),
    ("learned_dim8_fp8", 8, "fp8", 0), ("learned_dim8_fp8_b4", 8, "fp8", 4),
])
def test_fp8_boundary_specs_parse(spec, dim, element, block):
    c = parse_compression(spec, d_model=32)
    assert (c.bottleneck_dim, c.element, c.block, c.int8) == (dim, element, block, False)


@pytest.mark.parametrize("spec, needle", [
    ("fixed_fp8_b3", "fp8 block 3 in 'fixed_fp8_b3' must be 2..65535 and divide the "
                     "boundary's width (32)"),
    ("fixed_fp4", "valid forms"), ("fixed", "valid forms"), ("fixed_fp8_b", "valid forms"),
])
def test_a_bad_fp8_spec_is_a_config_error_naming_it(spec, needle):
    with pytest.raises(SchemaError) as exc:
        structure({**MODEL, "compression": spec}, ModelConfig)
    assert needle in exc.value.message and exc.value.field == "$.compression"


@pytest.mark.parametrize("spec", ["fixed_fp8", "learned_dim8_fp8_b4"])
def test_an_fp8_pipeline_sends_its_bytes_trains_and_matches_its_own_reference(data, spec):
    mc = ModelConfig(**MODEL, compression=spec)
    tc = TrainingConfig(steps=12, batch_size=8, micro_batches=2, eval_batches=0)
    res = run_local_pipeline(mc, tc, data, 2)
    assert all(isinstance(r, StageResult) for r in res.values()), res
    width, groups = (32, 1) if spec == "fixed_fp8" else (8, 2)
    rows = (8 // 2) * MODEL["seq_len"]
    payload = rows * width + rows * groups * 4
    expected = 2 * (HEADER_SIZE + payload) + HEADER_SIZE + 8  # 2 micro-batches, 1 norm frame
    for r in res.values():
        assert isinstance(r, StageResult)
        assert r.metrics.wire_tx_bytes_per_step == r.metrics.expected_wire_tx_bytes_per_step \
            == expected
    got = res[1].losses  # type: ignore[union-attr]
    assert got[-1] < got[0]
    # One process with the same boundary simulated (e4m3 forward and backward): the same
    # losses, to float tolerance; an fp32 boundary trains otherwise.
    ref, _ = train_reference(mc, tc, data, split_layers(mc.n_layers, [1, 1]))
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    # (and it is e4m3 that crossed: int8 codes in the same bytes train otherwise)
    int8, _ = train_reference(ModelConfig(**MODEL, compression=spec.replace("fp8", "int8")), tc,
                              data, split_layers(mc.n_layers, [1, 1]))
    assert max(abs(a - b) for a, b in zip(int8, got, strict=True)) > 1e-5


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("compression", ["fp8", "fp8_b64"])
def test_an_fp8_ring_leaves_every_member_the_same_mean(replicas, compression):
    gen = torch.Generator().manual_seed(0)
    tensors = [[torch.randn(37, 11, generator=gen), torch.randn(320, generator=gen)]
               for _ in range(replicas)]
    got = _all_reduce(tensors, compression)
    _check_means(tensors, got, compression, 0.07)


def test_fp8_sync_sends_a_byte_an_element_and_trains(data):
    """dp over 2 replicas with fp8 gradients: each replica sends its ring's bytes exactly (a
    byte an element, a scale a chunk, R-1 confirmations), and the loss falls."""
    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 10, "batch_size": 8, "micro_batches": 2, "eval_batches": 0,
                    "sync": {"compression": "fp8"}}, TrainingConfig)
    res = run_local_pipeline(mc, tc, data, 1, replicas=2, timeout=120)
    assert all(isinstance(r, StageResult) for r in res.values()), res
    n = sum(p.numel() for p in StageModule(mc, data.vocab_size, 0, 0, 3, 0, 1).parameters())
    for r in res.values():
        assert isinstance(r, StageResult)
        m = r.metrics
        # R = 2: one chunk out in each of 2 rounds, each half the elements, one frame a lane.
        frames = 2
        expected = frames * HEADER_SIZE + n + frames * 4 + (HEADER_SIZE + 4)
        assert m.sync_tx_bytes_per_step == m.expected_sync_tx_bytes_per_step == expected
    losses = res[0].losses  # type: ignore[union-attr]
    assert losses[-1] < losses[0]
