"""SWARM wiring across fellow processes (issue 34 points 1 and 3): a 2 x 2 job whose
micro-batches are routed 3 : 1 to stage 1's replicas over real TCP between four fellows
computes the losses of one process at the same global batch; and so do the same job routed by
measured throughput, a job whose stages hold unequal cells, one whose peer moves between
stages halfway, and one whose peers SWARM's rebalancing moves (decided by the cells)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract.placement import split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline.frames import HEADER_SIZE
from swarm_core.pipeline.reference import train_reference
from swarm_core.schema import structure
from tests.clusters import cli_json, job_view, run_cli, wait_until

pytestmark = pytest.mark.slow

MODEL = {"name": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16,
         "compression": "none", "wire_dtype": "fp32"}
TRAINING = {"name": "routed", "dataset": "shakespeare", "steps": 10, "batch_size": 8,
            "micro_batches": 2, "eval_batches": 1, "seed": 4}


def _run(name: str, topology: dict[str, Any], env: dict[str, str], path: Path,
         training: dict[str, Any] = TRAINING) -> dict[str, Any]:
    """Submit a train job of ``topology`` and wait for its end: its view then."""
    path.write_text(json.dumps({"name": name, "kind": "train", "model": MODEL,
                                "training": training, "topology": topology}))
    job_id = cli_json("submit", "--payload", str(path), env=env)["job_id"]
    return wait_until(lambda: (j := job_view(job_id, env))["state"] in (
        "COMPLETED", "FAILED") and j, 240, f"the {name} job's end")


def test_a_swarm_wired_job_of_four_fellows_matches_one_process(cli_env, tmp_path):
    up = run_cli("restart-cluster", "--fellows", "4", env=cli_env, timeout=120)
    assert up.returncode == 0, up.stderr
    try:
        path = tmp_path / "job.json"
        job = _run("routed", {"stages": 2, "replicas": 2, "wiring": "swarm",
                              "route_weights": [[1, 1], [3, 1]]}, cli_env, path)
        # The same job with SWARM's measured routes: the fellows agree on each step's plan
        # from what they measured (a disagreement would stall the job), from the START the
        # leader sent them.
        measured = _run("measured", {"stages": 2, "replicas": 2, "wiring": "swarm",
                                     "routing": "measured"}, cli_env, path)
        # Stages of unequal cells (issue 34 point 3, from the START's placement): stage 0
        # one cell, stage 1 three, over the same two shares of the batch.
        laid = _run("layout", {"replicas": 2, "wiring": "swarm", "layout": [[0], [0, 1, 2]]},
                    cli_env, path)
        # A peer moved between stages at step 5: every fellow makes the move in band, the
        # moved one goes on as its new cell, the leader learns it from their reports. At
        # step 7 a peer that stayed through it moves (from the placement the first made,
        # not its START's).
        moved = _run("moved", {"stages": 2, "replicas": 2, "wiring": "swarm",
                               "moves": [{"at": 5, "source": 0, "cell": 1, "target": 1},
                                         {"at": 7, "source": 1, "cell": 1, "target": 0}]},
                     cli_env, path)
        # SWARM's rebalancing, decided by the cells from what they measured: stage 1's one
        # cell slowed 3x against stage 0's three, so the rule moves stage-0 peers there.
        # (Dispatch gives the layout's second cell, 1.0, the second ready fellow.)
        ids = sorted(f["fellow_id"] for f in cli_json("fellows", env=cli_env)["fellows"])
        slowed = run_cli("set-speed", "--fellow-id", str(ids[1]), "--slowdown", "3",
                         env=cli_env)
        assert slowed.returncode == 0, slowed.stderr
        rebalanced = _run("rebalanced", {"wiring": "swarm", "routing": "measured",
                                         "rebalance_every": 3, "layout": [[0, 1, 2], [0]]},
                          cli_env, path, {**TRAINING, "micro_batches": 4})
    finally:
        run_cli("stop-cluster", env=cli_env)
    assert job["state"] == "COMPLETED", job["reason"]
    assert job["topology"]["wiring"] == "swarm"
    mc, tc = structure(MODEL, ModelConfig), structure(TRAINING, TrainingConfig)
    ref, _ = train_reference(mc, tc, load_token_data(tc, mc.seq_len),
                             split_layers(mc.n_layers, [1, 1]))
    got = [loss for _step, loss in job["loss_history"]]
    assert len(got) == 10
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    # Stage 1's replicas ran 3 : 1 of each step's 4 micro-batches: replica 0 sent two more
    # gradient frames a step (each 2 windows x 16 x 32 fp32 and its header) than replica 1.
    stages = job["metrics"]["stages"]
    sent = [stages[f"1.{r}"]["wire_tx_bytes_per_step"] for r in range(2)]
    assert sent[0] - sent[1] == 2 * (2 * 16 * 32 * 4 + HEADER_SIZE)
    assert measured["state"] == "COMPLETED", measured["reason"]
    assert measured["topology"]["routing"] == "measured"
    got = [loss for _step, loss in measured["loss_history"]]
    assert len(got) == 10 and max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    assert laid["state"] == "COMPLETED", laid["reason"]
    assert laid["placement"]["layout"] == [[0], [0, 1, 2]]
    got = [loss for _step, loss in laid["loss_history"]]
    assert len(got) == 10 and max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    assert set(laid["metrics"]["stages"]) == {"0.0", "1.0", "1.1", "1.2"}
    assert moved["state"] == "COMPLETED", moved["reason"]
    assert [c["moved"] for c in moved["membership"]] == [
        {"at": 5, "source": 0, "cell": 1, "target": 1, "new_id": 2},
        {"at": 7, "source": 1, "cell": 1, "target": 0, "new_id": 1}]
    assert moved["placement"]["layout"] == [[0, 1], [0, 2]]
    got = [loss for _step, loss in moved["loss_history"]]
    assert len(got) == 10 and max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    assert rebalanced["state"] == "COMPLETED", rebalanced["reason"]
    p = rebalanced["placement"]
    assert next(c for c in p["stages"] if (c["stage"], c["replica"]) == (1, 0))[
        "fellow_id"] == ids[1]  # (the premise: the slowed fellow ran stage 1's cell 0)
    made = [c["moved"] for c in rebalanced["membership"]]
    assert made and all((m["source"], m["target"]) == (0, 1) and m["at"] % 3 == 0
                        for m in made), made
    assert all(c["reason"] == "rebalance" for c in rebalanced["membership"])
    assert len(p["layout"][1]) == 1 + len(made)
    tm = structure({**TRAINING, "micro_batches": 4}, TrainingConfig)
    ref4, _ = train_reference(mc, tm, load_token_data(tm, mc.seq_len),
                              split_layers(mc.n_layers, [1, 1]))
    got = [loss for _step, loss in rebalanced["loss_history"]]
    assert len(got) == 10 and max(abs(a - b) for a, b in zip(ref4, got, strict=True)) <= 1e-5
