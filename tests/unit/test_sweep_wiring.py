"""A sweep runs the topology its training profile asks for, wiring and all: a swarm profile's
runs are routed (its routing, weights, layout, moves and rebalancing reach every job), a
``wiring`` axis puts chain and swarm side by side, and what a job would refuse is refused at
load, naming the file and field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from swarm_core.config.profiles import ConfigError, load_experiment, load_training_profile
from swarm_core.schema import unstructure
from tests.support import write_config


@pytest.fixture
def exp(tmp_path):
    write_config(tmp_path, "model/m.json", {"name": "m", "d_model": 32, "n_layers": 2, "n_heads": 2,
                                      "seq_len": 16})

    def make(sweep: dict[str, Any], cluster: dict[str, Any],
             sync: dict[str, Any] | None = None) -> Path:
        write_config(tmp_path, "training/t.json", {
            "steps": 6, "batch_size": 36, "micro_batches": 6,
            **({"sync": sync} if sync else {}), "cluster_profile": cluster})
        return write_config(tmp_path, "e.json", {"name": "e", "training_config": "training/t.json",
                                           "model_configs": ["model/m.json"], "sweep": sweep})

    return make


def test_a_swarm_profiles_runs_are_routed_as_it_says(exp, capsys):
    from swarm_tui.cli import run

    path = exp({"seeds": [0, 1]}, {"stages": 2, "replicas": 3, "wiring": "swarm",
                                   "routing": "measured", "rebalance_every": 3})
    r = load_experiment(path)
    assert [x.run_name for x in r.runs] == ["m-none-unconstrained-2x3-dp-swarm-s0-r0",
                                            "m-none-unconstrained-2x3-dp-swarm-s1-r0"]
    topo = r.runs[0].job("x").topology
    assert (topo.wiring, topo.routing, topo.rebalance_every) == ("swarm", "measured", 3)
    assert (topo.stages, topo.replicas, topo.fellows) == (2, 3, 6)
    assert run(["validate", str(path)]) == 0
    table = capsys.readouterr().out
    assert "swarm measured rebalance /3" in table


def test_a_layout_profile_runs_its_cells(exp):
    path = exp({}, {"replicas": 2, "wiring": "swarm", "layout": [[0], [0, 1, 2]],
                    "moves": [{"at": 2, "source": 1, "cell": 2, "target": 0}]})
    (spec,) = load_experiment(path).runs
    assert (spec.stages, spec.replicas, spec.fellows) == (2, 2, 4)
    assert spec.wiring_label == "swarm cells 1+3 1 move(s)"
    topo = spec.job("x").topology
    assert topo.layout == [[0], [0, 1, 2]]
    assert unstructure(topo.moves) == [{"at": 2, "source": 1, "cell": 2, "target": 0,
                                        "new_id": None}]
    assert (topo.stages, topo.fellows) == (2, 4)


def test_a_wiring_axis_puts_chain_and_swarm_side_by_side(exp):
    # The profile is a weighted swarm: its chain runs drop the swarm's fields (the baseline),
    # its swarm runs keep them.
    weights = [[1.0, 1.0], [3.0, 1.0]]
    r = load_experiment(exp({"wiring": ["chain", "swarm"]},
                            {"stages": 2, "replicas": 2, "wiring": "swarm",
                             "route_weights": weights}))
    assert [x.run_name for x in r.runs] == ["m-none-unconstrained-2x2-dp-s0-r0",
                                            "m-none-unconstrained-2x2-dp-swarm-s0-r0"]
    topos = [x.job("x").topology for x in r.runs]
    assert [t.wiring for t in topos] == ["chain", "swarm"]
    assert topos[0].route_weights is None and topos[1].route_weights == weights
    # A chain profile's swarm runs route equally.
    r = load_experiment(exp({"wiring": ["swarm", "chain"]}, {"stages": 2, "replicas": 2}))
    assert [x.wiring for x in r.runs] == [{"wiring": "swarm"}, {}]


def test_a_swarm_profile_routes_the_runs_it_can_and_chains_the_others(exp):
    """As the wiring axis does: one replica has nothing to route, a periodic mode's replicas
    train apart; those runs are chained, the dp run of several replicas routed."""
    r = load_experiment(exp({"replicas": [1, 2], "sync": ["none", "dp", "diloco"],
                             "inner_steps": [2]},
                            {"stages": 2, "wiring": "swarm", "routing": "measured"}))
    assert [(x.run_name.split("unconstrained-")[1], x.job("x").topology.routing)
            for x in r.runs] == [("2x1-none-s0-r0", "given"),
                                 ("2x2-dp-swarm-s0-r0", "measured"),
                                 ("2x2-diloco_h2-s0-r0", "given")]


def test_a_wiring_axis_routes_dp_runs_only(exp):
    # One replica has nothing to route, a periodic mode's replicas train apart: each runs
    # once, chained.
    r = load_experiment(exp({"wiring": ["chain", "swarm"], "replicas": [1, 2],
                             "sync": ["none", "dp", "diloco"], "inner_steps": [2]},
                            {"stages": 2}))
    assert [x.run_name.split("unconstrained-")[1] for x in r.runs] == [
        "2x1-none-s0-r0", "2x2-dp-s0-r0", "2x2-dp-swarm-s0-r0", "2x2-diloco_h2-s0-r0"]
    assert [x.job("x").topology.wiring for x in r.runs] == ["chain", "chain", "swarm", "chain"]


@pytest.mark.parametrize("sweep, cluster, sync, where, field, message", [
    ({"stages": [2, 4]}, {"replicas": 2, "wiring": "swarm", "layout": [[0], [0, 1, 2]]},
     None, "e.json", "$.sweep.stages", "cluster_profile.layout (t.json) is drawn for its own "
     "grid"),
    ({"replicas": [2, 3]}, {"stages": 2, "replicas": 2, "wiring": "swarm",
                            "route_weights": [[1, 1], [1, 2]]},
     None, "e.json", "$.sweep.replicas", "cluster_profile.route_weights"),
    ({"wiring": ["chain", "swarm"]}, {"replicas": 2, "wiring": "swarm",
                                      "layout": [[0], [0, 1, 2]]},
     None, "e.json", "$.sweep.wiring", "has no chain wiring"),
    ({"wiring": ["swarm"], "replicas": [1]}, {"stages": 2}, None, "e.json", "$.sweep.wiring",
     "this sweep has none"),
    ({"wiring": ["swarm", "swarm"]}, {"stages": 2, "replicas": 2}, None, "e.json",
     "$.sweep.wiring", "unique wirings"),
    ({"stages": [2, 3]}, {"stages": 2, "replicas": 2, "wiring": "swarm",
                          "moves": [{"at": 2, "source": 0, "cell": 1, "target": 1}]},
     None, "e.json", "$.sweep.stages", "cluster_profile.moves (t.json) is drawn for its own"),
    # What the job would refuse: a layout over diloco, a move that does not fit.
    ({}, {"replicas": 2, "wiring": "swarm", "layout": [[0], [0, 1, 2]]}, {"mode": "diloco"},
     "t.json", "$.cluster_profile", "(sync mode dp), not diloco (run m-none-unconstrained-"),
    ({}, {"stages": 2, "replicas": 2, "wiring": "swarm",
          "moves": [{"at": 9, "source": 0, "cell": 1, "target": 1}]}, None, "t.json",
     "$.cluster_profile.moves", "(run m-none-unconstrained-2x2-dp-swarm-s0-r0)"),
])
def test_bad_wiring_says_which_file_and_field(exp, sweep, cluster, sync, where, field,
                                              message):
    with pytest.raises(ConfigError) as err:
        load_experiment(exp(sweep, cluster, sync))
    assert Path(err.value.path).name == where
    assert err.value.field == field
    assert message in err.value.message
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("cluster, field, message", [
    ({"layout": [[0], [0, 1]]}, "$.cluster_profile.layout", "need wiring swarm"),
    ({"wiring": "swarm", "layout": [[0], [1]]}, "$.cluster_profile.layout", "no cell 0"),
    ({"wiring": "swarm", "stages": 2, "replicas": 2, "route_weights": [[1, 1], [1]]},
     "$.cluster_profile.route_weights", "must be 2 lists (stages) of 2 weights"),
    ({"wiring": "swarm", "stages": 3, "layout": [[0], [0, 1]]}, "$.cluster_profile.layout",
     "2 stages listed for a 3-stage job"),
    ({"wiring": "swarm", "stages": 2, "replicas": 2, "routing": "measured",
      "rebalance_every": 2, "moves": [{"at": 2, "source": 0, "cell": 1, "target": 1}]},
     "$.cluster_profile.moves", "not both"),
    ({"wiring": "swarm", "fellows": 7, "replicas": 2, "layout": [[0], [0, 1, 2]]},
     "$.cluster_profile.fellows", "fellows 7 contradicts the layout's 4 cells"),
])
def test_a_bad_swarm_profile_is_one_line_at_its_field(tmp_path, cluster, field, message):
    path = write_config(tmp_path, "t.json", {"steps": 6, "cluster_profile": cluster})
    with pytest.raises(ConfigError) as err:
        load_training_profile(path)
    assert (err.value.field, "\n" in str(err.value)) == (field, False)
    assert message in err.value.message
