"""Sample text from the glued model: what ``swarm generate`` runs, on one device."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def sample_tokens(model: nn.Module, prompt: Sequence[int], count: int, *, seq_len: int,
                  temperature: float, top_k: int | None, seed: int) -> list[int]:
    """``count`` token ids drawn one at a time after ``prompt``, each from the model's next-token
    distribution over the last ``seq_len`` ids (the window it was trained on); the same seed
    draws the same ids."""
    if not prompt:
        raise ValueError("the prompt holds no tokens")
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            ctx = torch.tensor([ids[-seq_len:]])
            # float32 whatever the model computes in: softmax over bfloat16 rounds coarsely
            logits = model(ctx)[0, -1].float() / max(temperature, 1e-6)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
    return ids[len(prompt):]
