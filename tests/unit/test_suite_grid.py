"""A suite's scenario names its grid shape (stages x replicas over the infra's cells) and may set
its sync over the training profile's: both reach the job and the plan, and a shape the infra or
the batch cannot hold, or a sync value training.sync would refuse, is one line naming the
scenario's field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from swarm_core.config.profiles import ConfigError
from swarm_core.config.schemas import SyncConfig
from swarm_core.experiments.suites import as_experiment, load_suite, plan, summarize
from swarm_core.schema import SchemaError, structure, unstructure


def _suite(tmp: Path, grid: dict[str, Any] | None, infra: str = "four",
           training: dict[str, Any] | None = None, sync: Any = None) -> Path:
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
                **({"grid": grid} if grid is not None else {}),
                **({"sync": sync} if sync is not None else {})}
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


def test_a_routed_grid_reaches_the_job(tmp_path):
    suite = load_suite(_suite(tmp_path, {"stages": 2, "replicas": 2, "wiring": "swarm",
                                         "routing": "measured", "rebalance_every": 2},
                              sync={"mode": "dp"}))
    run = as_experiment(suite, tmp_path / "out").runs[1]
    topo = run.job("x").topology
    assert (topo.wiring, topo.routing, topo.rebalance_every) == ("swarm", "measured", 2)
    assert run.wiring_label == "swarm measured rebalance /2"
    assert as_experiment(suite, tmp_path / "out").runs[0].wiring == {}  # (no grid: a chain)


def test_a_layout_grid_and_its_moves_reach_the_job_and_the_plan(tmp_path):
    """Stages of unequal cells over the infra's four: stage 0 one cell, stage 1 three, two
    data shares, a peer moved back at step 2; the job's topology is the layout's."""
    grid = {"replicas": 2, "wiring": "swarm", "layout": [[0], [0, 1, 2]],
            "moves": [{"at": 2, "source": 1, "cell": 2, "target": 0}]}
    suite = load_suite(_suite(tmp_path, grid, sync={"mode": "dp"}))
    sc = suite.scenarios[1]
    assert (sc.stages, sc.replicas, sc.fellows) == (2, 2, 4)
    assert any("grid cells 1+3: a swarm layout's cells over 2 data shares" in e
               for e in sc.emulated)
    run = as_experiment(suite, tmp_path / "out").runs[1]
    topo = run.job("x").topology
    assert (topo.num_stages, topo.layout, topo.fellows) == (2, [[0], [0, 1, 2]], 4)
    assert [(m.at, m.source, m.cell, m.target) for m in topo.moves or ()] == [(2, 1, 2, 0)]
    assert run.stages == 2 and run.wiring_label == "swarm cells 1+3 1 move(s)"
    row = plan(suite, None)["scenarios"][1]
    assert row["layout"] == [[0], [0, 1, 2]]
    from swarm_tui.commands.suites import _grid

    assert (_grid(row), _grid(plan(suite, None)["scenarios"][0])) == ("cells 1+3", "1x1")


@pytest.mark.parametrize("grid, message", [
    ({"replicas": 2, "wiring": "swarm", "layout": [[0], [0, 1]]},
     "grid cells 1+2 is 3 cells; infra 'four' has 4"),
    ({"stages": 3, "replicas": 2, "wiring": "swarm", "layout": [[0, 1], [0, 1]]},
     "a layout of 2 stages in a grid of 3"),
    ({"replicas": 2, "layout": [[0], [0, 1, 2]]}, "stages of unequal cells need wiring swarm"),
    ({"replicas": 2}, "give stages (or a swarm layout's cells by stage)"),
])
def test_a_layout_grid_that_cannot_run_is_one_line_at_the_scenario(tmp_path, grid, message):
    path = _suite(tmp_path, grid, sync={"mode": "dp"})
    with pytest.raises(ConfigError) as info:
        load_suite(path)
    assert (info.value.field or "").startswith("$.scenarios[1].grid")
    assert message in info.value.message and "\n" not in str(info.value)


@pytest.mark.parametrize("grid, message", [
    # The profile's sync is diloco: routed micro-batches would mix its replicas.
    ({"stages": 2, "replicas": 2, "wiring": "swarm"}, "(sync mode dp), not diloco"),
    ({"stages": 2, "replicas": 2, "routing": "measured"}, "measured routing is for wiring swarm"),
    ({"stages": 2, "replicas": 2, "wiring": "swarm", "route_weights": [[1, 1]]},
     "must be 2 lists (stages) of 2 weights"),
])
def test_a_routed_grid_that_cannot_run_is_one_line_at_the_scenario(tmp_path, grid, message):
    path = _suite(tmp_path, grid)
    with pytest.raises(ConfigError) as info:
        load_suite(path)
    assert (info.value.field or "").startswith("$.scenarios[1].grid")
    assert message in info.value.message and "\n" not in str(info.value)


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


PROFILE_SYNC = {"mode": "diloco", "inner_steps": 2}  # _suite's training profile's


@pytest.mark.parametrize("sync", [
    {"mode": "dp"},
    {"inner_steps": 7},
    {"mode": "diloco", "outer_lr": 0.5, "outer_momentum": 0.5, "compression": "int8_b16",
     "bucket_mb": 4.0},
])
def test_a_scenario_sync_is_merged_over_the_profile_and_reaches_the_job(tmp_path, sync):
    suite = load_suite(_suite(tmp_path, {"stages": 2, "replicas": 2}, sync=sync))
    base, sc = suite.scenarios
    # The fields it names win; the rest are the training profile's, then SyncConfig's defaults.
    want = structure({**PROFILE_SYNC, **sync}, SyncConfig)
    assert sc.training.sync == want
    assert base.training.sync == structure(PROFILE_SYNC, SyncConfig)  # (its own profile's)
    assert sc.sync_mode == want.mode
    assert any(f"kept in step by {want.mode} (sync compression {want.compression})" in e
               for e in sc.emulated)
    run = as_experiment(suite, tmp_path / "out").runs[1]
    assert run.job("x").training.sync == want
    assert run.sync_mode == want.mode
    assert plan(suite, None)["scenarios"][1]["training"]["sync"] == unstructure(want)
    assert plan(suite, None)["scenarios"][1]["sync_mode"] == want.mode
    row = summarize(suite, tmp_path / "out", {})["scenarios"][1]
    assert (row["scenario"], row["sync_mode"]) == ("swarm", want.mode)


def _sync_refusal(value: dict[str, Any]) -> SchemaError:
    """What training.sync's own converter says of ``value`` over the profile's sync."""
    with pytest.raises(SchemaError) as info:
        structure({**PROFILE_SYNC, **value}, SyncConfig, "$.scenarios[1].sync")
    return info.value


@pytest.mark.parametrize("value", [
    {"inner_steps": 0}, {"outer_lr": -1.0}, {"outer_momentum": 1.5}, {"bucket_mb": 0},
    {"mode": "ring"}, {"compression": "int4"}, {"compression": "int8_b1"},
    {"inner_steps": "5"}, {"inner": 3},
])
def test_a_bad_scenario_sync_is_one_line_at_its_field(tmp_path, value):
    path = _suite(tmp_path, {"stages": 2, "replicas": 2}, sync=value)
    with pytest.raises(ConfigError) as info:
        load_suite(path)
    want = _sync_refusal(value)
    assert info.value.path == str(path)
    assert (info.value.field, info.value.message) == (want.field, want.message)
    assert (info.value.field or "").startswith("$.scenarios[1].sync")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("sync, grid, message", [
    ("dp", {"stages": 2, "replicas": 2}, "expected an object"),
    ({"mode": "dp"}, {"stages": 4, "replicas": 1}, "this scenario runs 1 replica"),
    ({"mode": "dp"}, None, "this scenario runs 1 replica"),
])
def test_a_scenario_sync_that_cannot_apply_is_refused(tmp_path, sync, grid, message):
    path = _suite(tmp_path, grid, sync=sync, training={
        "steps": 4, "batch_size": 8, "micro_batches": 2})
    with pytest.raises(ConfigError) as info:
        load_suite(path)
    assert info.value.field == "$.scenarios[1].sync"
    assert message in info.value.message and "\n" not in str(info.value)
