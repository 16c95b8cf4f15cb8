"""A suite's scenario names its grid shape (stages x replicas over the infra's cells): it
reaches the job's topology and the plan, and a shape the infra or the batch cannot hold is one
line naming the scenario's grid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from swarm_core.config.profiles import ConfigError
from swarm_core.experiments.suites import as_experiment, load_suite, plan


def _suite(tmp: Path, grid: dict[str, Any] | None, infra: str = "four",
           training: dict[str, Any] | None = None) -> Path:
    for d in ("model", "training", "infra"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    (tmp / "model" / "m.json").write_text(json.dumps(
        {"name": "m", "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}))
    (tmp / "training" / "t.json").write_text(json.dumps(training or {
        "steps": 4, "batch_size": 8, "micro_batches": 2, "sync": {"mode": "diloco",
                                                                  "inner_steps": 2}}))
    (tmp / "infra" / "four.json").write_text(json.dumps(
        {"name": "four", "nodes": [{"name": "a", "fellows": 2}, {"name": "b", "fellows": 2}],
         "inter_node_link": {"tx_mbps": 50, "rx_mbps": 50}}))
    (tmp / "infra" / "one.json").write_text(json.dumps({"name": "one", "nodes": [{"name": "a"}]}))
    scenario = {"name": "swarm", "model": "model/m.json", "training": "training/t.json",
                "infra": f"infra/{infra}.json", "artifacts": {"dir": "swarm"},
                **({"grid": grid} if grid is not None else {})}
    base = {"name": "base", "model": "model/m.json", "training": "training/t.json",
            "infra": "infra/one.json", "artifacts": {"dir": "base"}}
    path = tmp / "suite.json"
    path.write_text(json.dumps({"name": "s", "scenarios": [base, scenario]}))
    return path


def test_a_scenario_grid_reaches_the_job_and_the_plan(tmp_path):
    suite = load_suite(_suite(tmp_path, {"stages": 2, "replicas": 2}))
    base, sc = suite.scenarios
    assert (base.stages, base.replicas, base.sync_mode) == (1, 1, "none")
    assert (sc.stages, sc.replicas, sc.fellows, sc.sync_mode) == (2, 2, 4, "diloco")
    assert any("grid 2x2" in e and "diloco" in e for e in sc.emulated)
    run = as_experiment(suite, tmp_path / "out").runs[1]
    topo = run.job("x").topology
    assert (topo.stages, topo.replicas, topo.fellows) == (2, 2, 4)
    assert run.sync_mode == "diloco"
    row = plan(suite, None)["scenarios"][1]
    assert (row["stages"], row["replicas"], row["sync_mode"]) == (2, 2, "diloco")


def test_without_a_grid_every_cell_is_a_stage(tmp_path):
    sc = load_suite(_suite(tmp_path, None, training={
        "steps": 4, "batch_size": 8, "micro_batches": 2})).scenarios[1]
    assert (sc.stages, sc.replicas) == (4, 1)


@pytest.mark.parametrize("grid, training, message", [
    ({"stages": 2, "replicas": 1}, None, "grid 2x1 is 2 cells; infra 'four' has 4"),
    ({"stages": 1, "replicas": 4}, {"steps": 4, "batch_size": 4, "micro_batches": 2},
     "batch_size 4 is not divisible by 4 replicas x 2 micro_batches"),
    ({"stages": 4, "replicas": 0}, None, "must be 1-256, got 0"),
    ({"stages": 0}, None, "must be 1-1024, got 0"),
    ({"stages": 2, "replica": 2}, None, "unknown field(s): replica"),
])
def test_a_grid_that_cannot_run_is_one_line_at_the_scenario(tmp_path, grid, training, message):
    path = _suite(tmp_path, grid, training=training)
    with pytest.raises(ConfigError) as info:
        load_suite(path)
    assert info.value.path == str(path)
    assert (info.value.field or "").startswith("$.scenarios[1].grid")
    assert message in info.value.message and "\n" not in str(info.value)
