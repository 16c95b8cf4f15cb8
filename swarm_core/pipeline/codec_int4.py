"""``int4``: symmetric absmax 4-bit integer codes, two to a byte, with a float32 scale per row
or per block of B elements (``int4_bB``; a block is what makes 4 bits usable on a long row).

Each row (or block) is divided by ``max|x| / 7`` and rounded to an integer in -7..7 (round half
to even, as torch rounds), stored offset by 8 as a nibble (1..15; 0 is never written). Sixteen
levels keep a row's largest elements and flush most of its small ones to zero: the format for
pseudo-gradients with error feedback (Streaming DiLoCo sends 4-bit outer gradients), not for
activations without one.
"""

from __future__ import annotations

import torch

from swarm_core.pipeline.codecs import Nibbles

LEVELS = 7  # codes -7..7, symmetric


class Int4(Nibbles):
    """The element codec ``methods.ELEMENTS['int4']`` names."""

    @staticmethod
    def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_()).div_(LEVELS)
        scale.masked_fill_(scale == 0, 1.0)
        q = (rows / scale.unsqueeze(1)).round_().clamp_(-LEVELS, LEVELS)
        return (q + 8).to(torch.uint8), scale

    @staticmethod
    def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor,
                        shape: torch.Size) -> torch.Tensor:
        out = codes.to(torch.float32).sub_(8).mul_(scale.unsqueeze(1))
        return out.reshape(shape)
