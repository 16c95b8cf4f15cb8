"""Benchmark suites: planning errors in a dry run, and a small suite end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from swarm_core.config.profiles import ConfigError
from swarm_core.experiments.suites import load_suite
from tests.clusters import cli_json, run_cli
from tests.support import REPO
from tests.tracking_support import expected_scalars, read_tb


def _suite(tmp_path, scenarios=None, **over):
    (tmp_path / "model").mkdir(parents=True, exist_ok=True)
    (tmp_path / "training").mkdir(exist_ok=True)
    (tmp_path / "infra").mkdir(exist_ok=True)
    (tmp_path / "model" / "m.json").write_text(json.dumps(
        {"name": "m", "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}))
    (tmp_path / "training" / "t.json").write_text(json.dumps(
        {"steps": 4, "batch_size": 4, "micro_batches": 2, "eval_batches": 1}))
    (tmp_path / "infra" / "one.json").write_text(json.dumps(
        {"name": "one", "nodes": [{"name": "a"}]}))
    (tmp_path / "infra" / "two.json").write_text(json.dumps(
        {"name": "two", "nodes": [{"name": "a"}, {"name": "b"}],
         "inter_node_link": {"tx_mbps": 50, "rx_mbps": 50}}))
    (tmp_path / "infra" / "four.json").write_text(json.dumps(
        {"name": "four", "nodes": [{"name": "a", "fellows": 2}, {"name": "b", "fellows": 2}]}))

    def sc(name, infra):
        return {"name": name, "model": "model/m.json", "training": "training/t.json",
                "infra": f"infra/{infra}.json", "artifacts": {"dir": name}}

    body = {"name": "s", "baseline": "base",
            "scenarios": scenarios or [sc("base", "one"), sc("shaped", "two")], **over}
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(body))
    return path, sc


def test_default_suite_loads_and_says_what_it_emulates():
    suite = load_suite(REPO / "exp/configs/benchmarks/multinode_training_v1.json")
    by = {s.spec.name: s for s in suite.scenarios}
    assert list(by) == ["single_device", "one_node_two_slots", "two_nodes_unconstrained",
                        "two_nodes_constrained"]
    assert [(s.fellows, s.stages) for s in suite.scenarios] == [(1, 1), (1, 2), (2, 2), (2, 2)]
    assert by["one_node_two_slots"].slots_per_fellow == 2
    assert any("sharing this machine's cores" in n
               for n in by["one_node_two_slots"].not_emulated)
    assert any("20.0 Mbit/s" in e for e in by["two_nodes_constrained"].emulated)


@pytest.mark.parametrize("case, message", [
    ("missing_profile", "file not found"),
    ("bad_baseline", "names no scenario"),
    ("duplicate_dirs", "artifact dirs must be unique"),
    ("bad_node", "must be 1-64, got 0"),
    ("nul_in_model", "$.scenarios[0].model: not a usable path (embedded null byte)"),
])
def test_planning_errors(tmp_path, case, message):
    path, _sc = _suite(tmp_path)
    data = json.loads(path.read_text())
    if case == "missing_profile":
        data["scenarios"][1]["training"] = "training/nope.json"
    elif case == "bad_baseline":
        data["baseline"] = "nope"
    elif case == "duplicate_dirs":
        data["scenarios"][1]["artifacts"]["dir"] = "base"
    elif case == "nul_in_model":
        data["scenarios"][0]["model"] = "model/m\u0000.json"
    elif case == "bad_node":
        (tmp_path / "infra" / "two.json").write_text(json.dumps(
            {"name": "two", "nodes": [{"name": "a", "fellows": 0}]}))
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as exc:
        load_suite(path)
    assert message in str(exc.value)


@pytest.mark.slow
def test_dry_run_checks_topology_and_a_small_suite_runs(cli_env, tmp_path):
    path, sc = _suite(tmp_path)
    big, _ = _suite(tmp_path / "big", scenarios=[sc("base", "one"), sc("wide", "four")])
    assert run_cli("restart-cluster", "--fellows", "2", env=cli_env, timeout=90).returncode == 0
    try:
        dry = run_cli("suite", "--suite", str(big), "--dry-run", "--out", str(tmp_path / "dry"),
                      env=cli_env)
        res = run_cli("suite", "--suite", str(path), "--out", str(tmp_path / "out"),
                      "--format", "json", env=cli_env, timeout=240)
    finally:
        run_cli("stop-cluster", env=cli_env)
    # The dry run plans, writes suite_plan.json, and refuses what the cluster cannot do.
    assert dry.returncode == 1 and "wide" in dry.stderr and "needs 4 active" in dry.stderr
    plan = json.loads((tmp_path / "dry" / "suite_plan.json").read_text())
    assert [s["topology_ok"] for s in plan["scenarios"]] == [True, False]
    assert res.returncode == 0, res.stderr
    out = tmp_path / "out"
    for name in ("suite_plan.json", "suite_manifest.json", "suite_summary.json"):
        assert (out / name).exists(), name
    for scenario in ("base", "shaped"):
        d = out / scenario
        for name in ("manifest.json", "config_resolved.json", "infra_resolved.json",
                     "job_final.json", "placement_plan.json", "train_progress.ndjson",
                     "metrics_summary.json", "model_export/run_manifest.json"):
            assert (d / name).exists(), f"{scenario}/{name}"
        # A suite's runs are tracked as a sweep's are (the [tracking] extra is installed).
        records = [json.loads(x) for x in (d / "train_progress.ndjson").read_text().splitlines()]
        assert read_tb(d / "tb")["scalars"] == expected_scalars(records)
    summary = json.loads((out / "suite_summary.json").read_text())
    rows = {r["scenario"]: r for r in summary["scenarios"]}
    assert rows["base"]["status"] == rows["shaped"]["status"] == "COMPLETED"
    assert rows["base"]["wire_bytes_per_step"] is None or rows["base"]["stages"] == 1
    assert rows["shaped"]["link_bound_s"] > 0 and rows["shaped"]["slowdown_vs_baseline"] > 0
    # Same seed, same data: splitting into two stages does not change the losses.
    assert abs(rows["base"]["final_loss"] - rows["shaped"]["final_loss"]) < 1e-5
    # The workflow: each scenario's folder holds its export whole (copied from the leader over
    # HTTP), and glue on it, with the leader gone, gives the model the pipeline evaluated.
    export = out / "shaped" / "model_export"
    run_manifest = json.loads((export / "run_manifest.json").read_text())
    assert run_manifest["complete"] is True and len(run_manifest["shards"]) == 2
    assert [p.parent.name.split("-fellow-")[0] for p in
            sorted(export.glob("shards/*/shard_manifest.json"))] == ["stage-0", "stage-1"]
    glued = subprocess.run([sys.executable, str(REPO / "exp/scripts/glue_model_export.py"),
                            "--export-dir", str(export)], capture_output=True, text=True,
                           env=cli_env, timeout=120)
    assert glued.returncode == 0, glued.stderr
    assert (export / "full_model" / "inference_manifest.json").exists()
    final = json.loads((out / "shaped" / "job_final.json").read_text())
    ev = cli_json("eval", "--model", str(export / "full_model"), env=cli_env)
    assert abs(ev["eval_loss"] - final["metrics"]["eval_loss"]) <= 1e-5


def test_the_suite_summary_reads_runs_through_the_reports_checks(tmp_path):
    """A scenario whose run files are damaged is a DAMAGED row naming the file and field, not
    a traceback that loses the whole summary; the other rows are still summed up."""
    from swarm_core.experiments.suites import summarize

    path, _sc = _suite(tmp_path)
    suite = load_suite(path)
    good, bad = tmp_path / "runs" / "base", tmp_path / "runs" / "shaped"
    for d in (good, bad):
        d.mkdir(parents=True)
        (d / "metrics_summary.json").write_text(json.dumps(
            {"status": "COMPLETED", "final_loss": 2.5, "tokens_per_s": 100.0}))
        (d / "train_progress.ndjson").write_text("".join(
            json.dumps({"step": i, "loss": 3.0 - i / 10, "step_seconds": s}) + "\n"
            for i, s in enumerate([9.0, 0.5, 0.25, 0.75], start=1)))
    (bad / "train_progress.ndjson").write_text('{"step": 1, "step_seconds": "fast"}\n')
    summary = summarize(suite, tmp_path / "runs", {"base": good, "shaped": bad})
    rows = {r["scenario"]: r for r in summary["scenarios"]}
    assert rows["base"]["status"] == "COMPLETED" and "damage" not in rows["base"]
    assert rows["base"]["step_time_s"] == 0.5  # the median, the warm-up step left out
    assert rows["base"]["final_loss"] == 2.5
    assert rows["shaped"]["status"] == "DAMAGED"
    assert rows["shaped"]["damage"] == (f"{bad}/train_progress.ndjson line 1: step_seconds "
                                        'is "fast", not a number from 0 to 2**63-1')
    assert rows["shaped"]["tokens_per_s"] is None and rows["shaped"]["step_time_s"] is None
