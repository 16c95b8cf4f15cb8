"""Sparse messages between a stage group's replicas: a tensor's tiles, the few values kept of
each, their positions in a packed bit stream, and the mean over the members that sent a value at
each position. SparseLoCo (``sparseloco.py``) sends them from its error feedback, DeMo
(``demo.py``) from the DCT of its decoupled momentum."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from swarm_core.pipeline.codecs import pack_bits, unpack_bits
from swarm_core.pipeline.frames import FrameError

RANGE_SIGMAS = 6.0  # the quantiser's range: ±3 standard deviations, as the paper's code's
SIGNS = 0  # SparseCode's bits for values sent as their signs alone (DeMo's 1-bit)


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


@attrs.frozen
class Tiling:
    """A parameter's tiles: a matrix (rows x the rest) in h x w blocks of at most ``chunk``
    elements (h and w the largest divisors of rows and columns with h ≤ √chunk, h·w ≤ chunk),
    as the paper's 64 x 64 chunks; a vector in runs of at most ``chunk``. Each tile keeps
    ``k`` = round(density x its size) (at least 1) of its elements, each named by its
    position in the tile in ``index_bits`` bits."""

    shape: tuple[int, ...]
    rows: int
    h: int
    cols: int
    w: int
    k: int

    @classmethod
    def of(cls, shape: tuple[int, ...], chunk: int, density: float) -> Tiling:
        n = math.prod(shape)
        if len(shape) >= 2:
            rows, cols = shape[0], n // shape[0]
            h = _largest_divisor(rows, math.isqrt(chunk))
            w = _largest_divisor(cols, chunk // h)
        else:
            rows, h, cols, w = 1, 1, n, _largest_divisor(max(n, 1), chunk)
        size = h * w
        return cls(tuple(shape), rows, h, cols, w, min(size, max(1, round(density * size))))

    @classmethod
    def blocks(cls, shape: tuple[int, ...], side: int, k: int) -> Tiling:
        """DeMo's: a matrix in h x w blocks, each the largest divisor of its dimension up to
        ``side``; a vector in runs up to ``side``; ``k`` kept of each (at most all)."""
        n = math.prod(shape)
        if len(shape) >= 2:
            rows, cols = shape[0], n // shape[0]
            h, w = _largest_divisor(rows, side), _largest_divisor(cols, side)
        else:
            rows, h, cols, w = 1, 1, n, _largest_divisor(max(n, 1), side)
        return cls(tuple(shape), rows, h, cols, w, min(h * w, k))

    @property
    def size(self) -> int:
        return self.h * self.w

    @property
    def count(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)

    @property
    def dense(self) -> bool:
        """Every element of a tile kept: the positions go without saying (none cross)."""
        return self.k == self.size

    @property
    def index_bits(self) -> int:
        return 0 if self.dense else (self.size - 1).bit_length()

    def tiles(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as (tiles, tile size)."""
        t = x.reshape(self.rows // self.h, self.h, self.cols // self.w, self.w)
        return t.permute(0, 2, 1, 3).reshape(self.count, self.size)

    def untile(self, t: torch.Tensor) -> torch.Tensor:
        x = t.reshape(self.rows // self.h, self.cols // self.w, self.h, self.w)
        return x.permute(0, 2, 1, 3).reshape(self.shape)


@attrs.frozen
class SparseCode:
    """How one tensor's kept values cross: their ``bits``-bit codes of a 2^bits-entry lookup
    (after a shift), float32 at 32 bits, or their signs alone at SIGNS (a bit each, read back
    as -1 or +1); then their positions in their tiles."""

    tiling: Tiling
    bits: int

    @property
    def kept(self) -> int:
        return self.tiling.count * self.tiling.k

    @property
    def table_bytes(self) -> int:
        return 0 if self.bits in (32, SIGNS) else 4 * (1 + (1 << self.bits))

    @property
    def value_bytes(self) -> int:
        return -(-self.kept * max(self.bits, 1) // 8)

    @property
    def index_bytes(self) -> int:
        return -(-self.kept * self.tiling.index_bits // 8)

    @property
    def size(self) -> int:
        """Its bytes in a message: the lookup (a shift and 2^bits float32), codes, positions."""
        return self.table_bytes + self.value_bytes + self.index_bytes

    def select(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top k of each tile of ``e`` by magnitude: (positions ascending in each tile,
        their values), both (tiles, k)."""
        return self.top(self.tiling.tiles(e))

    def top(self, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`select` of a tensor already in its tiles (tiles, size). Of equal magnitudes
        the first positions are kept (a stable sort, not topk's unspecified choice): a tile
        of zeros (an embedding's unused rows) is sent alike by every run and every member."""
        order = torch.sort(tiles.abs(), dim=1, descending=True, stable=True).indices
        pos, _ = order[:, :self.tiling.k].sort(dim=1)
        return pos, tiles.gather(1, pos)

    def encode(self, pos: torch.Tensor, values: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """The message's bytes for these values, and the values as every member decodes
        them."""
        flat = values.reshape(-1).float()
        if self.bits == SIGNS:
            bits = torch.signbit(flat)
            table, codes_bytes = b"", pack_bits(bits, 1).cpu().numpy().tobytes()
            decoded = 1.0 - 2.0 * bits.float()
        elif self.bits == 32:
            table, codes_bytes, decoded = b"", flat.cpu().numpy().tobytes(), flat
        else:
            shift, lookup, codes = _quantize(flat, self.bits)
            table = torch.cat([shift.reshape(1), lookup]).cpu().numpy().tobytes()
            codes_bytes = pack_bits(codes, self.bits).cpu().numpy().tobytes()
            decoded = lookup[codes] + shift
        index = b"" if self.tiling.dense else \
            pack_bits(pos, self.tiling.index_bits).cpu().numpy().tobytes()
        return table + codes_bytes + index, decoded.reshape(values.shape)

    def decode(self, raw: memoryview, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, values), both (tiles, k), from this tensor's part of a message."""
        t = self.tiling
        at = self.table_bytes
        codes_raw = _u8(raw[at:at + self.value_bytes], device)
        pos_raw = _u8(raw[at + self.value_bytes:self.size], device)
        if self.bits == SIGNS:
            values = 1.0 - 2.0 * unpack_bits(codes_raw, 1, self.kept).float()
        elif self.bits == 32:
            values = codes_raw.view(torch.float32)
        else:
            table = _u8(raw[:at], device).view(torch.float32)
            codes = unpack_bits(codes_raw, self.bits, self.kept)
            values = table[1:][codes] + table[0]
        if t.dense:  # (every position, in order: what select gives a dense tile)
            pos = torch.arange(t.size, device=device).repeat(t.count)
        else:
            pos = unpack_bits(pos_raw, t.index_bits, self.kept)
        if self.kept and int(pos.max()) >= t.size:
            raise FrameError(f"a sparse message names position {int(pos.max())} of a tile of "
                             f"{t.size}")
        return pos.view(t.count, t.k), values.view(t.count, t.k)


def _u8(raw: memoryview, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device) if len(raw) else \
        torch.zeros(0, dtype=torch.uint8, device=device)


def _quantize(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The paper's code's statistical quantiser: values less their mean, in 2^bits bins of
    RANGE_SIGMAS standard deviations in all, each bin decoded as the mean of what fell in
    it. Returns (shift, lookup, codes)."""
    bins = 1 << bits
    shift = values.mean()
    centred = values - shift
    n = centred.numel()
    std = centred.norm() / math.sqrt(n - 1) if n > 1 else centred.new_zeros(())
    scale = float(RANGE_SIGMAS * std / bins)
    if scale == 0.0 or not math.isfinite(scale):
        scale = 1.0
    codes = (centred / scale + bins // 2).round().clamp(0, bins - 1).to(torch.int64)
    sums = centred.new_zeros(bins).scatter_add_(0, codes, centred)
    counts = centred.new_zeros(bins).scatter_add_(0, codes, torch.ones_like(centred))
    lookup = torch.where(counts > 0, sums / counts.clamp(min=1), centred.new_zeros(()))
    return shift, lookup, codes




def mean_over_senders(codes: Sequence[SparseCode], messages: Sequence[bytes],
                      device: torch.device) -> list[torch.Tensor]:
    """Each tensor's mean, in its tiles (tiles, size), at every position over the members
    that sent a value there (a position none sent is 0), the messages summed in rank order
    so every member computes the same bits."""
    out = []
    offsets = np.cumsum([0] + [c.size for c in codes])
    for i, code in enumerate(codes):
        t = code.tiling
        total = torch.zeros(t.count, t.size, dtype=torch.float32, device=device)
        count = torch.zeros_like(total)
        for m in messages:
            pos, values = code.decode(memoryview(m)[offsets[i]:offsets[i + 1]], device)
            total.scatter_add_(1, pos, values)
            count.scatter_add_(1, pos, torch.ones_like(values))
        out.append(total / count.clamp(min=1))
    return out
