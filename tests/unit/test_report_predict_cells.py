"""The report's predictor section and its throughput-per-cell chart, from a synthetic run
folder (no training): the prediction from the run's own resolved config and a calibration
cache written here, the lines that say why a run has none, one line per cell at its own tokens
per second, and the marks at the steps of the run's set-speeds and membership changes."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import attrs
import pytest

from swarm_core.config.defaults import DEFAULT_MODEL, DEFAULT_TRAINING
from swarm_core.contract import JobSubmit
from swarm_core.experiments import report_predict
from swarm_core.experiments.report import cell_throughput, load_run, render_html
from swarm_core.experiments.report_cells import marks, png_cells
from swarm_core.experiments.report_predict import NOT_CALIBRATED, predict_dir
from swarm_core.predict.calibrate import calibrate, stage_works
from swarm_core.predict.critical_path import StageTimes
from swarm_core.predict.runs import load_runs
from swarm_core.predict.service import predict_run
from swarm_core.schema import structure, unstructure

CELLS = ("0.0", "0.1", "1.0", "1.1")
STEPS = 8
LINK = {"tx_mbps": 80.0, "rx_mbps": 80.0, "latency_ms": 20.0}
# per cell its own seconds a step: 1.1 is slowed 4x from step 4 (the set-speed below)
SECONDS = {"0.0": 0.5, "0.1": 0.5, "1.0": 0.6, "1.1": 0.6}
TIMES = [StageTimes(0.01, 0.02, 0.005), StageTimes(0.012, 0.025, 0.005)]


def _job(**training: Any) -> dict[str, Any]:
    body = {"name": "grid", "kind": "train", "model": dict(DEFAULT_MODEL),
            "training": {**DEFAULT_TRAINING, "link": LINK, **training},
            "topology": {"fellows": 4, "replicas": 2}}
    return unstructure(structure(body, JobSubmit))  # (as the runner writes it)


def _seconds(cell: str, step: int) -> float:
    return SECONDS[cell] * (4.0 if cell == "1.1" and step >= 4 else 1.0)


def _run_dir(root: Path, job: dict[str, Any] | None = None, routed: bool = False) -> Path:
    d = root / "20260101T000000-e-00-grid"
    d.mkdir(parents=True)
    lines = []
    for s in range(1, STEPS + 1):
        rec: dict[str, Any] = {
            "step": s, "loss": 5.0 - 0.1 * s, "wire_bytes": 100, "ts": 1000.0 + s,
            "step_seconds": 0.7, "tokens_per_s": 1024 / 0.7,
            "stage_seconds": {c: _seconds(c, s) for c in CELLS}}
        if routed:
            rec["micro_batches"] = {"0.0": 4, "0.1": 4, "1.0": 6, "1.1": 2}
        lines.append(rec)
    (d / "train_progress.ndjson").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (d / "metrics_summary.json").write_text(json.dumps({
        "run_id": d.name, "status": "COMPLETED", "final_loss": 4.2, "stages": 2,
        "replicas": 2, "sync_mode": "dp",
        "link_changes": [{"at_step": 4, "fellow_id": 3, "slowdown": 4.0}],
        "membership": [{"step": 6, "epoch": 1, "members": [0], "left": [1],
                        "reason": "rebalance"}]}))
    if job is not None:
        (d / "config_resolved.json").write_text(json.dumps({
            "run_id": d.name, "job": job, "network_profile": {"name": "80mbit-20ms", **LINK}}))
    return d


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return _run_dir(tmp_path / "runs", _job())


@pytest.fixture
def cache(tmp_path: Path, run_dir: Path) -> Path:
    """The calibration cache as swarm predict writes it, holding the run's two stages."""
    shape = report_predict.run_shape(report_predict.read_resolved(run_dir))
    path = tmp_path / "calibration.json"
    calibrate(stage_works(shape.model, shape.training, 2, 2), path,
              measure=lambda w: TIMES[w.stage])
    return path


# --- the predictor section ----------------------------------------------------------------------


def test_the_prediction_is_swarm_predicts_for_the_runs_job_from_the_cache(run_dir, cache,
                                                                        tmp_path):
    run = load_run(run_dir)
    row = predict_dir(run_dir, run.label, run.mean_step_seconds, cache)
    assert row.why_not is None and row.prediction is not None
    # The same job given to swarm predict (its body as a file) predicts the same step.
    body = tmp_path / "job.json"
    body.write_text(json.dumps(_job()))
    want = predict_run(load_runs(body)[0], cache, measure=lambda w: pytest.fail("measured"))
    p = row.prediction
    assert (p.step_seconds, p.step_seconds_overlap, p.bound_by) == (
        want.prediction.step_seconds, want.prediction.step_seconds_overlap,
        want.prediction.bound_by)
    assert p.step_seconds >= p.step_seconds_overlap  # (the predicted step, over its bound)
    assert [s.utilisation for s in p.stages] == [s.utilisation
                                                 for s in want.prediction.stages]
    assert p.stages[0].compute_seconds == pytest.approx(4 * (0.01 + 0.02) + 0.005)
    # Measured: the mean of steps 2..8 (the first waits for its neighbours), over predicted.
    assert row.measured == pytest.approx(0.7)
    assert row.ratio == pytest.approx(0.7 / p.step_seconds)
    page = render_html([run], cache)
    section = page[page.index("<h2 id='predictor'>"):]
    head = section[:section.index("</tr>")]
    assert head.index("<th>predicted s/step</th>") < head.index("<th>perfect overlap s/step</th>")
    assert f"<td>{p.step_seconds:.3f}</td><td>{p.step_seconds_overlap:.3f}</td>" in section
    assert f"<td>{0.7 / p.step_seconds:.2f}</td>" in section
    assert f"<td>{html.escape(p.bound_by)}</td>" in section
    assert f"s0 {p.stages[0].utilisation:.0%} s1 {p.stages[1].utilisation:.0%}" in section


def test_a_cache_without_the_runs_stages_says_not_calibrated_and_measures_nothing(
        run_dir, tmp_path):
    run = load_run(run_dir)
    missing = tmp_path / "none.json"
    assert predict_dir(run_dir, run.label, 0.7, missing).why_not == NOT_CALIBRATED
    assert not missing.exists()
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"another-machine": {"forward": 1, "backward": 1,
                                                     "optimizer": 1}}))
    before = other.read_text()
    assert predict_dir(run_dir, run.label, 0.7, other).why_not == NOT_CALIBRATED
    assert other.read_text() == before, "a report writes no calibration"
    assert f"grid: {NOT_CALIBRATED}" in render_html([run], other)


@pytest.mark.parametrize(("resolved", "why"), [
    (None, "no config_resolved.json in the run folder"),
    ("{not json", "config_resolved.json is not valid JSON"),
    ({"run_id": "x"}, "config_resolved.json has no job"),
    ({"job": {"name": "grid", "kind": "smoke"}}, "not a train job with a model"),
])
def test_a_config_the_predictor_cannot_read_is_one_line_in_the_section(tmp_path, resolved, why):
    d = _run_dir(tmp_path / "runs")
    if resolved is not None:
        (d / "config_resolved.json").write_text(
            resolved if isinstance(resolved, str) else json.dumps(resolved))
    row = predict_dir(d, "grid", 0.7, tmp_path / "cache.json")
    assert row.prediction is None and why in (row.why_not or "")
    assert "\n" not in (row.why_not or "")
    page = render_html([load_run(d)], tmp_path / "cache.json")
    assert "<h2 id='predictor'>Predictor</h2>" in page and why in page


# --- throughput per cell ------------------------------------------------------------------------


def test_each_cell_is_its_own_tokens_over_its_own_step_time(run_dir):
    series = cell_throughput(load_run(run_dir))
    assert list(series) == list(CELLS)
    tokens = 16 // 2 * 64  # the replica's share of the batch, in windows of seq_len
    for cell in CELLS:
        assert series[cell] == [(s, pytest.approx(tokens / _seconds(cell, s)))
                                for s in range(1, STEPS + 1)]


def test_routed_micro_batches_count_where_a_record_holds_them(tmp_path):
    series = cell_throughput(load_run(_run_dir(tmp_path / "runs", _job(), routed=True)))
    per_mb = 16 // 2 // 4 * 64
    assert series["1.0"][0] == (1, pytest.approx(6 * per_mb / 0.6))
    assert series["1.1"][0] == (1, pytest.approx(2 * per_mb / 0.6))


def test_without_a_config_the_records_tokens_are_shared_by_the_replicas(tmp_path):
    series = cell_throughput(load_run(_run_dir(tmp_path / "runs")))
    assert series["0.0"][0] == (1, pytest.approx(1024 / 2 / 0.5))


def test_the_html_chart_has_a_line_per_cell_and_the_marks_at_their_steps(run_dir, tmp_path):
    run = load_run(run_dir)
    assert [(m.step, m.text) for m in marks(run.summary)] == [
        (4, "f3 slowdown x4"), (6, "r1 left (rebalance)")]
    page = render_html([run], tmp_path / "cache.json")
    section = page[page.index("<h2 id='cells'>"):page.index("<h2 id='predictor'>")]
    assert re.findall(r"class='cell' data-cell='([\d.]+)'", section) == list(CELLS)
    assert re.findall(r"class='mark' data-step='(\d+)'", section) == ["4", "6"]
    # A mark sits on the step axis the lines share: at the x of each line's point of its step.
    points = re.search(r"data-cell='0.0'[^>]*points='([^']+)'", section)[1].split()
    x_of_step = {s: float(pt.split(",")[0]) for s, pt in zip(range(1, STEPS + 1), points,
                                                              strict=True)}
    for step in (4, 6):
        mark = re.search(rf"data-step='{step}'.*?<line x1='([\d.]+)'", section)[1]
        assert float(mark) == pytest.approx(x_of_step[step], abs=0.1)


def test_a_run_without_per_cell_times_says_so(tmp_path):
    d = _run_dir(tmp_path / "runs")
    lines = [json.loads(x) for x in (d / "train_progress.ndjson").read_text().splitlines()]
    (d / "train_progress.ndjson").write_text("".join(
        json.dumps({**x, "stage_seconds": None}) + "\n" for x in lines))
    page = render_html([load_run(d)], tmp_path / "cache.json")
    assert "no per-cell step times" in page and "class='cell'" not in page


def test_the_png_panel_has_a_line_per_cell_and_a_vertical_per_change(run_dir):
    plt = pytest.importorskip("matplotlib.pyplot")
    run = load_run(run_dir)
    fig, ax = plt.subplots()
    try:
        png_cells(ax, [(run.label, cell_throughput(run), marks(run.summary))], ["#000"])
        lines = ax.get_lines()
        cells = [ln for ln in lines if ln.get_label() in CELLS]
        assert [ln.get_label() for ln in cells] == list(CELLS)
        verticals = [ln.get_xdata()[0] for ln in lines if ln not in cells]
        assert verticals == [4, 6]
    finally:
        plt.close(fig)


def test_a_moves_mark_names_its_fellow_and_the_table_the_layout_and_the_move(tmp_path):
    """Placement-cells step 7: a peer's move is a mark "f2 0.1->1.2 (rebalance)" (its fellow
    from the run's last placement, topology_snapshot.json's), and the summary table's
    topology reads the layout the job gave, then the move and its step."""
    from swarm_core.contract.placement import FellowSlots, plan
    from swarm_core.experiments.report import summary_rows

    d = _run_dir(tmp_path / "runs")
    summary = json.loads((d / "metrics_summary.json").read_text())
    move = {"at": 5, "source": 0, "cell": 1, "target": 1, "new_id": 2}
    summary |= {"wiring": "swarm", "membership": [
        {"step": 6, "epoch": 1, "members": [0, 1, 2], "reason": "rebalance", "moved": move}]}
    (d / "metrics_summary.json").write_text(json.dumps(summary))
    start = plan([FellowSlots(i, f"f{i}", ["cpu"]) for i in range(5)], 2, 4, replicas=2,
                 layout=[[0, 1, 2], [0, 1]])
    (d / "topology_snapshot.json").write_text(json.dumps(
        {"actual": unstructure(start.moved(0, 1, 1, 2))}))
    (d / "config_resolved.json").write_text(json.dumps(
        {"run_id": d.name, "job": {"topology": {"layout": [[0, 1, 2], [0, 1]]}}}))
    run = load_run(d)
    assert [(m.step, m.text) for m in marks(run.summary, run.placement)] == [
        (4, "f3 slowdown x4"), (6, "f2 0.1->1.2 (rebalance)")]
    assert [(m.step, m.text) for m in marks(run.summary)][1] == (6, "0.1->1.2 (rebalance)")
    assert summary_rows([run])[0][2] == "2 stages, cells 3+2 (0.1->1.2 @6)"
    # Without the snapshot the mark names no fellow; the run is read all the same.
    (d / "topology_snapshot.json").write_text("{")
    assert load_run(d).placement is None


def test_the_prediction_plays_the_runs_emulated_slowdowns(run_dir, cache):
    """The run's cell 1.1 ran slowed 4x (``emulated_slowdown_by_cell``): the report's row
    predicts the run as it was, as ``swarm predict --slowdown 1.1=4`` does; labels that are
    not the run's cells are left out."""
    run = load_run(run_dir)
    plain = predict_dir(run_dir, run.label, run.mean_step_seconds, cache)
    slowed = predict_dir(run_dir, run.label, run.mean_step_seconds, cache,
                         slowdowns={"1.1": 4.0, "1.0": 1.0, "7.0": 3.0, "x": 2.0})
    assert plain.prediction is not None and slowed.prediction is not None
    shape = report_predict.run_shape(report_predict.read_resolved(run_dir))
    want = predict_run(attrs.evolve(shape, slowdowns=((1, 1, 4.0),)), cache,
                       measure=lambda w: pytest.fail("measured"))
    assert slowed.prediction.step_seconds == want.prediction.step_seconds
    assert slowed.prediction.compute_seconds > plain.prediction.compute_seconds
    assert report_predict.slowed_cells({"1.1": 4.0, "1.0": 1.0, "7.0": 3.0, "x": 2.0},
                                       shape) == ((1, 1, 4.0),)


def test_a_rebalancing_runs_row_names_the_moves_its_rule_would_make(tmp_path):
    """A 2 x 3 swarm run with measured routes and a look every 4 steps whose stage-1 cells
    1 and 2 ran 4x slowed: the predictor plays its rule on those speeds and the section
    names the move (stage 0's cell 2 to stage 1 as cell 3, before step 4) and the step
    predicted after it, shorter than the row's."""
    job = _job(batch_size=24, micro_batches=4)
    job["topology"] = {"stages": 2, "replicas": 3, "wiring": "swarm", "routing": "measured",
                       "rebalance_every": 4}
    job = unstructure(structure(job, JobSubmit))
    run_dir = _run_dir(tmp_path / "runs", job)
    shape = report_predict.run_shape(report_predict.read_resolved(run_dir))
    cache = tmp_path / "calibration.json"
    calibrate(stage_works(shape.model, shape.training, 2, 3), cache,
              measure=lambda w: TIMES[w.stage])
    row = predict_dir(run_dir, "rb", 0.7, cache, slowdowns={"1.1": 4.0, "1.2": 4.0})
    assert row.prediction is not None
    [(text, at, after)] = row.moves
    assert (text, at) == ("0.2 -> 1.3", 4) and after < row.prediction.step_seconds
    section = report_predict.html_section([row])
    assert f"rb: rebalancing, as its rule would move peers on these speeds: 0.2 -&gt; 1.3 " \
           f"before step 4 (then {after:.3f} s/step)" in section
