"""Split backward: a stage's Linear layers can leave their weight gradients for later.

A backward pass does two kinds of work: the gradient of the stage's input (which the upstream
stage is waiting for) and the gradients of the weights (which nobody needs before the optimiser
step). With ``split_backward`` the stage runs only the first kind in B, sends the input gradient
upstream at once, and queues each Linear's weight gradient (its input and output gradient, held
until then) as a W pass. The stage runs W passes whenever it would otherwise wait for a frame,
and drains the rest before clipping: the idea of zero-bubble pipeline schedules (Qi et al., 2023,
arXiv 2401.10241), applied greedily at run time instead of from a precomputed table, so W passes
fill waits from any cause (the pipeline bubble, a slow link).

The weight gradient is computed with the same matrix products autograd's ``addmm`` backward uses
(``g.t() @ x`` and ``g.sum(0)``) and accumulated in micro-batch order, so losses match a single
process to float rounding. Under autocast (a model profile's ``dtype: bfloat16``) the layer casts
its input and weight as autocast's ``linear`` would and saves those casts for backward (which runs
without autocast), so the products are the same bfloat16 ones; gradients are accumulated in the
parameters' float32.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from swarm_core.pipeline.memory import ActivationMeter


class WeightGradQueue:
    """Deferred weight gradients of one stage, oldest micro-batch first."""

    def __init__(self, meter: ActivationMeter | None = None) -> None:
        self._pending: deque[list[Callable[[], None]]] = deque()
        self._open: list[Callable[[], None]] | None = None
        self.meter = meter  # counts what the pending passes hold

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def deferring(self) -> bool:
        return self._open is not None

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Weight gradients computed by backward passes inside this block become one W pass."""
        self._open = []
        try:
            yield
        finally:
            if self._open:
                self._pending.append(self._open)
            self._open = None

    def add(self, fn: Callable[[], None]) -> None:
        assert self._open is not None
        self._open.append(fn)

    def run_one(self) -> bool:
        """Run one layer's weight gradient, the oldest first; False when there is none. One
        layer at a time, so a stage filling a wait notices its frame within a layer's work."""
        if not self._pending:
            return False
        batch = self._pending[0]
        with torch.no_grad():
            batch.pop(0)()
        if not batch:
            self._pending.popleft()
        return True

    def run_batch(self) -> None:
        """Finish the oldest micro-batch's W pass."""
        if self._pending:
            with torch.no_grad():
                for fn in self._pending.popleft():
                    fn()

    def drain(self) -> None:
        while self._pending:
            self.run_batch()

    def clear(self) -> None:
        self._pending.clear()


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    # What AccumulateGrad does: the first gradient is stored, later ones are added in place.
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) \
        if torch.is_autocast_enabled(device_type) else None


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                bias: torch.Tensor | None, layer: SplitLinear) -> torch.Tensor:
        # Backward runs without autocast, so what is saved for it must already be the casts
        # autocast's linear would make (a bfloat16 grad times a float32 weight fails).
        dt = _autocast_dtype(x.device.type)
        if dt is not None:
            x, weight = x.to(dt), weight.to(dt)
            bias = None if bias is None else bias.to(dt)
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = g2.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None
        layer: SplitLinear = ctx.layer
        queue = layer.wgrad
        has_bias = ctx.has_bias
        if queue is not None and queue.deferring:
            w, b = layer.weight, layer.bias
            # Counted while the pass is pending: the function holds the meter's tokens.
            held = (queue.meter.hold(g2), queue.meter.hold(x2)) if queue.meter else ()

            def weight_pass(_held: tuple = held) -> None:
                # (The autograd engine casts the undeferred path's gradients the same way.)
                _accumulate(w, g2.t().mm(x2).to(w.dtype))
                if has_bias and b is not None:
                    _accumulate(b, g2.sum(0).to(b.dtype))

            queue.add(weight_pass)
            return grad_x, None, None, None
        grad_w = g2.t().mm(x2) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class SplitLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict names) whose weight gradient can be
    deferred to a :class:`WeightGradQueue`. Without a queue it is a plain Linear.

    ``deferrable = False`` keeps a layer out of the queue: the LM head, whose output gradient
    (tokens x vocabulary) would be the largest thing a deferred pass holds, and which runs
    last on the last stage, where nothing waits for its input gradient anyway."""

    wgrad: WeightGradQueue | None = None
    deferrable: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wgrad is None or not torch.is_grad_enabled() or not self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        return _SplitLinearFn.apply(x, self.weight, self.bias, self)


def attach(module: nn.Module, queue: WeightGradQueue | None) -> int:
    """Route the weight gradients of every deferrable SplitLinear in ``module`` to ``queue``
    (None: back to plain Linears). Returns how many layers it touched."""
    n = 0
    for sub in module.modules():
        if isinstance(sub, SplitLinear) and sub.deferrable:
            sub.wgrad = queue
            n += 1
    return n
