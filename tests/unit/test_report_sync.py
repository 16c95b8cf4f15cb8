"""The report over runs of several grid shapes and sync modes, from synthetic run directories
(no training): eval loss by wall time and by total bytes (pipeline + sync), a line style per
mode, and the table's grid, sync, inner steps and sync bytes; and the summary a run of
replicas writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from swarm_core.contract import CodecErrors, JobInfo, ProgressRecord, Topology
from swarm_core.experiments.report import (
    HEADERS,
    load_run,
    load_runs,
    render_html,
    render_png,
    summary_rows,
)
from swarm_core.experiments.runner import PROGRESS_FIELDS, progress_line, summarize

# (name, summary's grid fields, per-step sync bytes (None: no sync), eval every)
RUNS = [
    ("m-2x1-none", {"stages": 2, "replicas": 1, "sync_mode": "none"}, None),
    ("m-1x2-dp", {"stages": 1, "replicas": 2, "sync_mode": "dp", "sync_compression": "int8",
                  "sync_bytes_per_step": 1000.0}, lambda s: 1000),
    ("m-1x2-diloco_h2", {"stages": 1, "replicas": 2, "sync_mode": "diloco", "inner_steps": 2,
                         "overlap_steps": 1, "sync_compression": "none",
                         "sync_bytes_per_step": 1000.0},
     lambda s: 2000 if s % 2 == 0 else None),
]


def _run_dir(root: Path, name: str, grid: dict[str, Any], sync: Any) -> Path:
    d = root / f"20260101T000000-e-00-{name}"
    d.mkdir(parents=True)
    lines = []
    for s in range(1, 7):
        lines.append({"step": s, "loss": 5.0 - 0.1 * s, "wire_bytes": 100,
                      "sync_bytes": sync(s) if sync else None,
                      "eval_loss": 5.0 - 0.2 * s if s % 2 == 0 else None,
                      "ts": 1000.0 + 2 * s})
    (d / "train_progress.ndjson").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (d / "metrics_summary.json").write_text(json.dumps({
        "run_id": d.name, "status": "COMPLETED", "final_loss": 4.4, "eval_loss": 3.8,
        "wire_bytes_per_step": 100.0, **grid}))
    return d


@pytest.fixture
def runs(tmp_path: Path) -> list[Path]:
    return [_run_dir(tmp_path / "runs", *r) for r in RUNS]


def test_eval_points_carry_wall_time_and_pipeline_plus_sync_bytes(runs):
    none, dp, diloco = (load_run(d) for d in runs)
    assert none.eval_losses == pytest.approx([4.6, 4.2, 3.8])
    # Wall time from the first step's record; the steps that evaluated: 2, 4, 6.
    assert dp.eval_wall == [2.0, 6.0, 10.0]
    # Bytes sent by each evaluation: 100 a step on the pipeline, plus the sync's.
    assert none.eval_bytes == [200, 400, 600]
    assert dp.eval_bytes == [2200, 4400, 6600]
    assert diloco.eval_bytes == [2200, 4400, 6600]  # (2000 every second step)
    assert dp.bytes_sent[:2] == [1100, 2200]  # the training loss's bytes too
    assert [r.sync_mode for r in (none, dp, diloco)] == ["none", "dp", "diloco"]


def test_table_shows_grid_sync_mode_inner_steps_and_sync_bytes(runs):
    loaded, skipped = load_runs(runs)
    assert skipped == []
    rows = {r[0]: dict(zip(HEADERS, r, strict=True)) for r in summary_rows(loaded)}
    cols = ("grid", "sync", "inner steps", "sync bytes/step")
    assert [tuple(rows[n][c] for c in cols) for n in ("m-2x1-none", "m-1x2-dp",
                                                       "m-1x2-diloco_h2")] == [
        ("2x1", "none", "-", "-"), ("1x2", "dp int8", "-", "1,000"),
        ("1x2", "diloco overlap 1", "2", "1,000")]


def test_html_draws_eval_charts_in_each_mode_style(runs):
    loaded, _ = load_runs(runs)
    html = render_html(loaded)
    for title in ("eval loss by wall time", "eval loss by bytes sent",
                  "bytes on the wire (pipeline + sync)"):
        assert title in html
    # Five charts, a line per run in each (three evaluations each: the eval charts draw them).
    assert html.count("<polyline") == 15
    # Dashes by mode: dp's and diloco's in each of the five charts and in the legend.
    assert html.count("stroke-dasharray='7,3'") == 6
    assert html.count("stroke-dasharray='2,2'") == 6
    assert html.count("<circle") == 2 * 3 * 3  # each evaluation marked, in both eval charts
    assert "m-1x2-diloco_h2 (diloco)" in html


def test_png_has_the_eval_panels(runs, tmp_path):
    pytest.importorskip("matplotlib")
    loaded, _ = load_runs(runs)
    png = render_png(loaded)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "report.png").write_bytes(png)


def test_a_run_from_before_the_fields_reads_as_a_chain(tmp_path):
    d = _run_dir(tmp_path, "old", {}, None)
    (run,) = load_runs([d])[0]
    assert run.sync_mode == "none"
    row = dict(zip(HEADERS, summary_rows([run])[0], strict=True))
    assert (row["grid"], row["sync"], row["sync bytes/step"]) == ("-", "none", "-")


def test_a_bad_sync_mode_in_a_summary_is_one_line_naming_it(runs):
    path = runs[1] / "metrics_summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "sync_mode": "ring"}))
    _, skipped = load_runs([runs[1]])
    from swarm_core.config.methods import SYNC_METHODS

    modes = ", ".join(("none", *SYNC_METHODS))  # (dp, diloco, sparseloco, demo, ...)
    assert skipped == [(runs[1], f"{runs[1]}/metrics_summary.json: sync_mode is \"ring\", "
                        f"not one of {modes}")]


def test_every_sync_mode_has_its_own_dash_and_a_new_one_still_charts(tmp_path):
    from typing import get_args

    from swarm_core.config.grid import SyncAxis
    from swarm_core.experiments.report import MODE_DASH, mode_dash

    modes = get_args(SyncAxis)
    assert set(MODE_DASH) == set(modes)
    assert len({MODE_DASH[m] for m in modes}) == len(modes)  # (the dash tells modes apart)
    assert mode_dash("a_mode_from_later") == MODE_DASH["none"]  # (drawn, not a KeyError)
    d = _run_dir(tmp_path, "m-1x2-sparseloco_h2", {
        "stages": 1, "replicas": 2, "sync_mode": "sparseloco", "inner_steps": 2,
        "sync_bytes_per_step": 100.0}, lambda s: 200 if s % 2 == 0 else None)
    loaded, skipped = load_runs([d])
    assert skipped == []
    html = render_html(loaded)
    assert html.count(f"stroke-dasharray='{MODE_DASH['sparseloco'][0]}'") == 6
    assert "m-1x2-sparseloco_h2 (sparseloco)" in html
    row = dict(zip(HEADERS, summary_rows(loaded)[0], strict=True))
    assert (row["grid"], row["sync"], row["inner steps"]) == ("1x2", "sparseloco", "2")


def test_summary_of_a_diloco_run_names_its_grid_and_sync_bytes(tmp_path):
    from swarm_core.config.profiles import load_experiment

    (tmp_path / "model").mkdir()
    (tmp_path / "training").mkdir()
    (tmp_path / "model" / "m.json").write_text(json.dumps(
        {"name": "m", "d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8}))
    (tmp_path / "training" / "t.json").write_text(json.dumps(
        {"steps": 4, "batch_size": 8, "micro_batches": 2, "cluster_profile": {"fellows": 1}}))
    (tmp_path / "e.json").write_text(json.dumps({
        "name": "e", "training_config": "training/t.json", "model_configs": ["model/m.json"],
        "sweep": {"replicas": [1, 2], "sync": ["diloco"], "inner_steps": [2]}}))
    one, two = load_experiment(tmp_path / "e.json").runs
    # (cells of a job of replicas are "stage.replica": the summary gathers them by stage)
    records = [ProgressRecord(step=s, loss=3.0, wire_bytes=0,
                              sync_bytes=500 if s % 2 == 0 else None,
                              activation_peak_bytes={"0.0": 5, "0.1": 7},
                              wait_seconds={"0.0": 0.1, "0.1": 0.3},
                              stage_seconds={"0.0": 1.0, "0.1": 1.0},
                              codec_error={"0.0": CodecErrors(grad=0.1),
                                           "0.1": CodecErrors(grad=0.3)})
               for s in range(1, 5)]
    assert "sync_bytes" in PROGRESS_FIELDS and progress_line(records[1])["sync_bytes"] == 500

    def job(replicas: int) -> JobInfo:
        return JobInfo(job_id="job-000001", name="r", kind="train", state="COMPLETED",
                       created_at=0.0, started_at=None, finished_at=None, last_step=4,
                       last_loss=3.0, fellows=list(range(replicas)),
                       topology=Topology(stages=1, replicas=replicas), reason="")

    class St:
        run_id = "r"

    st = St()
    st.spec = two  # type: ignore[attr-defined]
    s = summarize(st, job(2), records)  # type: ignore[arg-type]
    assert (s["stages"], s["replicas"], s["sync_mode"], s["inner_steps"],
            s["overlap_steps"]) == (1, 2, "diloco", 2, 0)
    # Per step over every step (a step that did not sync sent nothing): per inner step.
    assert s["sync_bytes_per_step"] == 250.0 and s["sync_bytes_total"] == 1000
    assert s["total_bytes"] == 1000 and s["sync_compression"] == "none"
    assert s["activation_peak_bytes_by_stage"] == [7]
    assert s["wait_fraction_by_stage"] == [pytest.approx(0.2)]
    assert s["codec_error_by_stage"] == [{"grad": pytest.approx(0.2)}]
    st.spec = one  # type: ignore[attr-defined]
    s = summarize(st, job(1), [ProgressRecord(step=1, loss=3.0, wire_bytes=0)])  # type: ignore[arg-type]
    assert (s["replicas"], s["sync_mode"], s["inner_steps"], s["sync_bytes_per_step"]) == \
        (1, "none", None, None)


def test_the_report_says_which_replicas_left_at_which_step():
    from swarm_core.experiments.report import _grid

    summary = {"stages": 1, "replicas": 3,
               "membership": [{"step": 8, "epoch": 1, "members": [0, 2], "left": [1],
                               "joined": [], "reason": "fellow 1 stopped heartbeating"}]}
    assert _grid(summary) == "1x3 (r1 left @8)"
    assert _grid({"stages": 2, "replicas": 1}) == "2x1"  # (a summary without the field)


def test_the_figure_tells_inner_steps_optimizers_and_variants_apart(tmp_path):
    """Runs of one mode at H=10 and H=50, and a sweep's variants (MuLoCo: Muon inner steps,
    density 1), are separate series of the figure, each labelled by what sets it apart; the
    table's sync column says the density and the inner optimizer."""
    from swarm_core.experiments.report import loss_by_bytes_points, loss_by_wall_points

    base = {"stages": 1, "replicas": 4, "sync_mode": "sparseloco", "compression": "none",
            "model": "m", "sync_compression": "none", "sync_bytes_per_step": 10.0,
            "wall_time_s": 12.0}
    grids = [
        ("a-h10", {**base, "inner_steps": 10, "sync_density": 0.02, "variant": "sparseloco"}),
        ("a-h50", {**base, "inner_steps": 50, "sync_density": 0.02, "variant": "sparseloco"}),
        ("b-h50", {**base, "inner_steps": 50, "sync_density": 1.0, "optimizer": "muon",
                   "variant": "muloco-2bit"})]
    dirs = [_run_dir(tmp_path / "runs", name, grid, None) for name, grid in grids]
    loaded, _ = load_runs(dirs)
    points = loss_by_bytes_points(loaded)
    assert [p.series for p in points] == [  # (the variant's name said once: not "sparseloco
        # sparseloco"; MuLoCo's mode and knobs kept, its name does not say them)
        "none sparseloco H=10 d=0.02", "none sparseloco H=50 d=0.02",
        "none muloco-2bit sparseloco H=50 d=1 muon"]
    assert [p.runs for p in points] == [1, 1, 1]  # (H=10 and H=50 no longer pooled)
    assert len(loss_by_wall_points(loaded)) == 3
    assert [dict(zip(HEADERS, r, strict=True))["sync"] for r in summary_rows(loaded)] == [
        "sparseloco d=0.02", "sparseloco d=0.02", "sparseloco d=1 muon"]
    assert [load_run(d).summary.variant for d in dirs] == ["sparseloco", "sparseloco",
                                                           "muloco-2bit"]
    # The same row from a warm start and from scratch: two settings, told apart by the start.
    warm = _run_dir(tmp_path / "runs", "a-h10-warm",
                    {**grids[0][1], "warm_start": "job-000029@500"}, None)
    points = loss_by_bytes_points(load_runs([dirs[0], warm])[0])
    assert [p.series for p in points] == ["none scratch", "none from job-000029@500"]


def test_a_series_label_leaves_out_what_its_variant_says_unless_two_would_read_alike():
    """A variant named after its sync ("dp-muon" with "dp muon") reads once; where dropping
    those words would give two series one label (a variant running two modes whose name
    says both), each keeps its whole sync."""
    from swarm_core.experiments.report import _series_labels

    muon = ("m", "none", "1x4", ("dp", "muon"), "dp-muon", "scratch")
    diloco = ("m", "none", "1x4", ("diloco", "H=10", "int8"), "diloco-int8", "scratch")
    assert list(_series_labels([muon, diloco]).values()) == [
        "none dp-muon", "none diloco-int8 H=10"]
    both = [("m", "none", "1x4", (mode,), "dp-diloco", "scratch") for mode in ("dp", "diloco")]
    alone = ("m", "none", "1x4", ("dp",), "dp", "scratch")
    assert list(_series_labels([*both, alone]).values()) == [
        "none dp-diloco dp", "none dp-diloco diloco", "none dp dp"]
