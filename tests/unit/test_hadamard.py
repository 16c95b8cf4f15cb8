"""The rotated low-bit boundary specs ``hadamard_int4[_bB]``, ``hadamard_int2[_bB]`` and the
plain ``fixed_int4_bB`` beside them: the rotation against a reference built here from its
definition, the bytes that cross each way against the planned number, stochastic rounding on
the backward (reproducible and unbiased), refused frames and specs, and a two-stage pipeline
against the single process that simulates the same boundary."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from swarm_core.config import methods
from swarm_core.config.schemas import ModelConfig, TrainingConfig, parse_compression
from swarm_core.contract.placement import split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline import codecs
from swarm_core.pipeline.boundary import make_boundary
from swarm_core.pipeline.codec_hadamard import SIGN_SEED, HadamardBoundary, StochasticSide
from swarm_core.pipeline.codecs import Codec, CodecError
from swarm_core.pipeline.frames import HEADER_SIZE, Kind
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.reference import train_reference
from swarm_core.pipeline.stage import StageResult
from swarm_core.pipeline.wire_math import expected_wire_bytes
from swarm_core.schema import SchemaError, structure

MODEL = dict(d_model=32, n_layers=3, n_heads=2, seq_len=16)
BITS = {Codec.HADAMARD_INT4: 4, Codec.HADAMARD_INT2: 2}


def reference_rotation(tile: int) -> torch.Tensor:
    """M = D H / sqrt(tile) from the definitions the codec documents: H[i, j] =
    (-1)^popcount(i & j) (Sylvester), D's i-th sign from bit i (lowest first) of
    BLAKE2b-512(SIGN_SEED + b"/tile/0"), then ".../1" and on: a set bit is -1."""
    digest = b""
    k = 0
    while len(digest) * 8 < tile:
        digest += hashlib.blake2b(SIGN_SEED + f"/{tile}/{k}".encode(), digest_size=64).digest()
        k += 1
    d = [-1.0 if digest[i // 8] >> (i % 8) & 1 else 1.0 for i in range(tile)]
    h = [[(-1.0) ** bin(i & j).count("1") for j in range(tile)] for i in range(tile)]
    return torch.tensor(d).unsqueeze(1) * torch.tensor(h) / math.sqrt(tile)


def reference_codes(x: torch.Tensor, codec: Codec, tile: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(integer levels, steps) of nearest rounding, rotated by the reference: int4's levels
    -7..7 of max|y|/7, int2's -1.5, -0.5, 0.5, 1.5 of min(2 max|y|/3, 0.996 rms(y)), the
    values beyond clipped to the outer levels."""
    y = x.reshape(-1, tile).double() @ reference_rotation(tile).double()
    amax = y.abs().amax(dim=1, keepdim=True)
    if codec is Codec.HADAMARD_INT4:
        step = amax / 7
        return torch.round(y / step), step.squeeze(1)
    rms = y.pow(2).mean(dim=1, keepdim=True).sqrt()
    step = torch.minimum(amax * 2 / 3, 0.996 * rms)
    # (the nearest half-integer, within the four levels)
    return (torch.floor(y / step) + 0.5).clamp(-1.5, 1.5), step.squeeze(1)


def unpack(payload: bytes, n: int, codec: Codec, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The payload as documented: float32 steps, then each tile's codes, its 8/bits parts
    packed lowest first."""
    bits = BITS[codec]
    tiles = n // tile
    steps = torch.frombuffer(bytearray(payload[:4 * tiles]), dtype=torch.float32)
    raw = torch.frombuffer(bytearray(payload[4 * tiles:]), dtype=torch.uint8).reshape(tiles, -1)
    parts = [(raw.to(torch.int64) >> (bits * k)) & ((1 << bits) - 1) for k in range(8 // bits)]
    return torch.cat(parts, dim=1), steps


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


@pytest.mark.parametrize("tile", [4, 8, 64, 128])
def test_the_rotation_is_the_documented_orthogonal_matrix(tile):
    from swarm_core.pipeline.codec_hadamard import rotation

    m = rotation(tile)
    assert torch.allclose(m, reference_rotation(tile), atol=1e-7)
    assert torch.allclose(m @ m.t(), torch.eye(tile), atol=1e-6)
    assert 0 < int((torch.diag(m * math.sqrt(tile)) < 0).sum()) < tile  # (random signs)


@pytest.mark.parametrize("codec, offset", [(Codec.HADAMARD_INT4, 8), (Codec.HADAMARD_INT2, 1.5)])
@pytest.mark.parametrize("tile", [8, 64])
def test_codes_are_the_rotated_tiles_rounded_to_nearest(codec, offset, tile):
    x = torch.randn(6, 2 * 64, generator=torch.Generator().manual_seed(3))
    payload = b"".join(bytes(b) for b in codecs.encode(x, codec, tile))
    got, steps = unpack(payload, x.numel(), codec, tile)
    levels, ref_steps = reference_codes(x, codec, tile)
    assert torch.allclose(steps.double(), ref_steps, rtol=1e-6)
    assert torch.equal(got.double() - offset, levels)
    # Decoding is the levels times the steps, rotated back (M's transpose).
    y = codecs.decode(bytearray(payload), tuple(x.shape), codec, block=tile)
    want = (levels * ref_steps.unsqueeze(1)) @ reference_rotation(tile).double().t()
    assert torch.allclose(y.double(), want.reshape(x.shape), atol=1e-5)


def test_a_tile_of_zeros_decodes_to_zeros():
    x = torch.zeros(2, 64)
    x[1] = torch.linspace(-1, 1, 64)
    for codec in BITS:
        y = codecs.roundtrip(x, codec, 16)
        assert torch.equal(y[0], torch.zeros(64))


@pytest.mark.parametrize("spec, codec, tile, bits", [
    ("hadamard_int4_b64", Codec.HADAMARD_INT4, 64, 4),
    ("hadamard_int4", Codec.HADAMARD_INT4, 64, 4),  # (the default tile)
    ("hadamard_int4_b16", Codec.HADAMARD_INT4, 16, 4),
    ("hadamard_int2_b64", Codec.HADAMARD_INT2, 64, 2),
    ("hadamard_int2_b4", Codec.HADAMARD_INT2, 4, 2),
    ("hadamard_int2", Codec.HADAMARD_INT2, 64, 2),
    ("fixed_int4_b64", Codec.INT4, 64, 4),
])
@pytest.mark.parametrize("kind", [Kind.ACT, Kind.GRAD])
def test_the_bytes_that_cross_are_the_planned_bytes(spec, codec, tile, bits, kind):
    """Each way, the sender's buffers are exactly ``methods``' byte expectation: a float32
    step a tile and ``bits`` an element; the ratio to fp32 is 32 B / (32 + B bits)."""
    mc = ModelConfig(d_model=128, n_layers=2, n_heads=2, seq_len=8, compression=spec)
    boundary = make_boundary(mc)
    side = boundary.codec(kind, True)
    assert (side.wire.codec, side.wire.block) == (codec, tile)
    shape = (3, 8, 128)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    sent = sum(len(b) for b in side.encode(x, 0))
    n = x.numel()
    planned = n // tile * 4 + n * bits // 8
    assert sent == planned == codecs.payload_size(shape, codec, tile)
    assert sent == side.wire.payload_size(shape)
    assert n * 4 / sent == pytest.approx(32 * tile / (32 + tile * bits))
    # The receiving side takes exactly those bytes.
    payload = bytearray().join(side.encode(x, 1))
    assert boundary.codec(kind, False).decode(payload, shape, None, 1).shape == shape


def test_the_default_tile_is_64_or_the_largest_power_of_two_dividing_d_model():
    assert parse_compression("hadamard_int4", d_model=256).block == 64
    assert parse_compression("hadamard_int2", d_model=96).block == 32
    assert parse_compression("hadamard_int4", d_model=32).form == "hadamard_int4"
    assert parse_compression("hadamard_int4_b128", d_model=256).form == "hadamard_int4_bB"


def test_the_rotation_is_worth_its_row_on_an_outlier():
    """A hidden state with one loud channel: in tiles of 64, int4 without the rotation spends
    the outlier's tile on it; with it, the outlier is spread over the tile."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen)
    x[:, 5] *= 40.0

    def err(codec: Codec) -> float:
        return float((codecs.roundtrip(x, codec, 64) - x).norm() / x.norm())

    assert err(Codec.HADAMARD_INT4) < 0.6 * err(Codec.INT4)


# stochastic rounding on the backward ------------------------------------------------------------
def test_the_backward_rounds_stochastically_and_reproducibly():
    boundary = make_boundary(ModelConfig(**MODEL, compression="hadamard_int4_b16"))
    assert isinstance(boundary, HadamardBoundary)
    a, b = boundary.codec(Kind.GRAD, True), boundary.codec(Kind.GRAD, True)
    assert isinstance(a, StochasticSide) and a is not b
    assert boundary.codec(Kind.ACT, True) is boundary.codec(Kind.ACT, False)  # (stateless)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    nearest = bytes(bytearray().join(codecs.encode(x, Codec.HADAMARD_INT4, 16)))

    def coded(side, slot: int, step: int) -> bytes:
        return bytes(bytearray().join(side.encode(x, slot, step)))

    first = [coded(a, 0, step) for step in range(2)]
    # The same slot of the same step draws the same numbers, on any side, however often it
    # is coded (a swarm-wired redo, a resumed run: nothing is counted between frames)...
    assert [coded(b, 0, step) for step in range(2)] == first == [coded(a, 0, s) for s in (0, 1)]
    # ... and other numbers for the next step, another slot, or nearest rounding.
    assert first[0] != first[1] and nearest not in first
    assert coded(b, 1, 0) != first[0]


def test_the_draws_are_murmur3s_finaliser_of_the_element_index():
    """u for element i of a frame with key k: fmix32(i * 0x9E3779B1 + k) mod 2^24 / 2^24,
    computed here in plain Python (the same on any device)."""
    from swarm_core.pipeline.codec_hadamard import frame_key, uniform_

    def fmix(i: int, key: int) -> float:
        h = (i * 0x9E3779B1 + key) & 0xFFFFFFFF
        for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, 1)):
            h = ((h ^ (h >> shift)) * mul) & 0xFFFFFFFF
        return (h & 0xFFFFFF) / 2 ** 24

    key = frame_key(3, 7)
    assert -2 ** 31 <= key < 2 ** 31 and key != frame_key(3, 8)
    got = uniform_(torch.empty(5, 16), key, 160).reshape(-1).tolist()
    assert got == [fmix(160 + i, key) for i in range(80)]


@pytest.mark.parametrize("spec", ["hadamard_int4_b16", "hadamard_int2_b16"])
def test_stochastic_rounding_is_unbiased(spec):
    """The mean of many stochastically rounded decodes approaches the input; nearest rounding
    keeps its error whatever the number of frames."""
    boundary = make_boundary(ModelConfig(**MODEL, compression=spec))
    send, recv = boundary.codec(Kind.GRAD, True), boundary.codec(Kind.GRAD, False)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(4))
    frames = 400
    mean = sum(recv.decode(bytearray().join(send.encode(x, 0, step)), tuple(x.shape))
               for step in range(frames)) / frames
    nearest = boundary.codec(Kind.ACT, True).roundtrip(x)
    single = float((nearest - x).norm() / x.norm())
    assert float((mean - x).norm() / x.norm()) < 0.25 * single


# refused frames and specs ---------------------------------------------------------------------
@pytest.mark.parametrize("codec", list(BITS))
def test_a_payload_of_the_wrong_size_or_a_bad_tile_is_refused(codec):
    x = torch.randn(2, 64)
    payload = bytearray().join(codecs.encode(x, codec, 16))
    with pytest.raises(CodecError, match=f"{codec.name} payload of shape .* needs "
                                         f"{len(payload)} bytes, got {len(payload) - 1}"):
        codecs.decode(payload[:-1], (2, 64), codec, block=16)
    for tile in (2, 12, 2048):  # (a header may claim any block)
        with pytest.raises(CodecError):
            codecs.decode(payload, (2, 64), codec, block=tile)
    # A frame's codec byte is a new number, never one of the elements'.
    assert int(codec) not in {e.wire_id for e in methods.ELEMENTS.values()}


@pytest.mark.parametrize("body, needle", [
    ({"compression": "hadamard_int4_b48"}, "hadamard_int4 tile 48 in 'hadamard_int4_b48' must "
     "be a power of two, 4..1024, dividing d_model (32)"),
    ({"compression": "hadamard_int2_b2"}, "hadamard_int2 tile 2 in 'hadamard_int2_b2'"),
    ({"compression": "hadamard_int4_b64"}, "dividing d_model (32)"),
    ({"d_model": 6, "n_heads": 2, "compression": "hadamard_int2"},
     "'hadamard_int2' tiles d_model (6) by powers of two from 4"),
    ({"d_model": 2048, "n_heads": 2, "compression": "hadamard_int4_b2048"},
     "tile 2048 in 'hadamard_int4_b2048' must be a power of two, 4..1024"),
    ({"compression": "hadamard_int3"}, "unknown compression 'hadamard_int3'"),
    ({"compression": "fixed_int4"}, "int4 takes a scale block in 'fixed_int4': fixed_int4_bB"),
    ({"compression": "learned_dim8_int4"}, "int4 takes a scale block in 'learned_dim8_int4'"),
    ({"compression": "fixed_int4_b3"}, "int4 block 3 in 'fixed_int4_b3'"),
])
def test_a_bad_spec_is_a_one_line_error_naming_it(body, needle):
    with pytest.raises(SchemaError) as exc:
        structure({**MODEL, **body}, ModelConfig)
    assert exc.value.field == "$.compression"
    assert needle in exc.value.message and "\n" not in exc.value.message


def test_swarm_validate_names_a_bad_tile(tmp_path, capsys):
    from swarm_tui.cli import run

    (tmp_path / "model").mkdir()
    (tmp_path / "training").mkdir()
    (tmp_path / "model" / "m.json").write_text(json.dumps({"name": "m", **MODEL}))
    (tmp_path / "training" / "t.json").write_text(json.dumps(
        {"steps": 3, "batch_size": 4, "micro_batches": 2, "cluster_profile": {"fellows": 2}}))
    exp = tmp_path / "e.json"
    sweep = ["hadamard_int4_b16", "hadamard_int2", "fixed_int4_b8", "hadamard_int4_b24"]
    exp.write_text(json.dumps({"name": "e", "training_config": "training/t.json",
                               "model_configs": ["model/m.json"],
                               "sweep": {"compressions": sweep}}))
    assert run(["validate", str(exp)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tile 24 in 'hadamard_int4_b24'" in err[0], err
    exp.write_text(json.dumps({"name": "e", "training_config": "training/t.json",
                               "model_configs": ["model/m.json"],
                               "sweep": {"compressions": sweep[:3]}}))
    assert run(["validate", str(exp)]) == 0


# the pipeline ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, bits, tile", [("hadamard_int4_b16", 4, 16),
                                              ("hadamard_int2", 2, 32),
                                              ("fixed_int4_b8", 4, 8)])
def test_a_pipeline_matches_one_process_and_sends_the_planned_bytes(data, spec, bits, tile):
    """Two stages against the single-process model simulating the same boundary (nearest
    forward, stochastic backward with the same draws): the same losses; each stage sends its
    planned bytes (2 micro-batches of 4 x 16 x 32 one way, and a norm frame)."""
    mc = ModelConfig(**MODEL, compression=spec)
    tc = TrainingConfig(steps=4, batch_size=8, micro_batches=2, eval_batches=1)
    ref, _ = train_reference(mc, tc, data, split_layers(mc.n_layers, [1, 1]))
    res = run_local_pipeline(mc, tc, data, 2)
    assert all(isinstance(r, StageResult) for r in res.values()), res
    got = res[1].losses  # type: ignore[union-attr]
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    n = 4 * 16 * 32
    frame = HEADER_SIZE + n // tile * 4 + n * bits // 8
    for s in (0, 1):
        m = res[s].metrics  # type: ignore[union-attr]
        assert m.wire_tx_bytes_per_step == expected_wire_bytes(mc, tc, s, 2) \
            == 2 * frame + HEADER_SIZE + 8


def test_three_stages_under_1f1b_match_one_process(data):
    """Two boundaries, the backward's frames coded in 1F1B's order: each frame's draws are
    keyed by its slot and step, as the reference's, so the draws and the losses agree."""
    mc = ModelConfig(**MODEL, compression="hadamard_int2_b8")
    tc = TrainingConfig(steps=3, batch_size=8, micro_batches=4, schedule="1f1b",
                        eval_batches=0)
    ref, _ = train_reference(mc, tc, data, split_layers(mc.n_layers, [1, 1, 1]))
    res = run_local_pipeline(mc, tc, data, 3)
    got = res[2].losses  # type: ignore[union-attr]
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5


# the console offers them ----------------------------------------------------------------------
async def test_submit_takes_a_compression_spec_over_the_model_profiles(api, auth, tmp_path,
                                                                       capsys):
    """``swarm submit --model m.json --compression hadamard_int4_b8``: the job's model has
    that spec; a bad one is one usage line naming it, and nothing is submitted."""
    import asyncio

    from tests.unit.test_cli_grid import A, _cli, _register

    await _register(api, auth, 0)
    await _register(api, auth, 1)
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"name": "m", **MODEL}))
    base = ["submit", "--model", str(model), "--stages", "2", "--steps", "4"]
    assert await asyncio.to_thread(_cli, api, *base, "--compression", "hadamard_int4_b24") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compression hadamard_int4_b24: " in err[0] \
        and "tile 24 in 'hadamard_int4_b24'" in err[0], err
    assert (await (await api.get(f"{A}/jobs", headers=auth)).json())["jobs"] == []
    for spec in ("hadamard_int4_b8", "hadamard_int2", "fixed_int4_b16"):
        assert await asyncio.to_thread(_cli, api, *base, "--compression", spec,
                                       "--format", "json") == 0
        assert json.loads(capsys.readouterr().out)["model"]["compression"] == spec


def test_the_launcher_and_submit_offer_the_new_specs():
    """Model profiles of each new spec (what the console's launcher lists and ``swarm submit
    --model`` takes), and ``--compression``'s help lists every registered grammar."""
    import argparse

    from swarm_core.config.profiles import load_model_profile
    from swarm_tui.app.launch import ProfileSource
    from swarm_tui.commands import jobs
    from tests.support import REPO

    configs = REPO / "exp" / "configs"
    offered = ProfileSource(configs).options("model")
    for spec in ("hadamard_int4_b64", "hadamard_int2_b64", "fixed_int4_b64"):
        assert f"model/small_{spec}.json" in offered
        assert load_model_profile(configs / "model" / f"small_{spec}.json").compression == spec
    parser = argparse.ArgumentParser()
    jobs.register(parser.add_subparsers())
    submit = next(a for a in parser._subparsers._group_actions[0].choices["submit"]._actions
                  if "--compression" in a.option_strings)
    assert all(f.grammar in str(submit.help) for f in methods.BOUNDARY_FORMS)
