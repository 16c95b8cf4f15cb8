"""``fp4``: float4 e2m1 codes (the OCP MX FP4 element), two to a byte, with a float32 absmax
scale per row or per block of B elements (``fp4_bB``; MXFP4 uses blocks of 32).

e2m1 holds ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Each row (or block) is divided by ``max|x| / 6``, so
its largest element lands on 6, and rounded to the nearest of those magnitudes, ties to the
even code (round half to even, as the MX spec and torch's float casts do). The code is the
sign bit over the magnitude's index (0..7). Unlike MXFP4 the scale is a float32, not a
power-of-two exponent: the block's largest element is then exact, for 4/B bytes more than
MX's 1/B.
"""

from __future__ import annotations

import torch

from swarm_core.pipeline.codecs import Nibbles

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


class Fp4(Nibbles):
    """The element codec ``methods.ELEMENTS['fp4']`` names."""

    @staticmethod
    def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_()).div_(E2M1_MAX)
        scale.masked_fill_(scale == 0, 1.0)
        y = rows / scale.unsqueeze(1)
        mag = y.abs().clamp_(max=E2M1_MAX)
        grid = torch.tensor(E2M1, device=rows.device)
        mids = (grid[1:] + grid[:-1]) / 2
        # bucketize puts a value equal to a midpoint in the lower bucket: a tie there goes up
        # where the lower code is odd, so every tie lands on the even code.
        idx = torch.bucketize(mag, mids)
        tie = (idx < len(E2M1) - 1) & (mag == mids[idx.clamp(max=len(mids) - 1)]) & (idx % 2 == 1)
        idx = idx + tie.to(idx.dtype)
        sign = (y < 0) & (idx > 0)  # (no negative zero: one code for 0)
        return (idx | (sign.to(idx.dtype) << 3)).to(torch.uint8), scale

    @staticmethod
    def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor,
                        shape: torch.Size) -> torch.Tensor:
        grid = torch.tensor(E2M1, device=codes.device)
        c = codes.to(torch.int64)
        out = grid[c & 7]
        out = torch.where((c & 8) != 0, -out, out).mul_(scale.unsqueeze(1))
        return out.reshape(shape)
