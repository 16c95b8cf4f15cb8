"""Split backward: a stage's Linear layers can leave their weight gradients for later.

A backward pass does two kinds of work: the gradient of the stage's input (which the upstream
stage is waiting for) and the gradients of the weights (which nobody needs before the optimiser
step). With ``split_backward`` the stage runs only the first kind in B, sends the input gradient
upstream at once, and queues each Linear's weight gradient (its input and output gradient, held
until then) as a W pass. The stage runs W passes whenever it would otherwise wait for a frame,
and drains the rest before clipping: the idea of zero-bubble pipeline schedules (Qi et al., 2023,
arXiv 2401.10241), applied greedily at run time instead of from a precomputed table, so W passes
fill waits from any cause (the pipeline bubble, a slow link).

The weight gradient is computed with the products autograd's ``addmm`` backward uses
(``g.t() @ x`` and ``g.sum(0)``) and accumulated in micro-batch order (later micro-batches
straight into the running sum with ``addmm_``), so losses match a single process to float
rounding. Under autocast (a model profile's ``dtype: bfloat16``) the W pass casts the layer's
input as autocast's ``linear`` did, so the products are the same bfloat16 ones; gradients are
accumulated in the parameters' float32.
"""

from __future__ import annotations

import contextlib
import functools
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
        # Whether the forward now running will have its backward split: off, the layers run
        # as plain Linears (autograd's fused backward, no hook) for that micro-batch.
        self.splitting = True

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


class SplitLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict names) whose weight gradient can be
    deferred to a :class:`WeightGradQueue`. Without a queue it is a plain Linear.

    With a queue, the forward multiplies by a detached weight, so autograd's own (native)
    ``addmm`` backward computes only the input gradient, and a hook on the output collects the
    output gradient for the weight pass. A custom autograd Function did the same at a Python
    call per layer in forward and backward, which cost ~2 % of a stage's step on the bench
    model; the hook is one call per layer, in backward only. (So with a queue attached, any
    backward through the layer, ``torch.autograd.grad`` too, produces the weight gradient.)

    ``deferrable = False`` keeps a layer out of the queue (``attach`` leaves the layers
    named in KEEP_FUSED plain to begin with)."""

    wgrad: WeightGradQueue | None = None
    deferrable: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.wgrad is None or not self.wgrad.splitting or not torch.is_grad_enabled()
                or not self.weight.requires_grad or not x.requires_grad):
            # (An input without a gradient leaves no input gradient to hurry: nothing to split.)
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        out = F.linear(x, self.weight.detach(), bias)
        x = x.detach()  # (shares the version counter: the check below sees in-place changes)
        out.register_hook(functools.partial(self._output_grad, x, x._version,
                                            _autocast_dtype(x.device.type)))
        return out

    def _output_grad(self, x: torch.Tensor, version: int, dt: torch.dtype | None,
                     grad: torch.Tensor) -> None:
        if x._version != version:
            # Autograd makes this check for the tensors it saves; this input is ours to save.
            raise RuntimeError("one of the variables needed for gradient computation has been "
                               f"modified by an inplace operation: the {list(x.shape)} input "
                               f"of a Linear is at version {x._version}, saved at {version}")
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        queue = self.wgrad
        if queue is None or not queue.deferring:
            with torch.no_grad():
                self._weight_pass(g2, x2, dt)
            return
        # Counted while the pass is pending: the closure holds the meter's tokens.
        held = (queue.meter.hold(g2), queue.meter.hold(x2)) if queue.meter else ()
        queue.add(functools.partial(self._weight_pass, g2, x2, dt, held))

    def _weight_pass(self, g2: torch.Tensor, x2: torch.Tensor, dt: torch.dtype | None,
                     _held: tuple = ()) -> None:
        w, b = self.weight, self.bias
        if dt is not None:
            # The products autograd makes under autocast: bfloat16 casts of input and weight
            # (backward runs without autocast), the result cast to the float32 parameter.
            _accumulate(w, g2.t().mm(x2.to(dt)).to(w.dtype))
        elif w.grad is None:
            w.grad = g2.t().mm(x2)
        else:
            # One GEMM into the running sum: no product tensor, no separate add.
            w.grad.addmm_(g2.t(), x2)
        if b is not None and b.requires_grad:  # (a frozen bias gets no gradient)
            _accumulate(b, g2.sum(0).to(b.dtype))


# Layers that keep autograd's fused backward: the LM head, whose output gradient (tokens x
# vocabulary) would be the largest thing a deferred pass holds, and which runs last on the last
# stage, where nothing waits for its input gradient anyway.
KEEP_FUSED = frozenset({"lm_head"})


def attach(module: nn.Module, queue: WeightGradQueue | None) -> int:
    """Route the weight gradients of the Linear layers in ``module`` to ``queue`` (None: back
    to plain Linears). A model is built of plain ``nn.Linear``; the stage that splits its
    backward makes each a :class:`SplitLinear` here, in place (same parameters, same names),
    except those named in KEEP_FUSED. Returns how many layers it touched."""
    n = 0
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.Linear) or name.rpartition(".")[2] in KEEP_FUSED:
            continue
        if type(sub) is nn.Linear:
            sub.__class__ = SplitLinear  # (a subclass that adds behaviour, not state)
        if isinstance(sub, SplitLinear) and sub.deferrable:
            sub.wgrad = queue
            n += 1
    return n
