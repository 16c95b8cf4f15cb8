"""SWARM wiring (issue 34 point 1): each micro-batch routed to a replica of the next stage by a
throughput-weighted rule, the gradient back along the same path; with dp, S x R computes what
one process computes at the same global batch, whatever the route."""

from __future__ import annotations

import pytest
import torch

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract import JobSubmit
from swarm_core.contract.placement import split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline.frames import HEADER_SIZE
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.reference import train_reference
from swarm_core.pipeline.routing import route_plan, runs
from swarm_core.pipeline.stage import StageResult
from swarm_core.schema import SchemaError, structure

MODEL = dict(d_model=32, n_layers=3, n_heads=2, seq_len=16)


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


def test_a_route_deals_by_throughput_each_replica_at_least_one_and_the_same_everywhere():
    plan = route_plan(7, 3, 3, 2, 4, [[1, 1], [3, 1], [1, 1]])
    assert plan == route_plan(7, 3, 3, 2, 4, [[1, 1], [3, 1], [1, 1]])  # (every cell alike)
    assert plan[0] == [0, 0, 0, 0, 1, 1, 1, 1]  # (stage 0: each replica's own share)
    assert (len(runs(plan, 1, 0)), len(runs(plan, 1, 1))) == (6, 2)  # (3 : 1)
    assert sorted(runs(plan, 2, 0) + runs(plan, 2, 1)) == list(range(8))
    assert route_plan(7, 4, 3, 2, 4, [[1, 1], [3, 1], [1, 1]]) != plan  # (reshuffled a step)
    skewed = route_plan(0, 0, 2, 3, 2, [[1, 1, 1], [100, 1, 1]])
    assert all(runs(skewed, 1, r) for r in range(3))  # (a slow replica still gets one)


def _losses(res: dict[int, StageResult], stages: int, replicas: int) -> list[float]:
    per_replica = [res[r * stages + stages - 1].losses for r in range(replicas)]
    return [sum(step) / replicas for step in zip(*per_replica, strict=True)]


@pytest.mark.parametrize("stages, weights, steps", [
    (2, [[1, 1], [3, 1]], 20),  # the case: a deliberately skewed route
    (3, [[1, 1], [1, 2], [2, 1]], 8),  # a middle stage routed both ways
])
def test_a_swarm_wired_job_computes_what_one_process_computes(data, stages, weights, steps):
    """``none``, fp32, dp: S x 2 swarm-wired computes the losses of one process at the same
    global batch to 1e-5, and the first replica's chain evaluates its model."""
    mc = ModelConfig(**MODEL)
    tc = structure({"steps": steps, "batch_size": 16, "micro_batches": 4, "eval_batches": 1,
                    "seed": 11}, TrainingConfig)
    ref, model = train_reference(mc, tc, data, split_layers(mc.n_layers, [1] * stages))
    res = run_local_pipeline(mc, tc, data, stages, replicas=2, timeout=180, wiring="swarm",
                             route_weights=weights)
    failed = {k: v for k, v in res.items() if not isinstance(v, StageResult)}
    assert not failed, failed
    got = _losses(res, stages, 2)  # type: ignore[arg-type]
    assert len(got) == steps and ref[-1] < ref[0]
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    with torch.no_grad():
        x, y = data.eval_batches(1, tc.batch_size // tc.micro_batches, mc.seq_len)[0]
        logits = model(x)
        expected = float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    assert res[stages - 1].metrics.eval_loss == pytest.approx(expected, abs=1e-5)
    # The route crossed chains: stage 1's replicas sent their gradients back for 6 and 2 of
    # the step's 8 micro-batches (the skewed case), each a frame of one micro-batch.
    if stages == 2:
        assert [res[r * stages + 1].metrics.micro_batches for r in range(2)] == [6.0, 2.0]
        assert res[0].metrics.micro_batches == 4.0  # (stage 0: its own share)
        sent = [res[r * stages + 1].metrics.wire_tx_bytes_per_step for r in range(2)]
        assert sent[0] - sent[1] == 4 * (2 * MODEL["seq_len"] * MODEL["d_model"] * 4
                                         + HEADER_SIZE)


def test_swarm_wiring_is_refused_where_it_cannot_apply():
    body = {"kind": "train", "model": {**MODEL}, "topology": {"stages": 2, "replicas": 2,
                                                             "wiring": "swarm"}}
    with pytest.raises(SchemaError) as err:
        structure({**body, "training": {"sync": {"mode": "diloco"}}}, JobSubmit)
    assert "wiring swarm averages each stage group's gradients every step" in str(err.value)
    with pytest.raises(SchemaError) as err:
        structure({**body, "topology": {**body["topology"], "route_weights": [[1, 1]]}},
                  JobSubmit)
    assert "$.topology.route_weights: must be 2 lists (stages) of 2 weights" in str(err.value)
    with pytest.raises(SchemaError) as err:
        structure({**body, "topology": {"stages": 2, "route_weights": [[1], [1]]}}, JobSubmit)
    assert "route weights are for wiring swarm" in str(err.value)
    with pytest.raises(SchemaError) as err:
        structure({**body, "topology": {**body["topology"],
                                        "route_weights": [[1, 1], [0, 1]]}}, JobSubmit)
    assert "every weight must be a positive number" in str(err.value)
