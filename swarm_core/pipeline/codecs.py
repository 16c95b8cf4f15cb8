"""Stateless tensor codecs for the stage boundary: fp32, fp16, bf16, and the scaled codes
(int8 here, fp8 in its own file; absmax scales per row, or per block of B consecutive
elements of a row). ``methods.ELEMENTS`` lists them; a scaled code other than int8 is the
object its entry names, with ``quantize_rows`` and ``dequantize_rows``.

``encode`` returns the payload as a list of buffers (written back to back, no copy into one
blob); ``decode`` rebuilds a float32 tensor from one contiguous payload. On an accelerator both do
the codec's work there, so only the coded bytes cross to and from the host.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import attrs
import torch

from swarm_core.config.methods import ROTATED, load
from swarm_core.pipeline.wire_math import CODEC_NAMES, Codec, WireFormat, payload_size

__all__ = ["CODEC_NAMES", "Codec", "CodecError", "WireCodec", "decode", "encode",
           "payload_size"]

_CAST = {Codec.FP32: torch.float32, Codec.FP16: torch.float16, Codec.BF16: torch.bfloat16}


class CodecError(ValueError):
    pass


def as_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes (a contiguous one's own memory: writing them writes it)."""
    t = t.contiguous()
    # bf16 has no numpy dtype; view as raw bytes through uint8.
    return t.view(torch.uint8).numpy().data.cast("B")


# Work on blocks of about 1 MiB: the quotient and the widened codes stay in cache, and no
# full-size float temporaries are allocated (each one costs page faults at tens of MB).
_BLOCK_ELEMS = 1 << 18


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: scale = max|row| / 127, codes = round(x / scale)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() > 0 else x.reshape(1, 1)
    n_rows, width = rows.shape
    # max(amax, -amin) is max|x| without materialising |x|.
    scale = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_()).div_(127.0)
    scale.masked_fill_(scale == 0, 1.0)
    col = scale.unsqueeze(1)
    codes = torch.empty((n_rows, width), dtype=torch.int8, device=x.device)
    blk = max(1, _BLOCK_ELEMS // max(width, 1))
    scratch = torch.empty((min(blk, n_rows), width), device=x.device)
    for i in range(0, n_rows, blk):
        j = min(n_rows, i + blk)
        q = torch.div(rows[i:j], col[i:j], out=scratch[: j - i])
        codes[i:j].copy_(q.round_().clamp_(-127, 127))
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    col = scale.unsqueeze(1)
    blk = max(1, _BLOCK_ELEMS // max(codes.shape[-1], 1))
    for i in range(0, codes.shape[0], blk):
        out[i:i + blk].copy_(codes[i:i + blk]).mul_(col[i:i + blk])
    return out.reshape(shape)


class _Int8:
    quantize_rows = staticmethod(quantize_rows)
    dequantize_rows = staticmethod(dequantize_rows)

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        return codes

    @staticmethod
    def unpack(raw: torch.Tensor, n: int) -> torch.Tensor:
        return raw.view(torch.int8)


@functools.cache
def _scaled(codec: Codec) -> Any:
    """A scaled code's quantiser: ``quantize_rows(rows) -> (codes, scales)`` (a code an
    element, a float32 scale a row), ``dequantize_rows(codes, scales, shape)``, and
    ``pack(codes)`` / ``unpack(raw_bytes, n)`` between the codes and the wire's bytes."""
    return _Int8 if codec is Codec.INT8 else load(codec.element.impl)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, 0..15) two to a byte, the first in the low nibble (an odd count's
    last byte has a zero high nibble)."""
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(raw: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` 4-bit codes :func:`pack_nibbles` packed into ``raw`` (uint8)."""
    out = torch.stack([raw & 0x0F, raw >> 4], dim=1).reshape(-1)
    return out[:n]


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Unsigned integer codes below 2^``width`` as a packed bit stream (uint8), each code's
    bits lowest first, the stream's first bit a byte's lowest: ``ceil(n * width / 8)``
    bytes, the last one zero-padded."""
    flat = codes.reshape(-1).to(torch.int64)
    if width == 0 or flat.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=codes.device)
    shifts = torch.arange(width, device=flat.device)
    bits = ((flat.unsqueeze(1) >> shifts) & 1).reshape(-1)
    pad = -bits.numel() % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.arange(8, device=flat.device)
    return (bits.view(-1, 8) << weights).sum(dim=1).to(torch.uint8)


def unpack_bits(raw: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """The ``n`` codes (int64) of ``width`` bits that :func:`pack_bits` packed into ``raw``."""
    if width == 0 or n == 0:
        return torch.zeros(n, dtype=torch.int64, device=raw.device)
    weights = torch.arange(8, device=raw.device)
    bits = ((raw.to(torch.int64).unsqueeze(1) >> weights) & 1).reshape(-1)[:n * width]
    shifts = torch.arange(width, device=raw.device)
    return (bits.view(n, width) << shifts).sum(dim=1)


class Nibbles:
    """A scaled code of 4 bits: its codes cross two a byte."""

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        return pack_nibbles(codes)

    @staticmethod
    def unpack(raw: torch.Tensor, n: int) -> torch.Tensor:
        return unpack_nibbles(raw, n)


def _check_block(shape: tuple[int, ...], codec: Codec, block: int) -> int:
    """The width each scale covers: ``block``, or the row's width when it is 0."""
    if not codec.scaled:
        if block:
            raise CodecError(f"{codec.name} takes no block (got {block})")
        return 0
    if not shape or shape[-1] == 0:
        raise CodecError(f"{codec.name} payload of shape {list(shape)}: rows need a last "
                         "dimension")
    if block and shape[-1] % block:
        raise CodecError(f"{codec.name} block {block} does not divide the width {shape[-1]}")
    if codec.element.name in ROTATED:  # (a frame's header may claim any tile)
        from swarm_core.pipeline.codec_hadamard import check_tile

        check_tile(block or shape[-1])
    return block or shape[-1]


def encode(x: torch.Tensor, codec: Codec, block: int = 0) -> list[memoryview]:
    """``x`` coded, as buffers to write back to back. ``block``: a scaled code's scale block
    (0: one scale per row)."""
    x = x.detach()
    if codec.scaled:
        x = x.to(torch.float32)
        if block:
            # Blocks of a row are rows of a narrower view: the same quantiser serves both.
            x = x.reshape(-1, _check_block(tuple(x.shape), codec, block))
        rows = x.reshape(-1, x.shape[-1]) if x.dim() > 0 else x.reshape(1, 1)
        impl = _scaled(codec)
        codes, scale = impl.quantize_rows(rows)
        return [as_bytes(scale.cpu()), as_bytes(impl.pack(codes).cpu())]
    _check_block(tuple(x.shape), codec, block)
    return [as_bytes(x.to(_CAST[codec]).cpu())]


def decode(payload: bytes | bytearray | memoryview, shape: tuple[int, ...],
           codec: Codec, device: torch.device | None = None, block: int = 0) -> torch.Tensor:
    """A float32 tensor of ``shape`` on ``device`` (the CPU by default). On the CPU ``payload``
    must stay alive while the tensor is used."""
    width = _check_block(shape, codec, block)
    expected = payload_size(shape, codec, block)
    if len(payload) != expected:
        raise CodecError(f"{codec.name} payload of shape {shape} needs {expected} bytes, "
                         f"got {len(payload)}")
    if expected == 0:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    buf = torch.frombuffer(payload, dtype=torch.uint8)
    if device is not None and device.type != "cpu":
        buf = buf.to(device)  # the coded bytes cross; the codec's work happens there
    if codec.scaled:
        impl = _scaled(codec)
        n = _numel(shape)
        scales = 4 * (n // width)
        scale = buf[:scales].view(torch.float32)
        # (a row of codes a scale: ``width`` codes, or a rotated tile's packed bytes)
        codes = impl.unpack(buf[scales:], n).reshape(n // width, -1)
        return impl.dequantize_rows(codes, scale, torch.Size(shape))
    t = buf.view(_CAST[codec]).reshape(shape)
    return t if codec is Codec.FP32 else t.to(torch.float32)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@attrs.frozen
class WireCodec(WireFormat):
    """A stateless codec as one object: encode, decode, wire size, round-trip error. It is a
    ``BoundaryCodec`` (pipeline/boundary.py) for every side and slot at once."""

    @property
    def wire(self) -> WireCodec:
        return self

    def encode(self, x: torch.Tensor, slot: int = 0, step: int = 0,
               draw: int | None = None) -> list[memoryview]:
        return encode(x, self.codec, self.block)

    def decode(self, payload: bytes | bytearray | memoryview, shape: tuple[int, ...],
               device: torch.device | None = None, slot: int = 0) -> torch.Tensor:
        return decode(payload, shape, self.codec, device, self.block)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return roundtrip(x, self.codec, self.block)

    def relative_error(self, x: torch.Tensor) -> float:
        """||decode(encode(x)) - x|| / ||x||: what this codec changes in ``x`` (0 for fp32;
        NaN for a tensor that is not finite)."""
        return 0.0 if self.exact else relative_l2(x, self.roundtrip)


def relative_l2(x: torch.Tensor, coded: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """||coded(x) - x|| / ||x|| (``x`` as float32): 0 for a zero tensor, NaN for one that is
    not finite (``coded`` is not called for either)."""
    with torch.no_grad():
        x = x.detach().float()
        norm = float(torch.linalg.vector_norm(x))
        if norm == 0.0 or not math.isfinite(norm):
            return 0.0 if norm == 0.0 else math.nan
        return float(torch.linalg.vector_norm(coded(x) - x)) / norm


FP32_WIRE = WireCodec()


def roundtrip(x: torch.Tensor, codec: Codec, block: int = 0) -> torch.Tensor:
    """What the far side sees: encode then decode (for single-process simulation)."""
    if codec is Codec.FP32:
        return x
    if codec.scaled:
        impl = _scaled(codec)
        width = _check_block(tuple(x.shape), codec, block)
        codes, scale = impl.quantize_rows(x.detach().to(torch.float32).reshape(-1, width))
        return impl.dequantize_rows(codes, scale, x.shape)
    return x.to(_CAST[codec]).to(torch.float32)
