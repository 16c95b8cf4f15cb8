"""Experiments end to end: a 3-run sweep on a 2-fellow local cluster writes complete artifacts,
and on the same cluster a sweep of replicas (1 stage x 2, dp and DiLoCo) records and reports
its sync; the Python runner refuses standalone runs and topologies the cluster cannot
satisfy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from swarm_core import jsonio
from tests.clusters import run_cli
from tests.support import REPO
from tests.tracking_support import expected_scalars, read_tb

pytestmark = pytest.mark.slow

RUN_FILES = ("manifest.json", "config_resolved.json", "topology_snapshot.json",
             "train_progress.ndjson", "metrics_summary.json")


def _layout(tmp_path, fellows: int = 2, steps: int = 4):
    (tmp_path / "model").mkdir()
    (tmp_path / "training").mkdir()
    (tmp_path / "model" / "tiny.json").write_text(json.dumps(
        {"name": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}))
    (tmp_path / "training" / "t.json").write_text(json.dumps(
        {"steps": steps, "batch_size": 4, "micro_batches": 2, "eval_batches": 1,
         "max_final_loss": 10.0, "cluster_profile": {"fellows": fellows},
         "artifacts": {"runs_dir": "../runs", "export": True}}))
    cfg = tmp_path / "exp.json"
    cfg.write_text(json.dumps({
        "name": "sweep3", "training_config": "training/t.json",
        "model_configs": ["model/tiny.json"],
        "sweep": {"compressions": ["none", "fixed_int8", "learned_dim8_int8"]}}))
    return cfg


def _replicas_layout(tmp_path):
    """One stage, two replicas: dp and DiLoCo (H=2), evaluated every 2 steps."""
    (tmp_path / "training" / "r.json").write_text(json.dumps(
        {"steps": 4, "batch_size": 4, "micro_batches": 2, "eval_batches": 1, "eval_every": 2,
         "cluster_profile": {"fellows": 1}}))
    cfg = tmp_path / "replicas.json"
    cfg.write_text(json.dumps({
        "name": "replicas", "training_config": "training/r.json",
        "model_configs": ["model/tiny.json"],
        "sweep": {"replicas": [2], "sync": ["dp", "diloco"], "inner_steps": [2]}}))
    return cfg


def test_sweep_of_three_runs_writes_every_artifact(cli_env, tmp_path):
    cfg = _layout(tmp_path)
    replicas_cfg = _replicas_layout(tmp_path)
    assert run_cli("restart-cluster", "--fellows", "2", env=cli_env, timeout=90).returncode == 0
    try:
        res = run_cli("sweep", "--config", str(cfg), "--format", "json", env=cli_env,
                      timeout=240)
        # (the same cluster: no second one for the grid axes)
        swarm = run_cli("sweep", "--config", str(replicas_cfg), "--runs-dir",
                        str(tmp_path / "swarm_runs"), "--format", "json", env=cli_env,
                        timeout=240)
    finally:
        run_cli("stop-cluster", env=cli_env)
    assert res.returncode == 0, res.stderr
    runs = json.loads(res.stdout)["runs"]
    assert [r["state"] for r in runs] == ["COMPLETED"] * 3
    # Progress lines went to stderr (stdout is the JSON document).
    assert "COMPLETED" in res.stderr
    bytes_per_step, wait_cells, error_cells = [], [], []
    for r in runs:
        d = tmp_path / "runs" / r["run_id"]
        assert d.is_dir()
        for name in RUN_FILES:
            assert (d / name).exists(), f"{d.name} lacks {name}"
        manifest = jsonio.loads((d / "manifest.json").read_bytes())
        assert manifest["status"] == "COMPLETED" and manifest["job_id"] == r["job_id"]
        # artifacts.export: the run's own copy of its final shards, whole.
        export = jsonio.loads((d / "model_export" / "run_manifest.json").read_bytes())
        assert export["complete"] is True and export["step"] == 4
        assert all((d / "model_export" / s["dir"] / "weights.npz").exists()
                   for s in export["shards"])
        assert manifest["config_source"] == str(cfg) and manifest["leader_url"]
        resolved = jsonio.loads((d / "config_resolved.json").read_bytes())
        assert resolved["job"]["training"]["steps"] == 4
        topo = jsonio.loads((d / "topology_snapshot.json").read_bytes())
        assert topo["requested"]["fellows"] == 2 and len(topo["actual"]["stages"]) == 2
        records = [json.loads(line) for line in
                   (d / "train_progress.ndjson").read_text().splitlines()]
        assert [x["step"] for x in records] == [1, 2, 3, 4]
        assert all(x["loss"] > 0 and x["tokens_per_s"] > 0 and x["wire_bytes"] > 0
                   for x in records)
        # Every stage's activation memory, every step, from the fellows' reports.
        assert all(set(x["activation_peak_bytes"]) == {"0", "1"} and
                   min(x["activation_peak_bytes"].values()) > 0 for x in records)
        # TensorBoard files beside the artifacts (the [tracking] extra is installed): the
        # numbers of train_progress.ndjson, the run's config as hparams.
        tb = read_tb(d / "tb")
        assert tb["scalars"] == expected_scalars(records)
        assert tb["hparams"]["compression"] == resolved["job"]["model"]["compression"]
        assert tb["hparams"]["training.steps"] == 4
        summary = jsonio.loads((d / "metrics_summary.json").read_bytes())
        assert summary["steps_recorded"] == summary["steps_expected"] == 4
        assert summary["wire_bytes_per_step"] == summary["expected_wire_bytes_per_step"]
        assert summary["thresholds"]["max_final_loss"]["met"] is True
        assert summary["eval_loss"] > 0
        peaks = summary["activation_peak_bytes_by_stage"]
        assert peaks == [max(x["activation_peak_bytes"][str(k)] for x in records)
                         for k in (0, 1)]
        # And the time each stage sat blocked on its links, within its own step time, every
        # step; the summary's share leaves out the first step (neighbours starting).
        assert all(set(x["wait_seconds"]) == set(x["stage_seconds"]) == {"0", "1"} and
                   all(0 <= x["wait_seconds"][k] <= x["stage_seconds"][k] for k in "01")
                   for x in records)
        waits = summary["wait_fraction_by_stage"]
        assert waits == [pytest.approx(sum(x["wait_seconds"][str(k)] for x in records[1:])
                                       / sum(x["stage_seconds"][str(k)] for x in records[1:]))
                         for k in (0, 1)]
        assert all(0 < w < 1 for w in waits)
        # What the wire codec changed: nothing on fp32 (none), something on int8 (the others).
        assert all(x["codec_error"] == {"0": {"act": x["codec_error"]["0"]["act"]},
                                        "1": {"grad": x["codec_error"]["1"]["grad"]}}
                   for x in records)
        errors = summary["codec_error_by_stage"]
        assert errors[0]["act"] == pytest.approx(
            sum(x["codec_error"]["0"]["act"] for x in records) / len(records))
        if r is runs[0]:
            assert errors == [{"act": 0.0}, {"grad": 0.0}]
        else:
            assert 0 < errors[0]["act"] < 0.05 and 0 < errors[1]["grad"] < 0.05
        most = max(range(2), key=lambda k: waits[k])
        wait_cells.append(f"{waits[most]:.0%} (s{most})")
        error_cells.append(f"{errors[0]['act']:.2%}")
        bytes_per_step.append(summary["wire_bytes_per_step"])
    # none > fixed_int8 > learned_dim8_int8 on the wire
    assert bytes_per_step[0] > bytes_per_step[1] > bytes_per_step[2]

    report = tmp_path / "report.html"
    res = run_cli("report", str(tmp_path / "runs"), "--output", str(report), env=cli_env)
    assert res.returncode == 0, res.stderr
    html = report.read_text()
    # three charts with one line per run, then each run's throughput per cell (two stages)
    assert html.count("<polyline") == 3 * 3 + 3 * 2
    assert "none" in html and "learned_dim8_int8" in html
    # The table names each run's most blocked stage.
    assert "<th>link wait</th>" in html and all(f"<td>{c}</td>" in html for c in wait_cells)
    assert "<th>act error</th>" in html and all(f"<td>{c}</td>" in html for c in error_cells)
    _check_replica_sweep(swarm, tmp_path, cli_env)


def _check_replica_sweep(res, tmp_path, cli_env) -> None:
    """The grid axes through a real leader: each run's job is 1 stage x 2 replicas in its
    mode; dp's sync sends every step, DiLoCo's every second; the report plots and tables it."""
    assert res.returncode == 0, res.stderr
    runs = json.loads(res.stdout)["runs"]
    assert [r["state"] for r in runs] == ["COMPLETED"] * 2
    assert [r["run_id"].split("-", 3)[-1] for r in runs] == [
        "tiny-none-unconstrained-1x2-dp-s0-r0", "tiny-none-unconstrained-1x2-diloco_h2-s0-r0"]
    for r, mode in zip(runs, ("dp", "diloco"), strict=True):
        d = tmp_path / "swarm_runs" / r["run_id"]
        job = jsonio.loads((d / "config_resolved.json").read_bytes())["job"]
        assert job["topology"]["replicas"] == 2 and job["topology"]["stages"] == 1
        assert job["training"]["sync"]["mode"] == mode
        records = [json.loads(line) for line in
                   (d / "train_progress.ndjson").read_text().splitlines()]
        synced = [x["sync_bytes"] or 0 for x in records]
        if mode == "dp":
            assert all(b > 0 for b in synced)
        else:
            assert synced[0] == synced[2] == 0 and synced[1] > 0 and synced[3] > 0
        assert [x["step"] for x in records if x["eval_loss"] is not None] == [2, 4]
        assert read_tb(d / "tb")["scalars"] == expected_scalars(records)
        summary = jsonio.loads((d / "metrics_summary.json").read_bytes())
        assert (summary["stages"], summary["replicas"], summary["sync_mode"]) == (1, 2, mode)
        assert summary["inner_steps"] == (2 if mode == "diloco" else None)
        assert summary["sync_bytes_per_step"] == pytest.approx(sum(synced) / 4)
        assert summary["total_bytes"] == sum(synced) + sum(x["wire_bytes"] for x in records)
    report = tmp_path / "swarm_report.html"
    res = run_cli("report", str(tmp_path / "swarm_runs"), "--output", str(report),
                  env=cli_env)
    assert res.returncode == 0, res.stderr
    html = report.read_text()
    # Five charts, a line per run in each (two evaluations: the eval charts draw a line),
    # then each run's throughput per cell (1 stage x 2 replicas).
    assert html.count("<polyline") == 5 * 2 + 2 * 2 and "eval loss by bytes sent" in html
    assert "<th>sync bytes/step</th>" in html and "<td>1x2</td>" in html
    assert "<td>diloco</td>" in html and "<td>dp</td>" in html


def test_runner_refuses_standalone_and_unsatisfiable_topology(cli_env, tmp_path):
    script = [sys.executable, str(REPO / "exp" / "scripts" / "run_experiment.py")]
    cfg = _layout(tmp_path, fellows=3)
    alone = subprocess.run([*script, "--config-path", str(cfg)], capture_output=True,
                           text=True, env=cli_env, cwd=REPO, timeout=60)
    assert alone.returncode == 2 and "never standalone" in alone.stderr
    up = run_cli("restart-cluster", "--fellows", "2", env=cli_env, timeout=90)
    assert up.returncode == 0
    try:
        res = subprocess.run([*script, "--leader-url", up.stdout.strip(), "--config-path",
                              str(cfg)], capture_output=True, text=True, env=cli_env,
                             cwd=REPO, timeout=60)
        jobs = json.loads(run_cli("jobs", "--format", "json", env=cli_env).stdout)["jobs"]
    finally:
        run_cli("stop-cluster", env=cli_env)
    assert res.returncode == 1
    assert "cluster_profile wants 3 fellow(s)" in res.stderr and "has 2 active" in res.stderr
    assert jobs == [], "nothing was queued"
