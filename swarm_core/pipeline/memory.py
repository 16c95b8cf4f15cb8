"""How many bytes a stage holds for its backward passes, live and at the peak of each step.

This is the memory a schedule trades: GPipe keeps every micro-batch's activations until its
backward, 1F1B at most as many as there are stages from here to the end, and split backward keeps
each deferred weight pass's layer input and output gradient a while longer. The meter counts what
autograd saves during the stage's forward passes (through ``saved_tensors_hooks``) and what the
weight-gradient queue holds, once per storage, leaving out the stage's own parameters; it works
the same on any device. Allocator slack and temporaries inside one op are not in it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch

_Key = tuple[str, int]


def _key(t: torch.Tensor) -> _Key:
    st = t.untyped_storage()
    return (str(t.device), st.data_ptr())


class _Held:
    """A saved tensor, and the count that ends when autograd (or the queue) lets it go."""

    __slots__ = ("key", "meter", "tensor", "version")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor, key: _Key | None) -> None:
        self.meter, self.tensor, self.key = meter, tensor, key
        self.version = tensor._version

    def __del__(self) -> None:
        # No lock here: a collection may run this in the middle of _pack, in the same thread.
        # The key waits in a deque (appends are atomic) until the meter next counts.
        if self.key is not None:
            self.meter._released.append(self.key)


class ActivationMeter:
    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self._lock = threading.Lock()
        self._skip = {_key(p) for p in parameters}
        self._refs: dict[_Key, int] = {}
        self._sizes: dict[_Key, int] = {}
        self._released: deque[_Key] = deque()
        self._live = 0
        self.peak = 0

    @property
    def live(self) -> int:
        """Bytes held now."""
        with self._lock:
            self._drain()
            return self._live

    def saving(self) -> AbstractContextManager[Any]:
        """Autograd saves made inside this block are counted until autograd frees them."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def hold(self, tensor: torch.Tensor) -> _Held:
        """Count ``tensor`` for as long as the returned token is alive."""
        return self._pack(tensor)

    def start_step(self) -> None:
        """The next step's peak starts from what is held now."""
        with self._lock:
            self._drain()
            self.peak = self._live

    def _pack(self, t: torch.Tensor) -> _Held:
        # Detached: a saved output holding its own grad_fn would be a reference cycle, freed
        # only by the garbage collector (autograd restores the link when it unpacks).
        t = t.detach()
        key = _key(t)
        if key in self._skip or t.device.type == "meta":
            return _Held(self, t, None)
        with self._lock:
            # Releases first: a storage freed before this one was made may share its address.
            self._drain()
            n = self._refs.get(key, 0)
            if n == 0:
                size = t.untyped_storage().nbytes()
                self._sizes[key] = size
                self._live += size
                self.peak = max(self.peak, self._live)
            self._refs[key] = n + 1
        return _Held(self, t, key)

    def _drain(self) -> None:
        while self._released:
            key = self._released.popleft()
            n = self._refs[key] - 1
            if n:
                self._refs[key] = n
            else:
                del self._refs[key]
                self._live -= self._sizes.pop(key)


def _unpack(held: _Held) -> torch.Tensor:
    # Autograd skips its own in-place check for hooked saves; this is that check.
    if held.tensor._version != held.version:
        raise RuntimeError("one of the variables needed for gradient computation has been "
                           f"modified by an inplace operation: a {list(held.tensor.shape)} "
                           f"tensor is at version {held.tensor._version}, saved at "
                           f"{held.version}")
    return held.tensor
