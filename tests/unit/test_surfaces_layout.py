"""Every surface shows a swarm layout (stages of their own cells) and a peer's move between
stages (placement-cells step 7): ``swarm job``'s grid and membership rows, its watch lines,
the console's grid (cells, labels, per-replica loss, fellows' cells), and the report's marks
and topology line. From JobInfos built here (no leader): a 2-stage, 2-share swarm job laid
out [[0], [0, 1, 2]], and a 2 x 2 grid whose cell 0.1 (fellow 2) moved to 1.2 before step 5
(so from step 6, 1-based)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from swarm_core.config.schemas import TrainingConfig
from swarm_core.contract import JobInfo, StageMetrics, Topology
from swarm_core.contract.events import JobMembership, MetricReport
from swarm_core.contract.membership import MembershipChange
from swarm_core.contract.metrics import JobMetrics
from swarm_core.contract.placement import FellowSlots, Placement, plan
from swarm_core.contract.rebalance import PeerMove
from swarm_core.experiments.report import _grid
from swarm_core.experiments.report_cells import marks
from swarm_core.experiments.summary import MetricsSummary
from swarm_tui.app.cells import fellow_job, watch_cells
from swarm_tui.app.model import ClusterModel, FellowState, JobView
from swarm_tui.commands.jobs import _describe, membership_rows
from swarm_tui.grid import grid_table, grid_title, is_grid, job_grid, move_fellows

LAYOUT = [[0], [0, 1, 2]]
MOVE = PeerMove(at=5, source=0, cell=1, target=1, new_id=2)
CHANGE = MembershipChange(step=6, epoch=1, members=[0, 1, 2], reason="rebalance",
                          moved=MOVE)


def _placement(layout: list[list[int]] | None = None) -> Placement:
    fellows = [FellowSlots(i, f"f{i}", ["cpu"]) for i in range(4)]
    return plan(fellows, 2, 4, replicas=2, layout=layout)


def _job(placement: Placement, *, layout: list[list[int]] | None = None,
         membership: list[MembershipChange] | None = None, **kw: Any) -> JobInfo:
    return JobInfo(job_id="job-000001", name="r", kind="train", state="RUNNING",
                   created_at=0.0, started_at=None, finished_at=None, last_step=7,
                   last_loss=3.0, fellows=placement.fellows,
                   topology=Topology(stages=2, replicas=2, wiring="swarm", layout=layout),
                   reason="", training=TrainingConfig(micro_batches=4, batch_size=8),
                   placement=placement, membership=list(membership or []), **kw)


def _laid_out(**kw: Any) -> JobInfo:
    return _job(_placement(LAYOUT), layout=LAYOUT, **kw)


def _moved(**kw: Any) -> JobInfo:
    """The 2 x 2 grid after fellow 2's cell 0.1 moved to 1.2: placed [[0], [0, 1, 2]]."""
    return _job(_placement().moved(0, 1, 1, 2), membership=[CHANGE], **kw)


# --- swarm_tui/grid.py -------------------------------------------------------------------

def test_a_layout_is_a_grid_of_its_cells_by_stage_and_id():
    job = _laid_out(metrics=JobMetrics(stages={
        "1.2": StageMetrics(step=7, micro_batches=2.0),
        "1.0": StageMetrics(step=7, micro_batches=4.0),
        "0.0": StageMetrics(step=7, micro_batches=8.0)}))
    assert is_grid(job)
    cells = job_grid(job)
    assert [(c.stage, c.replica, c.fellow_id) for c in cells] == [
        (0, 0, 0), (1, 0, 1), (1, 1, 2), (1, 2, 3)]
    assert grid_title(job) == "grid: 2 stages, cells 1+3, swarm wiring"
    headers, rows = grid_table(job)
    assert [r[0] for r in rows] == ["s0/r0", "s1/r0", "s1/r1", "s1/r2"]
    assert [r[1] for r in rows] == ["0 (f0)", "1 (f1)", "2 (f2)", "3 (f3)"]
    # Each cell's share of the step's R x M = 8 micro-batches, its label's figures.
    assert headers[-1] == "mb share"
    assert [r[-1] for r in rows] == ["100%", "50%", "-", "25%"]
    assert [r[3] for r in rows] == ["7", "7", "-", "7"]


def test_after_a_move_the_grid_has_the_new_cell_and_the_title_counts_the_move():
    job = _moved()
    assert is_grid(job)
    assert [(c.stage, c.replica, c.fellow_id) for c in job_grid(job)] == [
        (0, 0, 0), (1, 0, 1), (1, 1, 3), (1, 2, 2)]  # (0.1 gone; fellow 2 at 1.2)
    assert grid_title(job) == "grid: 2 stages, cells 1+3 (1 move), swarm wiring"
    assert move_fellows(job) == {0: 2}


def test_two_moves_name_each_mover_and_a_move_back_to_the_grid_still_counts():
    there = _placement().moved(0, 1, 1, 2)
    back = there.moved(1, 2, 0, 1)
    assert back.layout is None
    again = attrs.evolve(CHANGE, step=9, epoch=2,
                         moved=PeerMove(at=8, source=1, cell=2, target=0, new_id=1))
    job = _job(back, membership=[CHANGE, again])
    assert move_fellows(job) == {0: 2, 1: 2}
    assert grid_title(job) == "grid: 2 stages, cells 2+2 (2 moves), swarm wiring"


def test_a_uniform_grids_title_is_as_before():
    job = _job(_placement())
    assert grid_title(job) == "grid: 2 stage(s) x 2 replicas, swarm wiring"


# --- swarm job: membership rows and watch lines ------------------------------------------

def test_swarm_job_prints_a_move_with_its_fellow_and_cells():
    assert membership_rows(_moved()) == [["moved @6", "f2 moved 0.1 -> 1.2 (rebalance)"]]


def test_a_departure_row_is_as_before_beside_a_move():
    left = MembershipChange(step=3, epoch=1, members=[0], left=[1], reason="lost")
    assert membership_rows(_job(_placement(), membership=[left])) == [
        ["replicas @3", "replica(s) 1 left; training: 0 (lost)"]]


def test_the_watch_line_of_a_move():
    assert _describe({"type": JobMembership.type, "data": {
        "job_id": "job-000001", **_change_json()}}) == \
        "job-000001 moved @6: moved 0.1 -> 1.2 (rebalance)"


def _change_json() -> dict[str, Any]:
    from swarm_core.schema import unstructure
    out: dict[str, Any] = unstructure(CHANGE)
    return out


# --- the console -------------------------------------------------------------------------

def _grid_heard() -> tuple[ClusterModel, JobView]:
    """The console holding the 2 x 2 grid, a step's report heard from each of its cells."""
    model = ClusterModel()
    model.apply_job(_job(_placement()))
    view = model.jobs["job-000001"]
    for fid, (stage, rid) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
        view.apply_metric(MetricReport(job_id="job-000001", fellow_id=fid, stage=stage,
                                       replica=rid, step=4, state="RUNNING"))
    return model, view


def test_the_consoles_cells_come_from_the_placement_not_arithmetic():
    view = JobView(_moved())
    assert view.grid
    assert [view.cell_of(i) for i in range(4)] == [(0, 0), (1, 0), (1, 1), (1, 2)]
    assert view.index_of(1, 2) == 3
    assert view.index_of(0, 1) is None  # (the mover's old cell)
    assert view.label(1, 2) == "1.2"
    # A report of cell 1.2 lands on its row; a late one of the old cell 0.1 on none.
    view.apply_metric(MetricReport(job_id="job-000001", fellow_id=2, stage=1, replica=2,
                                   step=7, state="RUNNING"))
    view.apply_metric(MetricReport(job_id="job-000001", fellow_id=2, stage=0, replica=1,
                                   step=5, state="RUNNING"))
    assert sorted(view.per_stage) == [3]
    assert view.per_stage[3].fellow_id == 2


def test_the_console_makes_a_move_it_hears_of_and_keeps_each_cells_figures():
    model, view = _grid_heard()
    assert sorted((i, fp.fellow_id) for i, fp in view.per_stage.items()) == [
        (0, 0), (1, 1), (2, 2), (3, 3)]
    change = model.apply_event({"type": JobMembership.type, "data": {
        "job_id": "job-000001", **_change_json()}})
    assert change.jobs == {"job-000001"}
    assert view.info.placement == _placement().moved(0, 1, 1, 2)
    assert view.info.members is None  # (nobody left)
    # The mover's old cell's figures are gone; 1.1 (fellow 3) is index 2 now.
    assert sorted((i, fp.fellow_id) for i, fp in view.per_stage.items()) == [
        (0, 0), (1, 1), (2, 3)]
    assert [view.cell_of(i) for i in range(4)] == [(0, 0), (1, 0), (1, 1), (1, 2)]
    # The record that follows says the same: nothing moves twice.
    model.apply_job(_moved())
    assert view.info.placement == _placement().moved(0, 1, 1, 2)
    assert sorted(view.per_stage) == [0, 1, 2]
    assert membership_rows(view.info) == [["moved @6", "f2 moved 0.1 -> 1.2 (rebalance)"]]


def test_the_consoles_loss_is_the_mean_over_the_last_stages_cells():
    view = JobView(_laid_out())
    for rid, loss, mbs in ((0, 2.0, 4.0), (1, 3.0, 2.0), (2, 4.0, 2.0)):
        view.apply_metric(MetricReport(
            job_id="job-000001", fellow_id=rid + 1, stage=1, replica=rid, step=8,
            loss=loss, state="RUNNING",
            metrics=StageMetrics(wire_tx_bytes=1, micro_batches=mbs)))
    # (weighted by the micro-batches each ran: (2 x 4 + 3 x 2 + 4 x 2) / 8)
    assert view.info.last_loss == (2.0 * 4 + 3.0 * 2 + 4.0 * 2) / 8


def test_the_fellows_table_and_the_watch_name_a_layout_cell():
    model = ClusterModel()
    view = JobView(_moved(metrics=JobMetrics(stages={"1.2": StageMetrics(step=7)})))
    model.jobs[view.job_id] = view
    st = FellowState(2, name="f2", job_id=view.job_id, stage=1, status="busy")
    model.fellows[2] = st
    assert fellow_job(model, st)[0] == "job-000001 s1/r2"
    cells = watch_cells(model, view, 3)
    assert cells["step"].plain == "7"  # (the leader's figures of "1.2")


# --- the report ----------------------------------------------------------------------------

def test_a_reports_marks_name_a_move():
    summary = MetricsSummary(stages=2, replicas=2, membership=[CHANGE])
    assert [(m.step, m.text) for m in marks(summary)] == [(6, "0.1->1.2 (rebalance)")]


def test_the_reports_topology_line_reads_a_layout_and_its_moves():
    summary = MetricsSummary(stages=2, replicas=2, membership=[CHANGE])
    assert _grid(summary) == "2x2 (0.1->1.2 @6)"
    assert _grid(MetricsSummary(stages=2, replicas=2), LAYOUT) == "2 stages, cells 1+3"
    assert _grid(summary, [[0, 1], [0, 1]]) == "2 stages, cells 2+2 (0.1->1.2 @6)"
    assert _grid(MetricsSummary(stages=2, replicas=2)) == "2x2"  # (a grid: as before)


# --- swarm set-speed --stage/--replica: a layout's cells ---------------------------------

async def test_set_speed_names_a_layout_cell_by_its_id():
    from swarm_tui.commands.base import CommandError
    from swarm_tui.commands.fellows import _cell_fellows

    class Client:
        async def jobs(self, state: str) -> list[JobInfo]:
            return [_moved()]

    c: Any = Client()
    assert await _cell_fellows(c, 1, 2) == ("job-000001", [2])  # (the mover, at 1.2)
    assert await _cell_fellows(c, 1, None) == ("job-000001", [1, 3, 2])
    with pytest.raises(CommandError, match=r"has no cell 0\.1 \(stage 0's cells: 0\)"):
        await _cell_fellows(c, 0, 1)
    with pytest.raises(CommandError, match=r"--replica 3: .* has 3 replica"):
        await _cell_fellows(c, None, 3)


def test_the_loss_curve_marks_the_step_a_peer_moved_from():
    from swarm_tui.app.screens.jobs import loss_plot

    view = JobView(_moved(loss_history=[[4.0, 3.0], [7.0, 2.5]]))
    assert loss_plot(view).marks == (6.0,)
    assert loss_plot(view, from_step=7).marks == ()


@pytest.mark.parametrize("by", ["event", "record"])
def test_a_new_cells_report_before_its_move_lands_once_the_move_is_known(by):
    """The moved peer's new cell reports its step before the leader's move event (or the
    record that has the move) reaches the console: the report is held, then lands on the
    new cell's row; a late report of the old cell is held and never lands."""
    model = ClusterModel()
    model.apply_job(_job(_placement()))
    view = model.jobs["job-000001"]
    view.apply_metric(MetricReport(job_id="job-000001", fellow_id=2, stage=1, replica=2,
                                   step=6, loss=2.5, tokens_per_s=120.0, state="RUNNING",
                                   metrics=StageMetrics(wire_tx_bytes=10)))
    assert 3 not in view.per_stage and len(view.unplaced) == 1
    for step in range(7, 17):  # (cell 1.0 trains on: step 6 leaves the console's window)
        view.apply_metric(MetricReport(job_id="job-000001", fellow_id=1, stage=1, replica=0,
                                       step=step, loss=2.0, state="RUNNING",
                                       metrics=StageMetrics(wire_tx_bytes=10)))
    if by == "event":
        model.apply_event({"type": JobMembership.type, "data": {
            "job_id": "job-000001", **_change_json()}})
        want_loss = 2.0  # (the newest step's, as before the move)
    else:
        model.apply_job(_moved())
        want_loss = 3.0  # (the record's)
    # The held report lands on its cell's row, and only there: the job's loss is not taken
    # back to its step's.
    assert view.info.last_loss == want_loss
    assert view.per_stage[3].fellow_id == 2
    assert (view.per_stage[3].step, view.per_stage[3].tokens_per_s) == (6, 120.0)
    assert view.unplaced == []
    # (the mover's old cell, 0.1, is gone: its late reports wait, bounded, land nowhere when
    # the placement changes again, and are let go then)
    for step in range(40):
        view.apply_metric(MetricReport(job_id="job-000001", fellow_id=2, stage=0, replica=1,
                                       step=step, state="RUNNING"))
    assert 2 not in {fp.fellow_id for i, fp in view.per_stage.items() if i != 3}
    assert len(view.unplaced) == 16
    back = attrs.evolve(CHANGE, step=20, epoch=2, moved=PeerMove(
        at=19, source=1, cell=2, target=0, new_id=1))
    view.take_move(back)
    assert view.unplaced == [] and view.info.placement == _placement()


def test_a_step_trained_again_after_a_change_replaces_its_curve_point():
    """Swarm wiring's redo: a cell lost mid-step, the survivors train the step again under the
    next membership; the console's curve takes the redone step's loss (the survivors'), and a
    late report of the attempt given up is not drawn over it."""
    view = JobView(_job(_placement()))
    view.info.loss_history = []

    def report(replica: int, step: int, loss: float, epoch: int) -> MetricReport:
        return MetricReport(job_id="job-000001", fellow_id=replica, stage=1, replica=replica,
                            step=step, loss=loss, state="RUNNING", epoch=epoch,
                            metrics=StageMetrics(wire_tx_bytes=10, micro_batches=2))

    view.apply_metric(report(0, 5, 3.0, 0))
    view.apply_metric(report(1, 5, 2.0, 0))
    assert view.info.loss_history == [[5, 2.5]]
    view.apply_metric(report(0, 5, 2.8, 1))  # (replica 1 left; step 5 trained again)
    assert view.info.loss_history == [[5, 2.8]] and view.info.last_loss == 2.8
    view.apply_metric(report(1, 5, 2.1, 0))  # (late: the given-up attempt's)
    assert view.info.loss_history == [[5, 2.8]]
    view.apply_metric(report(0, 6, 2.6, 1))
    assert view.info.loss_history == [[5, 2.8], [6, 2.6]]


# --- a cell that left alone (swarm wiring: the batch kept) --------------------------------
CELL_LEFT = MembershipChange(step=5, epoch=1, members=[0, 1], cells_left=[[1, 1]],
                             reason="fellow 3 lost", stage_steps=[5, 5])


def test_a_cell_that_left_alone_in_every_surfaces_words():
    job = _job(_placement().without([(1, 1)]), membership=[CELL_LEFT])
    assert membership_rows(job) == [
        ["cells @5", "cell(s) 1.1 left; training: 0,1 (fellow 3 lost)"]]
    from swarm_core.schema import unstructure
    assert _describe({"type": JobMembership.type, "data": {
        "job_id": "job-000001", **unstructure(CELL_LEFT)}}) == \
        "job-000001 cells @5: cell(s) 1.1 left; training: 0,1 (fellow 3 lost)"
    summary = MetricsSummary(stages=2, replicas=2, membership=[CELL_LEFT])
    assert [(m.step, m.text) for m in marks(summary)] == [(5, "c1.1 left (fellow 3 lost)")]
    assert "c1.1 left @5" in _grid(summary)


def test_the_console_takes_a_cell_that_left_out_of_its_grid():
    model, view = _grid_heard()
    from swarm_core.schema import unstructure
    change = model.apply_event({"type": JobMembership.type, "data": {
        "job_id": "job-000001", **unstructure(CELL_LEFT)}})
    assert change.jobs == {"job-000001"} and 3 in change.fellows
    assert view.info.placement == _placement().without([(1, 1)])
    assert view.info.placement.layout == ((0, 1), (0,))
    assert view.info.members == [0, 1] and view.info.fellows == [0, 1, 2]
    # (cell 1.1's figures gone; 0.1, fellow 2, keeps its own at its new index)
    assert sorted((i, fp.fellow_id) for i, fp in view.per_stage.items()) == [
        (0, 0), (1, 1), (2, 2)]
    assert [view.cell_of(i) for i in range(3)] == [(0, 0), (1, 0), (0, 1)]
