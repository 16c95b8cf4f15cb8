"""SWARM wiring (issue 34 point 1): each micro-batch routed to a replica of the next stage by a
throughput-weighted rule, the gradient back along the same path; with dp, S x R computes what
one process computes at the same global batch, whatever the route."""

from __future__ import annotations

import pytest
import torch

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract import JobSubmit
from swarm_core.contract.metrics import step_loss
from swarm_core.contract.placement import split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline.frames import HEADER_SIZE
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.pace import Pace
from swarm_core.pipeline.reference import train_reference
from swarm_core.pipeline.route_meter import chain_table
from swarm_core.pipeline.routing import ThroughputEstimate, route_plan, runs
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
    """Each step's loss: the last stage's replicas' (each the mean over the micro-batches its
    route gave it), weighted by those micro-batches."""
    last = [res[r * stages + stages - 1] for r in range(replicas)]
    return [step_loss(dict(enumerate(losses)), dict(enumerate(ran)))
            for losses, ran in zip(zip(*(c.losses for c in last), strict=True),
                                   zip(*(c.micro_batches for c in last), strict=True),
                                   strict=True)]


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


def test_the_throughput_estimate_is_hivemind_s_adjusted_ema_of_seconds_per_micro_batch():
    est = ThroughputEstimate(2, 2, given=[[1, 1], [3, 1]])
    assert est.weights() == [[1.0, 1.0], [3.0, 1.0]]  # (no sample yet: the given weights)
    est.update([[0.1, float("nan")], [0.02, 0.08]])
    # A stage some replica of which has no sample keeps its given weights (scales differ);
    # the first sample is taken whole (the EMA divided by 1 - 0.9).
    w = est.weights()
    assert w[0] == [1.0, 1.0]
    assert w[1] == pytest.approx([50.0, 12.5])
    est.update([[0.1, 0.1], [0.04, 0.08]])
    ema = 0.1 * 0.04 + 0.9 * (0.1 * 0.02)  # (by hand: alpha 0.1, from zero)
    assert est.weights()[1][0] == pytest.approx((1 - 0.9 ** 2) / ema)
    assert est.weights()[1][1] == pytest.approx(12.5)  # (the same sample twice: unchanged)
    assert est.weights()[0] == [pytest.approx(10.0), pytest.approx(10.0)]


def test_the_chain_s_table_goes_up_and_back_down_with_the_norm_s_sum():
    """Three stages over real links: each puts its row in on the way up; every stage ends
    with the total (summed as chain_sq_sum sums it) and the same whole table."""
    import socket
    import threading

    from swarm_core.pipeline.links import LinkShaper
    from swarm_core.pipeline.transport import PeerLink

    def linked_pair() -> tuple[PeerLink, PeerLink]:
        a, b = socket.socketpair()
        return PeerLink(a, LinkShaper(), 7, "b"), PeerLink(b, LinkShaper(), 7, "a")

    a_down, b_up = linked_pair()
    b_down, c_up = linked_pair()
    links: list[tuple[PeerLink | None, PeerLink | None]] = [
        (None, a_down), (b_up, b_down), (c_up, None)]
    out: dict[int, tuple[float, list[list[float]]]] = {}

    def run(k: int) -> None:
        up, down = links[k]
        out[k] = chain_table(float(k + 1), [10.0 * k, 10.0 * k + 1], k, 3, up, down, 5, 10.0)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    table = [[0.0, 1.0], [10.0, 11.0], [20.0, 21.0]]
    assert all(out[k] == (1.0 + (2.0 + 3.0), table) for k in range(3))
    for link in (a_down, b_up, b_down, c_up):
        link.close()


def test_a_confirmation_tells_every_member_every_figure_the_same_to_the_bit():
    """``confirm_telling`` round a ring of three over real links: each member ends with the
    three figures by rank, the same list everywhere (its own rounded to float32 as the others
    read it: a plan dealt from lists differing in the last bit could differ), and the word."""
    import socket
    import threading

    from swarm_core.pipeline.frames import Kind
    from swarm_core.pipeline.links import LinkShaper
    from swarm_core.pipeline.ring import confirm_telling
    from swarm_core.pipeline.transport import PeerLink

    ends = []
    for _ in range(3):  # (member i sends to i + 1 over pair i)
        a, b = socket.socketpair()
        ends.append((PeerLink(a, LinkShaper(), 7, "next", receives=()),
                     PeerLink(b, LinkShaper(), 7, "prev", receives=(Kind.SYNC,))))
    figures = [0.1, 0.2, 0.3]  # (none exact in float32)
    out: dict[int, tuple[int, float, float, list[float]]] = {}

    def run(i: int) -> None:
        out[i] = confirm_telling(ends[i][0], ends[(i - 1) % 3][1], i, 3, 4, 10.0,
                                 float(i == 1), figures[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    expected = [float(torch.tensor(x, dtype=torch.float32)) for x in figures]
    assert all(out[i][3] == expected for i in range(3))
    assert all(out[i][2] == 1.0 for i in range(3))  # (the largest word heard)
    for pair in ends:
        for link in pair:
            link.close()


def test_measured_routing_deals_fewer_to_a_slow_peer_and_computes_what_one_process_computes(
        data):
    """``routing: measured``: stage 1's replica 1 padded to 6x its compute gets fewer of the
    step's micro-batches once measured, every cell agreeing on each step's plan (a plan two
    cells disagreed on would leave one waiting for a frame never sent), and dp's losses are
    still one process's to 1e-5 (whatever the route). Without clipping too (the table then
    goes along an exchange of its own)."""
    mc = ModelConfig(**MODEL)
    for clip in (1.0, 0.0):
        tc = structure({"steps": 10, "batch_size": 16, "micro_batches": 4, "eval_batches": 0,
                        "seed": 5, "grad_clip": clip}, TrainingConfig)
        ref, _model = train_reference(mc, tc, data, split_layers(mc.n_layers, [1, 1]))
        res = run_local_pipeline(mc, tc, data, 2, replicas=2, timeout=180, wiring="swarm",
                                 routing="measured", stage_kwargs={3: {"pace": Pace(6.0)}})
        failed = {k: v for k, v in res.items() if not isinstance(v, StageResult)}
        assert not failed, failed
        got = _losses(res, 2, 2)  # type: ignore[arg-type]
        assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
        fast, slow = (res[c].metrics.micro_batches for c in (1, 3))  # type: ignore[union-attr]
        # (the first step deals 4 : 4, before anything is measured; then about 6 : 1, at
        # least one each)
        assert fast + slow == pytest.approx(8.0)
        assert slow < 3.0 < 5.0 < fast, (fast, slow)


def test_a_training_profile_s_cluster_asks_for_measured_routes():
    """``cluster_profile.routing``: a swarm profile's measured routes reach the job's topology;
    a chain asked for over it leaves them; measured routes on a chain profile are refused."""
    from swarm_core.config.profiles import ClusterProfile, job_topology
    from swarm_core.schema import FieldError

    cluster = ClusterProfile(replicas=2, stages=2, wiring="swarm", routing="measured")
    topo = job_topology(cluster)
    assert (topo["wiring"], topo["routing"]) == ("swarm", "measured")
    assert "routing" not in job_topology(cluster, wiring="chain")
    assert job_topology(ClusterProfile(replicas=2, stages=2), wiring="swarm",
                        routing="measured")["routing"] == "measured"
    with pytest.raises(FieldError, match="measured routing is for wiring swarm"):
        ClusterProfile(replicas=2, stages=2, routing="measured")


def test_a_training_profile_s_cluster_asks_for_rebalancing():
    """``cluster_profile.rebalance_every``: SWARM's rebalancing reaches the job's topology
    (a sweep's runs rebalance); without measured routes it is refused in one line."""
    from swarm_core.config.profiles import ClusterProfile, job_topology
    from swarm_core.contract.job import Topology
    from swarm_core.schema import FieldError

    cluster = ClusterProfile(replicas=3, stages=2, wiring="swarm", routing="measured",
                             rebalance_every=8)
    topo = structure(job_topology(cluster), Topology)
    assert (topo.rebalance_every, topo.routing, topo.cells) == (8, "measured", 6)
    assert "rebalance_every" not in job_topology(ClusterProfile(replicas=2, stages=2))
    with pytest.raises(FieldError, match="it needs wiring swarm and routing measured") as err:
        ClusterProfile(replicas=2, stages=2, wiring="swarm", rebalance_every=4)
    assert err.value.field == "rebalance_every" and "\n" not in str(err.value)
    with pytest.raises(FieldError, match="must be 1-1000000, got 0"):
        ClusterProfile(replicas=2, stages=2, wiring="swarm", routing="measured",
                       rebalance_every=0)


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
    with pytest.raises(SchemaError) as err:
        structure({**body, "topology": {"stages": 2, "routing": "measured"}}, JobSubmit)
    assert "$.topology.routing: measured routing is for wiring swarm" in str(err.value)
