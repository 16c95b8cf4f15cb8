"""``sync.mode: diloco``: DiLoCo's outer step (arXiv 2311.08105), optionally overlapped with
the inner steps after it and taken a fragment of the parameters at a time (Streaming DiLoCo,
arXiv 2501.18512).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from swarm_core.config.schemas import SyncConfig, TrainingConfig
from swarm_core.pipeline.codecs import WireCodec
from swarm_core.pipeline.collective import ring_maker
from swarm_core.pipeline.optim import OUTER_FIELD
from swarm_core.pipeline.ring import LINK_FAULTS, RingBroken, confirm_bytes
from swarm_core.pipeline.syncs.base import GroupSync, Synced
from swarm_core.pipeline.transport import PeerLink


def _blocks_of(names: Sequence[str]) -> list[int] | None:
    """Each parameter's transformer block, counted in the stage (``blocks.N.`` names);
    those before the first block join it, those after the last join that. None where no
    name is a block's."""
    seen: dict[str, int] = {}
    own = []
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "blocks" and len(parts) > 2 else None
        own.append(seen.setdefault(key, len(seen)) if key is not None else None)
    if not seen:
        return None
    out, current = [], 0
    for b in own:
        current = b if b is not None else current
        out.append(current)
    return out


def fragment_bounds(sizes: Sequence[int], parts: int, names: Sequence[str] = (),
                    pattern: str = "strided") -> list[list[int]]:
    """The parameters (by index, in the module's order) of each of ``parts`` fragments.
    ``strided`` (Streaming DiLoCo's choice): block b of the stage in fragment b mod P,
    each fragment a slice of every depth. ``sequential``, and wherever the stage holds
    fewer blocks than fragments: contiguous runs of about equal elements, each parameter
    in the fragment where its middle element falls (one may be empty where one parameter
    outweighs it)."""
    blocks = _blocks_of(names) if pattern == "strided" and len(names) == len(sizes) else None
    if blocks is not None and max(blocks) + 1 >= parts:
        of = [b % parts for b in blocks]
    else:
        total = sum(sizes) or 1
        of, before = [], 0
        for n in sizes:
            of.append(min(parts - 1, parts * (2 * before + n) // (2 * total)))
            before += n
    return [[i for i, f in enumerate(of) if f == part] for part in range(parts)]


class Exchange(Protocol):
    """What an outer step needs of the group's exchange of one fragment's change: a
    :class:`~swarm_core.pipeline.ring.Ring` (the mean, all-reduced) or SparseLoCo's
    ``SparseGather``."""

    base: int  # its frames' first number (a fragment's, after those before it)
    replicas: int

    @property
    def frames(self) -> int: ...

    @property
    def max_payload(self) -> int: ...

    def expected_bytes(self) -> int: ...

    def rewire(self, send: PeerLink | None, recv: PeerLink | None, rank: int,
               replicas: int) -> None: ...

    def reduce_(self, step: int, timeout: float,
                tensors: Sequence[torch.Tensor]) -> tuple[int, float]: ...

    def put_back(self, tensors: Sequence[torch.Tensor]) -> None: ...

    def confirm(self, step: int, timeout: float, word: float = 0.0) -> tuple[int, float, float]:
        ...

    def close(self) -> None: ...


class OuterStep(GroupSync):
    """DiLoCo (``sync.mode: diloco``, arXiv 2311.08105): each replica takes ``inner_steps``
    optimiser steps alone; then the group averages the pseudo-gradient (the weights at the last
    sync minus the weights now), an outer SGD with Nesterov momentum applies it to the weights
    at the last sync, and every replica goes on from the result. The inner optimiser's state
    stays each replica's own. The last step of a run syncs too, so the run ends on one set of
    weights.

    With ``overlap_steps`` d > 0 the average crosses while the replicas train on (as Streaming
    DiLoCo overlaps its outer step, arXiv 2501.18512): the ring runs on a thread of its own
    from the outer step's step s, and after step s + d each replica takes the outer step's
    result plus what it has trained since s (its drift), so no inner step is lost and the
    next pseudo-gradient, taken from the new anchor, holds that drift. An outer step where
    the run must hold one set of weights (``hold``: the last step, a checkpoint's) blocks as
    with d = 0.

    With ``fragments`` P > 1 (Streaming DiLoCo's fragments) the parameters are P fragments
    (:func:`fragment_bounds`), each with an exchange of its own: about every H/P steps the
    next fragment's outer step runs (``SyncConfig.turns``), so each is synced every H steps
    and a sync sends about 1/P of the model. Where the run must hold one set of weights,
    every fragment's runs, one after another, as one operation."""

    own_state = True  # (each replica's AdamW moments are its own)

    def __init__(self, params: Sequence[torch.nn.Parameter], exchanges: Sequence[Exchange],
                 cfg: SyncConfig, steps: int,
                 fragments: Sequence[Sequence[int]] | None = None) -> None:
        self.params, self.cfg, self.steps = list(params), cfg, steps
        self.exchanges = list(exchanges)
        self.fragments = [list(f) for f in fragments] if fragments is not None \
            else [list(range(len(self.params)))]
        assert len(self.fragments) == len(self.exchanges)
        self._number()
        self.overlap_steps = cfg.overlap_steps
        lr, momentum = cfg.outer_step
        self.anchor = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        # (momentum 0 is plain SGD on the mean change: with lr 1, weight averaging. One SGD
        # for every fragment: it steps only the anchors given a gradient, the due fragments')
        self.opt = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum,
                                   nesterov=momentum > 0)
        # The operation in hand: its fragments, and this member's own change of each (until
        # committed); overlapped, the weights each change was taken at.
        self._due: list[int] = []
        self._deltas: list[list[torch.Tensor]] = []
        self._sent: list[list[torch.Tensor]] = []
        self.word = self.heard = 0.0  # the membership proposed, and agreed, at confirmation
        # The overlapped outer step in flight: its step, and whether its result is still to
        # be taken from the ring's thread (False once that broke: it is done again inline).
        self.pending: int | None = None
        self._on_thread = False
        self._jobs: queue.SimpleQueue[tuple[int, float, float] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[int, float, float] | BaseException] = \
            queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def _number(self) -> None:
        """Each fragment's frames numbered after those of the fragments before it (an
        operation that holds one set of weights sends them all at one step)."""
        base = 0
        for ex in self.exchanges:
            ex.base = base
            base += ex.frames

    @property
    def max_payload(self) -> int:
        return max(ex.max_payload for ex in self.exchanges)

    def due(self, step: int, last: bool, hold: bool) -> list[int]:
        """The fragments whose outer step runs after 0-based step ``step`` (none: no sync):
        every one where the run must hold one set of weights, else the one whose turn it is."""
        if not (last or self.cfg.syncs_after(step + 1, self.steps)):
            return []
        if last or hold:
            return [f for f, r in enumerate(self.fragments) if len(r)]
        f = self.cfg.fragment_after(step + 1) if len(self.fragments) > 1 else 0
        return [f] if len(self.fragments[f]) else []

    def expected_bytes(self) -> int:
        """What an outer step of every fragment sends (one that holds the weights)."""
        return self.planned_bytes(0, True, True)

    def planned_bytes(self, step: int, last: bool, hold: bool) -> int:
        due = self.due(step, last, hold)
        if not due:
            return 0
        return sum(self.exchanges[f].expected_bytes() for f in due) \
            + confirm_bytes(self.replicas)

    @property
    def replicas(self) -> int:
        return self.exchanges[0].replicas

    def rewire(self, send: PeerLink | None, recv: PeerLink | None, rank: int,
               replicas: int) -> None:
        for ex in self.exchanges:
            ex.rewire(send, recv, rank, replicas)
        self._number()

    @property
    def in_flight(self) -> int | None:
        return self.pending

    def collect_due(self, step: int, last: bool) -> bool:
        """Whether the overlapped outer step in flight is taken after step ``step``."""
        return self.pending is not None and (step >= self.pending + self.overlap_steps or last)

    @torch.no_grad()
    def collect(self, step: int, last: bool, timeout: float) -> Synced:
        """After step ``step``: the overlapped outer step in flight, once ``overlap_steps``
        steps have passed since it began (or at the run's last step), waited for and
        applied. On a broken ring (RingBroken, of the outer step's own step) nothing has
        changed: it can be done again over a new ring, or :meth:`commit` what this member
        holds."""
        if not self.collect_due(step, last):
            return None
        assert self.pending is not None
        t0 = time.perf_counter()
        if self._on_thread:
            self._on_thread = False
            got = self._done.get()
            if isinstance(got, BaseException):
                raise got
        else:  # (the ring broke and the group chose to do it again: here, over the new ring)
            got = self._reduce_confirm(self.pending, timeout, self.word)
        sent, _seconds, self.heard = got
        self.commit()
        return sent, time.perf_counter() - t0

    @torch.no_grad()
    def after_step(self, step: int, last: bool, timeout: float, hold: bool = False) -> Synced:
        """After global step ``step`` (0-based): an outer step every ``inner_steps`` steps and
        at the end (a fragment's, every ``inner_steps / fragments``); overlapped with the
        steps after it unless ``hold`` or the last. On a broken ring (RingBroken) nothing has
        changed: the weights and the anchor are as before, so the outer step can be done
        again over a new ring, or :meth:`commit` what this member already holds."""
        due = self.due(step, last, hold)
        if not due:
            return None
        assert self.pending is None, "an outer step began with the last still in flight"
        self._due = due
        self._deltas = [[self.anchor[i].detach() - self.params[i].detach()
                         for i in self.fragments[f]] for f in due]
        # (a group left with one member overlaps too: its outer step lands where the
        # group's would, so the algorithm does not change with the members left)
        if self.overlap_steps and not (hold or last):
            self.pending, self._on_thread = step, True
            # (kept, not rebuilt as anchor - change at the end: the drift is then exactly
            # what the replica trained meanwhile, with no rounding of the weights it left)
            self._sent = [[self.params[i].detach().clone() for i in self.fragments[f]]
                          for f in due]
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="outer-all-reduce",
                                                daemon=True)
                self._worker.start()
            self._jobs.put((step, timeout, self.word))
            return None
        sent, seconds, self.heard = self._reduce_confirm(step, timeout, self.word)
        self.commit()
        return sent, seconds

    def _reduce_confirm(self, step: int, timeout: float,
                        word: float) -> tuple[int, float, float]:
        sent, seconds = 0, 0.0
        try:
            for f, deltas in zip(self._due, self._deltas, strict=True):
                more, wait = self.exchanges[f].reduce_(step, timeout, deltas)
                sent, seconds = sent + more, seconds + wait
        except LINK_FAULTS as exc:
            raise RingBroken(step, False, exc) from None
        try:
            more, wait, heard = self.exchanges[0].confirm(step, timeout, word)
        except LINK_FAULTS as exc:
            raise RingBroken(step, True, exc) from None
        return sent + more, seconds + wait, heard

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._done.put(self._reduce_confirm(*job))
            except BaseException as exc:  # (handed to the stage's thread, raised there)
                self._done.put(exc)

    def momentum(self) -> list[torch.Tensor | None]:
        """The outer SGD's momentum buffer of each parameter (None before its first step)."""
        return [self.opt.state.get(a, {}).get("momentum_buffer") for a in self.anchor]

    @torch.no_grad()
    def set_momentum(self, buffers: Sequence[torch.Tensor | None]) -> None:
        """Install momentum buffers (a joiner's from its donor, a resume's from its
        checkpoint); the anchor stays the weights the stage holds."""
        for a, buf in zip(self.anchor, buffers, strict=True):
            if buf is not None:
                self.opt.state[a]["momentum_buffer"] = buf.detach().clone().to(a.device,
                                                                               a.dtype)

    @torch.no_grad()
    def commit(self) -> None:
        """The outer step of each fragment in hand from the group's mean change, which this
        member holds. An overlapped one keeps what the replica trained since it began: the
        weights become the new anchor plus (the weights now - the weights the change was
        taken from)."""
        drift = self.pending is not None  # (an overlapped one, its result taken late)
        for k, (f, deltas) in enumerate(zip(self._due, self._deltas, strict=True)):
            if drift:
                for i, then in zip(self.fragments[f], self._sent[k], strict=True):
                    self.params[i].sub_(then)
            self.exchanges[f].put_back(deltas)
            for i, d in zip(self.fragments[f], deltas, strict=True):
                self.anchor[i].grad = d
        self.opt.step()
        for f in self._due:
            for i in self.fragments[f]:
                p, a = self.params[i], self.anchor[i]
                a.grad = None
                if drift:
                    p.add_(a)
                else:
                    p.copy_(a)
        self._due, self._deltas, self._sent, self.pending = [], [], [], None

    def checkpoint_state(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """The outer momentum, as ``<parameter>.outer_momentum``."""
        return {f"{name}.{OUTER_FIELD}": buf.detach().cpu().float().numpy().copy()
                for name, buf in zip(names, self.momentum(), strict=True) if buf is not None}

    def restore_state(self, names: Sequence[str], arrays: dict[str, np.ndarray]) -> None:
        keys = [f"{n}.{OUTER_FIELD}" for n in names]
        self.set_momentum([torch.from_numpy(np.array(arrays[k])) if k in arrays else None
                           for k in keys])

    def handoff(self) -> dict[str, np.ndarray]:
        """The anchor (the weights at the last outer step) and the outer momentum."""
        out = {}
        for i, (a, buf) in enumerate(zip(self.anchor, self.momentum(), strict=True)):
            out[f"a.{i}"] = a.detach().cpu().numpy()
            if buf is not None:
                out[f"m.{i}"] = buf.detach().cpu().numpy()
        return out

    @torch.no_grad()
    def take_handoff(self, arrays: dict[str, np.ndarray]) -> None:
        for i, a in enumerate(self.anchor):
            a.copy_(torch.from_numpy(arrays[f"a.{i}"]))
        self.set_momentum([torch.from_numpy(arrays[f"m.{i}"]) if f"m.{i}" in arrays
                           else None for i in range(len(self.anchor))])

    def close(self) -> None:
        if self._worker is not None:
            self._jobs.put(None)
        for ring in self.exchanges:
            ring.close()


def build(training: TrainingConfig, params: Sequence[torch.nn.Parameter], send: PeerLink | None,
          recv: PeerLink | None, rank: int, replicas: int, codec: WireCodec,
          device: torch.device, names: Sequence[str] = ()) -> OuterStep:
    params = list(params)
    parts = fragment_bounds([p.numel() for p in params], training.sync.fragments, names,
                            training.sync.fragment_pattern)
    make = ring_maker(training.transport)
    rings = [make([params[i].numel() for i in part], send, recv, rank, replicas, codec, device)
             for part in parts]
    return OuterStep(params, rings, training.sync, training.steps, parts)
