"""What SWARM's rebalancing would make of a run, predicted (``predict/rebalance``): the moves
its rule makes on the cells' speeds, look by look, and each layout's step."""

from __future__ import annotations

import json

import attrs
import pytest

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.config.selective import CompressWhen
from swarm_core.predict.critical_path import StageTimes
from swarm_core.predict.network import UniformNetwork
from swarm_core.predict.rebalance import plan_moves, speeds
from swarm_core.predict.step import RunShape, predict
from swarm_core.schema import structure
from swarm_tui.cli import run

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)
TIMES = [StageTimes(1.0, 2.0), StageTimes(1.0, 2.0)]


def _shape(slowdowns, every: int | None = 8, steps: int = 24) -> RunShape:
    training = structure({"steps": steps, "batch_size": 24, "micro_batches": 4,
                          "grad_clip": 0.0}, TrainingConfig)
    return RunShape("run", TINY, training, 2, 3, UniformNetwork("net"), wiring="swarm",
                    routing="measured", slowdowns=tuple(slowdowns), rebalance_every=every)


def test_the_rule_moves_a_peer_to_the_stage_its_slowed_cells_hold_back_once():
    """S=2 x R=3, f = 1, b = 2, stage 1's cells 1 and 2 slowed 4x: stage 1 does 1/3 +
    2/12 = 0.5 micro-batches a second against stage 0's 1. At the first look (step 8) the
    rule moves stage 0's cell 2 to stage 1 as its cell 3 (0.5 -> 2/3, +33 %); at the next,
    the best it could do is a slowed cell back (2/3 -> 0.75, +12.5 %), under its 20 %: no
    more moves. The layout's step is shorter than the grid's."""
    shape = _shape([(1, 1, 4.0), (1, 2, 4.0)])
    assert [sum(s.values()) for s in speeds(shape, TIMES)] == pytest.approx([1.0, 0.5])
    [look] = plan_moves(shape, TIMES)
    assert (look.move.at, look.move.cells()) == (8, "0.2 -> 1.3")
    assert look.shape.layout == ((0, 1), (0, 1, 2, 3))
    assert look.shape.slowed == {(1, 1): 4.0, (1, 2): 4.0}
    before, after = predict(shape, TIMES), predict(look.shape, TIMES)
    assert after.step_seconds < before.step_seconds
    # (the bottleneck's 4/3; fill and drain do not shrink, so the step gains less)
    assert before.step_seconds / after.step_seconds < 4 / 3


def test_a_moved_peer_keeps_its_slowdown_and_a_look_past_the_run_is_none():
    """Stage 0's cell 2 slowed 2x is the one worth moving where stage 1's cells 1 and 2 are
    slowed 4x (stage 0 1/3 + 1/3 + 1/6 against stage 1's 0.5: moving it makes 2/3 : 2/3,
    moving cell 1 leaves 0.5); at stage 1 it is cell 3, as slow. A run of 8 steps has no
    look (the first would come before step 8, its end); a run without rebalancing none."""
    slowed = [(0, 2, 2.0), (1, 1, 4.0), (1, 2, 4.0)]
    [look] = plan_moves(_shape(slowed), TIMES)
    assert look.move.cells() == "0.2 -> 1.3"
    assert look.shape.slowed == {(1, 3): 2.0, (1, 1): 4.0, (1, 2): 4.0}
    assert plan_moves(_shape(slowed, steps=8), TIMES) == []
    assert plan_moves(_shape(slowed, every=None), TIMES) == []


def test_swarm_predict_says_what_rebalancing_would_do(tmp_path, capsys, monkeypatch):
    """``swarm predict`` of a rebalancing job: the table names each look's move, layout and
    step against the start's; ``--format json`` gives them under ``rebalance`` (null for a
    job that does not rebalance, empty where its rule finds no move)."""
    monkeypatch.setattr("swarm_tui.commands.predict.measure_stage",
                        lambda w: StageTimes(0.001, 0.002, 0.0))
    body = {"name": "rb", "kind": "train", "model": {"d_model": 32, "n_layers": 2,
                                                     "n_heads": 2, "seq_len": 16},
            "training": {"steps": 24, "batch_size": 24, "micro_batches": 4},
            "topology": {"stages": 2, "replicas": 3, "wiring": "swarm",
                         "routing": "measured", "rebalance_every": 8}}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(body))
    slowed = ["--slowdown", "1.1=4", "--slowdown", "1.2=4"]
    assert run(["predict", str(path), "--format", "json", *slowed]) == 0
    (r,) = json.loads(capsys.readouterr().out)["runs"]
    [move] = r["rebalance"]
    assert (move["at"], move["move"], move["layout"]) == (8, "0.2 -> 1.3",
                                                          [[0, 1], [0, 1, 2, 3]])
    assert move["step_seconds"] < r["step_seconds"]
    assert set(move["deals"][1]) == {"0", "1", "2", "3"}
    assert run(["predict", str(path), *slowed]) == 0
    out = capsys.readouterr().out
    assert "0.2 -> 1.3" in out and "0,1 0,1,2,3" in out
    assert run(["predict", str(path), "--format", "json"]) == 0  # (nothing slowed)
    assert json.loads(capsys.readouterr().out)["runs"][0]["rebalance"] == []
    assert run(["predict", str(path)]) == 0
    assert "finds no move worth it" in capsys.readouterr().out
    body["topology"].pop("rebalance_every")
    path.write_text(json.dumps(body))
    assert run(["predict", str(path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["rebalance"] is None


def test_under_a_link_matrix_a_moved_peer_keeps_its_site():
    """Each replica's chain at a site of its own: the rule moves stage 0's cell 2 (site c) to
    stage 1 as cell 3, an id the replica rule has no site for; the moved peer keeps c (as
    its START's placement keeps it), so its links are c's and the layout is predicted."""
    from swarm_core.config.network import LinkMatrix
    from swarm_core.predict.network import MatrixNetwork

    matrix = structure({"sites": {"a": {}, "b": {}, "c": {"up_mbps": 5.0}},
                        "default": {"mbps": 1000}, "replica_sites": ["a", "b", "c"]},
                       LinkMatrix)
    shape = attrs.evolve(_shape([(1, 1, 4.0), (1, 2, 4.0)]),
                         network=MatrixNetwork(matrix, 2))
    [look] = plan_moves(shape, TIMES)
    net = look.shape.network
    assert isinstance(net, MatrixNetwork) and net.tx((1, 3)).mbps == 5.0  # (site c's cap)
    assert net.tx((1, 0)).mbps is None
    after = predict(look.shape, TIMES)
    assert any(link.name.startswith("stage 1 replica 3") for link in after.links)


def test_a_moved_peer_is_priced_in_the_format_its_own_sites_link_gets():
    """``compress_when: below_mbps 100`` over the same matrix: after the move, cell 1.3 sits
    at site c (5 Mbit/s up), so what it sends stage 0 is coded int8 and what stage 1's
    cell 0 (site a) sends goes fp32; the predictor prices each so (it read the moved peer's
    site by its new id before, and failed)."""
    from swarm_core.config.network import LinkMatrix
    from swarm_core.pipeline.wire_math import link_bytes
    from swarm_core.predict.network import MatrixNetwork

    matrix = structure({"sites": {"a": {}, "b": {}, "c": {"up_mbps": 5.0}},
                        "default": {"mbps": 1000}, "replica_sites": ["a", "b", "c"]},
                       LinkMatrix)
    model = attrs.evolve(TINY, compression="fixed_int8")
    shape = attrs.evolve(_shape([(1, 1, 4.0), (1, 2, 4.0)]), model=model,
                         network=MatrixNetwork(matrix, 2),
                         training=attrs.evolve(_shape([]).training, network=matrix,
                                               compress_when=structure(
                                                   {"below_mbps": 100}, CompressWhen)))
    [look] = plan_moves(shape, TIMES)
    after = predict(look.shape, TIMES)
    t, placed = look.shape.training, look.shape.placed
    coded = link_bytes(model, t, (1, 3), (0, 0), 2, 3, placed=placed)
    plain = link_bytes(model, t, (1, 0), (0, 0), 2, 3, placed=placed)
    assert coded < plain / 3
    assert any(x.name.startswith("stage 1 replica 3") for x in after.links)
