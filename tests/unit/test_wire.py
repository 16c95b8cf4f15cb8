"""Frames and codecs: round trips, sizes, and every way a frame can be wrong."""

from __future__ import annotations

import contextlib
import re
import struct

import attrs
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm_core.pipeline import codecs
from swarm_core.pipeline.frames import (
    HEADER_SIZE,
    FrameError,
    FrameHeader,
    Kind,
    check_payload,
    expect,
    job_tag,
    make_header,
)


@pytest.mark.parametrize("codec, bound", [
    (codecs.Codec.FP32, 0.0), (codecs.Codec.FP16, 5e-8), (codecs.Codec.BF16, 5e-5),
    (codecs.Codec.INT8, 8e-4),
])
def test_codec_roundtrip_error_bounds(codec, bound):
    # hivemind's bounds on N(0,1): 16-bit MSE < 5e-8, 8-bit < 8e-4 (bf16 keeps 8 mantissa bits).
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    raw = b"".join(bytes(b) for b in codecs.encode(x, codec))
    assert len(raw) == codecs.payload_size(tuple(x.shape), codec)
    y = codecs.decode(bytearray(raw), tuple(x.shape), codec)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert float((x - y).pow(2).mean()) <= bound


def test_int8_is_per_row_absmax():
    x = torch.tensor([[1.0, -2.0, 0.5], [100.0, 0.0, -50.0], [0.0, 0.0, 0.0]])
    codes, scale = codecs.quantize_rows(x)
    assert scale.tolist() == pytest.approx([2 / 127, 100 / 127, 1.0])
    assert codes[0].tolist() == [64, -127, 32] and codes[2].tolist() == [0, 0, 0]
    # Per row: the small row keeps its precision next to the large one.
    y = codecs.dequantize_rows(codes, scale, x.shape)
    assert (y[0] - x[0]).abs().max() < 2 / 127


def test_int8_blocks_scale_each_run_of_a_row_apart():
    """With a block B, each B consecutive elements of a row get their own absmax scale: an
    outlier costs its own block's precision, not the row's, for 4/B bytes an element."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 256, generator=gen)
    x[:, 3] = 200.0  # one outlier a row, in block 0
    per_row = b"".join(bytes(b) for b in codecs.encode(x, codecs.Codec.INT8))
    blocked = b"".join(bytes(b) for b in codecs.encode(x, codecs.Codec.INT8, block=64))
    assert len(per_row) == codecs.payload_size((32, 256), codecs.Codec.INT8) == 32 * 4 + 32 * 256
    assert len(blocked) == codecs.payload_size((32, 256), codecs.Codec.INT8, 64) == \
        32 * 4 * 4 + 32 * 256
    y_row = codecs.decode(bytearray(per_row), (32, 256), codecs.Codec.INT8)
    y_blk = codecs.decode(bytearray(blocked), (32, 256), codecs.Codec.INT8, block=64)
    # The scales are each block's absmax / 127, in row-major block order.
    scales = torch.frombuffer(bytearray(blocked[:32 * 4 * 4]), dtype=torch.float32)
    want = x.reshape(32, 4, 64).abs().amax(dim=2).reshape(-1) / 127
    assert torch.allclose(scales, want)
    # Outside the outlier's block the error is that block's half-step, far below the row's.
    rest = (slice(None), slice(64, None))
    assert float((y_blk - x)[rest].abs().max()) <= float(want.reshape(32, 4)[:, 1:].max()) / 2
    assert float((y_blk - x)[rest].pow(2).mean()) < float((y_row - x)[rest].pow(2).mean()) / 100
    # The same through roundtrip (the single-process simulation of a boundary).
    assert torch.equal(codecs.roundtrip(x, codecs.Codec.INT8, 64), y_blk)
    with pytest.raises(codecs.CodecError, match="block 48 does not divide the width 256"):
        codecs.encode(x, codecs.Codec.INT8, block=48)


@pytest.mark.parametrize("codec", list(codecs.Codec))
def test_the_codec_works_on_the_device_it_is_given(codec):
    """Decoding onto a device moves the coded bytes and widens or dequantises them there; every
    tensor the codec makes follows its input's device. (The meta device stands in for a GPU,
    which CI does not have: any CPU tensor mixed in would raise.)"""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    raw = bytearray(b"".join(bytes(b) for b in codecs.encode(x, codec)))
    meta = torch.device("meta")
    y = codecs.decode(raw, tuple(x.shape), codec, meta)
    assert y.device == meta and y.dtype == torch.float32 and tuple(y.shape) == (8, 16)
    codes, scale = codecs.quantize_rows(x.to(meta))
    assert codes.device == meta and scale.device == meta and codes.dtype == torch.int8
    assert codecs.roundtrip(x.to(meta), codec).device == meta


def test_decode_refuses_wrong_length():
    with pytest.raises(codecs.CodecError, match="needs 24 bytes"):
        codecs.decode(bytearray(20), (2, 3), codecs.Codec.FP32)


def _frame(step=3, mb=1, kind=Kind.ACT, payload=b"x" * 24):
    h = make_header(kind, job_tag("job-1"), step, mb, (2, 3), int(codecs.Codec.FP32), payload)
    return h, h.pack()


def test_header_roundtrip_and_size():
    h, raw = _frame()
    assert len(raw) == HEADER_SIZE == 64
    back = FrameHeader.unpack(raw)
    assert back == h
    check_payload(back, b"x" * 24)
    expect(back, Kind.ACT, job_tag("job-1"), 3, 1)


@pytest.mark.parametrize("mutate, message", [
    (lambda r: b"XXXX" + r[4:], "bad magic"),
    (lambda r: r[:4] + bytes([9]) + r[5:], "version 9"),
    (lambda r: r[:20] + bytes([r[20] ^ 1]) + r[21:], "header checksum"),
    (lambda r: r[:40], "truncated header"),
])
def test_bad_headers_are_clear_errors(mutate, message):
    _, raw = _frame()
    with pytest.raises(FrameError, match=message):
        FrameHeader.unpack(mutate(raw))


def test_oversized_payload_refused_before_reading_it():
    h = make_header(Kind.ACT, 1, 0, 0, (1,), 1, b"")
    big = FrameHeader(h.kind, h.codec, h.dtype, h.job, h.step, h.micro_batch, h.shape,
                      1 << 40, 0).pack()
    with pytest.raises(FrameError, match="exceeds the limit"):
        FrameHeader.unpack(big)


def test_payload_checksum_and_length():
    h, _ = _frame()
    with pytest.raises(FrameError, match="checksum"):
        check_payload(h, b"y" * 24)
    with pytest.raises(FrameError, match="length"):
        check_payload(h, b"x" * 23)


@pytest.mark.parametrize("kind, step, mb, job, message", [
    (Kind.GRAD, 3, 1, "job-1", "expected GRAD step 3 micro-batch 1, got ACT"),
    (Kind.ACT, 4, 1, "job-1", "expected ACT step 4 micro-batch 1, got ACT step 3"),
    (Kind.ACT, 3, 0, "job-1", "micro-batch 0, got ACT step 3 micro-batch 1"),
    (Kind.ACT, 3, 1, "job-2", "another job"),
])
def test_wrong_frame_is_an_error_not_a_guess(kind, step, mb, job, message):
    h, _ = _frame()
    with pytest.raises(FrameError, match=message):
        expect(h, kind, job_tag(job), step, mb)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=80))
def test_header_decoder_never_crashes(data):
    with contextlib.suppress(FrameError):
        FrameHeader.unpack(data)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 63), st.integers(0, 255))
def test_any_single_corruption_is_detected(pos, value):
    _h, raw = _frame()
    corrupted = bytearray(raw)
    if corrupted[pos] == value:
        return
    corrupted[pos] = value
    try:
        back = FrameHeader.unpack(bytes(corrupted))
    except FrameError:
        return
    raise AssertionError(f"corruption at byte {pos} went unnoticed: {back}")


def test_header_check_covers_fields():
    _, raw = _frame()
    (check,) = struct.unpack("<I", raw[60:])
    assert check == xxhash.xxh3_64_intdigest(raw[:60]) & 0xFFFFFFFF


def test_frames_that_do_not_fit_are_frame_errors():
    """A peer's frame of the wrong size or shape fails the stage with a FrameError that says
    what came and what was expected, never a struct or reshape error from deep inside."""
    import socket

    from swarm_core.pipeline.links import LinkShaper
    from swarm_core.pipeline.transport import PeerLink

    a, b = socket.socketpair()
    left, right = PeerLink(a, LinkShaper(), 7, "b"), PeerLink(b, LinkShaper(), 7, "a")
    try:
        left.send_raw(Kind.NORM, 3, 0, b"\0" * 4)
        with pytest.raises(FrameError, match="NORM step 3 from a carries 4 bytes, expected 8"):
            right.recv_float(Kind.NORM, 3, 0, timeout=5)
        left.send_tensor(Kind.ACT, 3, 0, torch.ones(2, 3), codecs.FP32_WIRE)
        with pytest.raises(FrameError, match=r"ACT step 3 micro-batch 0 from a has shape "
                                             r"\[2, 3\], expected \[2, 4\]"):
            right.recv_tensor(Kind.ACT, 3, 0, timeout=5, shape=(2, 4))
        left.send_tensor(Kind.GRAD, 3, 0, torch.ones(()), codecs.WireCodec(codecs.Codec.INT8))
        with pytest.raises(FrameError, match="rows need a last dimension"):
            right.recv_tensor(Kind.GRAD, 3, 0, timeout=5)
    finally:
        left.close()
        right.close()


def test_an_evaluation_frame_is_not_taken_for_a_training_one():
    import socket

    from swarm_core.pipeline.frames import FLAG_EVAL
    from swarm_core.pipeline.links import LinkShaper
    from swarm_core.pipeline.transport import PeerLink

    a, b = socket.socketpair()
    left, right = PeerLink(a, LinkShaper(), 7, "b"), PeerLink(b, LinkShaper(), 7, "a")
    try:
        left.send_tensor(Kind.ACT, 3, 0, torch.ones(2, 4), codecs.FP32_WIRE, flags=FLAG_EVAL)
        with pytest.raises(FrameError, match="expected a training ACT step 3 micro-batch 0, "
                                             "got an evaluation one"):
            right.recv_tensor(Kind.ACT, 3, 0, timeout=5)
        left.send_tensor(Kind.ACT, 3, 1, torch.ones(2, 4), codecs.FP32_WIRE)
        with pytest.raises(FrameError, match="expected an evaluation ACT step 3 micro-batch 1, "
                                             "got a training one"):
            right.recv_tensor(Kind.ACT, 3, 1, timeout=5, flags=FLAG_EVAL)
    finally:
        left.close()
        right.close()


@pytest.mark.parametrize("frame, message", [
    ("hello", "unexpected HELLO frame from a (this link carries ACT/NORM)"),
    ("grad", "unexpected GRAD frame from a (this link carries ACT/NORM)"),
    ("foreign", "frame for another job from a"),
    ("huge", "payload of 1073741824 bytes exceeds the limit of 4096"),
    ("pulse", "PULSE frame from a is not the empty frame a pulse is"),
])
def test_a_frame_the_link_never_takes_fails_it_at_once(frame, message):
    """A frame of a kind this link does not carry, for another job, or claiming more than one
    boundary tensor fails the link when it arrives (a waiting recv raises it), instead of
    sitting in a queue nobody reads while the recv times out, or allocating what it claims."""
    import socket
    import time

    from swarm_core.pipeline.frames import make_header
    from swarm_core.pipeline.links import LinkShaper
    from swarm_core.pipeline.transport import PeerLink

    a, b = socket.socketpair()
    right = PeerLink(b, LinkShaper(), 7, "a", max_payload=4096, receives=(Kind.ACT, Kind.NORM))
    try:
        payload = b"\0" * 16
        kind, job = {"hello": (Kind.HELLO, 7), "grad": (Kind.GRAD, 7),
                     "foreign": (Kind.ACT, 8), "huge": (Kind.ACT, 7),
                     "pulse": (Kind.PULSE, 7)}[frame]
        header = make_header(kind, job, 0, 0, (4,), 1, payload)
        if frame == "huge":
            header = attrs.evolve(header, payload_len=1 << 30)
        a.sendall(header.pack() + payload)
        start = time.monotonic()
        with pytest.raises(FrameError, match=re.escape(message)):
            right.recv(Kind.ACT, 0, 0, timeout=30)
        assert time.monotonic() - start < 5  # not the frame timeout
    finally:
        a.close()
        right.close()


def test_unused_header_fields_must_be_as_written():
    """dtype, flags and the sizes past ndim are fixed in this version: a peer that
    sets them means something this fellow would not do, so the frame is refused."""
    from swarm_core.pipeline import frames

    h = make_header(Kind.ACT, 1, 0, 0, (2, 3), 1, b"\0" * 24)
    norm = make_header(Kind.NORM, 1, 0, 0, (8,), 0, b"\0" * 8)
    for bad, message in [(attrs.evolve(h, dtype=2), "unknown frame dtype 2"),
                         (attrs.evolve(h, flags=8), "unknown frame flags 0x8"),
                         (attrs.evolve(h, flags=frames.FLAG_FAREWELL),
                          "ACT frame with the flag FAREWELL"),
                         (attrs.evolve(norm, codec_arg=64),
                          r"NORM frame with a codec argument \(64\)"),
                         (attrs.evolve(norm, flags=frames.FLAG_HEARD),
                          "NORM frame with the flag HEARD")]:
        with pytest.raises(FrameError, match=message):
            FrameHeader.unpack(bad.pack())
    fields = [frames.MAGIC, frames.VERSION, int(h.kind), h.codec, h.dtype, 2, 0, 0, h.job,
              h.step, h.micro_batch, 2, 3, 0, 0, h.payload_len, h.payload_check]
    for index, value, message in [(13, 5, "sizes past its 2")]:
        raw_fields = list(fields)
        raw_fields[index] = value
        head = frames._HEADER.pack(*raw_fields)
        raw = head + frames._CRC.pack(frames.checksum(head))
        with pytest.raises(FrameError, match=message):
            FrameHeader.unpack(raw)
    assert FrameHeader.unpack(h.pack()) == h
    heard = attrs.evolve(h, flags=frames.FLAG_HEARD)  # (a training step's ACT or GRAD may)
    assert FrameHeader.unpack(heard.pack()) == heard
    bye = frames.pulse_header(1, frames.FLAG_FAREWELL)  # (a PULSE may say FAREWELL)
    assert FrameHeader.unpack(bye.pack()) == bye != frames.pulse_header(1)


@pytest.mark.parametrize("codec, codec_arg, shape, message", [
    (codecs.Codec.INT8, 3, (2, 4), "INT8 block 3 does not divide the width 4"),
    (codecs.Codec.FP32, 2, (2, 4), "FP32 takes no block (got 2)"),
])
def test_a_codec_argument_that_does_not_fit_is_a_frame_error(codec, codec_arg, shape, message):
    """The int8 block comes in the header: one that does not divide the width, or a block on a
    codec that has none, fails the stage with a FrameError naming it, never a reshape error."""
    import socket

    from swarm_core.pipeline.links import LinkShaper
    from swarm_core.pipeline.transport import PeerLink

    a, b = socket.socketpair()
    right = PeerLink(b, LinkShaper(), 7, "a")
    try:
        payload = b"\0" * 24  # the block is checked before the length
        header = make_header(Kind.ACT, 7, 3, 0, shape, int(codec), payload,
                             codec_arg=codec_arg)
        a.sendall(header.pack() + payload)
        with pytest.raises(FrameError, match=re.escape(f"ACT step 3 micro-batch 0 from a: "
                                                       f"{message}")):
            right.recv_tensor(Kind.ACT, 3, 0, timeout=5)
    finally:
        a.close()
        right.close()

