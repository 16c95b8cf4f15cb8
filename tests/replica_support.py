"""What the tests of replicas share: the windows a group trains on once some replicas left
(the one-process reference's data)."""

from __future__ import annotations

import torch


class SurvivorWindows:
    """The step's windows a group trains on once ``left`` replicas left before step
    ``from_step`` (0-based): the shares of those that remain (each replica keeps its own
    share, chain-wired or swarm-wired alike)."""

    def __init__(self, data, replicas: int, left: set[int], from_step: int) -> None:
        self.data, self.replicas, self.left, self.from_step = data, replicas, left, from_step
        self.vocab_size = data.vocab_size

    def batch(self, step: int, batch: int, seq: int, seed: int):
        x, y = self.data.batch(step, batch, seq, seed)
        if step < self.from_step:
            return x, y
        share = batch // self.replicas
        keep = [r for r in range(self.replicas) if r not in self.left]
        rows = torch.cat([torch.arange(r * share, (r + 1) * share) for r in keep])
        return x[rows], y[rows]
