"""``fp8``: float8 e4m3 codes with a float32 absmax scale per row or per block.

Each row (or block of B elements) is divided by ``max|x| / 448``, so its largest element lands
on e4m3's largest finite value, and cast to ``torch.float8_e4m3fn`` (round to nearest even):
3 mantissa bits keep about 2 significant digits at every magnitude, where int8's uniform grid
loses the small elements of a row with an outlier. The payload is laid out as int8's: the
scales, then one byte a code. FP8 is what torchft sends DiLoCo's pseudo-gradients in, and
what the 2025-26 low-bit boundary papers start from.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
CODE_DTYPE = torch.float8_e4m3fn


class Fp8:
    """The element codec ``methods.ELEMENTS['fp8']`` names: rows in, (codes, scales) out."""

    @staticmethod
    def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` (2-D float32) as e4m3 bytes and one float32 scale per row."""
        scale = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_()).div_(E4M3_MAX)
        scale.masked_fill_(scale == 0, 1.0)
        # (the quotient may round a hair past 448; e4m3fn has no infinity to saturate to)
        q = (rows / scale.unsqueeze(1)).clamp_(-E4M3_MAX, E4M3_MAX)
        return q.to(CODE_DTYPE).view(torch.uint8), scale

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        return codes  # (a byte a code)

    @staticmethod
    def unpack(raw: torch.Tensor, n: int) -> torch.Tensor:
        return raw

    @staticmethod
    def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor,
                        shape: torch.Size) -> torch.Tensor:
        """float32 of ``shape`` from e4m3 bytes (2-D, a row per scale) and their scales."""
        out = codes.view(CODE_DTYPE).to(torch.float32).mul_(scale.unsqueeze(1))
        return out.reshape(shape)
