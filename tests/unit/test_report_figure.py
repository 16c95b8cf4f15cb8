"""The compression figure of ``swarm report``, from synthetic run directories (no training):
final eval loss against wire bytes per step, one point per spec with its seeds' spread, and
step time against link rate, one line per spec; in the HTML, in the PNG, and from summaries
written before the summary named the link rate."""

from __future__ import annotations

import io
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from swarm_core.experiments import report
from swarm_core.experiments.report import (
    FIGURE_LOSS,
    FIGURE_STEP,
    PNG_DPI,
    PNG_SIZE,
    UNSHAPED,
    link_mbps,
    load_runs,
    loss_by_bytes_points,
    render_html,
    render_png,
    step_by_link_points,
)

SPECS = {"none": 2_097_152, "fixed_int8": 540_672, "learned_dim64_int8": 270_336}
SEEDS = (0, 1, 2)
NETWORKS = {"unshaped": None, "80mbit": 80.0}
STEPS = 8
EVAL_EVERY = 4


def _eval_loss(spec: str, seed: int) -> float:
    # Distinct per spec and seed, the same on either network (shaping changes no arithmetic).
    return 2.4 + 0.05 * list(SPECS).index(spec) + 0.01 * seed * (seed + 1)


def _step_seconds(spec: str, seed: int, network: str) -> float:
    wire = SPECS[spec] * 8 / 1e6 / NETWORKS[network] if NETWORKS[network] else 0.0
    return 0.1 + wire + 0.002 * seed


def _run_dir(root: Path, spec: str, seed: int, network: str, *, status: str = "COMPLETED",
             old: bool = False, model: str = "m") -> Path:
    name = f"{model}-{spec}-{network}-s{seed}-r0"
    d = root / f"20260101T000000-fig-00-{name}"
    d.mkdir(parents=True)
    steady = _step_seconds(spec, seed, network)
    lines = []
    for s in range(1, STEPS + 1):
        evaluated = s % EVAL_EVERY == 0
        # The first step waits for the neighbours, an evaluating one for its evaluation: the
        # mean step time must leave both out.
        seconds = 9.0 if s == 1 else steady + (5.0 if evaluated else 0.0)
        lines.append({"step": s, "loss": 4.0 - 0.1 * s, "wire_bytes": SPECS[spec],
                      "step_seconds": seconds,
                      "eval_loss": _eval_loss(spec, seed) + (0.3 if s < STEPS else 0.0)
                      if evaluated else None, "ts": 1000.0 + s})
    (d / "train_progress.ndjson").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary: dict[str, Any] = {
        "run_id": d.name, "status": status, "final_loss": 3.2,
        "eval_loss": _eval_loss(spec, seed), "wire_bytes_per_step": float(SPECS[spec]),
        "stages": 2, "replicas": 1, "sync_mode": "none"}
    if not old:
        summary |= {"compression": spec, "network_profile": network, "model": model,
                    "link_mbps": NETWORKS[network], "seed": seed, "repeat": 0,
                    "latency_ms": 0.0}
    (d / "metrics_summary.json").write_text(json.dumps(summary))
    return d


def _resolved(d: Path, spec: str, network: str, model: str = "m") -> None:
    rate = NETWORKS[network]
    (d / "config_resolved.json").write_text(json.dumps({
        "job": {"model": {"name": model, "compression": spec}},
        "network_profile": {"name": network, "tx_mbps": rate, "rx_mbps": rate,
                            "latency_ms": 0.0, "tc_profile": None}}))


@pytest.fixture
def grid(tmp_path: Path) -> list[Path]:
    return [_run_dir(tmp_path / "runs", spec, seed, net)
            for spec in SPECS for net in NETWORKS for seed in SEEDS]


def test_one_loss_point_per_spec_pools_its_seeds_and_networks(grid):
    runs, skipped = load_runs(grid)
    assert skipped == []
    points = loss_by_bytes_points(runs)
    assert [p.series for p in points] == list(SPECS)
    for p in points:
        losses = [_eval_loss(p.series, s) for s in SEEDS] * len(NETWORKS)
        assert p.runs == len(SEEDS) * len(NETWORKS)
        assert p.x == SPECS[p.series]
        assert p.y == pytest.approx(statistics.mean(losses))
        assert (p.y_min, p.y_max) == (pytest.approx(min(losses)), pytest.approx(max(losses)))
        assert p.y_min < p.y < p.y_max  # (the seeds differ, so the bar has a length)


def test_one_step_time_line_per_spec_across_link_rates(grid):
    runs, _ = load_runs(grid)
    points = step_by_link_points(runs)
    # A line per spec, its points in rate order with unshaped last.
    assert [(p.series, p.network, p.x) for p in points] == [
        (spec, net, rate) for spec in SPECS
        for net, rate in (("80mbit", 80.0), ("unshaped", math.inf))]
    for p in points:
        times = [_step_seconds(p.series, s, p.network) for s in SEEDS]
        assert p.runs == len(SEEDS)
        assert p.y == pytest.approx(statistics.mean(times))
        assert (p.y_min, p.y_max) == (pytest.approx(min(times)), pytest.approx(max(times)))
    by = {(p.series, p.network): p.y for p in points}
    # What the figure is for: on the slow link, fewer bytes are a shorter step.
    assert by["none", "80mbit"] > by["fixed_int8", "80mbit"] > by["learned_dim64_int8",
                                                                    "80mbit"]


def test_a_run_that_did_not_complete_stays_off_the_figure(grid, tmp_path):
    failed = _run_dir(tmp_path / "more", "none", 7, "unshaped", status="FAILED")
    runs, _ = load_runs([*grid, failed])
    (none,) = [p for p in loss_by_bytes_points(runs) if p.series == "none"]
    assert none.runs == len(SEEDS) * len(NETWORKS)
    assert sum(p.runs for p in step_by_link_points(runs) if p.series == "none") == \
        len(SEEDS) * len(NETWORKS)


def test_settings_that_differ_beyond_the_spec_are_named_by_it(tmp_path):
    dirs = [_run_dir(tmp_path, spec, 0, "unshaped", model=model)
            for model in ("small", "large") for spec in ("none", "fixed_int8")]
    runs, _ = load_runs(dirs)
    assert [p.series for p in loss_by_bytes_points(runs)] == [
        "none small", "fixed_int8 small", "none large", "fixed_int8 large"]


def test_chain_and_swarm_runs_of_one_grid_are_settings_of_their_own(tmp_path):
    """A sweep's wiring axis: chain and swarm runs of one spec and grid are not pooled, and
    the series (and the table's grid column) say which is which."""
    dirs = []
    for seed, wiring in enumerate(("chain", "swarm", "swarm")):
        d = _run_dir(tmp_path, "none", seed, "unshaped")
        summary = json.loads((d / "metrics_summary.json").read_text())
        summary |= {"replicas": 2, "sync_mode": "dp", "wiring": wiring,
                    "routing": "measured" if seed == 2 else "given"}
        (d / "metrics_summary.json").write_text(json.dumps(summary))
        dirs.append(d)
    runs, _ = load_runs(dirs)
    assert [(p.series, p.runs) for p in loss_by_bytes_points(runs)] == [
        ("none 2x2", 1), ("none 2x2 swarm", 1), ("none 2x2 swarm measured", 1)]
    html = render_html(runs)
    assert "<td>2x2 swarm measured</td>" in html and "<td>2x2</td>" in html


def test_an_older_summary_takes_its_place_from_the_resolved_config(tmp_path):
    placed = _run_dir(tmp_path, "fixed_int8", 0, "80mbit", old=True)
    _resolved(placed, "fixed_int8", "80mbit")
    unplaced = _run_dir(tmp_path, "none", 0, "80mbit", old=True)  # (no config beside it)
    runs, skipped = load_runs([placed, unplaced])
    assert skipped == []
    assert [(r.compression, r.link_mbps, r.network) for r in runs] == [
        ("fixed_int8", 80.0, "80mbit"), (None, None, None)]
    (loss,) = loss_by_bytes_points(runs)
    (step,) = step_by_link_points(runs)
    assert (loss.series, loss.runs, step.series, step.x) == ("fixed_int8", 1, "fixed_int8", 80.0)


def test_unshaped_in_an_older_config_is_unshaped(tmp_path):
    d = _run_dir(tmp_path, "none", 0, "unshaped", old=True)
    _resolved(d, "none", "unshaped")
    (run,), _ = load_runs([d])
    assert run.link_mbps == math.inf


def test_a_bad_link_rate_in_a_summary_is_one_line_naming_it(grid):
    path = grid[0] / "metrics_summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "link_mbps": -3}))
    _, skipped = load_runs([grid[0]])
    assert skipped == [(grid[0], f"{grid[0]}/metrics_summary.json: link_mbps is -3, not a "
                        "number above 0")]


def test_html_draws_both_charts_with_a_bar_per_point(grid):
    runs, _ = load_runs(grid)
    page = render_html(runs)
    for text in (*FIGURE_LOSS, *FIGURE_STEP, "Compression figure"):
        assert text in page
    points = len(loss_by_bytes_points(runs)) + len(step_by_link_points(runs))
    assert page.count("<g class='bar'>") == points
    # The step-time chart's x ticks: the rate that has points, then unshaped at the end.
    step_svg = page[page.index(FIGURE_STEP[0]):]
    assert ">80</text>" in step_svg and f">{UNSHAPED}</text>" in step_svg
    assert step_svg.index(">80</text>") < step_svg.index(f">{UNSHAPED}</text>")
    for spec in SPECS:
        assert f"</svg> {spec}</li>" in page  # the figure's legend
    # The figure's table: a row per spec with its seeds' mean and extremes.
    losses = [_eval_loss("none", s) for s in SEEDS]
    assert f"<td>{statistics.mean(losses):.4f}</td><td>{min(losses):.4f}</td>" \
           f"<td>{max(losses):.4f}</td>" in page


def test_html_of_runs_without_the_figure_fields_says_no_data(tmp_path):
    runs, _ = load_runs([_run_dir(tmp_path, "none", 0, "unshaped", old=True)])
    page = render_html(runs)
    assert f"{FIGURE_LOSS[0]}: no data" in page and f"{FIGURE_STEP[0]}: no data" in page


def test_png_decodes_at_its_size(grid):
    plt = pytest.importorskip("matplotlib.pyplot")
    runs, _ = load_runs(grid)
    png = render_png(runs)
    pixels = plt.imread(io.BytesIO(png), format="png")
    assert pixels.shape[:2] == (round(PNG_SIZE[1] * PNG_DPI), round(PNG_SIZE[0] * PNG_DPI))


def test_png_panels_hold_the_points_and_unshaped_tick(grid):
    plt = pytest.importorskip("matplotlib.pyplot")
    runs, _ = load_runs(grid)
    fig, (loss_ax, step_ax) = plt.subplots(1, 2)
    try:
        report._png_figure(loss_ax, step_ax, runs)
        assert (loss_ax.get_title(), loss_ax.get_xlabel(), loss_ax.get_ylabel()) == FIGURE_LOSS
        assert (step_ax.get_title(), step_ax.get_xlabel(), step_ax.get_ylabel()) == FIGURE_STEP
        assert loss_ax.get_xscale() == "log"
        # One errorbar series per spec in each panel, in the same colours.
        assert [c.get_label() for c in loss_ax.containers] == list(SPECS)
        assert [c.get_label() for c in step_ax.containers] == list(SPECS)
        colours = [[c.lines[0].get_color() for c in ax.containers] for ax in (loss_ax, step_ax)]
        assert colours[0] == colours[1]
        # The loss panel's points at their bytes and mean losses.
        first = loss_ax.containers[0].lines[0]
        assert list(first.get_xdata()) == [SPECS["none"]]
        assert list(first.get_ydata()) == pytest.approx(
            [statistics.mean([_eval_loss("none", s) for s in SEEDS])])
        # Unshaped a decade past 80 Mbit/s, labelled.
        line = step_ax.containers[0].lines[0]
        assert list(line.get_xdata()) == pytest.approx([80.0, 800.0])
        assert [t.get_text() for t in step_ax.get_xticklabels()] == ["80", UNSHAPED]
    finally:
        plt.close(fig)


def test_summary_names_the_link_rate_model_and_seed(tmp_path):
    from swarm_core.config.profiles import load_experiment
    from swarm_core.contract import JobInfo, ProgressRecord, Topology
    from swarm_core.experiments.runner import summarize

    (tmp_path / "model").mkdir()
    (tmp_path / "training").mkdir()
    (tmp_path / "model" / "m.json").write_text(json.dumps(
        {"name": "m", "d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8}))
    (tmp_path / "training" / "t.json").write_text(json.dumps(
        {"steps": 2, "batch_size": 4, "micro_batches": 2, "cluster_profile": {"fellows": 2}}))
    (tmp_path / "e.json").write_text(json.dumps({
        "name": "e", "training_config": "training/t.json", "model_configs": ["model/m.json"],
        "sweep": {"seeds": [3], "compressions": ["fixed_int8"], "network_profiles": [
            {"name": "free"}, {"name": "slow", "tx_mbps": 80, "rx_mbps": 40,
                               "latency_ms": 20}]}}))
    free, slow = load_experiment(tmp_path / "e.json").runs
    job = JobInfo(job_id="job-000001", name="r", kind="train", state="COMPLETED",
                  created_at=0.0, started_at=None, finished_at=None, last_step=2,
                  last_loss=3.0, fellows=[0, 1], topology=Topology(stages=2), reason="")

    class St:
        run_id = "r"

    st = St()
    out = {}
    for spec in (free, slow):
        st.spec = spec  # type: ignore[attr-defined]
        out[spec.network["name"]] = summarize(st, job, [  # type: ignore[arg-type]
            ProgressRecord(step=1, loss=3.0, wire_bytes=10)])
    keys = ("compression", "network_profile", "link_mbps", "latency_ms", "model", "seed",
            "repeat")
    assert [tuple(s[k] for k in keys) for s in out.values()] == [
        ("fixed_int8", "free", None, 0.0, "m", 3, 0),
        ("fixed_int8", "slow", 40.0, 20.0, "m", 3, 0)]


def test_the_figure_config_is_the_reference_setting_over_specs_networks_and_seeds():
    from swarm_core.config.profiles import load_experiment

    exp = load_experiment(Path(__file__).parents[2] / "exp" / "configs"
                          / "exp_compression_figure_v1.json")
    specs = ["none", "fixed_int8", "fixed_int8_b32", "learned_dim64", "learned_dim64_int8",
             "learned_dim64_int8_b32"]
    assert list(dict.fromkeys(r.compression for r in exp.runs)) == specs
    assert {(r.network["name"], link_mbps(r.network)) for r in exp.runs} == {
        ("unshaped", None), ("80mbit", 80.0)}
    seeds = sorted({r.seed for r in exp.runs})
    assert len(exp.runs) == len(specs) * 2 * len(seeds) and len(seeds) >= 3
    run = exp.runs[0]
    assert (run.stages, run.replicas) == (2, 1)
    assert {k: run.model[k] for k in ("d_model", "n_layers", "n_heads", "seq_len")} == \
        {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128}
    assert {k: run.training[k] for k in ("dataset", "tokenizer", "batch_size", "lr",
                                         "min_lr", "warmup_steps", "weight_decay",
                                         "grad_clip")} == {
        "dataset": "shakespeare", "tokenizer": "byte", "batch_size": 16, "lr": 3e-3,
        "min_lr": 3e-4, "warmup_steps": 20, "weight_decay": 0.1, "grad_clip": 1.0}
