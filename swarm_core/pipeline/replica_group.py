"""A stage group from one member's side: who is in it, its ring, what to do when the ring
breaks, and the hand-off to a replica that joins. The sync algorithm (a ``GroupSync``) runs
over the group's ring; the stage only says when (see ``StageRunner._finish``).

Membership follows ``contract/membership.py``: a member whose ring breaks reports where it
stands to its coordinator (the leader, through its fellow) and does as the order says; a
replica joining is agreed at a synchronisation's confirmation, so every group takes it in
after the same step.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from swarm_core.contract.membership import RegroupOrder, RegroupReport
from swarm_core.pipeline.frames import Kind, job_tag
from swarm_core.pipeline.links import LinkShaper, PairShaper
from swarm_core.pipeline.listener import DataListener, Expected
from swarm_core.pipeline.optim import load_optimizer_arrays, optimizer_arrays
from swarm_core.pipeline.peers import peer_shaper
from swarm_core.pipeline.ring import STATE_ROUND, RingBroken
from swarm_core.pipeline.selective import sync_codec
from swarm_core.pipeline.syncs import GroupSync, Synced, make_sync
from swarm_core.pipeline.transport import (
    LinkClosed,
    Liveness,
    PeerLink,
    PeerTimeout,
    connect,
    farewell,
)
from swarm_core.pipeline.wire_math import NORM_PAYLOAD

if TYPE_CHECKING:
    from swarm_core.pipeline.stage import StageSpec

log = logging.getLogger(__name__)

# A cell whose group's ring broke asks this for its order (blocking; see contract/membership):
# the leader through its fellow, or run_local_pipeline's coordinator.
Coordinator = Callable[[RegroupReport], RegroupOrder]

# A stage whose compute thread shows no progress (an op begun, a wait polled) for this many frame
# timeouts stops pulsing its links, so its neighbours time out: long enough for any checkpoint
# (a shard write is seconds), short of for ever for a call hung on a disk or a device. A joiner
# tries to ring its members, and a member waits for a donor's state, as long.
STUCK_AFTER = 10


class StageDropped(Exception):
    """This cell's replica left the job (its chain lost a stage): the others train on."""


def ring_tag(job_id: str, epoch: int) -> int:
    """The handshake tag of a group's ring: the job's, and after a regroup one of the new
    membership's own (a dial meant for an earlier ring cannot join this one)."""
    return job_tag(job_id if epoch == 0 else f"{job_id}#membership-{epoch}")


def open_ring(spec: StageSpec, members: list[int], epoch: int, shaper: LinkShaper,
              listener: DataListener | None, stop: threading.Event, timeout: float,
              liveness: Liveness, max_payload: int) -> tuple[PeerLink | None, PeerLink | None]:
    """The links to the next and from the previous member of the group's ring after a regroup
    (none when one member is left): dialled and accepted side by side, as ``open_links``
    does, shaped like the pipeline's."""
    n = len(members)
    if n == 1:
        return None, None
    rank = members.index(spec.replica)
    nxt, prev = members[(rank + 1) % n], members[(rank - 1) % n]
    tag = ring_tag(spec.job_id, epoch)
    pulse = spec.training.frame_timeout_s / 4

    def shaping(replica: int) -> LinkShaper | PairShaper:
        return peer_shaper(spec, shaper, spec.stage, replica, spec.group_local[replica])

    assert listener is not None
    accepted: dict[str, Any] = {}
    cancel = threading.Event()

    def take() -> None:
        try:
            accepted.update(listener.accept_many(
                spec.key, tag, [Expected("ring", spec.stage, prev, shaping(prev), max_payload,
                                         receives=(Kind.SYNC,))],
                timeout, abort=stop, pulse_s=pulse, liveness=liveness, cancel=cancel,
                transport=spec.training.transport))
        except BaseException as exc:  # (re-raised below)
            accepted["error"] = exc

    acceptor = threading.Thread(target=take, name="ring-accept", daemon=True)
    acceptor.start()
    send = None
    try:
        addr = spec.group_addrs[nxt]
        assert addr is not None
        send = connect(addr, spec.key, spec.stage, tag, shaping(nxt), timeout, abort=stop,
                       receives=(), pulse_s=pulse, liveness=liveness, ring=(spec.replica, nxt),
                       transport=spec.training.transport)
    except BaseException:
        cancel.set()
        raise
    finally:
        acceptor.join()
        if send is None or "error" in accepted:
            for link in (send, accepted.get("ring")):
                if link is not None:
                    link.close()
    if "error" in accepted:
        raise accepted["error"]
    return send, accepted["ring"]


class ReplicaGroup:
    """One member's view of its stage group: the members that train, the number of regroups
    so far (``epoch``), the step of the last synchronisation committed, the ring, and the
    algorithm (``sync``) that runs over it. A job of one replica has a group of one with no
    ring and no algorithm."""

    def __init__(self, spec: StageSpec, module: torch.nn.Module, opt: torch.optim.Optimizer,
                 shaper: LinkShaper, stop: threading.Event, liveness: Liveness,
                 check_stop: Callable[[], None]) -> None:
        self.spec, self.module, self.opt = spec, module, opt
        self.shaper, self.stop, self.liveness, self.check_stop = shaper, stop, liveness, \
            check_stop
        self.members = spec.ids(spec.stage)  # (a layout's stage: its own cells)
        self.epoch = 0
        self.synced_step = -1
        self.sync: GroupSync | None = None
        self.ring_next: PeerLink | None = None
        self.ring_prev: PeerLink | None = None
        self.coordinator: Coordinator | None = None
        self.listener: DataListener | None = None
        # What the leader told this cell of replicas joining (appended by the fellow):
        # (order, (the group's addresses, which of them are in this fellow)).
        self.inbox: list[tuple[RegroupOrder, Any]] | None = None
        self.admit_after = 0  # the membership the group agreed to take on after this step
        # The algorithm's state from a checkpoint, by parameter name: installed once the
        # algorithm exists (with the links, after any resume's weights are in).
        self.resume: dict[str, np.ndarray] | None = None

    def start(self, params: list[torch.nn.Parameter], device: torch.device,
              ring_next: PeerLink | None, ring_prev: PeerLink | None) -> None:
        """The group's ring, once its links are open (a joiner rings its members later)."""
        spec = self.spec
        joins = spec.join is not None and spec.replicas > 1
        # (a layout's stage of one cell keeps a sync too: it still divides by the shares)
        if not (joins or (ring_next is not None and ring_prev is not None)
                or spec.layout is not None):
            return
        self.ring_next, self.ring_prev = ring_next, ring_prev
        rank, n = (spec.replica, spec.replicas) if spec.layout is None else \
            (self.members.index(spec.replica), len(self.members))
        self.sync = make_sync(spec.training, params, ring_next, ring_prev, rank, n, device,
                              self.names(), sync_codec(spec))
        self._divide()
        if self.resume:
            self.sync.restore_state(self.names(), self.resume)
        if ring_prev is not None:
            ring_prev.max_payload = max(NORM_PAYLOAD, self.sync.max_payload)

    def _divide(self) -> None:
        """Under a layout, the group's sum becomes the mean over the job's data shares."""
        if self.spec.layout is not None and self.sync is not None:
            self.sync.divide_by(self.spec.replicas)

    def names(self) -> list[str]:
        """The trained parameters' names, in the order the algorithm holds them."""
        return [n for n, p in self.module.named_parameters() if p.requires_grad]

    @property
    def dealt(self) -> list[int] | None:
        """Whom the job's routes deal to (``route_plan``'s members): the group's members,
        every stage's alike (a regroup's survivors); under a layout, every cell of it (None:
        a lost cell's regroup is not built for layouts)."""
        return None if self.spec.layout is not None else self.members

    @property
    def leads(self) -> bool:
        """The first member left: it evaluates and checkpoints for its group (whose replicas
        hold the same weights)."""
        return self.spec.replica == self.members[0]

    # the algorithm's operations, around the optimiser step -------------------------------------
    def before_step(self, step: int, heard: bool) -> Synced:
        """The gradients complete (the algorithm's ``after_backward``)."""
        sync, timeout = self.sync, self.spec.training.frame_timeout_s
        if sync is None:
            return None
        return self.synchronised(step, lambda: sync.after_backward(step, timeout), heard)

    def after_step(self, step: int, heard: bool, hold: bool) -> Synced:
        """After the optimiser step: an operation in flight that is due, then this step's
        own; ``hold``: the replicas must hold one set of weights after it."""
        sync, t = self.sync, self.spec.training
        if sync is None:
            return None
        last = step + 1 == t.steps
        synced = None
        if sync.collect_due(step, last):
            synced = self.synchronised(step, lambda: sync.collect(step, last, t.frame_timeout_s),
                                       heard, op_step=sync.in_flight)
        return plus(synced, self.synchronised(
            step, lambda: sync.after_step(step, last, t.frame_timeout_s, hold), heard))

    def synchronised(self, step: int, op: Callable[[], Synced], heard: bool,
                     op_step: int | None = None) -> Synced:
        """Run the group's synchronisation ``op``; where its ring breaks, regroup and commit
        or do it again over the new ring, as the order says. ``heard``: whether a cell of this
        cell's chain had been told of a replica joining when the step began. ``op_step``: the
        step the operation began at, where earlier than this one (an overlapped outer step's)."""
        assert self.sync is not None
        # The membership this member proposes at the confirmation: the newest it was told of,
        # but only where its chain had heard of it when the step began. Every chain learns it
        # at the same step, and every stage group holds one cell of each chain, so every
        # group agrees on the same step to take a joining chain in (each cell of it then
        # starts at the same step).
        told = max([self.epoch + 1] + [o.epoch for o, _ in self.told()])
        self.sync.word = float(told if heard else self.epoch)
        while True:
            try:
                out = op()
            except RingBroken as exc:
                if self.coordinator is None:
                    raise exc.cause from None
                if self._regroup(exc):
                    assert self.sync is not None
                    self.sync.commit()
                    out = (0, 0.0)
                else:
                    continue
            if out is not None:
                self.synced_step = step if op_step is None else op_step
                if self.sync.heard > self.epoch:  # (someone was told of a replica joining)
                    self.admit_after = int(self.sync.heard)
            return out

    def told(self) -> list[tuple[RegroupOrder, Any]]:
        """The memberships the leader told this cell of (a replica joins), newer than its
        own: (order, the job's placement now)."""
        return [m for m in (self.inbox or []) if m[0].epoch > self.epoch]

    def _regroup(self, exc: RingBroken) -> bool:
        """Report where this cell stands, wait for its order, and ring the members left.
        Returns whether to commit the broken operation's result (else: do it again)."""
        assert self.coordinator is not None and self.sync is not None
        spec = self.spec
        closed_by = self.ring_dead()
        self.let_go()
        order = self.coordinator(RegroupReport(
            fellow_id=0, stage=spec.stage, replica=spec.replica, epoch=self.epoch,
            op_step=exc.step, synced_step=self.synced_step, finished=exc.finished,
            closed_by=closed_by))
        self.check_stop()
        if order.drop or spec.replica not in order.members:
            raise StageDropped(f"replica {spec.replica} left the job at step {exc.step}")
        self.epoch, self.members = order.epoch, list(order.members)
        self.admit_after = 0
        if self.inbox is not None:  # (a join it was told of is off: this order replaces it)
            self.inbox[:] = [m for m in self.inbox if m[0].epoch > self.epoch]
        self._ring(spec.training.frame_timeout_s)
        return order.commit

    def _ring(self, timeout: float, state_bytes: int = 0) -> None:
        """Ring the current members (after a regroup, or to take a replica in)."""
        assert self.sync is not None
        spec = self.spec
        rank, n = self.members.index(spec.replica), len(self.members)
        self.sync.rewire(None, None, rank, n)  # (its chunks, hence its frames, change)
        send, recv = open_ring(spec, self.members, self.epoch, self.shaper, self.listener,
                               self.stop, timeout, self.liveness,
                               max(NORM_PAYLOAD, self.sync.max_payload, state_bytes))
        self.ring_next, self.ring_prev = send, recv
        self.sync.rewire(send, recv, rank, n)

    def reform(self, params: list[torch.nn.Parameter], device: torch.device,
               state_bytes: int = 0) -> None:
        """Swarm wiring's regroup (``pipeline/reroute``): a fresh algorithm over a ring of the
        current members (the one that ran the given-up step may still wait on its old ring).
        ``state_bytes``: room for a stage's state on the ring (a layout's move hands it)."""
        spec = self.spec
        self.admit_after = 0
        if self.sync is not None:
            self.sync.close()
        rank, n = self.members.index(spec.replica), len(self.members)
        self.sync = make_sync(spec.training, params, None, None, rank, n, device, self.names(),
                              sync_codec(spec))
        self._divide()
        self._ring(spec.training.frame_timeout_s, state_bytes)

    # a replica joins ---------------------------------------------------------------------------
    def admit_safely(self, step: int) -> None:
        """Take the joiner in; if its ring cannot be made (it died meanwhile), regroup as for
        any broken ring, before the group's next operation."""
        try:
            self._admit(step)
        except (LinkClosed, PeerTimeout, OSError) as exc:
            if self.coordinator is None:
                raise
            self._regroup(RingBroken(self.spec.training.sync.next_sync(step), False, exc))

    def state_bound(self) -> int:
        """The most bytes the stage's state takes as a frame (weights, AdamW's two moments,
        DiLoCo's anchor and momentum, and the archive's own)."""
        return 4 * 6 * sum(p.numel() for p in self.module.parameters() if p.requires_grad) \
            + (1 << 20)

    def _state_blob(self, step: int) -> bytes:
        arrays = {f"w.{k}": v.detach().cpu().float().numpy()
                  for k, v in self.module.state_dict().items()}
        arrays.update({f"o.{k}": v for k, v in optimizer_arrays(self.opt, self.module).items()})
        if self.sync is not None:
            arrays.update({f"s.{k}": v for k, v in self.sync.handoff().items()})
        arrays["step"] = np.array([step], dtype=np.int64)
        out = io.BytesIO()
        np.savez(out, **arrays)
        return out.getvalue()

    @torch.no_grad()
    def _load_state(self, blob: bytes) -> int:
        """Take a donor's state; returns the step it had finished."""
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        own = self.module.state_dict()
        weights = {k[2:]: torch.from_numpy(v).to(own[k[2:]].dtype)
                   for k, v in arrays.items() if k.startswith("w.")}
        self.module.load_state_dict(weights, strict=True)
        load_optimizer_arrays(self.opt, self.module,
                              {k[2:]: v for k, v in arrays.items() if k.startswith("o.")})
        if self.sync is not None:
            self.sync.take_handoff({k[2:]: v for k, v in arrays.items() if k.startswith("s.")})
        return int(arrays["step"][0])

    def _pass_state(self, donor: int, blob: bytes | None) -> bytes:
        """The donor's state around the ring, from the donor to the member before it. (Its
        frames are step 0's: the ring is new, and the step is in the state.)"""
        step = 0
        patience = STUCK_AFTER * self.spec.training.frame_timeout_s
        me = self.spec.replica
        if me != donor:
            assert self.ring_prev is not None
            _, raw = self.ring_prev.recv(Kind.SYNC, step, STATE_ROUND, patience)
            blob = bytes(raw)
        assert blob is not None
        n = len(self.members)
        after = self.members[(self.members.index(me) + 1) % n]
        if after != donor and self.ring_next is not None:
            self.ring_next.send_raw(Kind.SYNC, step, STATE_ROUND, blob)
            self.ring_next.flush(patience)
        return blob

    def hand_state(self, donor: int, step: int) -> None:
        """Round the ring from ``donor`` (the group's members once a newcomer is rung): the
        donor's state after step ``step``, each member passing it on to the one after it."""
        self._pass_state(donor, self._state_blob(step) if self.spec.replica == donor else None)

    def take_state(self, donor: int) -> int:
        """A newcomer on the ring: the donor's state, installed. Returns the step it had
        finished."""
        return self._load_state(self._pass_state(donor, None))

    def _admit(self, step: int) -> None:
        """After step ``step``'s operation, where the group agreed a replica joins: ring the
        new members and hand the joiner the state, from the order's donor."""
        epoch, self.admit_after = self.admit_after, 0
        t = self.spec.training
        deadline = time.monotonic() + 2 * t.frame_timeout_s
        while not (told := [m for m in self.told() if m[0].epoch == epoch]):
            # (another member heard of it first: the leader's word to this one is on its way)
            if time.monotonic() > deadline:
                # No word came: what the chains carried was a join the leader called off (a
                # replica left meanwhile; a group yet to regroup still held its order). Every
                # member of the group waited for the same word, and none takes anyone in.
                log.warning("%s stage %d: no word of membership %d; going on as %d",
                            self.spec.job_id, self.spec.stage, epoch, self.epoch)
                return
            self.check_stop()
            time.sleep(0.05)
        order, addrs = told[-1]
        self.spec.group_addrs, self.spec.group_local = addrs
        self.epoch, self.members = order.epoch, list(order.members)
        assert order.donor is not None
        self._ring(t.frame_timeout_s, self.state_bound())
        self.hand_state(order.donor, step)

    def join(self) -> int:
        """A joiner: ring the members it joins (they ring it at their next operation
        boundary, however far off) and take the donor's state. Returns the step to go on
        from."""
        order = self.spec.join
        assert order is not None and order.donor is not None
        self.epoch, self.members = order.epoch, list(order.members)
        t = self.spec.training
        deadline = time.monotonic() + STUCK_AFTER * t.frame_timeout_s
        while True:
            try:
                self._ring(t.frame_timeout_s, self.state_bound())
                break
            except (PeerTimeout, LinkClosed, OSError):
                if time.monotonic() > deadline:
                    raise
                self.check_stop()
        step = self.take_state(order.donor)
        self.synced_step = step
        return step + 1

    def ring_links(self) -> list[PeerLink]:
        return [x for x in (self.ring_next, self.ring_prev) if x is not None]

    def ring_dead(self) -> int | None:
        """The ring neighbour (its replica) whose link closed without a FAREWELL: its
        process likely ended (the one before this cell first, as the ring's data comes from
        it); None where neither did."""
        n = len(self.members)
        if n < 2:
            return None
        at = self.members.index(self.spec.replica)
        for link, off in ((self.ring_prev, -1), (self.ring_next, 1)):
            if link is not None and link.died:
                return self.members[(at + off) % n]
        return None

    def let_go(self) -> None:
        """Close the ring's links to regroup, saying FAREWELL first: its neighbours must not
        take this cell for the one that died."""
        farewell(self.ring_links(), self.spec.training.frame_timeout_s)
        self.close()

    def close(self) -> None:
        """Close the ring's links (the algorithm stays, to be rewired)."""
        for link in self.ring_links():
            link.close()

    def shut(self) -> None:
        """The run is over: the algorithm's threads too."""
        if self.sync is not None:
            self.sync.close()
        self.close()


def plus(a: Synced, b: Synced) -> Synced:
    """Two synchronisations' bytes and seconds in one step (either may be None: none ran)."""
    if a is None or b is None:
        return a or b
    return a[0] + b[0], a[1] + b[1]
