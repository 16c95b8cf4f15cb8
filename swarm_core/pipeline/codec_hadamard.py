"""``hadamard_int4[_bB]`` and ``hadamard_int2[_bB]``: low-bit boundary codes behind a fixed
randomized Hadamard rotation of each tile of B consecutive elements of a row (after
TAH-Quant, arXiv 2506.01352; ``docs/decisions.md`` says where this follows it and where not).

A tile ``x`` (B a power of two) is sent as ``y = x M`` with ``M = D H / sqrt(B)``: D a fixed
diagonal of random signs (drawn from :data:`SIGN_SEED` and B alone, the same on every stage and
every run), H the B x B Sylvester Walsh-Hadamard matrix. M is orthogonal, so the receiver
takes ``y M^T``. The rotation spreads an outlier over its whole tile, so one absmax scale per
tile no longer spends its levels on one element. Then:

* int4: ``step = max|y| / 7``, codes ``round(y / step)`` in -7..7 stored offset by 8 (1..15);
  two a byte, the tile's first half in the low nibbles and its second in the high ones.
* int2: the four levels ``(c - 1.5) step``, c 0..3 (no zero level, which 2-bit codes of
  Gaussian-like values cannot afford); four a byte, the tile's quarters from the lowest bits
  up. The backward's step is ``2 max|y| / 3`` (levels -3, -1, 1, 3 thirds of the absmax:
  nothing clipped, so stochastic rounding stays unbiased). The forward's is
  ``min(2 max|y| / 3, 0.996 rms(y))``: a rotated tile is near Gaussian, and 0.996 sigma is the
  step of the MSE-optimal uniform 4-level quantizer of a Gaussian, so the few values beyond
  1.5 steps are clipped to the outer level (relative L2 error 0.34 on Gaussian data, against
  0.51 with the absmax step).

The float32 steps go first (one per tile), then the packed codes: ``Element.payload_size``'s
``tiles * 4 + n * bits / 8`` exactly. A tile of zeros is sent as step 0 (decoded as zeros).

Activations (ACT) round to nearest. Gradients (GRAD) round stochastically, ``floor(t + u)``
with u uniform in [0, 1): unbiased, so the backward's error averages out over steps rather
than biasing it. The draws are reproducible: u for element i of a frame is a hash of i and the
frame's 32-bit key (murmur3's finaliser over ``i * 0x9E3779B1 + key``, its low 24 bits over
2^24: integer tensor ops, the same numbers on any device and several times faster on a CPU than
torch's Mersenne Twister); the key is BLAKE2b of :data:`SR_SEED`, the micro-batch's place in
the step's whole batch (``BoundaryCodec.encode``'s ``draw``: chain-wired replicas draw apart)
and the step (see :func:`frame_key`), as dropout's masks are keyed (``model.dropout_rng``). The
pipeline's sender and the single-process simulator (``BoundarySimulator``) code each slot of
each step once, so they draw the same numbers, whatever order a schedule or a route codes the
frames in; a step trained again (a swarm-wired redo) and a resumed run draw what an unbroken
run draws.

Speed (``bench/bench_codec.py``): the rotation is a B x B matmul into a preallocated block
(faster on a CPU than log2(B) butterfly passes in torch: see ``docs/decisions.md``), and each
step works on blocks of about 1 MiB so that no full-size float temporaries are made. Codes
are rounded by adding 1.5 * 2^23 (the same half-to-even rounding as ``torch.round``, the code
left in the float's low bits) and packed from the floats' int32 views, so no float -> int
conversion is made; the decode unpacks with uint8 ops on the packed bytes (int4's offset too)
before one widening copy. Both are bit for bit what rounding and converting would give.
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch

from swarm_core.config.methods import MAX_TILE, MIN_TILE
from swarm_core.config.schemas import ModelConfig
from swarm_core.pipeline.boundary import Boundary, BoundaryCodec
from swarm_core.pipeline.codecs import CodecError, WireCodec, as_bytes
from swarm_core.pipeline.frames import Kind

SIGN_SEED = b"silentswarm/hadamard/signs"  # the rotation's signs: a wire constant
SR_SEED = 0x5EED_4AD4  # stochastic rounding's draws (see frame_key)
# murmur3's constants as int32 (torch's int32 products wrap, as the hash needs)
_GOLDEN, _MIX1, _MIX2 = (v - (1 << 32) for v in (0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35))
_BLOCK_ELEMS = 1 << 18  # ~1 MiB of float32 per block: stays in cache
# 1.5 * 2^23: for |t| < 2^22, the float32 sum t + _MAGIC is round(t) (half to even) + _MAGIC,
# the integer in the mantissa's low bits (the float's int32 bits are 0x4B400000 + round(t))
_MAGIC = 12582912.0


def check_tile(tile: int) -> None:
    """A tile is a power of two from MIN_TILE to MAX_TILE (a frame may claim anything)."""
    if not MIN_TILE <= tile <= MAX_TILE or tile & (tile - 1):
        raise CodecError(f"a Hadamard tile must be a power of two, {MIN_TILE}..{MAX_TILE}; "
                         f"got {tile}")


def signs(tile: int) -> torch.Tensor:
    """The rotation's fixed ±1 diagonal for ``tile``: bits of BLAKE2b over the seed and the
    tile size (no torch generator, whose streams could change between versions)."""
    out = bytearray()
    counter = 0
    while len(out) * 8 < tile:
        out += hashlib.blake2b(SIGN_SEED + f"/{tile}/{counter}".encode(),
                               digest_size=64).digest()
        counter += 1
    bits = torch.frombuffer(bytearray(out), dtype=torch.uint8).clone()
    unpacked = ((bits.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)
    return 1.0 - 2.0 * unpacked[:tile].to(torch.float32)


def walsh_hadamard(tile: int) -> torch.Tensor:
    """The unnormalised Sylvester Hadamard matrix of order ``tile`` (entries ±1)."""
    h = torch.ones(1, 1)
    while h.shape[0] < tile:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.cache
def _rotation(tile: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, M^T)`` for ``tile`` on ``device``, both contiguous (the matmul's right side)."""
    check_tile(tile)
    m = signs(tile).unsqueeze(1) * walsh_hadamard(tile) / math.sqrt(tile)
    return m.to(device).contiguous(), m.t().to(device).contiguous()


def rotation(tile: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """M = D H / sqrt(tile): a row ``x`` of ``tile`` elements is sent rotated as ``x @ M``."""
    return _rotation(tile, str(torch.device(device)))[0]


class _LowBit:
    """One rotated code: its bits, levels and the rounding of ``t = y / step + offset``."""

    bits: int
    top: float  # the largest code
    offset: float  # the code of 0.0 (int2: between two codes)
    levels: float  # step = max|y| / levels
    clip_rms: float | None = None  # nearest rounding: step <= clip_rms * rms(y), values clipped

    @classmethod
    def quantize_rows(cls, rows: torch.Tensor, key: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of one tile each (float32, ``(n, tile)``) rotated and coded: ``(codes, steps)``,
        the codes already packed, ``tile * bits / 8`` bytes a row. With ``key`` (a frame's, see
        :func:`uniform_`), rounded stochastically."""
        n, tile = rows.shape
        check_tile(tile)
        m, _ = _rotation(tile, str(rows.device))
        per = 8 // cls.bits  # codes a byte: the tile's 1/per parts, packed lowest first
        part = tile // per
        steps = torch.empty(n, dtype=torch.float32, device=rows.device)
        packed = torch.empty((n, part), dtype=torch.uint8, device=rows.device)
        blk = max(1, _BLOCK_ELEMS // tile)
        scratch = torch.empty((min(blk, n), tile), device=rows.device)
        # (packed through int32 views of the codes: float -> uint8 is slow in torch)
        wide = torch.empty((min(blk, n), part), dtype=torch.int32, device=rows.device)
        noise = torch.empty_like(scratch) if key is not None else None
        work = _HashWork(noise.numel(), rows.device) if noise is not None else None
        for i in range(0, n, blk):
            j = min(n, i + blk)
            y = torch.matmul(rows[i:j], m, out=scratch[: j - i])
            step = torch.amax(y, dim=1, out=steps[i:j])  # (the steps written in place)
            torch.maximum(step, y.amin(dim=1).neg_(), out=step).div_(cls.levels)
            if cls.clip_rms is not None and noise is None:
                rms = torch.linalg.vector_norm(y, dim=1).mul_(cls.clip_rms / math.sqrt(tile))
                torch.minimum(step, rms, out=step)  # (a tile of zeros: 0 either way)
            y.mul_(step.masked_fill(step == 0, 1.0).reciprocal_().unsqueeze(1))
            y.add_(cls.offset)
            if noise is not None:
                # (clamped: u just below 1 on the absmax element would pass the top code)
                assert key is not None
                y.add_(uniform_(noise[: j - i], key, i * tile, work)).floor_()
                y.clamp_(0.0, cls.top)
                y.add_(_MAGIC)  # (exact: the codes are integers already)
            else:
                # round half to even, as torch.round, left in the low bits of the float's
                # mantissa (|y| < 2^22), which the packing below reads as integers
                y.add_(_MAGIC)
                if cls.clip_rms is not None:  # (else |y| <= levels * step: codes in 0..top)
                    y.clamp_(_MAGIC, _MAGIC + cls.top)
            # (the magic's bits are 0x4B4 << 20: shifted left by at most 6 they leave the low
            # byte alone, and the int32 -> uint8 copy keeps just that byte)
            yi = y.view(torch.int32)
            a = torch.add(yi[:, :part], yi[:, part:2 * part], alpha=1 << cls.bits,
                          out=wide[: j - i])
            for k in range(2, per):
                a.add_(yi[:, k * part:(k + 1) * part], alpha=1 << (cls.bits * k))
            packed[i:j].copy_(a)
        return packed, steps

    @classmethod
    def dequantize_rows(cls, codes: torch.Tensor, steps: torch.Tensor,
                        shape: torch.Size) -> torch.Tensor:
        """``quantize_rows``' packed codes (``(n, tile * bits / 8)`` uint8) and steps back to
        float32 of ``shape``, rotated back."""
        per = 8 // cls.bits
        n, part = codes.shape
        tile = part * per
        _, mt = _rotation(tile, str(codes.device))
        out = torch.empty((n, tile), dtype=torch.float32, device=codes.device)
        blk = max(1, _BLOCK_ELEMS // tile)
        scratch = torch.empty((min(blk, n), tile), device=codes.device)
        piece = torch.empty((min(blk, n), part), dtype=torch.uint8, device=codes.device)
        mask = (1 << cls.bits) - 1
        whole = cls.offset == int(cls.offset)
        for i in range(0, n, blk):
            j = min(n, i + blk)
            c, s, p = codes[i:j], scratch[: j - i], piece[: j - i]
            for k in range(per):  # (uint8 ops on the packed bytes, widened by the copy)
                if k == 0:
                    torch.bitwise_and(c, mask, out=p)
                elif k < per - 1:
                    torch.bitwise_right_shift(c, cls.bits * k, out=p).bitwise_and_(mask)
                else:  # (the top part's shift leaves its bits alone)
                    torch.bitwise_right_shift(c, cls.bits * k, out=p)
                if whole:  # (int4: the offset taken off the bytes, exact, before widening)
                    s[:, k * part:(k + 1) * part].copy_(p.view(torch.int8).sub_(int(cls.offset)))
                else:
                    s[:, k * part:(k + 1) * part].copy_(p)
            if not whole:
                s.sub_(cls.offset)
            torch.matmul(s, mt, out=out[i:j]).mul_(steps[i:j].unsqueeze(1))
        return out.reshape(shape)

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        return codes  # (quantize_rows packs as it codes)

    @staticmethod
    def unpack(raw: torch.Tensor, n: int) -> torch.Tensor:
        return raw  # (dequantize_rows unpacks as it decodes)


class HadamardInt4(_LowBit):
    """The element codec ``methods.ROTATED['hadamard_int4']`` names."""

    bits, top, offset, levels = 4, 15.0, 8.0, 7.0


class HadamardInt2(_LowBit):
    """The element codec ``methods.ROTATED['hadamard_int2']`` names."""

    bits, top, offset, levels = 2, 3.0, 1.5, 1.5
    clip_rms = 0.996  # (the Gaussian's MSE-optimal uniform 4-level step, in sigmas)


class _HashWork:
    """uniform_'s int32 scratch for blocks of up to ``n`` elements (allocated once a frame)."""

    def __init__(self, n: int, device: torch.device | None = None) -> None:
        self.index = torch.arange(n, dtype=torch.int32, device=device)
        self.h = torch.empty_like(self.index)
        self.t = torch.empty_like(self.index)


def uniform_(out: torch.Tensor, key: int, first: int,
             work: _HashWork | None = None) -> torch.Tensor:
    """``out`` filled with u in [0, 1) for a frame's elements ``first``, ``first + 1``, ...:
    murmur3's 32-bit finaliser of ``index * 0x9E3779B1 + key``, its low 24 bits / 2^24 (a
    bijection of the index, so no two elements of a frame share a draw)."""
    n = out.numel()
    work = work or _HashWork(n, out.device)
    h, t = work.h[:n], work.t[:n]
    torch.add(work.index[:n], first, out=h).mul_(_GOLDEN).add_(key)
    # (>> on int32 is arithmetic: the masks make it the logical shift murmur3 means)
    for shift, mul in ((16, _MIX1), (13, _MIX2), (16, 1)):
        torch.bitwise_right_shift(h, shift, out=t).bitwise_and_((1 << (32 - shift)) - 1)
        h.bitwise_xor_(t)
        if mul != 1:
            h.mul_(mul)
    return out.view(-1).copy_(h.bitwise_and_(0xFFFFFF)).mul_(2.0 ** -24).view(out.shape)


def frame_key(slot: int, step: int) -> int:
    """The hash key (a signed 32-bit integer) of the GRAD frame of micro-batch ``slot`` of
    (0-based) step ``step`` (its place in the step's whole batch: see
    ``BoundaryCodec.encode``'s ``draw``)."""
    digest = hashlib.blake2b(f"{SR_SEED}/{slot}/{step}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little", signed=True)


class StochasticSide:
    """The GRAD sender's codec: the wire's format, rounded stochastically, each frame's draws
    keyed by :func:`frame_key` (its micro-batch and step: nothing kept between frames, so a
    step trained again draws the same numbers)."""

    def __init__(self, wire: WireCodec) -> None:
        self.wire = wire
        self.impl: type[_LowBit] = HadamardInt4 if wire.codec.element.bits == 4 else HadamardInt2

    def encode(self, x: torch.Tensor, slot: int = 0, step: int = 0,
               draw: int | None = None) -> list[memoryview]:
        x = x.detach().to(torch.float32)
        tile = self.wire.block
        if not x.dim() or x.shape[-1] % tile:
            raise CodecError(f"{self.wire.codec.name} tile {tile} does not divide the width "
                             f"{x.shape[-1] if x.dim() else 0}")
        rows = x.reshape(-1, tile)
        packed, steps = self.impl.quantize_rows(rows, frame_key(slot if draw is None else draw,
                                                                step))
        return [as_bytes(steps.cpu()), as_bytes(packed.cpu())]

    def decode(self, payload: bytes | bytearray | memoryview, shape: tuple[int, ...],
               device: torch.device | None = None, slot: int = 0) -> torch.Tensor:
        return self.wire.decode(payload, shape, device, slot)


class HadamardBoundary(Boundary):
    """``hadamard_int{4,2}[_bB]``: no modules; the rotated code both ways, ACT rounded to
    nearest (one stateless codec for both sides), GRAD's sender rounding stochastically."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        check_tile(self.format.block)

    def codec(self, kind: Kind, sending: bool) -> BoundaryCodec:
        if kind is Kind.GRAD and sending:
            return StochasticSide(self.format)
        return self.format
