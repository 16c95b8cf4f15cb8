"""Experiment configs: the shipped ones load, grids expand, and bad configs say exactly why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from swarm_core.config.profiles import ConfigError, load_experiment
from swarm_tui.cli import run
from tests.support import REPO, write_config

CONFIGS = REPO / "exp" / "configs"


def test_shipped_configs_load():
    smoke = load_experiment(CONFIGS / "exp_distributed_smoke_v1.json")
    assert len(smoke.runs) == 1 and smoke.runs[0].fellows == 2
    assert smoke.runs[0].training["max_final_loss"] == 4.5
    assert smoke.runs_dir == (REPO / "exp" / "runs").resolve()
    full = load_experiment(CONFIGS / "exp_full_sweep_cluster_network_v1.json")
    assert len(full.runs) == 9
    assert {(r.compression, r.network["name"]) for r in full.runs} == {
        (c, n) for c in ("none", "fixed_int8", "learned_dim32_int8")
        for n in ("unconstrained", "80mbit", "10mbit_20ms")}
    slow = next(r for r in full.runs if r.network["name"] == "10mbit_20ms")
    assert slow.training["link"] == {"tx_mbps": 10.0, "rx_mbps": 10.0, "latency_ms": 20.0}
    fast = next(r for r in full.runs if r.network["name"] == "unconstrained")
    assert fast.training["link"] is None


@pytest.fixture
def layout(tmp_path):
    write_config(tmp_path, "model/m.json", {"name": "m", "d_model": 32, "n_layers": 2, "n_heads": 2,
                                      "seq_len": 16})
    write_config(tmp_path, "training/t.json", {"steps": 3, "batch_size": 4, "micro_batches": 2,
                                         "cluster_profile": {"fellows": 2}})

    def exp(**over: Any) -> Path:
        body = {"name": "e", "training_config": "training/t.json",
                "model_configs": ["model/m.json"], **over}
        return write_config(tmp_path, "e.json", body)

    return tmp_path, exp


def test_grid_expansion_order_and_overrides(layout):
    tmp, exp = layout
    write_config(tmp, "model/m2.json", {"name": "m2", "d_model": 32, "n_layers": 2, "n_heads": 2,
                                  "seq_len": 16, "compression": "fixed_int8"})
    r = load_experiment(exp(model_configs=["model/m.json", "model/m2.json"], sweep={
        "seeds": [1, 2], "repeats": 2, "steps": 5, "overrides": {"lr": 0.01},
        "network_profiles": [{"name": "a"}, {"name": "b", "tx_mbps": 5}]}))
    assert len(r.runs) == 2 * 2 * 2 * 2
    assert [x.run_name for x in r.runs[:3]] == ["m-none-a-s1-r0", "m-none-a-s1-r1",
                                                 "m-none-a-s2-r0"]
    assert r.runs[8].model["name"] == "m2" and r.runs[8].compression == "fixed_int8"
    assert all(x.training["steps"] == 5 and x.training["lr"] == 0.01 for x in r.runs)
    assert [x.seed for x in r.runs[:4]] == [1, 1, 2, 2]
    # (the fields this test is about; later ones, a trace or a matrix, are null here)
    assert {k: r.runs[4].network[k] for k in ("name", "tx_mbps", "rx_mbps", "latency_ms",
                                               "tc_profile", "trace")} == \
        {"name": "b", "tx_mbps": 5.0, "rx_mbps": None, "latency_ms": 0.0, "tc_profile": None,
         "trace": None}
    # compressions override every model's spec
    r = load_experiment(exp(sweep={"compressions": ["none", "learned_dim8_int8"]}))
    assert [x.model["compression"] for x in r.runs] == ["none", "learned_dim8_int8"]
    # Two profiles of one name make runs of different names when their specs differ.
    write_config(tmp, "model/m3.json", {"name": "m", "d_model": 32, "n_layers": 2, "n_heads": 2,
                                  "seq_len": 16, "compression": "fixed_int8"})
    r = load_experiment(exp(model_configs=["model/m.json", "model/m3.json"]))
    assert [x.run_name for x in r.runs] == ["m-none-unconstrained-s0-r0",
                                            "m-fixed_int8-unconstrained-s0-r0"]


def test_swept_specs_take_their_own_width_and_block(layout):
    """A profile's bottleneck_dim is the width of its learned_bottleneck: a swept spec that
    names its own width (or has none) runs without it, and int8 blocks sweep like any spec."""
    tmp, exp = layout
    write_config(tmp, "model/lb.json", {"name": "lb", "d_model": 32, "n_layers": 2, "n_heads": 2,
                                  "seq_len": 16, "compression": "learned_bottleneck",
                                  "bottleneck_dim": 16})
    specs = ["learned_bottleneck", "learned_dim8_int8_b4", "fixed_int8", "fixed_int8_b8"]
    r = load_experiment(exp(model_configs=["model/lb.json"], sweep={"compressions": specs}))
    assert [(x.model["compression"], x.model["bottleneck_dim"]) for x in r.runs] == [
        ("learned_bottleneck", 16), ("learned_dim8_int8_b4", None), ("fixed_int8", None),
        ("fixed_int8_b8", None)]
    with pytest.raises(ConfigError, match=r"\$\.sweep\.compressions\[1\].*int8 block 5"):
        load_experiment(exp(model_configs=["model/lb.json"],
                            sweep={"compressions": ["none", "fixed_int8_b5"]}))


BAD = [
    # (what to break, expected message fragment, field)
    ("unknown_top_key", "unknown field(s): trainig_config", "$"),
    ("missing_training", "required field missing", "$.training_config"),
    ("training_file_missing", "file not found", "$.training_config"),
    ("model_file_missing", "file not found", "$.model_configs[0]"),
    ("empty_models", "must list at least one model profile", "$.model_configs"),
    ("typo_in_training", "unknown field(s): setps", "$"),
    ("bad_compression", "unknown compression 'int4'", "$.sweep.compressions[0]"),
    ("bad_seed_type", "expected an integer, got a string", "$.sweep.seeds[1]"),
    ("zero_repeats", "must be 1-100, got 0", "$.sweep.repeats"),
    ("bad_network_rate", "must be 0.001-1e+06 Mbit/s (or null for unlimited), got -5",
     "$.sweep.network_profiles[0].tx_mbps"),
    ("tc_without_target", "give exactly one of netns or dev", "$.sweep.network_profiles[0]"
                                                              ".tc_profile.dev"),
    ("bad_cluster", "must be 1-1024, got 0", "$.cluster_profile.fellows"),
    ("not_json", "not valid JSON", None),
    ("bad_override", "must be > 0, got -1", "$.sweep(overrides).lr"),
    ("heads", "d_model 32 is not divisible by n_heads 3", "$.n_heads"),
    ("bad_name", "it names run directories", "$.name"),
    # What the leader would refuse, refused by validate first (one rule for both).
    ("weights_vs_fellows", "3 weights for 2 stages", "$.stage_weights"),
    ("fellows_vs_layers", "5 stages for 2 layers", "$.cluster_profile.fellows"),
    ("small_vocab", "vocab_size 100 is smaller than the byte tokenizer's 256", "$.vocab_size"),
    ("weights_override", "1 weights for 2 stages", "$.sweep(overrides).stage_weights"),
    ("dim_vs_spec", "bottleneck_dim 16 contradicts 'learned_dim32'", "$.bottleneck_dim"),
    # Runs are named by model, spec, network, seed and repeat: none may repeat.
    ("same_seed_twice", "seeds must be unique, got [1, 1]", "$.sweep.seeds"),
    ("same_spec_twice", "specs must be unique", "$.sweep.compressions"),
    ("no_networks", "must list at least one profile", "$.sweep.network_profiles"),
    ("same_model_twice", "model profiles 0 and 1 both make a run named "
                         "'m-none-unconstrained-s0-r0'", "$.model_configs[1]"),
    ("grid_too_big", "the sweep has 20,000 runs, more than 10,000", "$.sweep"),
    ("min_lr_above_lr", "min_lr 0.0003 is above lr 0.0001", "$.min_lr"),
    ("training_is_a_dir", "cannot read {tmp}/training/d.json: Is a directory",
     "$.training_config"),
    ("training_link_loop", "not a usable path", "$.training_config"),
    ("nul_in_runs_dir", "not a usable path (embedded null byte)", "$.artifacts.runs_dir"),
    ("min_lr_override", "min_lr 0.01 is above lr 0.003", "$.sweep(overrides).min_lr"),
]


@pytest.mark.parametrize("case, message, field", BAD, ids=[b[0] for b in BAD])
def test_bad_configs_say_exactly_why(layout, case, message, field):
    tmp, exp = layout
    target = "e.json"
    if case == "unknown_top_key":
        path = write_config(tmp, "e.json", {"name": "e", "trainig_config": "training/t.json",
                                      "training_config": "training/t.json",
                                      "model_configs": ["model/m.json"]})
    elif case == "missing_training":
        path = write_config(tmp, "e.json", {"name": "e", "model_configs": ["model/m.json"]})
    elif case == "training_file_missing":
        path = exp(training_config="training/nope.json")
    elif case == "model_file_missing":
        path = exp(model_configs=["model/nope.json"])
    elif case == "empty_models":
        path = exp(model_configs=[])
    elif case == "typo_in_training":
        write_config(tmp, "training/t.json", {"setps": 3})
        path, target = exp(), "training/t.json"
    elif case == "bad_compression":
        path = exp(sweep={"compressions": ["int4"]})
    elif case == "bad_seed_type":
        path = exp(sweep={"seeds": [1, "2"]})
    elif case == "zero_repeats":
        path = exp(sweep={"repeats": 0})
    elif case == "bad_network_rate":
        path = exp(sweep={"network_profiles": [{"name": "x", "tx_mbps": -5}]})
    elif case == "tc_without_target":
        path = exp(sweep={"network_profiles": [{"name": "x", "tc_profile": {"rate_mbit": 5}}]})
    elif case == "bad_cluster":
        write_config(tmp, "training/t.json", {"cluster_profile": {"fellows": 0}})
        path, target = exp(), "training/t.json"
    elif case == "not_json":
        path = write_config(tmp, "e.json", "{not json")
    elif case == "bad_override":
        path = exp(sweep={"overrides": {"lr": -1}})
    elif case == "heads":
        write_config(tmp, "model/m.json", {"d_model": 32, "n_heads": 3})
        path, target = exp(), "model/m.json"
    elif case == "bad_name":
        path = exp(name="../escape")
    elif case == "weights_vs_fellows":
        write_config(tmp, "training/t.json", {"stage_weights": [1, 1, 1],
                                        "cluster_profile": {"fellows": 2}})
        path, target = exp(), "training/t.json"
    elif case == "fellows_vs_layers":
        write_config(tmp, "training/t.json", {"cluster_profile": {"fellows": 5}})
        path, target = exp(), "training/t.json"
    elif case == "small_vocab":
        write_config(tmp, "model/m.json", {"d_model": 32, "n_layers": 2, "n_heads": 2,
                                     "vocab_size": 100})
        path, target = exp(), "model/m.json"
    elif case == "weights_override":
        path = exp(sweep={"overrides": {"stage_weights": [1]}})
    elif case == "dim_vs_spec":
        write_config(tmp, "model/m.json", {"d_model": 64, "n_layers": 2, "n_heads": 2,
                                     "compression": "learned_dim32", "bottleneck_dim": 16})
        path, target = exp(), "model/m.json"
    elif case == "same_seed_twice":
        path = exp(sweep={"seeds": [1, 1]})
    elif case == "same_spec_twice":
        path = exp(sweep={"compressions": ["none", "fixed_int8", "none"]})
    elif case == "no_networks":
        path = exp(sweep={"network_profiles": []})
    elif case == "same_model_twice":
        path = exp(model_configs=["model/m.json", "model/m.json"])
    elif case == "min_lr_above_lr":
        write_config(tmp, "training/t.json", {"lr": 1e-4, "cluster_profile": {"fellows": 2}})
        path, target = exp(), "training/t.json"
    elif case == "training_is_a_dir":
        (tmp / "training" / "d.json").mkdir()
        path = exp(training_config="training/d.json")
    elif case == "training_link_loop":
        (tmp / "training" / "loop.json").symlink_to(tmp / "training" / "loop.json")
        path = exp(training_config="training/loop.json")
    elif case == "nul_in_runs_dir":
        write_config(tmp, "training/t.json", {"cluster_profile": {"fellows": 2},
                                        "artifacts": {"runs_dir": "ru\u0000ns"}})
        path, target = exp(), "training/t.json"
    elif case == "min_lr_override":
        path = exp(sweep={"overrides": {"min_lr": 0.01}})
    elif case == "grid_too_big":
        path = exp(sweep={"seeds": list(range(200)), "repeats": 100})
    with pytest.raises(ConfigError) as exc:
        load_experiment(path)
    err = exc.value
    assert message.format(tmp=tmp) in err.message
    assert err.field == field
    assert Path(err.path).resolve() == (tmp / target).resolve()
    # The one-line form names file, field and problem.
    assert str(err).startswith(str(err.path))


def test_dataset_paths_are_relative_to_the_file_that_names_them(layout, tmp_path):
    tmp, exp = layout
    write_config(tmp, "training/t.json", {"dataset": "textfiles", "dataset_paths": [
        "../corpus/*.txt", "/abs/b.txt", "~/c.txt"], "cluster_profile": {"fellows": 2}})
    (run,) = load_experiment(exp()).runs
    assert run.training["dataset_paths"] == [str(tmp / "corpus" / "*.txt"), "/abs/b.txt",
                                             "~/c.txt"]
    # A sweep override's paths are the experiment file's.
    (run,) = load_experiment(exp(sweep={"overrides": {"dataset_paths": ["data/x.txt"]}})).runs
    assert run.training["dataset_paths"] == [str(tmp / "data" / "x.txt")]


def test_validate_command(layout, capsys):
    _tmp, exp = layout
    good = exp(sweep={"seeds": [0, 1]})
    assert run(["validate", str(good), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["run_name"] for r in out["runs"]] == ["m-none-unconstrained-s0-r0",
                                                     "m-none-unconstrained-s1-r0"]
    bad = exp(sweep={"repeats": 0})
    assert run(["validate", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "$.sweep.repeats: must be 1-100, got 0" in err[0]
    assert run(["sweep", "--config", str(bad), "--leader-url", "http://127.0.0.1:9"]) == 2


def test_validate_warns_of_dataset_paths_that_match_nothing_here(layout, capsys):
    """Valid (fellows elsewhere may hold the files), but said: here the runs would fail."""
    tmp, exp = layout
    (tmp / "corpus").mkdir()
    (tmp / "corpus" / "a.txt").write_text("some text")
    write_config(tmp, "training/t.json", {"dataset": "textfiles", "cluster_profile": {"fellows": 2},
                                    "dataset_paths": ["../corpus/*.txt", "../nope/*.txt"]})
    assert run(["validate", str(exp(sweep={"seeds": [0, 1]}))]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: dataset_paths {str(tmp / 'nope' / '*.txt')!r} matches no file on "
                   "this machine (fellows elsewhere read their own copies)"]


def test_config_docs_cover_every_field():
    import attrs

    from swarm_core.config import profiles, schemas
    from swarm_core.experiments import suites

    text = (REPO / "docs" / "configs.md").read_text()
    for cls in (schemas.ModelConfig, schemas.TrainingConfig, profiles.ExperimentConfig,
                profiles.SweepSpec, profiles.NetworkProfile, profiles.TcProfile,
                profiles.ClusterProfile, profiles.ArtifactsProfile, schemas.SyncConfig,
                suites.SuiteSpec, suites.ScenarioSpec, suites.GridShape,
                suites.ScenarioArtifacts):
        for f in attrs.fields(cls):
            assert f"`{f.name}`" in text, f"docs/configs.md misses {cls.__name__}.{f.name}"


def test_config_docs_are_current():
    from swarm_core.config.docs import render

    assert (REPO / "docs" / "configs.md").read_text() == render(), \
        "docs/configs.md is stale: run 'python -m swarm_core.config.docs'"


def _cluster(layout: Any, cluster: dict[str, Any]) -> Any:
    tmp, exp = layout
    write_config(tmp, "training/t.json", {"steps": 3, "batch_size": 8, "micro_batches": 2,
                                    "cluster_profile": cluster})
    return load_experiment(exp(sweep={"replicas": [1, 2]}))


def test_cluster_profile_takes_the_grid_as_topology_and_suites_say_it(layout):
    """``{stages, replicas}`` (a job's topology, a suite's grid) is the ``{fellows, replicas}``
    it multiplies out to: the same runs, named alike, asking for the same jobs."""
    def shape(r: Any) -> list[Any]:
        return [(x.run_name, x.stages, x.replicas, x.fellows, x.job("x").topology)
                for x in r.runs]

    grid = shape(_cluster(layout, {"stages": 2, "replicas": 2}))
    assert grid == shape(_cluster(layout, {"fellows": 4, "replicas": 2}))
    assert grid == shape(_cluster(layout, {"fellows": 4, "stages": 2, "replicas": 2}))
    assert [g[1:4] for g in grid] == [(2, 1, 2), (2, 2, 4)]
    # (stages alone: one replica of each)
    assert shape(_cluster(layout, {"stages": 2})) == shape(_cluster(layout, {"fellows": 2}))
    # The forms of before keep their meaning, the default included.
    assert [x.fellows for x in _cluster(layout, {"fellows": 2}).runs] == [2, 4]
    assert [x.fellows for x in _cluster(layout, {"fellows": 4, "replicas": 2}).runs] == [2, 4]
    assert [x.fellows for x in _cluster(layout, {}).runs] == [2, 4]


def test_a_job_from_a_profile_of_stages_keeps_them(tmp_path):
    """``swarm submit --training`` and the console launcher: the profile's grid reaches the
    job, and --replicas alone keeps the stages a profile names (its fellows, where it names
    those, as before)."""
    from swarm_core.config.profiles import job_topology, load_job_cluster, load_job_training
    from swarm_core.contract import Topology
    from swarm_core.schema import structure

    def topology(cluster: dict[str, Any], **flags: Any) -> tuple[int, int, int]:
        path = write_config(tmp_path, "t.json", {"steps": 3, "cluster_profile": cluster})
        assert load_job_training(path)[1] == load_job_cluster(path).num_fellows
        topo = structure(job_topology(load_job_cluster(path), **flags), Topology)
        return topo.num_stages, topo.replicas, topo.num_fellows

    assert topology({"stages": 2, "replicas": 2}) == topology({"fellows": 4, "replicas": 2}) \
        == (2, 2, 4)
    assert topology({"stages": 2, "replicas": 2}, replicas=3) == (2, 3, 6)
    assert topology({"fellows": 4, "replicas": 2}, replicas=4) == (1, 4, 4)
    assert topology({"stages": 2, "replicas": 2}, fellows=6) == (3, 2, 6)
    assert topology({"stages": 2, "replicas": 2}, stages=3) == (3, 2, 6)
    assert topology({"fellows": 4}, stages=2, replicas=2) == (2, 2, 4)


@pytest.mark.parametrize("cluster, message, field", [
    ({"fellows": 3, "stages": 2, "replicas": 2},
     "fellows 3 contradicts stages 2 x replicas 2 (4 fellows): give fellows or stages, not both",
     "$.cluster_profile.stages"),
    ({"fellows": 2, "stages": 1}, "fellows 2 contradicts stages 1 x replicas 1 (1 fellows)",
     "$.cluster_profile.stages"),
    ({"stages": 0}, "must be 1-1024, got 0", "$.cluster_profile.stages"),
    ({"stages": 2, "replicas": 512}, "must be 1-256, got 512", "$.cluster_profile.replicas"),
    ({"stages": 600, "replicas": 2}, "stages 600 x replicas 2 is 1200 fellows, more than 1024",
     "$.cluster_profile.replicas"),
    ({"stages": "2"}, "expected an integer, got a string", "$.cluster_profile.stages"),
    # What the leader would refuse is named at the field the profile gave.
    ({"stages": 5}, "5 stages for 2 layers", "$.cluster_profile.stages"),
])
def test_a_bad_cluster_grid_is_one_line_naming_its_fields(layout, cluster, message, field):
    tmp, exp = layout
    write_config(tmp, "training/t.json", {"cluster_profile": cluster})
    with pytest.raises(ConfigError) as exc:
        load_experiment(exp())
    err = exc.value
    assert message in err.message and err.field == field
    assert "\n" not in str(err) and str(err).startswith(str(tmp / "training" / "t.json"))
