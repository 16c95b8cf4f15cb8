"""Sweep axes of the job's shape: replicas, sync modes and DiLoCo's inner steps expand into
runs named by them, reach the job's topology and training.sync, and bad values say why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from swarm_core.config.grid import grid_cells
from swarm_core.config.profiles import ConfigError, load_experiment
from swarm_core.schema import FieldError, unstructure
from tests.support import write_config


@pytest.fixture
def exp(tmp_path):
    write_config(tmp_path, "model/m.json", {"name": "m", "d_model": 32, "n_layers": 2, "n_heads": 2,
                                      "seq_len": 16})
    write_config(tmp_path, "training/t.json", {"steps": 3, "batch_size": 8, "micro_batches": 2,
                                         "cluster_profile": {"fellows": 2}})

    def make(sweep: dict[str, Any], training: dict[str, Any] | None = None) -> Path:
        if training is not None:
            write_config(tmp_path, "training/t.json", training)
        return write_config(tmp_path, "e.json", {"name": "e", "training_config": "training/t.json",
                                           "model_configs": ["model/m.json"], "sweep": sweep})

    return make


def test_replicas_sync_and_inner_steps_expand_into_named_runs(exp):
    r = load_experiment(exp({"replicas": [1, 2], "sync": ["dp", "diloco"],
                             "inner_steps": [2, 5], "seeds": [0, 1]}))
    # One replica runs once (nothing to sync); dp once; diloco once per H. Seeds nest inside.
    assert [x.run_name for x in r.runs] == [
        "m-none-unconstrained-2x1-none-s0-r0", "m-none-unconstrained-2x1-none-s1-r0",
        "m-none-unconstrained-2x2-dp-s0-r0", "m-none-unconstrained-2x2-dp-s1-r0",
        "m-none-unconstrained-2x2-diloco_h2-s0-r0", "m-none-unconstrained-2x2-diloco_h2-s1-r0",
        "m-none-unconstrained-2x2-diloco_h5-s0-r0", "m-none-unconstrained-2x2-diloco_h5-s1-r0"]
    # The profile's 2 stages stay; replicas add fellows.
    assert [(x.stages, x.replicas, x.fellows, x.sync_mode) for x in r.runs[::2]] == [
        (2, 1, 2, "none"), (2, 2, 4, "dp"), (2, 2, 4, "diloco"), (2, 2, 4, "diloco")]
    job = r.runs[4].job("x")
    assert (job.topology.stages, job.topology.replicas, job.topology.fellows) == (2, 2, 4)
    assert (job.training.sync.mode, job.training.sync.inner_steps) == ("diloco", 2)
    assert r.runs[6].job("x").training.sync.inner_steps == 5
    assert r.runs[2].job("x").training.sync.mode == "dp"


def test_every_periodic_mode_runs_once_per_inner_steps(exp, capsys):
    """sparseloco is periodic as diloco is (the registry says): the inner_steps axis repeats
    its runs too, named ``<mode>_h<H>``, and its own fields reach them by overrides."""
    from swarm_tui.cli import run

    path = exp({"replicas": [2], "sync": ["dp", "diloco", "sparseloco"],
                "inner_steps": [10, 50], "overrides": {"sync": {"density": 0.05}}})
    r = load_experiment(path)
    assert [x.run_name for x in r.runs] == [
        "m-none-unconstrained-2x2-dp-s0-r0",
        "m-none-unconstrained-2x2-diloco_h10-s0-r0", "m-none-unconstrained-2x2-diloco_h50-s0-r0",
        "m-none-unconstrained-2x2-sparseloco_h10-s0-r0",
        "m-none-unconstrained-2x2-sparseloco_h50-s0-r0"]
    assert [x.sync_mode for x in r.runs] == ["dp", "diloco", "diloco", "sparseloco",
                                             "sparseloco"]
    sync = r.runs[4].job("x").training.sync
    assert (sync.mode, sync.inner_steps, sync.density, sync.outer_step) == \
        ("sparseloco", 50, 0.05, (1.0, 0.0))
    assert run(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sparseloco H=10 d=0.05 2-bit" in out and "sparseloco H=50 d=0.05 2-bit" in out


def test_a_sparseloco_profile_is_swept_by_inner_steps_alone():
    # (the profile's mode: periodic, so an inner_steps axis alone repeats it)
    cells = grid_cells(1, 2, "sparseloco", 500, None, None, [3, 7])
    assert [(c.sync, c.inner_steps, c.label) for c in cells] == [
        ("sparseloco", 3, "1x2-sparseloco_h3"), ("sparseloco", 7, "1x2-sparseloco_h7")]
    assert [c.label for c in grid_cells(1, 2, "dp", 500, [1, 2], ["none", "sparseloco"],
                                        None)] == ["1x1-none", "1x2-sparseloco_h500"]


def test_axes_left_out_keep_the_profile(exp):
    # No axis, one replica: the names of before (a sweep of chains keeps its run folders).
    r = load_experiment(exp({}))
    assert [x.run_name for x in r.runs] == ["m-none-unconstrained-s0-r0"]
    assert r.runs[0].sync_mode == "none" and r.runs[0].replicas == 1
    # A profile of replicas names its runs by the grid, and its sync mode holds.
    r = load_experiment(exp({"inner_steps": [3, 4]}, {
        "steps": 3, "batch_size": 8, "micro_batches": 2,
        "cluster_profile": {"fellows": 2, "replicas": 2},
        "sync": {"mode": "diloco", "compression": "int8", "outer_lr": 0.5}}))
    assert [x.run_name for x in r.runs] == ["m-none-unconstrained-1x2-diloco_h3-s0-r0",
                                            "m-none-unconstrained-1x2-diloco_h4-s0-r0"]
    sync = r.runs[1].job("x").training.sync
    assert (sync.mode, sync.inner_steps, sync.compression, sync.outer_lr) == \
        ("diloco", 4, "int8", 0.5)
    # A replicas axis alone: the profile's mode for several replicas.
    r = load_experiment(exp({"replicas": [2, 1]}, {"steps": 3, "batch_size": 8,
                                                   "micro_batches": 2,
                                                   "cluster_profile": {"fellows": 2}}))
    assert [x.run_name for x in r.runs] == ["m-none-unconstrained-2x2-dp-s0-r0",
                                            "m-none-unconstrained-2x1-none-s0-r0"]


def test_sync_overrides_merge_with_the_axes(exp):
    r = load_experiment(exp({"replicas": [2], "sync": ["diloco"],
                             "overrides": {"sync": {"compression": "fp16"}}}))
    sync = unstructure(r.runs[0].job("x").training.sync)
    # (outer_lr/outer_momentum null: diloco's own, 0.7 and 0.9; the other modes' fields kept)
    assert sync == {"mode": "diloco", "compression": "fp16", "inner_steps": 500,
                    "outer_lr": None, "outer_momentum": None, "bucket_mb": 25.0,
                    "overlap_steps": 0, "fragments": 1, "fragment_pattern": "strided",
                    "density": 0.02, "chunk": 4096, "value_bits": 2,
                    "error_decay": 0.95, "dct_chunk": 64, "topk": 8, "sign_values": True,
                    "momentum_decay": 0.999}
    assert r.runs[0].job("x").training.sync.outer_step == (0.7, 0.9)


def test_an_overlap_reaches_every_diloco_run_and_the_validate_table_shows_it(exp, capsys):
    from swarm_tui.cli import run

    path = exp({"replicas": [2], "sync": ["dp", "diloco"], "inner_steps": [4, 10],
                "overrides": {"sync": {"overlap_steps": 3}}})
    runs = load_experiment(path).runs
    assert [(r.sync_mode, r.job("x").training.sync.overlap_steps) for r in runs] == \
        [("dp", 3), ("diloco", 3), ("diloco", 3)]  # (dp has nothing to overlap)
    assert run(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "diloco H=4 overlap 3" in out and "diloco H=10 overlap 3" in out


BAD = [
    # (sweep, training profile or None, message fragment, field)
    ({"replicas": []}, None, "must list at least one value", "$.sweep.replicas"),
    ({"replicas": [0]}, None, "each must be 1-256, got [0]", "$.sweep.replicas"),
    ({"replicas": [2, 2]}, None, "values must be unique, got [2, 2]", "$.sweep.replicas"),
    ({"replicas": ["2"]}, None, "expected an integer, got a string", "$.sweep.replicas[0]"),
    ({"replicas": [2], "sync": ["ring"]}, None, "expected one of 'none', 'dp', 'diloco'",
     "$.sweep.sync[0]"),
    ({"replicas": [1, 2], "sync": ["dp", "dp"]}, None, "values must be unique",
     "$.sweep.sync"),
    ({"replicas": [2], "sync": ["diloco"], "inner_steps": [0]}, None,
     "each must be 1-1,000,000, got [0]", "$.sweep.inner_steps"),
    # Combinations that would run nothing of what an axis lists.
    ({"replicas": [2], "sync": ["none", "dp"]}, None,
     "'none' is the mode of a single replica", "$.sweep.sync"),
    ({"replicas": [1, 2], "sync": ["none"]}, None, "need a mode to synchronise by",
     "$.sweep.sync"),
    ({"sync": ["dp"]}, None, "dp keeps replicas in step, and every run has 1 replica",
     "$.sweep.sync"),
    ({"replicas": [2], "sync": ["dp"], "inner_steps": [10]}, None,
     "inner_steps applies to periodic runs only (diloco, sparseloco)", "$.sweep.inner_steps"),
    ({"inner_steps": [10]}, None, "inner_steps applies to periodic runs only",
     "$.sweep.inner_steps"),
    ({"replicas": [1, 512]}, None, "each must be 1-256", "$.sweep.replicas"),
    # The batch must split into replicas x micro_batches: the axis value at fault is named.
    ({"replicas": [1, 3]}, None, "batch_size 8 is not divisible by 3 replicas x 2",
     "$.sweep.replicas[1]"),
    ({"replicas": [2], "sync": ["diloco"], "overrides": {"sync": {"mode": "dp"}}}, None,
     "sync ['mode'] is swept", "$.sweep.overrides"),
    # SparseLoCo codes its values itself: a sync compression over it is refused.
    ({"replicas": [2], "sync": ["dp", "sparseloco"],
      "overrides": {"sync": {"compression": "int8"}}}, None,
     "must be none under sparseloco", "$.sweep(overrides).sync.compression"),
    ({"replicas": [2], "sync": ["sparseloco"], "overrides": {"sync": {"density": 0}}}, None,
     "must be > 0, got 0", "$.sweep(overrides).sync.density"),
    # An overlap must end before the next outer step of every H swept.
    ({"replicas": [2], "sync": ["diloco"], "inner_steps": [10, 2],
      "overrides": {"sync": {"overlap_steps": 3}}}, None,
     "must be below inner_steps (2)", "$.sweep(overrides).sync.overlap_steps"),
    # Variants: named rows, each its own overrides; grids: shapes side by side.
    ({"replicas": [2], "variants": [{"name": "a"}, {"name": "a"}]}, None,
     "must list variants of unique names, got ['a', 'a']", "$.sweep.variants"),
    ({"replicas": [2], "variants": [{"name": "a b"}]}, None,
     "must be 1-32 of letters", "$.sweep.variants[0].name"),
    ({"replicas": [2], "variants": [{"name": "a", "overrides": {"sync": {"mode": "dp"}}}]},
     None, "give the variant's own sync / inner_steps list", "$.sweep.variants[0].overrides"),
    ({"replicas": [2], "variants": [{"name": "a", "overrides": {"steps": 5}}]}, None,
     "set ['steps'] as sweep fields, not overrides", "$.sweep.variants[0].overrides"),
    ({"replicas": [2], "variants": [{"name": "a", "sync": ["ring"]}]}, None,
     "expected one of 'none', 'dp', 'diloco'", "$.sweep.variants[0].sync[0]"),
    ({"replicas": [2], "variants": [{"name": "a", "sync": ["dp"], "inner_steps": [5]}]}, None,
     "inner_steps applies to periodic runs only", "$.sweep.variants[0].inner_steps"),
    ({"replicas": [2], "variants": [{"name": "a", "sync": ["sparseloco"], "overrides": {
        "sync": {"compression": "int8"}}}]}, None, "must be none under sparseloco",
     "$.sweep.variants[0](overrides).sync.compression"),
    ({"replicas": [2], "variants": [{"name": "a", "sync": ["diloco"]}],
      "overrides": {"sync": {"mode": "dp"}}}, None, "sync ['mode'] is swept",
     "$.sweep.overrides"),
    ({"grids": ["1x2"], "stages": [1]}, None, "give grids, or the stages and replicas axes",
     "$.sweep.grids"),
    ({"grids": ["2by2"]}, None, "as STAGESxREPLICAS", "$.sweep.grids"),
    ({"grids": ["1x2", "1x2"]}, None, "must list unique shapes", "$.sweep.grids"),
    ({"grids": ["1x512"]}, None, "1x512: at most 256 replicas", "$.sweep.grids"),
    ({"grids": ["1x3"]}, None, "batch_size 8 is not divisible by 3 replicas x 2",
     "$.sweep.grids[0]"),
    ({"grids": ["1x4"], "variants": [{"name": "a", "overrides": {"batch_size": 20}}]}, None,
     "batch_size 20 is not divisible by 4 replicas x 2",
     "$.sweep.variants[0](overrides).batch_size"),
    # A field is blamed on whichever set it: the sweep's lr, though the variant sets another.
    ({"replicas": [2], "overrides": {"lr": -1},
      "variants": [{"name": "a", "overrides": {"optimizer": "muon"}}]}, None,
     "must be > 0", "$.sweep(overrides).lr"),
    ({"replicas": [2], "variants": [{"name": "a", "overrides": {"sync": "int8"}}]}, None,
     "sync must be an object of sync fields, got 'int8'", "$.sweep.variants[0].overrides"),
    ({"replicas": [2], "overrides": {"sync": None}}, None,
     "sync must be an object of sync fields, got None", "$.sweep.overrides"),
    # A sweep list no variant takes is a typo, as an unused axis is without variants.
    ({"replicas": [2], "inner_steps": [10, 50], "variants": [{"name": "a", "sync": ["dp"]}]},
     None, "no variant takes the sweep's inner_steps", "$.sweep.inner_steps"),
    ({"replicas": [2], "sync": ["dp"], "variants": [{"name": "a", "sync": ["diloco"]}]},
     None, "every variant gives its own sync", "$.sweep.sync"),
    # The sweep's axes a variant takes are blamed on the sweep.
    ({"replicas": [1], "sync": ["dp"], "variants": [{"name": "a"}]}, None,
     "dp keeps replicas in step", "$.sweep.sync"),
    ({"replicas": [2], "sync": ["diloco"], "wiring": ["swarm"]}, None,
     "swarm wiring routes between the replicas of runs kept by dp", "$.sweep.wiring"),
    ({"network_profiles": [{"name": "lan"}, {"name": "lan-fast"}],
      "variants": [{"name": "fast-x"}, {"name": "x"}]}, None,
     "two runs are named 'm-none-lan-fast-x-s0-r0'", "$.sweep"),
    # The warm-up is checked as the leader checks a job: its batch, not the variants'.
    ({"replicas": [4], "warm_up": {"steps": 2},
      "variants": [{"name": "a", "overrides": {"batch_size": 20}}]},
     {"steps": 3, "batch_size": 10, "micro_batches": 5, "cluster_profile": {"fellows": 2}},
     "the warm-up (run 0's job, 2 steps): batch_size 10 is not divisible by 4 replicas x 5",
     "$.sweep.warm_up"),
]


@pytest.mark.parametrize("sweep, training, message, field", BAD,
                         ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_axes_say_exactly_why(exp, sweep, training, message, field):
    path = exp(sweep, training)
    with pytest.raises(ConfigError) as info:
        load_experiment(path)
    err = info.value
    assert err.path == str(path) and err.field == field
    assert message in err.message
    assert "\n" not in str(err)  # one line


def test_a_grid_past_the_largest_cluster_is_refused():
    with pytest.raises(FieldError, match="8 stages x 256 replicas is more than 1024 fellows"):
        grid_cells(8, 1, "dp", 500, [1, 256], None, None)


def test_the_shipped_replica_examples_load():
    from swarm_core.experiments.suites import load_suite
    from tests.support import REPO

    r = load_experiment(REPO / "exp/configs/exp_sweep_replicas_sync_v1.json")
    assert [(x.stages, x.replicas, x.sync_mode) for x in r.runs] == [
        (1, 1, "none"), (1, 2, "dp"), (1, 2, "diloco"), (1, 2, "diloco")]
    assert [x.training["sync"]["inner_steps"] for x in r.runs[2:]] == [10, 20]
    suite = load_suite(REPO / "exp/configs/benchmarks/replicas_grid_v1.json")
    assert [(s.stages, s.replicas, s.sync_mode) for s in suite.scenarios] == [
        (2, 1, "none"), (1, 2, "dp"), (1, 2, "diloco")]


def test_preflight_names_the_run_whose_replicas_want_more_fellows(exp):
    """The sweep's axis, not the profile, asks for 4 fellows: the error names that run."""
    import asyncio
    from types import SimpleNamespace

    from swarm_core.experiments.runner import ExperimentError, preflight

    resolved = load_experiment(exp({"replicas": [1, 2]}))

    class Client:
        base_url = "http://leader"

        async def fellows(self) -> list[SimpleNamespace]:
            return [SimpleNamespace(fellow_id=i, name=f"f{i}",
                                    status=SimpleNamespace(live=True)) for i in range(2)]

    with pytest.raises(ExperimentError, match=r"run m-none-unconstrained-2x2-dp-s0-r0 \(2x2\) "
                       r"wants 4 fellow\(s\); the leader at http://leader has 2 active"):
        asyncio.run(preflight(Client(), resolved))  # type: ignore[arg-type]


def test_the_sync_frontier_experiments_ask_for_the_figures_rows():
    """Issue "Replica sync at the field's frontier", the figure in one config: dp (AdamW and
    Muon), DiLoCo fp32 and int8, SparseLoCo, DeMo, DiLoCo in 4 fp4 fragments and MuLoCo
    (Muon inside DiLoCo, 2-bit with error feedback), the periodic ones at H 10 and 50, at
    1x4 and 2x2, three seeds, all from one warm-up; the same rows from scratch; and the
    H=50 density study."""
    from tests.support import REPO

    def runs(name: str) -> list[tuple[Any, ...]]:
        r = load_experiment(REPO / "exp" / "configs" / f"{name}.json")
        return [(x.stages, x.replicas, x.variant, x.sync_mode,
                 x.training["sync"]["inner_steps"]
                 if x.sync_mode in ("diloco", "sparseloco") else None, x.seed,
                 x.training.get("optimizer", "adamw"), x.training["sync"]["compression"],
                 x.training["sync"]["fragments"], x.training["sync"]["density"]
                 if x.sync_mode == "sparseloco" else None)
                for x in r.runs]

    rows = [("dp", "dp", None, "adamw", "none", 1, None),
            ("dp-muon", "dp", None, "muon", "none", 1, None),
            *[(v, m, h, "adamw", c, f, d) for h in (10, 50) for v, m, c, f, d in (
                ("diloco", "diloco", "none", 1, None),
                ("diloco-int8", "diloco", "int8", 1, None),
                ("sparseloco", "sparseloco", "none", 1, 0.02),
                ("fragments-fp4", "diloco", "fp4_b32", 4, None))],
            ("demo", "demo", None, "adamw", "none", 1, None),
            *[("muloco-2bit", "sparseloco", h, "muon", "none", 1, 1.0) for h in (10, 50)]]
    want = sorted([(s, r, v, m, h, seed, o, c, f, d) for s, r in ((1, 4), (2, 2))
                   for seed in (0, 1, 2) for v, m, h, o, c, f, d in rows], key=str)
    for name in ("exp_sync_frontier_v1", "exp_sync_frontier_scratch_v1"):
        assert sorted(runs(name), key=str) == want
    figure = load_experiment(REPO / "exp" / "configs" / "exp_sync_frontier_v1.json")
    assert figure.config.sweep.warm_up is not None and figure.config.sweep.warm_up.steps == 500
    # The warm-up is run 0's job without its variant: AdamW, data parallel, fp32.
    warm = figure.warm_up(500)
    assert (warm.stages, warm.replicas, warm.training["sync"]["mode"],
            warm.training.get("optimizer", "adamw")) == (1, 4, "dp", "adamw")
    muloco = {(x.training["sync"]["value_bits"], x.training["sync"]["outer_lr"],
               x.training["sync"]["outer_momentum"]) for x in figure.runs
              if x.variant == "muloco-2bit"}
    assert muloco == {(2, 0.7, 0.9)}  # (MuLoCo's 2 bits: every value, Nesterov outer)
    density = load_experiment(REPO / "exp" / "configs" / "exp_sync_frontier_density_v1.json")
    # (no outer momentum: SparseLoCo's own outer step; 0.9: DiLoCo's Nesterov)
    assert {(x.training["sync"]["density"], x.training["sync"]["outer_momentum"],
             x.training["sync"]["inner_steps"]) for x in density.runs} == {
        (0.02, None, 50), (0.02, 0.9, 50), (0.05, None, 50), (0.2, None, 50),
        (1.0, None, 50), (1.0, 0.9, 50)}
    assert len(density.runs) == 18


def test_variants_are_named_rows_with_their_own_overrides_and_sync(exp, capsys):
    """A variant's overrides go over the sweep's (a sync object's fields merged), its sync
    and inner steps replace the sweep's axes; the sweep's inner steps repeat only its
    periodic rows; its name is in its runs' names and on each run."""
    from swarm_tui.cli import run

    path = exp({"replicas": [2], "inner_steps": [2, 5], "seeds": [0],
                "overrides": {"lr": 0.01, "sync": {"outer_lr": 0.5}},
                "variants": [
                    {"name": "dp", "sync": ["dp"]},
                    {"name": "lo-int8", "sync": ["diloco"],
                     "overrides": {"lr": 0.02, "sync": {"compression": "int8"}}},
                    {"name": "lo-h3", "sync": ["diloco"], "inner_steps": [3],
                     "overrides": {"optimizer": "muon"}}]})
    r = load_experiment(path)
    assert [(x.run_name, x.variant) for x in r.runs] == [
        ("m-none-unconstrained-dp-2x2-dp-s0-r0", "dp"),
        ("m-none-unconstrained-lo-int8-2x2-diloco_h2-s0-r0", "lo-int8"),
        ("m-none-unconstrained-lo-int8-2x2-diloco_h5-s0-r0", "lo-int8"),
        ("m-none-unconstrained-lo-h3-2x2-diloco_h3-s0-r0", "lo-h3")]
    jobs = [x.job("x").training for x in r.runs]
    assert [(t.lr, t.optimizer, t.sync.mode, t.sync.compression, t.sync.outer_lr)
            for t in jobs] == [
        (0.01, "adamw", "dp", "none", 0.5), (0.02, "adamw", "diloco", "int8", 0.5),
        (0.02, "adamw", "diloco", "int8", 0.5), (0.01, "muon", "diloco", "none", 0.5)]
    assert [t.sync.inner_steps for t in jobs[1:]] == [2, 5, 3]
    assert run(["validate", str(path)]) == 0
    table = capsys.readouterr().out
    assert "variant" in table and "lo-int8" in table
    # (a tracker's hyperparameters name it, from the run's config_resolved.json)
    from swarm_core.tracking.names import hparams

    assert hparams({"variant": "lo-int8", "job": {}})["variant"] == "lo-int8"
    assert "variant" not in hparams({"variant": None, "job": {}})


def test_grids_run_shapes_side_by_side_each_with_every_variant(exp):
    r = load_experiment(exp({"grids": ["2x2", "1x4"], "sync": ["dp"], "variants": [
        {"name": "a"}, {"name": "b", "overrides": {"lr": 0.02}}]},
        {"steps": 3, "batch_size": 8, "micro_batches": 2, "cluster_profile": {"fellows": 2}}))
    assert [(x.stages, x.replicas, x.fellows, x.variant) for x in r.runs] == [
        (2, 2, 4, "a"), (2, 2, 4, "b"), (1, 4, 4, "a"), (1, 4, 4, "b")]
    assert [x.job("x").topology.num_stages for x in r.runs] == [2, 2, 1, 1]
    plain = load_experiment(exp({"grids": ["2x1", "1x2"]}))  # (no variants: the axis alone)
    assert [x.run_name for x in plain.runs] == ["m-none-unconstrained-2x1-none-s0-r0",
                                                 "m-none-unconstrained-1x2-dp-s0-r0"]


def test_a_variants_warm_up_is_run_0_without_its_overrides(exp):
    """The warm-up trains no row's method: run 0's job with its variant's overrides left
    out (AdamW here, though run 0 is Muon's), data parallel, fp32."""
    r = load_experiment(exp({"replicas": [2], "warm_up": {"steps": 4}, "variants": [
        {"name": "muon", "sync": ["diloco"], "inner_steps": [2],
         "overrides": {"optimizer": "muon", "sync": {"compression": "int8"}}},
        {"name": "adamw", "sync": ["dp"]}]}))
    assert r.runs[0].training["optimizer"] == "muon"
    warm = r.warm_up(4)
    assert (warm.training["optimizer"], warm.training["sync"], warm.training["steps"],
            warm.variant) == ("adamw", {"mode": "dp"}, 4, None)


def test_sweep_overrides_of_the_sync_mode_and_period_reach_the_grid(exp):
    """``overrides.sync.mode`` where no axis lists modes, and ``overrides.sync.inner_steps``
    where no axis lists periods, are the runs' (they were replaced by the profile's)."""
    r = load_experiment(exp({"replicas": [2], "overrides": {"sync": {"mode": "diloco",
                                                                      "inner_steps": 7}}}))
    assert [x.run_name for x in r.runs] == ["m-none-unconstrained-2x2-diloco_h7-s0-r0"]
    assert r.runs[0].job("x").training.sync.inner_steps == 7
    r = load_experiment(exp({"replicas": [2], "overrides": {"sync": {"inner_steps": 10}},
                             "variants": [{"name": "a", "sync": ["diloco"]}]}))
    assert [x.run_name for x in r.runs] == ["m-none-unconstrained-a-2x2-diloco_h10-s0-r0"]


def test_a_grids_axis_runs_each_listed_mode_in_some_shape(exp):
    """One replica runs as ``none`` beside the dp shapes, as with the replicas axis."""
    r = load_experiment(exp({"grids": ["1x1", "1x4"], "sync": ["dp"]},
                            {"steps": 3, "batch_size": 8, "micro_batches": 2}))
    assert [(x.stages, x.replicas, x.sync_mode) for x in r.runs] == [(1, 1, "none"),
                                                                      (1, 4, "dp")]
    # (and under variants, each variant's modes over every shape, shape by shape)
    r = load_experiment(exp({"grids": ["1x1", "1x4"], "variants": [
        {"name": "a", "sync": ["dp"]}, {"name": "b", "sync": ["diloco"]}]},
        {"steps": 3, "batch_size": 8, "micro_batches": 2}))
    assert [(x.stages, x.replicas, x.variant, x.sync_mode) for x in r.runs] == [
        (1, 1, "a", "none"), (1, 1, "b", "none"), (1, 4, "a", "dp"), (1, 4, "b", "diloco")]
    r = load_experiment(exp({"stages": [2, 1], "replicas": [2], "sync": ["dp"], "variants": [
        {"name": "a"}, {"name": "b"}]}))
    assert [(x.stages, x.variant) for x in r.runs] == [(2, "a"), (2, "b"), (1, "a"), (1, "b")]


def test_a_warm_up_ignores_the_variants_modes_and_no_warm_up_builds_none(exp):
    """Run 0's variant may need sync fields its own mode takes (SparseLoCo codes its values
    itself): the warm-up, data parallel, takes none of them, whichever variant comes first."""
    training = {"steps": 3, "batch_size": 8, "micro_batches": 2,
                "cluster_profile": {"fellows": 2}, "sync": {"compression": "int8"}}
    rows = [{"name": "sparse", "sync": ["sparseloco"],
             "overrides": {"sync": {"compression": "none"}}}, {"name": "dp8", "sync": ["dp"]}]
    for warm in (None, {"steps": 2}):
        sweep = {"replicas": [2], "variants": rows, **({"warm_up": warm} if warm else {})}
        r = load_experiment(exp(sweep, training))
        assert [x.variant for x in r.runs] == ["sparse", "dp8"]
        assert (r.warm_base is None) == (warm is None)
    warm_job = r.warm_up(2).job("w")
    assert (warm_job.training.sync.mode, warm_job.training.sync.compression) == ("dp", "none")


def test_a_long_run_name_is_cut_in_its_middle_keeping_what_tells_runs_apart():
    """Past 120 characters a run's name loses its middle, not its variant, grid and seed."""
    from swarm_core.config.profiles import _slug

    names = [_slug(f"{'m' * 64}-none-{'n' * 64}-{v * 32}-2x2-dp-s{seed}-r0")
             for v in "ab" for seed in (0, 1)]
    assert len(set(names)) == 4 and all(len(n) == 120 for n in names)
    assert [n[-45:] for n in names] == [f"{v * 32}-2x2-dp-s{s}-r0" for v in "ab" for s in (0, 1)]
    assert all(n.startswith("m" * 60 + "_") for n in names)
    assert _slug("short name/x") == "short_name_x"
