"""Swarm wiring's answer to a lost cell (issue 34): the survivors redo the broken step over
the members left, every micro-batch of it routed to a survivor and counted once.

Under chain wiring a lost cell takes its chain with it and the other chains never touched it
(their rings regroup, ``replica_group``). Under swarm wiring every chain's micro-batches
crossed the lost cell's stage, so no survivor holds a whole step of its stage's gradients:
a cell whose pipeline link or ring breaks reports the step it had not yet applied
(``RegroupReport.routed``) and waits for its order: every member trains on from the
earliest such step. Of a dp job, a lost cell other than its stage's cell 0 leaves alone
(``contract.membership.cell_orders``, SWARM's: the job's batch kept, each stage dealing all
its shares' micro-batches to the cells it has left; the order names the layout without it,
which every survivor takes its placement down to); else the lost cell's replica leaves every
stage (``routed_orders``: the batch shrinks to the survivors' shares). The survivors
are at most one step apart, so a cell that had applied that step undoes it: it keeps the
weights and optimiser state from before its last optimiser step (a copy a step: the price of
an exact redo, paid by swarm-wired jobs of several replicas only). Its links then start
over: new pipe links and a new ring under the new membership's handshake tag, so no frame of
the given-up attempt reaches the redo, and a fresh synchronisation (dp keeps nothing across
steps; the one that ran the given-up step may still be waiting on its closed ring). No
spare joins in the lost replica's place: its cells would need every neighbour's links anew.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from swarm_core.contract.membership import RegroupOrder, RegroupReport
from swarm_core.contract.placement import slot_count
from swarm_core.pipeline.replica_group import Coordinator, StageDropped
from swarm_core.pipeline.route_meter import RouteMeter
from swarm_core.pipeline.transport import (
    LinkAborted,
    LinkClosed,
    PeerLink,
    PeerTimeout,
    farewell,
)

if TYPE_CHECKING:
    from swarm_core.pipeline.stage import StageRunner

log = logging.getLogger(__name__)


# What breaks a routed step: a link to a cell that died, broke or went quiet (socket errors
# come as LinkClosed). Anything else (a bad frame, a disk error) fails the cell as before.
LINK_FAULTS = (LinkClosed, PeerTimeout)
# Times a cell trains one step again before it gives up (a peer slow past the frame timeout
# but alive would otherwise have every member redo that step for ever).
MAX_REDOS = 3


class Rerouter:
    """One swarm-wired cell's side of a regroup: the step it last applied, the state before
    it, and the report, order, undo and fresh links of a regroup."""

    def __init__(self, runner: StageRunner, coordinator: Coordinator, start_step: int) -> None:
        self.runner, self.coordinator = runner, coordinator
        self.applied = start_step - 1  # the last step whose optimiser step ran (0-based)
        # Before the last optimiser step: its step, and the weights' and optimiser state's
        # tensors (copied into the same buffers every step: no allocation, no deep copy),
        # with the optimiser state's keys and its values that are not tensors.
        self._kept_step: int | None = None
        self._bufs: list[torch.Tensor] = []
        self._keys: list[tuple[int, str]] = []
        self._extra: dict[tuple[int, str], Any] = {}
        self.redone: list[int] = []  # the steps this cell trained again after a regroup
        self._fault: BaseException | None = None
        self._meters: dict[int, RouteMeter] = {}  # measured routes' meter at a step's start

    def _state(self) -> tuple[list[torch.Tensor], list[tuple[int, str]],
                              dict[tuple[int, str], Any]]:
        """The cell's weights and buffers, then its optimiser state's tensors by (parameter,
        key), and the state's other values."""
        r = self.runner
        tensors = [t.detach() for t in r.module.state_dict(keep_vars=True).values()]
        keys, extra = [], {}
        for i, p in enumerate(self._params()):
            for k, v in sorted(r.opt.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    tensors.append(v)
                    keys.append((i, k))
                else:
                    extra[(i, k)] = copy.deepcopy(v)
        return tensors, keys, extra

    def _params(self) -> list[torch.nn.Parameter]:
        """The optimiser's parameters, in the order its state is keyed by here."""
        return [p for g in self.runner.opt.param_groups for p in g["params"]]

    @torch.no_grad()
    def keep(self, step: int) -> None:
        """Before step ``step``'s optimiser step: what undoing it restores."""
        tensors, keys, self._extra = self._state()
        if keys != self._keys or len(tensors) != len(self._bufs):
            self._bufs = [t.clone() for t in tensors]
        else:
            for buf, t in zip(self._bufs, tensors, strict=True):
                buf.copy_(t)
        self._keys, self._kept_step = keys, step

    def stepped(self, step: int) -> None:
        self.applied = step

    def flush(self, link: PeerLink, timeout: float) -> None:
        """A link's flush after the optimiser step: a fault is kept for the next step to
        raise, so the applied step's report goes out first."""
        try:
            link.flush(timeout)
        except LINK_FAULTS as exc:
            self._fault = self._fault or exc

    def check(self, step: int) -> None:
        """At step ``step``'s start: measured routes' meter as it stands kept (a cell-wise
        regroup that trains this step or the one before again starts every survivor's from
        there), then the fault the last step's flush kept raised, if any."""
        meter = self.runner.meter_routes
        if meter is not None:
            self._meters = {s: m for s, m in self._meters.items() if s == step - 1}
            self._meters[step] = copy.deepcopy(meter)
        fault, self._fault = self._fault, None
        if fault is not None:
            raise fault

    def regroup(self, cause: BaseException) -> int:
        """Report, take the order, and get ready to train from the step it names (returned).
        Raises StageDropped where this cell's replica is out. Where the new links cannot be
        made (another cell died meanwhile), it reports again under the new membership."""
        spec = self.runner.spec
        while True:
            order = self._ask(cause)
            redo = order.redo_step
            if redo is None or redo not in (self.applied, self.applied + 1):
                raise RuntimeError(f"stage {spec.stage} replica {spec.replica} applied step "
                                   f"{self.applied} and cannot train on from step {redo}")
            if self.redone.count(redo) >= MAX_REDOS:
                raise cause
            if redo == self.applied:
                self._undo(redo)
            try:
                self._relink(order)
            except LINK_FAULTS as exc:
                cause = exc
                continue
            self.redone.append(redo)
            return redo

    def _ask(self, cause: BaseException) -> RegroupOrder:
        r = self.runner
        spec, group = r.spec, r.group
        log.info("stage %d replica %d: step %d broke (%s); asking for the members left",
                 spec.stage, spec.replica, self.applied + 1, cause)
        # What it queued goes out first (a neighbour may need it to finish its own step,
        # and fewer cells then have a step to undo); a link to the lost cell fails at once.
        for link in r.pipe_links():
            with contextlib.suppress(OSError, LinkAborted):
                link.flush(spec.training.frame_timeout_s)
        # The cell whose link closed without a FAREWELL likely died: named, the leader need
        # not wait out its heartbeat; every survivor says FAREWELL before it lets go.
        dead = r.links.dead_peer(spec.replica)
        report = RegroupReport(fellow_id=0, stage=spec.stage, replica=spec.replica,
                               epoch=group.epoch, op_step=self.applied + 1, routed=True,
                               closed_by=dead if dead is not None else group.ring_dead())
        farewell([*r.links.all(), *group.ring_links()], spec.training.frame_timeout_s)
        r.links.close()  # (the pipe's and the ring's: a new membership gets new ones)
        group.close()
        self._fault = None
        order = self.coordinator(report)
        group.check_stop()
        kept = order.members if order.layout is None else order.layout[spec.stage]
        if order.drop or spec.replica not in kept:
            raise StageDropped(f"replica {spec.replica} left the job at step "
                               f"{self.applied + 1}")
        return order

    @torch.no_grad()
    def _undo(self, step: int) -> None:
        r = self.runner
        if self._kept_step != step:
            raise RuntimeError(f"stage {r.spec.stage} replica {r.spec.replica} kept no state "
                               f"from before step {step} to undo it")
        # (state the undone step created, as the first step creates AdamW's moments, goes)
        params = self._params()
        kept = set(self._keys) | set(self._extra)
        for i, p in enumerate(params):
            state = r.opt.state.get(p)
            for k in [k for k in (state or {}) if (i, k) not in kept]:
                del state[k]  # type: ignore[union-attr]
            if p in r.opt.state and not r.opt.state[p]:
                del r.opt.state[p]
        tensors, keys, _extra = self._state()
        if keys != self._keys:
            raise RuntimeError(f"stage {r.spec.stage} replica {r.spec.replica}: the optimiser "
                               f"state changed shape since step {step}; cannot undo it")
        for t, buf in zip(tensors, self._bufs, strict=True):
            t.copy_(buf)
        for (i, k), v in self._extra.items():
            r.opt.state[params[i]][k] = v
        self.applied = step - 1
        log.info("stage %d replica %d: step %d undone, to train it again over the members "
                 "left", r.spec.stage, r.spec.replica, step)

    def _relink(self, order: RegroupOrder) -> None:
        from swarm_core.pipeline.stage import open_links  # (stage imports this module)

        r = self.runner
        spec, group = r.spec, r.group
        peers: Sequence[int] = order.members
        if order.layout is not None:
            # A cell-wise departure: the job's cells but the lost ones, each where it was.
            if spec.placement is None:
                raise RuntimeError(f"stage {spec.stage} replica {spec.replica} runs no "
                                   "placement to take the lost cells out of")
            kept = {(k, i) for k, ids in enumerate(order.layout) for i in ids}
            spec.placed(spec.placement.without(
                [(c.stage, c.replica) for c in spec.placement.stages
                 if (c.stage, c.replica) not in kept]))
            peers = range(slot_count(spec.layout, spec.replicas))
        # (first: a report after a failed relink speaks for the new membership)
        group.epoch = order.epoch
        group.members = list(order.members) if order.layout is None else spec.ids(spec.stage)
        links = open_links(spec, r.shaper, group.listener, r.stop,
                           spec.training.frame_timeout_s, r.liveness,
                           members=peers, epoch=order.epoch)
        r.links = attrs.evolve(links, ring_next=None, ring_prev=None)  # (the group's, below)
        r.up, r.down = links.up, links.down
        group.reform(r.params, r.device)
        if r.meter_routes is not None:
            # Every member must deal alike from the step it trains again. A cell that undid a
            # step had fed its table to the estimate, so the meter is the one every survivor
            # held at that step's start (each had fed it the same tables), the cells that
            # left taken out (a cell-wise departure; after a replica's, its entries stay
            # and no plan deals to it: ``weights(members)``).
            held = None if order.redo_step is None else self._meters.get(order.redo_step)
            r.meter_routes = RouteMeter.of(spec) if held is None else held.under(spec)
            self._meters = {}
            if group.sync is not None:
                group.sync.own = 0.0
