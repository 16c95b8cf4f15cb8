"""``training.optimizer: muon``: Muon (Jordan et al. 2024; torch.optim.Muon) on a stage's hidden
matrices and AdamW on the rest (the embeddings, the head, every vector), as the Muon and MuLoCo
(arXiv 2505.23725) papers split them, run as one optimiser: one step, one set of parameter
groups for the learning-rate schedule, one state keyed by parameter for checkpoints and joins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch
from torch import nn

MUON_MOMENTUM = 0.95  # (the paper's and torch's default, Nesterov)
ADAMW_FIELDS = ("step", "exp_avg", "exp_avg_sq")
MUON_FIELDS = ("momentum_buffer",)


def muon_takes(name: str, p: nn.Parameter) -> bool:
    """A hidden matrix: 2-D and neither the embeddings nor the head."""
    return p.dim() == 2 and not name.startswith(("embed.", "head."))


class _States(MutableMapping[Any, Any]):
    """The two optimisers' states as one mapping by parameter (each kept in its own)."""

    def __init__(self, parts: tuple[torch.optim.Optimizer, ...]) -> None:
        self.parts = parts

    def _owner(self, p: Any) -> torch.optim.Optimizer:
        for part in self.parts:
            if any(q is p for g in part.param_groups for q in g["params"]):
                return part
        raise KeyError(p)

    def __getitem__(self, p: Any) -> Any:
        return self._owner(p).state[p]

    def __setitem__(self, p: Any, value: Any) -> None:
        self._owner(p).state[p] = value

    def __delitem__(self, p: Any) -> None:
        del self._owner(p).state[p]

    def __iter__(self) -> Iterator[Any]:
        for part in self.parts:
            yield from part.state

    def __len__(self) -> int:
        return sum(len(part.state) for part in self.parts)

    def get(self, p: Any, default: Any = None) -> Any:
        for part in self.parts:
            if p in part.state:
                return part.state[p]
        return default

    def clear(self) -> None:
        for part in self.parts:
            part.state.clear()


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on ``muon_groups``, AdamW on ``adamw_groups``: lr and weight decay per group as
    given (Muon's lr scaled to AdamW's update RMS, so one schedule serves both)."""

    def __init__(self, muon_groups: list[dict[str, Any]], adamw_groups: list[dict[str, Any]],
                 lr: float, betas: tuple[float, float]) -> None:
        self.muon = torch.optim.Muon(muon_groups, lr=lr, momentum=MUON_MOMENTUM,
                                     nesterov=True, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=1e-8)
        super().__init__([p for g in muon_groups + adamw_groups for p in g["params"]],
                         {"lr": lr})
        # (the parts' own groups, shared: the schedule's set_lr reaches both)
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
        self.state = _States((self.muon, self.adamw))  # type: ignore[assignment]

    def fields(self, p: nn.Parameter) -> tuple[str, ...]:
        """The state fields parameter ``p`` has once stepped."""
        muon = any(q is p for g in self.muon.param_groups for q in g["params"])
        return MUON_FIELDS if muon else ADAMW_FIELDS

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)


def make_muon(module: nn.Module, weight_decay: float, lr: float,
              betas: tuple[float, float]) -> MuonWithAdamW:
    """The stage's hidden matrices to Muon (decayed), the rest to AdamW (matrices decayed,
    vectors not)."""
    hidden: list[nn.Parameter] = []
    matrices: list[nn.Parameter] = []
    vectors: list[nn.Parameter] = []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (hidden if muon_takes(name, p) else matrices if p.dim() >= 2 else vectors).append(p)
    adamw = [g for g in ({"params": matrices, "weight_decay": weight_decay},
                         {"params": vectors, "weight_decay": 0.0}) if g["params"]]
    return MuonWithAdamW([{"params": hidden, "weight_decay": weight_decay}], adamw, lr, betas)
