"""Every stage of one pipeline as threads of this process, over real loopback TCP: the data
plane and schedules exactly as fellows run them, without a leader. For tests, device checks and
notebooks; fellows do not use it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract import StageStart, chain_starts
from swarm_core.contract.membership import (
    MembershipChange,
    RegroupConflict,
    RegroupOrder,
    RegroupReport,
    cell_departure,
    cell_orders,
    cellwise_layout,
    departure,
    regroup_orders,
    routed_orders,
)
from swarm_core.contract.placement import layout_cells, normal_layout, slot_count, stage_ids
from swarm_core.contract.rebalance import PeerMove
from swarm_core.data import TokenData
from swarm_core.pipeline.layout import (
    Layout,
    check_layout,
    check_weights,
)
from swarm_core.pipeline.links import LinkShaper
from swarm_core.pipeline.listener import DataListener
from swarm_core.pipeline.move import LayoutMove, Rebalance
from swarm_core.pipeline.stage import (
    StageDropped,
    StageResult,
    StageSpec,
    StageStopped,
    StepReport,
    run_stage,
)

__all__ = ["LocalCoordinator", "run_local_pipeline"]


class LocalCoordinator:
    """What the leader does for a job of several replicas when a member is lost, for the
    cells of one process: it gathers the survivors' reports and, once every cell of the
    current members has reported or ended, answers each with the one rule of
    ``contract/membership.py``. ``changes`` records who left at which step.

    ``cellwise``: a swarm-wired dp job's rule, as the leader's: a lost cell other than its
    stage's cell 0 leaves alone, the job's batch kept (``cell_orders``); ``layout``: the
    job's cells at the start (None: the grid)."""

    def __init__(self, stages: int, replicas: int, stop: threading.Event,
                 cellwise: bool = False, layout: Sequence[Sequence[int]] | None = None
                 ) -> None:
        self.stages, self.stop, self.shares, self.cellwise = stages, stop, replicas, cellwise
        self.layout = normal_layout(layout, stages, replicas)
        self.members = sorted({r for k in range(stages)
                               for r in stage_ids(self.layout, k, replicas)})
        self.epoch = 0
        self.changes: list[MembershipChange] = []
        self._cond = threading.Condition()
        self._reports: dict[tuple[int, int], RegroupReport] = {}
        self._ended: set[tuple[int, int]] = set()
        self._finished: set[tuple[int, int]] = set()
        self._orders: dict[tuple[int, int], RegroupOrder | Exception] = {}

    def cell_ended(self, stage: int, replica: int) -> None:
        """A cell's thread ended in an error: its chain is out."""
        with self._cond:
            self._ended.add((stage, replica))
            self._decide()
            self._cond.notify_all()

    def cell_finished(self, stage: int, replica: int) -> None:
        """A cell trained to the end."""
        with self._cond:
            self._finished.add((stage, replica))
            self._decide()
            self._cond.notify_all()

    def __call__(self, report: RegroupReport) -> RegroupOrder:
        cell = (report.stage, report.replica)
        with self._cond:
            self._reports[cell] = report
            self._decide()
            self._cond.notify_all()
            while cell not in self._orders:
                if self.stop.is_set():
                    raise StageStopped()
                self._cond.wait(0.1)
            order = self._orders.pop(cell)
        if isinstance(order, Exception):
            raise order
        return order

    def _decide(self) -> None:
        cells = {(s, r) for s in range(self.stages) for r in self.members
                 if r in stage_ids(self.layout, s, self.shares)}
        routed = any(rep.routed for rep in self._reports.values())
        if not self._reports or cells - self._reports.keys() - self._ended \
                - (self._finished if routed else set()):
            return
        lost = cells & self._ended
        # (once a replica left by the rule of whole replicas, that rule goes on deciding)
        whole = set(self.members) >= {r for k in range(self.stages)
                                      for r in stage_ids(self.layout, k, self.shares)}
        after = cellwise_layout(self.layout, self.stages, self.shares, lost) \
            if self.cellwise and routed and whole else None
        if after is not None:
            self._decide_cells(cells, lost, after)
            return
        broken = {r for _s, r in self._ended}
        rule = routed_orders if routed else regroup_orders
        try:
            if routed and self._finished & cells:
                # (a survivor that finished the job cannot redo its last step)
                raise RegroupConflict("a replica finished the job while another had not "
                                      "applied its last step")
            members, orders = rule(self._reports, self.stages, broken, self.epoch + 1)
            if not members:
                raise RegroupConflict("no replica is left")
        except RegroupConflict as exc:
            self._orders.update({c: exc for c in self._reports})
            self._reports.clear()
            return
        self.changes.append(departure(self._reports, orders, self.stages, self.members,
                                      members, self.epoch + 1, at=time.time()))
        self.epoch, self.members = self.epoch + 1, members
        self._orders.update(orders)
        self._reports.clear()

    def _decide_cells(self, cells: set[tuple[int, int]], lost: set[tuple[int, int]],
                      after: Layout) -> None:
        try:
            if self._finished & cells:
                raise RegroupConflict("a cell finished the job while another had not "
                                      "applied its last step")
            orders = cell_orders(self._reports, after, self.epoch + 1)
        except RegroupConflict as exc:
            self._orders.update({c: exc for c in self._reports})
            self._reports.clear()
            return
        change = cell_departure(orders, self.stages, lost, self.epoch + 1, at=time.time())
        self.changes.append(change)
        self.epoch, self.members = change.epoch, change.members
        self.layout = normal_layout(after, self.stages, self.shares)
        self._ended -= lost  # (gone from the job's cells: not counted again)
        self._orders.update(orders)
        self._reports.clear()


def _move(relayout: tuple[int, Sequence[Sequence[int]]], before: Layout | None,
          stages: int, shares: int, training: TrainingConfig, wiring: str) -> LayoutMove:
    at, after = relayout
    move = LayoutMove(at, before, check_layout(after, stages, shares, training.sync.mode,
                                               wiring), shares)
    if move.before == move.after:
        raise ValueError("relayout: the layout it moves to is the one the job has")
    if not 0 < at < training.steps:
        raise ValueError(f"relayout: step {at} is not a boundary between two of the job's "
                         f"{training.steps} steps")
    return move


def _runs(replica: int, stage: int, layout: Layout | None, move: LayoutMove | None,
          shares: int) -> bool:
    """Whether the grid's cell (stage, id) runs: the layout has it, or the move's either."""
    if move is not None:
        return replica in stage_ids(move.before, stage, shares) \
            or replica in stage_ids(move.after, stage, shares)
    return replica in stage_ids(layout, stage, shares)


def run_local_pipeline(model: ModelConfig, training: TrainingConfig,
                       data: TokenData | Callable[[int], TokenData],
                       num_stages: int, *,
                       devices: Sequence[str] | None = None,
                       shapers: Sequence[LinkShaper] | None = None,
                       stop: threading.Event | None = None,
                       prepare: Mapping[int, Callable[[StageSpec], None]] | None = None,
                       stage_kwargs: Mapping[int, dict[str, Any]] | None = None,
                       on_step: Callable[[int, StepReport], None] | None = None,
                       timeout: float = 60.0,
                       replicas: int = 1,
                       coordinator: LocalCoordinator | None = None,
                       wiring: Literal["chain", "swarm"] = "chain",
                       route_weights: list[list[float]] | None = None,
                       routing: Literal["given", "measured"] = "given",
                       layout: Sequence[Sequence[int]] | None = None,
                       relayout: tuple[int, Sequence[Sequence[int]]] | None = None,
                       rebalance: int | None = None,
                       moves: Sequence[PeerMove] | None = None,
                       on_move: Callable[[LayoutMove], None] | None = None
                       ) -> dict[int, StageResult | BaseException]:
    """Run ``num_stages`` equal stages (``replicas`` data-parallel replicas of each) to the
    end. Returns, by cell (replica r of stage s is cell r x num_stages + s: the stage itself
    for one replica), ``run_stage``'s :class:`StageResult` or the exception that ended it; the
    first failure sets ``stop`` for the others. ``devices``, ``shapers``, ``prepare`` and
    ``stage_kwargs`` are by cell too.
    ``data`` may be a loader ``data(s)``, which stage s calls as a fellow loads its data:
    while its links are being opened.
    ``prepare[s](spec)`` runs in stage s's thread before it starts (and may raise);
    ``stage_kwargs[s]`` go to its ``run_stage``; ``shapers[s]`` shapes stage s's links (as a
    fellow's set-speed would; unshaped by default). Raises TimeoutError if a stage is still
    running after ``timeout`` seconds.

    Each cell is a fellow of its own, and its START is built as the leader builds one.
    With ``coordinator`` (replicas), a cell that fails does not stop the others: its replica
    leaves, or (``LocalCoordinator(cellwise=True)``, a swarm dp job's rule) the cell alone,
    and the others go on (a dropped cell's result is its StageDropped).
    ``wiring``, ``route_weights`` and ``routing``: the job topology's (swarm wiring routes
    micro-batches to any replica of the next stage).
    ``layout`` (swarm wiring, dp): each stage's cell ids, where stages have unequal cells
    (``pipeline/layout``); ``replicas`` is then the job's data shares, the cells are those
    of a grid as wide as the ids (cell id x num_stages + stage: the results' keys, and what
    ``devices`` and the rest are indexed by, a cell the layout leaves out running nothing),
    and ``route_weights`` are by id.
    ``relayout`` ``(step, layout)``: from that 0-based step on the job runs under that layout
    (``pipeline/move``: a peer moved between stages); a cell either layout has runs, each
    from or to the step where only one has it (its result: what it trained).
    ``rebalance`` (swarm wiring, measured routes, dp): every that many steps the cells look
    at their measured throughput and move a peer between stages where SWARM's rule says so
    (``move.Rebalance``): the moved peer's thread goes on as a cell of its new stage (the
    grid is ``num_stages x replicas`` ids wide; a thread's result under each cell it was,
    the last where it was one twice), ``on_move`` told of each move, by the peer that moved.
    ``moves``: peers moved at given steps (a job's ``topology.moves``), made as decided ones
    are."""
    shape = None if layout is None else check_layout(
        layout, num_stages, replicas, training.sync.mode, wiring)
    move = None if relayout is None else _move(relayout, shape, num_stages, replicas, training,
                                               wiring)
    width = slot_count(shape, replicas) if move is None else move.width
    rebalancer, weights_width = None, width
    if rebalance is not None:
        if wiring != "swarm" or routing != "measured" or training.sync.mode != "dp" \
                or move is not None or rebalance < 1:
            raise ValueError("rebalance: a number of steps >= 1, for swarm wiring with "
                             "measured routes and sync.mode dp, without relayout")
        # (a moved peer takes the smallest id its new stage lacks: at most every cell's)
        weights_width = max(width, replicas * num_stages)
        rebalancer = Rebalance(every=rebalance)
    if moves:
        if wiring != "swarm" or training.sync.mode != "dp" or move is not None \
                or rebalancer is not None:
            raise ValueError("moves: for swarm wiring and sync.mode dp, without relayout or "
                             "rebalance")
        weights_width = max(width, replicas * num_stages)
    moving = rebalancer is not None or bool(moves)
    if shape is not None or move is not None or moving:
        check_weights(route_weights, num_stages, weights_width)
        if coordinator is not None and (move is not None or moving):
            raise ValueError("a lost cell's regroup is not built for peers that move")
    cells = num_stages * width
    devs = list(devices or ["cpu"] * cells)
    if len(devs) != cells:
        raise ValueError(f"{len(devs)} devices for {cells} cells")
    shaping = list(shapers or [LinkShaper() for _ in range(cells)])
    if len(shaping) != cells:
        raise ValueError(f"{len(shaping)} shapers for {cells} cells")
    run = [s for s in range(cells) if _runs(s // num_stages, s % num_stages, shape, move,
                                            replicas)]
    listeners = {s: DataListener() for s in run}
    results: dict[int, Any] = {}
    stop = stop or threading.Event()

    def placed(layout: Layout | None) -> dict[int, StageStart]:
        """The STARTs of ``layout``'s cells as the leader builds them, each cell on a
        fellow of its own listening where the grid's cell (id x num_stages + stage) does."""
        keys = [r * num_stages + k
                for k, r in (layout_cells(layout) if layout is not None else
                             [(i % num_stages, i // num_stages)
                              for i in range(num_stages * replicas)])]
        starts = chain_starts(model, training, [listeners[c].addr for c in keys],
                              [devs[c] for c in keys], replicas=replicas, wiring=wiring,
                              route_weights=None if by_id else route_weights,
                              routing=routing, layout=layout)
        # (a job that changes layout names its weights by id, both layouts' ids)
        return {c: attrs.evolve(st, route_weights=route_weights, moves=list(moves or ()) or None)
                if by_id else st for c, st in zip(keys, starts, strict=True)}

    by_id = shape is not None or move is not None or moving
    starts = placed(shape if move is None else move.before)
    if move is not None:
        after = placed(move.after)
        move = attrs.evolve(move, placement=next(iter(after.values())).placement)
        starts.update({c: st for c, st in after.items() if c not in starts})

    def loader(s: int) -> TokenData | Callable[[], TokenData]:
        return (lambda: data(s)) if callable(data) else data

    def reporter(s: int) -> Callable[[StepReport], None]:
        return (lambda r: on_step(s, r)) if on_step else (lambda r: None)

    def go(s: int) -> None:
        start = starts[s]
        spec = StageSpec.from_start(start)
        kwargs = dict((stage_kwargs or {}).get(s, {}))
        # (its fellow's, as its listener: a moved peer keeps them, and its pace)
        shaper, listener = shaping[s], listeners[s]
        if move is not None:
            kwargs["move"] = move
        if rebalancer is not None:
            kwargs["rebalance"] = rebalancer
        try:
            if prepare and s in prepare:
                prepare[s](spec)
            while True:
                done = run_stage(spec, loader(s), shaper, listener, stop, reporter(s),
                                 connect_timeout=training.frame_timeout_s,
                                 coordinator=coordinator, **kwargs)
                results[s] = done
                if done.moved is None or move is not None:
                    break  # (a relayout's newcomer has a thread of its own)
                # (its peer moved: this thread, its fellow, goes on as the cell it became,
                # from the START every cell's move gives it, as a fellow's would)
                if on_move is not None:
                    on_move(done.moved)
                assert done.moved.peer is not None
                start = start.after_move(*done.moved.peer, at=done.moved.at,
                                         placement=done.moved.placement)
                s = start.replica * num_stages + start.stage
                spec = StageSpec.from_start(start)
                kwargs["move"] = done.moved
            if coordinator is not None:
                coordinator.cell_finished(spec.stage, spec.replica)
        except Exception as exc:
            results[s] = exc
            if coordinator is None:
                stop.set()
            elif not isinstance(exc, StageDropped):
                coordinator.cell_ended(spec.stage, spec.replica)

    threads = [threading.Thread(target=go, args=(s,), name=f"stage-{s}", daemon=True)
               for s in run]
    deadline = time.monotonic() + timeout
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    finally:
        for ln in listeners.values():
            ln.close()
    if any(t.is_alive() for t in threads):
        stop.set()
        raise TimeoutError(f"a stage was still running after {timeout:g}s")
    return results

