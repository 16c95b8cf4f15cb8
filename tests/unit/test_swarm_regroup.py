"""A cell lost under SWARM wiring (issue 34): its micro-batches re-routed to the survivors,
nothing counted twice. The survivors redo the broken step over the replicas left (a cell
that had applied it undoes it first), and the losses are those of one process that trains
on the full batch up to that step and on the survivors' shares from it, to 1e-5."""

from __future__ import annotations

import logging
import math
import threading

import pytest

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract.membership import (
    RegroupConflict,
    RegroupReport,
    cell_departure,
    cell_orders,
    cellwise_layout,
    departure,
    routed_orders,
)
from swarm_core.contract.metrics import step_loss
from swarm_core.contract.placement import split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline.local import LocalCoordinator, run_local_pipeline
from swarm_core.pipeline.pace import Pace
from swarm_core.pipeline.reference import train_reference
from swarm_core.pipeline.routing import ThroughputEstimate, route_plan, runs
from swarm_core.pipeline.stage import StageDropped, StageResult, StageRunner
from swarm_core.schema import structure
from tests.replica_support import SurvivorWindows

MODEL = dict(d_model=32, n_layers=2, n_heads=2, seq_len=16)
STAGES, REPLICAS, STEPS = 2, 3, 8


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


def _report(stage: int, replica: int, op_step: int) -> RegroupReport:
    return RegroupReport(fellow_id=0, stage=stage, replica=replica, op_step=op_step,
                         routed=True)


def test_the_survivors_train_on_from_the_earliest_step_one_of_them_had_not_applied():
    reports = {(0, 0): _report(0, 0, 5), (1, 0): _report(1, 0, 4), (0, 2): _report(0, 2, 5),
               (1, 2): _report(1, 2, 4), (0, 1): _report(0, 1, 5)}  # (cell 1, 1 died)
    members, orders = routed_orders(reports, 2, {1}, 3)
    assert members == [0, 2]
    assert {c: (o.redo_step, o.members, o.drop) for c, o in orders.items()} == {
        (0, 0): (4, [0, 2], False), (1, 0): (4, [0, 2], False), (0, 2): (4, [0, 2], False),
        (1, 2): (4, [0, 2], False), (0, 1): (None, [0, 2], True)}
    change = departure(reports, orders, 2, [0, 1, 2], members, 3)
    assert (change.step, change.stage_steps, change.left) == (5, [5, 5], [1])
    with pytest.raises(RegroupConflict, match="steps 4 to 6"):
        routed_orders({**reports, (0, 0): _report(0, 0, 6)}, 2, {1}, 3)


class _Run:
    """Each cell's reported losses by step (a step trained again replaces its loss), and a
    cell that dies where the test says."""

    def __init__(self, dies_after: tuple[int, int] | None = None) -> None:
        self.dies_after = dies_after  # (cell, 1-based step): raise in its step report
        self.losses: dict[int, dict[int, float]] = {}
        self.ran: dict[int, dict[int, float]] = {}
        self.steps_done: dict[int, int] = {}

    def __call__(self, cell: int, rep) -> None:
        self.steps_done[cell] = rep.step
        if rep.loss is not None:
            self.losses.setdefault(rep.step - 1, {})[cell] = rep.loss
            self.ran.setdefault(rep.step - 1, {})[cell] = rep.micro_batches
        if self.dies_after == (cell, rep.step):
            raise RuntimeError(f"cell {cell} dies after step {rep.step}")

    def curve(self, left: int, from_step: int) -> list[float]:
        """Each step's loss: that of the last-stage cells of the replicas that trained it,
        each the mean over the micro-batches it ran, weighted by them."""
        out = []
        for step, by_cell in sorted(self.losses.items()):
            keep = [r * STAGES + STAGES - 1 for r in range(REPLICAS)
                    if step < from_step or r != left]
            out.append(step_loss({c: by_cell[c] for c in keep},
                                 {c: self.ran[step][c] for c in keep}))
        return out


def _training(**over) -> TrainingConfig:
    return structure({"steps": STEPS, "batch_size": 12, "micro_batches": 2, "eval_batches": 0,
                      "lr": 3e-3, "frame_timeout_s": 20, "seed": 5, **over}, TrainingConfig)


class _Recording(LocalCoordinator):
    """The in-process coordinator, keeping every report it was given."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.reports: list[RegroupReport] = []

    def __call__(self, report: RegroupReport):
        self.reports.append(report)
        return super().__call__(report)


def _run_and_check(data, tc: TrainingConfig, run: _Run, lost: int, dead: int,
                   **kwargs) -> int:
    """Run S=2 x R=3 swarm-wired dp with ``dead`` dying; check who ended how, the change, who
    the reports named as having closed a link without a FAREWELL (the dead cell's replica,
    never a survivor that let go to regroup) and the losses against the one-process
    reference. Returns the redone step (0-based)."""
    mc = ModelConfig(**MODEL)
    stop = threading.Event()
    coord = _Recording(STAGES, REPLICAS, stop)
    res = run_local_pipeline(mc, tc, data, STAGES, replicas=REPLICAS, timeout=120, stop=stop,
                             coordinator=coord, on_step=run, wiring="swarm",
                             route_weights=[[1, 1, 1], [3, 1, 2]], **kwargs)
    assert isinstance(res[dead], RuntimeError), res[dead]
    for s in range(STAGES):
        cell = lost * STAGES + s
        if cell != dead:  # (the rest of its replica left)
            assert isinstance(res[cell], StageDropped), res[cell]
    survivors = [r for r in range(REPLICAS) if r != lost]
    for r in survivors:
        for s in range(STAGES):
            assert isinstance(res[r * STAGES + s], StageResult), res[r * STAGES + s]
    [change] = coord.changes
    assert (change.members, change.left) == (survivors, [lost])
    assert {r.closed_by for r in coord.reports} - {None} == {lost}
    redo = change.step - 1
    ref, _ = train_reference(mc, tc, SurvivorWindows(data, REPLICAS, {lost}, redo),
                             split_layers(mc.n_layers, [1] * STAGES))
    got = run.curve(lost, redo)
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    # (each survivor of the last stage ran micro-batches: the step's were dealt to them)
    ran = [res[r * STAGES + 1].metrics.micro_batches for r in survivors]
    assert all(m is not None and m > 0 for m in ran)
    return redo


@pytest.mark.parametrize("routing", ["given", "measured"])
def test_a_cell_lost_between_steps_its_micro_batches_go_to_the_survivors(data, routing):
    """Stage 0's replica 1 dies after step 4: its replica leaves, the others train step 5 on
    (routed over two replicas each stage) to the end without stopping. Measured routes start
    their estimate where every survivor held it at the redone step's start (a plan dealt apart
    would stall the job)."""
    run = _Run(dies_after=(1 * STAGES + 0, 4))
    redo = _run_and_check(data, _training(), run, lost=1, dead=1 * STAGES + 0,
                          routing=routing)
    assert redo == 4


class _DiesMidStep(Pace):
    """An emulated slowdown of 1 % that raises at its cell's first op after ``after`` steps:
    the cell dies in the middle of a step, one forward done and the rest not."""

    def __init__(self, run: _Run, cell: int, after: int) -> None:
        super().__init__(1.01)
        self.run, self.cell, self.after = run, cell, after

    def pad(self, compute_s, stop, check=None):
        if self.run.steps_done.get(self.cell) == self.after:
            raise RuntimeError(f"cell {self.cell} dies in step {self.after + 1}")
        return super().pad(compute_s, stop, check)


def test_a_cell_lost_mid_step_the_step_is_trained_again_over_the_survivors(data):
    """Stage 1's replica 2 dies after the first op of step 4 (its own micro-batches half
    done, the other cells' frames to it in flight): every survivor gives the step up and
    trains it again over replicas 0 and 1, nothing counted twice."""
    run = _Run()
    dead = 2 * STAGES + 1
    redo = _run_and_check(data, _training(), run, lost=2, dead=dead,
                          stage_kwargs={dead: {"pace": _DiesMidStep(run, dead, 3)}})
    assert redo == 3


def test_a_cell_that_applied_the_broken_step_undoes_it(data, monkeypatch, caplog):
    """Without clipping nothing ties the stages' optimiser steps together: stage 1's
    replica 1 dies as its group starts averaging step 4 (its gradients all sent back), so
    stage 0, whose ring holds, applies step 4 and moves on, while stage 1's survivors never
    can. All train step 4 again over the replicas left: stage 0's cells undo it first."""
    dead = 1 * STAGES + 1
    finish = StageRunner._finish

    def dies_in_its_ring(self, step, heard=False):
        if (self.spec.stage, self.spec.replica, step) == (1, 1, 3):
            for link in self.pipe_links():
                link.flush(20)
            raise RuntimeError("stage 1 replica 1 dies as step 4's ring starts")
        return finish(self, step, heard)

    monkeypatch.setattr(StageRunner, "_finish", dies_in_its_ring)
    caplog.set_level(logging.INFO, logger="swarm_core.pipeline.reroute")
    redo = _run_and_check(data, _training(grad_clip=0.0), _Run(), lost=1, dead=dead)
    assert redo == 3
    undone = sorted(r.message for r in caplog.records if "undone" in r.message)
    assert undone == [f"stage 0 replica {r}: step 3 undone, to train it again over the "
                      "members left" for r in (0, 2)]


def test_measured_routes_learn_again_over_the_replicas_left():
    """The estimate waits for a sample of every replica before it deals by measurement: of
    those left, once one left (its given weight stays, dealt nothing), else a stage whose
    replica left would deal by the given weights for the rest of the run."""
    est = ThroughputEstimate(2, 3)
    est.update([[0.1, 0.1, math.nan], [0.2, 0.4, math.nan]])  # (replica 2 left)
    assert est.weights() == [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    got = est.weights([0, 1])
    assert got[1] == pytest.approx([5.0, 2.5, 1.0])  # (1 / seconds, the EMA's first sample)
    plan = route_plan(5, 9, 2, 3, 4, got, members=[0, 1])
    assert set(plan[1]) == {0, 1, -1} and plan[0][8:] == [-1] * 4  # (replica 2's share: none)
    # (SWARM's deal of 8 at 5 : 2.5 a second: queues end at 1.0 and 1.2 s)
    assert (len(runs(plan, 1, 0)), len(runs(plan, 1, 1))) == (5, 3)


def test_a_report_of_a_step_trained_again_is_superseded():
    """The leader keeps the redone step's reports: a late one of the membership before the
    change, for the change's step or later, is not recorded over them."""
    from swarm_core.contract import JobStatusUpdate, MembershipChange
    from swarm_core.contract.job import JobSubmit, Topology
    from swarm_core.leader.membership import Membership

    class _Job:
        membership = [MembershipChange(step=5, epoch=1, members=[0, 2], left=[1])]
        spec = JobSubmit(topology=Topology(stages=2, replicas=3, wiring="swarm"))

    def upd(step: int, epoch: int | None) -> JobStatusUpdate:
        return JobStatusUpdate(fellow_id=1, state="RUNNING", step=step, epoch=epoch)

    job = _Job()
    assert Membership.superseded(job, upd(5, 0))  # (the undone step 5, trained under 0)
    assert not Membership.superseded(job, upd(4, 0))  # (step 4 was trained by all)
    assert not Membership.superseded(job, upd(5, 1))  # (the redone step 5)
    assert not Membership.superseded(job, upd(5, None))  # (a chain's report: no epoch)
    # A job whose peers move: its epochs count moves, which retrain no step.
    job.spec = JobSubmit(topology=Topology(stages=2, replicas=3, wiring="swarm",
                                           routing="measured", rebalance_every=2))
    assert not Membership.superseded(job, upd(5, 0))


def _cellwise_run(data, dead: tuple[int, int], die_after: int, *more: tuple[int, int, int],
                  slow: tuple[int, int] | None = None, **kwargs):
    """S=2 x R=3 swarm-wired dp under the leader's cell-wise rule, cell ``dead`` (stage, id)
    dying in its step ``die_after + 1`` (and each of ``more``, (stage, id, die_after), in
    its; ``slow``, a cell padded 8x): the results, the coordinator and the run."""
    mc = ModelConfig(**MODEL)
    stop = threading.Event()
    coord = _Recording(STAGES, REPLICAS, stop, True)
    run = _Run()
    dying = {r * STAGES + k: {"pace": _DiesMidStep(run, r * STAGES + k, after)}
             for k, r, after in ((*dead, die_after), *more)}
    if slow is not None:  # (a cell eight times slow: what measured routes learn;
        # 8x, not 4x: a busy machine's noise in the tiny model's compute once evened 4x out)
        dying[slow[1] * STAGES + slow[0]] = {"pace": Pace(8.0)}
    res = run_local_pipeline(mc, _training(), data, STAGES, replicas=REPLICAS, timeout=120,
                             stop=stop, coordinator=coord, on_step=run, wiring="swarm",
                             stage_kwargs=dying, **kwargs)
    return mc, res, coord, run


def _full_curve(run: _Run) -> list[float]:
    """Each step's loss over every last-stage cell that trained it (by micro-batches)."""
    last = [r * STAGES + STAGES - 1 for r in range(REPLICAS)]
    return [step_loss({c: v for c, v in by_cell.items() if c in last},
                      {c: run.ran[step][c] for c in by_cell if c in last})
            for step, by_cell in sorted(run.losses.items())]


@pytest.mark.parametrize("routing", ["given", "measured"])
def test_a_lost_cell_leaves_alone_and_the_batch_is_kept(data, routing):
    """SWARM's property: a lost peer costs the swarm its throughput, not its batch. Stage 1's
    cell 2 dies mid-step: only it leaves (stage 0's cell 2 trains on), the survivors train
    the step again under the layout without it, stage 1 dealing all three shares'
    micro-batches to its two cells, and every step's loss is one process's on the full batch
    (no survivor's windows: the batch never shrank), to 1e-5."""
    weights = [[1, 1, 1], [3, 1, 2]] if routing == "given" else None
    mc, res, coord, run = _cellwise_run(data, (1, 2), 3, routing=routing,
                                        route_weights=weights)
    dead = 2 * STAGES + 1
    assert isinstance(res[dead], RuntimeError), res[dead]
    for c in (0, 1, 2, 3, 4):  # (stage 0's cell 2, cell 4, is among them)
        assert isinstance(res[c], StageResult), res[c]
    [change] = coord.changes
    assert (change.left, change.cells_left, change.members) == ([], [[1, 2]], [0, 1, 2])
    assert change.step == 4 and change.left_text() == "cell(s) 1.2 left"
    ref, _ = train_reference(mc, _training(), data, split_layers(mc.n_layers, [1] * STAGES))
    got = _full_curve(run)
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    # (after the change stage 1's two cells ran all 3 x 2 micro-batches of each step)
    for step in range(change.step - 1, STEPS):
        assert run.ran[step][1] + run.ran[step][3] == REPLICAS * 2
        assert dead not in run.ran[step]


def test_a_lost_cell_0_takes_its_replica_with_it(data):
    """A stage's cell 0 evaluates and checkpoints for its group: lost, the cell-wise rule
    does not apply and its replica leaves every stage, as before (the batch shrinks)."""
    mc, res, coord, run = _cellwise_run(data, (1, 0), 3)
    [change] = coord.changes
    assert (change.left, change.cells_left, change.members) == ([0], [], [1, 2])
    assert isinstance(res[0], StageDropped), res[0]
    for c in (2, 3, 4, 5):
        assert isinstance(res[c], StageResult), res[c]
    redo = change.step - 1
    ref, _ = train_reference(mc, _training(), SurvivorWindows(data, REPLICAS, {0}, redo),
                             split_layers(mc.n_layers, [1] * STAGES))
    got = run.curve(0, redo)
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5


def test_cell_orders_keep_the_batch_and_name_the_layout():
    reports = {(0, 0): _report(0, 0, 5), (1, 0): _report(1, 0, 4), (0, 1): _report(0, 1, 5),
               (0, 2): _report(0, 2, 5), (1, 2): _report(1, 2, 4)}  # (cell 1.1 died)
    after = cellwise_layout(None, 2, 3, {(1, 1)})
    assert after == ((0, 1, 2), (0, 2))
    orders = cell_orders(reports, after, 3)
    assert {c: (o.redo_step, o.members, o.layout, o.drop) for c, o in orders.items()} == {
        c: (4, [0, 1, 2], [[0, 1, 2], [0, 2]], False) for c in reports}
    change = cell_departure(orders, 2, {(1, 1)}, 3)
    assert (change.step, change.stage_steps, change.left, change.cells_left) == \
        (5, [5, 5], [], [[1, 1]])
    assert cellwise_layout(None, 2, 3, {(1, 0)}) is None  # (a cell 0: whole replicas)
    assert cellwise_layout(None, 2, 3, set()) is None
    # (a layout that comes back to the grid stays a layout here: the orders name it)
    assert cellwise_layout([[0, 1], [0, 1, 2]], 2, 2, {(1, 2)}) == ((0, 1), (0, 1))
    with pytest.raises(RegroupConflict, match="steps 4 to 6"):
        cell_orders({**reports, (0, 0): _report(0, 0, 6)}, after, 3)


def test_two_cells_lost_in_turn_the_second_under_the_first_ones_layout(data):
    """Stage 0's cell 1 dies in step 3, then stage 1's cell 2 in step 6, under the layout the
    first loss left (id 1 has no stage-0 cell: its stage-1 cell hears the chain's norm by
    the layout's relay). Each leaves alone; the batch is kept throughout: one process's
    losses on the full batch, to 1e-5."""
    mc, res, coord, run = _cellwise_run(data, (0, 1), 2, (1, 2, 5))
    first, second = coord.changes
    assert (first.cells_left, first.step, second.cells_left, second.step) == \
        ([[0, 1]], 3, [[1, 2]], 6)
    assert second.members == [0, 1, 2]  # (id 2's stage-0 cell, id 1's stage-1 cell)
    for c in (0, 1, 3, 4):
        assert isinstance(res[c], StageResult), res[c]
    ref, _ = train_reference(mc, _training(), data, split_layers(mc.n_layers, [1] * STAGES))
    got = _full_curve(run)
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5


def test_after_a_lost_cell_0_the_rule_of_whole_replicas_goes_on(data):
    """Stage 1's cell 0 dies (its replica leaves every stage), then stage 1's cell 2: the
    grid has no id 0 left to keep, so replica 2 leaves too and replica 1 trains to the end
    (before, the cell-wise rule was tried there and the cells waited out the timeout)."""
    _mc, res, coord, _run = _cellwise_run(data, (1, 0), 2, (1, 2, 5))
    first, second = coord.changes
    assert (first.left, second.left, second.cells_left, second.members) == ([0], [2], [], [1])
    for c in (2, 3):
        assert isinstance(res[c], StageResult), res[c]


def test_measured_routes_keep_what_they_learnt_through_a_cell_that_left(data):
    """Measured routes, stage 1's cell 1 eight times slow; its cell 2 dies in step 4. The
    survivors train step 4 again under the layout without it, dealing by the estimate every
    one of them held at that step's start (the cell that left taken out): the slow cell is
    dealt fewer of the step's six micro-batches than its fast neighbour at once, rather than
    half of them while the estimate learns again; and the losses stay the full batch's."""
    mc, res, coord, run = _cellwise_run(data, (1, 2), 3, slow=(1, 1), routing="measured")
    dead, slow = 2 * STAGES + 1, 1 * STAGES + 1
    assert isinstance(res[dead], RuntimeError), res[dead]
    [change] = coord.changes
    redo = change.step - 1
    assert change.cells_left == [[1, 2]] and redo == 3
    assert run.ran[redo][slow] < run.ran[redo][1]  # (cell 1.0: 0 x STAGES + 1)
    assert run.ran[redo][slow] + run.ran[redo][1] == REPLICAS * 2
    ref, _ = train_reference(mc, _training(), data, split_layers(mc.n_layers, [1] * STAGES))
    got = _full_curve(run)
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5


def test_measured_routes_keep_what_they_learnt_through_a_replica_that_left(data):
    """As above where the rule of whole replicas decides: stage 1's cell 0 dies in step 4
    (its replica leaves), its cell 1 eight times slow: the redone step, over replicas 1 and
    2's four micro-batches, deals the slow cell fewer than cell 2 at once."""
    mc, res, coord, run = _cellwise_run(data, (1, 0), 3, slow=(1, 1), routing="measured")
    dead, slow, fast = 0 * STAGES + 1, 1 * STAGES + 1, 2 * STAGES + 1
    assert isinstance(res[dead], RuntimeError), res[dead]
    [change] = coord.changes
    redo = change.step - 1
    assert change.left == [0] and redo == 3
    assert run.ran[redo][slow] < run.ran[redo][fast]
    assert run.ran[redo][slow] + run.ran[redo][fast] == 2 * 2
    ref, _ = train_reference(mc, _training(), SurvivorWindows(data, REPLICAS, {0}, redo),
                             split_layers(mc.n_layers, [1] * STAGES))
    got = run.curve(0, redo)
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
