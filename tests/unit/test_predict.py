"""``swarm predict``: the schedule's critical path against hand-worked cases, the bytes from the
project's own plans, the predicted step and its perfect-overlap bound, what bounds it (compute,
a link, latency), the bandwidth-for-utilisation inversion, the calibration cache, and the
command's JSON and errors."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.pipeline.model import StageModule
from swarm_core.pipeline.syncs import make_sync
from swarm_core.pipeline.wire_math import expected_wire_bytes
from swarm_core.predict.calibrate import calibrate, measure_stage, stage_works
from swarm_core.predict.critical_path import StageTimes, compute_critical_path, simulate_step
from swarm_core.predict.network import Link, UniformNetwork
from swarm_core.predict.routed import RoutedRun
from swarm_core.predict.step import RunShape, _frame_hop, predict
from swarm_core.predict.sync_plan import sync_bytes_per_step
from swarm_core.schema import structure
from swarm_tui.cli import run
from swarm_tui.commands.base import ExitCode

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)


def _training(**kw) -> TrainingConfig:
    return structure({"steps": 10, "batch_size": 8, "micro_batches": 4, **kw}, TrainingConfig)


def _shape(stages: int = 2, replicas: int = 1, mbps: float | None = 80.0,
           latency_ms: float = 0.0, **kw) -> RunShape:
    return RunShape("run", TINY, _training(**kw), stages, replicas,
                    UniformNetwork("net", mbps, mbps, latency_ms))


# --- the critical path --------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uniform_stages_take_the_classic_bubble(schedule):
    """S = 3 stages of f = 1, b = 2 and M = 4: (M + S - 1)(f + b) = 18 under GPipe and 1F1B
    (the last forward reaches the last stage at (M + S - 1) f; the backwards drain alike)."""
    times = [StageTimes(1.0, 2.0)] * 3
    assert compute_critical_path(schedule, times, 4, clipped=False) == 18.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "eager"])
def test_two_unequal_stages_by_hand(schedule):
    """f0 = b0 = 1, f1 = b1 = 2, M = 2, worked by hand for each order: stage 0's forwards
    end at 1 and 2; stage 1 runs F0 [1,3] then (B0 [3,5], F1 [5,7]) or (F1 [3,5], B0 [5,7]),
    and B1 ends at 9 either way; stage 0's B1 runs [9,10]."""
    times = [StageTimes(1.0, 1.0), StageTimes(2.0, 2.0)]
    assert compute_critical_path(schedule, times, 2, clipped=False) == 10.0


def test_the_optimiser_waits_for_the_global_norm_when_clipping():
    """Same case with optimiser steps 0.5 and 2: clipped, every stage steps after the last
    backward (10) and the slowest takes 2; unclipped, stage 1 steps at 9 (ends 11) and stage 0
    at 10 (ends 10.5)."""
    times = [StageTimes(1.0, 1.0, 0.5), StageTimes(2.0, 2.0, 2.0)]
    assert compute_critical_path("1f1b", times, 2, clipped=True) == 12.0
    assert compute_critical_path("1f1b", times, 2, clipped=False) == 11.0


def test_eager_keeps_the_last_stage_busy_from_the_first_forward():
    """Three stages, f = 1, b = 1, M = 2 under eager, by hand: stages 0 and 1 run both
    forwards first (stage 1's F at [1,2], [2,3]); stage 2 runs F0 [2,3] B0 [3,4] F1 [4,5]
    B1 [5,6]; stage 1's B0 [4,5], B1 [6,7]; stage 0's B0 [5,6], B1 [7,8]."""
    assert compute_critical_path("eager", [StageTimes(1.0, 1.0)] * 3, 2, clipped=False) == 8.0


def test_queued_frames_leave_the_link_idle_where_the_schedule_does():
    """Two stages, f = b = 1, M = 2, 1F1B, each frame 3 s on its sender's link, no latency,
    by hand: stage 0's F0 [0,1] sends [1,4], F1 [1,2] sends [4,7]; stage 1's F0 [4,5], B0
    [5,6] sends [6,9], F1 [7,8], B1 [8,9] sends [9,12]; stage 0's B0 [9,10], B1 [12,13]. Each
    link is busy 6 s, the compute path is 6 s: perfect overlap would say 6."""
    times = [StageTimes(1.0, 1.0)] * 2
    assert simulate_step("1f1b", times, 2, False, lambda s, kind: (3.0, 0.0)) == 13.0
    assert simulate_step("1f1b", times, 2, False, lambda s, kind: (0.0, 0.5)) == \
        compute_critical_path("1f1b", times, 2, False) + 2 * 0.5  # (one hop each way)


# --- the bytes ----------------------------------------------------------------------------------


def test_boundary_bytes_are_the_stages_own_plan():
    for stages in (2, 3):
        shape = _shape(stages)
        p = predict(shape, [StageTimes(0.01, 0.02)] * stages)
        sent = {x.name: x.nbytes for x in p.links if x.name.endswith("tx")}
        assert sent == {f"stage {s} tx": expected_wire_bytes(TINY, shape.training, s, stages)
                        for s in range(stages)}
        # The ends receive what the other end's direction carries: stage 0 the gradients,
        # the last stage the activations.
        got = {x.name: x.nbytes for x in p.links if x.name.endswith("rx")}
        assert got["stage 0 rx"] == expected_wire_bytes(TINY, shape.training, stages - 1, stages)
        assert got[f"stage {stages - 1} rx"] == expected_wire_bytes(TINY, shape.training, 0,
                                                                     stages)


def test_a_ring_member_sends_its_syncs_planned_bytes_over_the_period():
    """DiLoCo with H = 4 over 2 replicas: one sync every 4 steps, so a quarter of what the
    algorithm itself plans for the step it syncs after (asked of it directly here)."""
    shape = _shape(1, 2, sync={"mode": "diloco", "inner_steps": 4})
    works = stage_works(TINY, shape.training, 1, 2)
    per_step = sync_bytes_per_step(works, 2)
    module = StageModule(TINY, works[0].vocab, 0, 0, 2, 0, 1)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    sync = make_sync(shape.training, [p for _, p in named], None, None, 0, 2,
                     torch.device("cpu"), [n for n, _ in named])
    try:
        assert per_step == [sync.planned_bytes(3, False, False) / 4]
    finally:
        sync.close()
    p = predict(shape, [StageTimes(0.01, 0.02)], per_step)
    tx = {x.name: x.nbytes for x in p.links if x.name.endswith("tx")}
    assert tx == {"stage 0 replica 0 tx": per_step[0], "stage 0 replica 1 tx": per_step[0]}


def test_each_ring_is_priced_in_the_format_compress_when_gives_its_group():
    """``compress_when: below_mbps 100`` for the sync: stage 0's two replicas share a data
    centre (fp32 ring), stage 1's replica 1 sits at a home 50 Mbit/s away (int8 ring, as
    ``sync_codec`` gives the group): each stage's ring bytes are its own format's, as the
    cells' ``expected_sync_tx_bytes_per_step`` are."""
    net = {"sites": {"dc": {}, "home": {}}, "links": {"dc": {"home": {"mbps": 50}}},
           "cell_sites": [["dc", "dc"], ["dc", "home"]]}
    rule = {"below_mbps": 100, "applies_to": ["sync"]}
    coded = _training(network=net, compress_when=rule, sync={"compression": "int8"})
    works = stage_works(TINY, coded, 2, 2)
    fp32 = sync_bytes_per_step(stage_works(TINY, _training(), 2, 2), 2)
    int8 = sync_bytes_per_step(stage_works(TINY, _training(sync={"compression": "int8"}),
                                           2, 2), 2)
    assert sync_bytes_per_step(works, 2) == [fp32[0], int8[1]] and int8[1] < fp32[1] / 3


# --- bound, and the bandwidth for a utilisation -------------------------------------------------


def test_the_link_bounds_only_when_it_takes_longer_than_compute():
    shape = _shape(2)
    nbytes = expected_wire_bytes(TINY, shape.training, 0, 2)
    link_s = 8 * nbytes / 80e6
    slow = [StageTimes(link_s, link_s)] * 2  # compute far above the link's time
    fast = [StageTimes(link_s / 100, link_s / 100)] * 2
    assert predict(shape, slow).bound_by == "compute"
    assert not any(x.bound for x in predict(shape, slow).links)
    p = predict(shape, fast)
    assert p.bound_by == "stage 0 tx" and p.bound_kind == "link"
    assert p.step_seconds_overlap == pytest.approx(link_s)
    assert [x.name for x in p.links if x.bound] == ["stage 0 tx"]
    # Utilisation is over the predicted step (the frames' fill on top of the link's time).
    assert p.step_seconds > link_s and p.latency_seconds == 0.0
    assert p.stages[0].utilisation == pytest.approx(p.stages[0].compute_seconds / p.step_seconds)
    assert p.utilisation == pytest.approx(p.compute_seconds / p.step_seconds)


def test_stages_that_outnumber_a_shared_machine_s_cores_wait_for_one():
    """Three stages of f = 1, b = 2 (M = 4) on a machine that runs two ops at once: while the
    pipeline is full the three stages share two cores, so the step is longer than the
    classic 18, and no shorter than the 36 s of compute over the 2 cores; with cores for
    every stage (or none named) the classic critical path holds."""
    times = [StageTimes(1.0, 2.0)] * 3
    alone = compute_critical_path("1f1b", times, 4, clipped=False)
    shared = compute_critical_path("1f1b", times, 4, clipped=False, cores=2)
    assert alone == 18.0 == compute_critical_path("1f1b", times, 4, False, cores=3)
    assert shared >= 3 * 4 * 3.0 / 2 and shared > alone
    # One core: every op in series, whatever the schedule.
    assert compute_critical_path("gpipe", times, 4, clipped=False, cores=1) == 36.0
    shape = attrs.evolve(_shape(3, mbps=None), cores=2)
    p = predict(shape, times)
    assert p.compute_seconds == pytest.approx(
        compute_critical_path("1f1b", times, 4, clipped=True, cores=2))
    assert p.step_seconds >= p.compute_seconds > predict(_shape(3, mbps=None),
                                                          times).compute_seconds


# --- the predicted step, and latency as a bound -------------------------------------------------


def _played(shape: RunShape, times: list[StageTimes]) -> float:
    t = shape.training
    return simulate_step(t.schedule, times, t.micro_batches, t.grad_clip > 0, _frame_hop(shape))


def test_the_headline_is_the_schedule_played_out_and_latency_bounds_a_far_pipeline():
    """Three stages at sites a, b, c: a-b 1 ms, b-c 120 ms, both at 1 Gbit/s. Perfect overlap
    charges one latency and says compute; the played-out step pays the far hop on every
    round trip of 1F1B, is the headline, and names that boundary's latency."""
    from swarm_core.config.network import LinkMatrix
    from swarm_core.predict.network import MatrixNetwork

    m = structure({"sites": {"a": {}, "b": {}, "c": {}}, "stage_sites": ["a", "b", "c"],
                   "links": {"a": {"b": {"mbps": 1000, "latency_ms": 1}},
                             "b": {"c": {"mbps": 1000, "latency_ms": 120}},
                             "c": {"a": {"mbps": 1000, "latency_ms": 120}}}}, LinkMatrix)
    shape = attrs.evolve(_shape(3), network=MatrixNetwork(m, 3, UniformNetwork("far")))
    times = [StageTimes(0.01, 0.02)] * 3
    p = predict(shape, times)
    assert p.step_seconds == pytest.approx(_played(shape, times))
    assert p.step_seconds_overlap == pytest.approx(p.compute_seconds)  # (perfect overlap)
    assert p.step_seconds > 2 * p.step_seconds_overlap
    assert p.bound_kind == "latency" and p.bound_by == "latency stage 1 ↔ stage 2"
    assert not any(x.bound for x in p.links)
    assert p.latency_seconds > p.compute_seconds
    assert p.utilisation == pytest.approx(p.compute_seconds / p.step_seconds)


def test_latency_is_what_the_step_loses_with_every_latency_at_0():
    """Unshaped links with 200 ms a hop: the step with latency 0 is the compute path, so
    latency adds exactly the rest; over one boundary it is named, over two alike (a uniform
    chain) it is just "latency"."""
    times = [StageTimes(0.01, 0.02)] * 2
    shape = _shape(2, mbps=None, latency_ms=200.0)
    p = predict(shape, times)
    assert p.step_seconds == pytest.approx(_played(shape, times))
    assert p.latency_seconds == pytest.approx(p.step_seconds - p.compute_seconds)
    assert (p.bound_kind, p.bound_by) == ("latency", "latency stage 0 ↔ stage 1")
    three = predict(_shape(3, mbps=None, latency_ms=200.0), [StageTimes(0.01, 0.02)] * 3)
    assert (three.bound_kind, three.bound_by) == ("latency", "latency")
    # A short latency on slow compute: compute still sets the step.
    slow = predict(_shape(2, mbps=None, latency_ms=1.0), [StageTimes(1.0, 2.0)] * 2)
    assert (slow.bound_kind, slow.bound_by) == ("compute", "compute")
    assert 0 < slow.latency_seconds < slow.compute_seconds


@pytest.mark.parametrize("latency_ms", [0.0, 2.0])
def test_the_bandwidth_for_a_utilisation_gives_that_utilisation(latency_ms):
    shape = _shape(2, latency_ms=latency_ms)
    times = [StageTimes(0.002, 0.004, 0.001), StageTimes(0.003, 0.005, 0.001)]
    p = predict(shape, times)
    busiest = max(p.links, key=lambda x: x.nbytes)
    for u in ("50", "90", "99"):
        rate = busiest.mbps_for[u]
        assert rate is not None
        again = predict(attrs.evolve(shape, network=shape.network.with_rate(rate)), times)
        # (a perfect-overlap figure: the predicted step adds the fill and the hops' latency)
        assert again.compute_seconds / again.step_seconds_overlap == pytest.approx(int(u) / 100)
        assert again.utilisation <= int(u) / 100 + 1e-9


def test_no_bandwidth_is_enough_when_latency_alone_is_longer():
    times = [StageTimes(0.001, 0.001)] * 2
    p = predict(_shape(2, latency_ms=1000.0), times)
    assert all(x.mbps_for["50"] is None for x in p.links)


# --- the calibration cache ----------------------------------------------------------------------


def test_the_calibration_is_measured_once_and_reused(tmp_path):
    calls: list[int] = []

    def fake(work):
        calls.append(work.stage)
        return StageTimes(0.1 * (work.stage + 1), 0.2, 0.01)

    cache = tmp_path / "cal.json"
    works = stage_works(TINY, _training(), 2, 1)
    first = calibrate(works, cache, measure=fake)
    assert calls == [0, 1] and first.cached == [False, False]
    second = calibrate(works, cache, measure=fake)
    assert calls == [0, 1], "the second call read the cache"
    assert second.times == first.times and second.cached == [True, True]
    calibrate(works, cache, force=True, measure=fake)
    assert calls == [0, 1, 0, 1]
    calibrate(stage_works(TINY, _training(threads=2), 2, 1), cache, measure=fake)
    assert calls == [0, 1, 0, 1, 0, 1], "other threads: another key"


def test_measuring_a_stage_runs_its_module_and_keeps_torch_threads():
    before = torch.get_num_threads()
    times = [measure_stage(w) for w in stage_works(TINY, _training(threads=1), 2, 1)]
    assert all(t.forward > 0 and t.backward > 0 and t.optimizer > 0 for t in times)
    assert torch.get_num_threads() == before


# --- the command --------------------------------------------------------------------------------


def _job(tmp_path, **training):
    body = {"name": "tiny", "kind": "train", "topology": {"stages": 2},
            "model": attrs.asdict(TINY),
            "training": {"steps": 10, "batch_size": 8, "micro_batches": 4,
                         "link": {"tx_mbps": 8.0, "rx_mbps": 8.0, "latency_ms": 1.0},
                         **training}}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(body))
    return path


def test_json_output_has_the_documented_fields(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("swarm_tui.commands.predict.measure_stage",
                        lambda w: StageTimes(0.001, 0.002, 0.0005))
    assert run(["predict", str(_job(tmp_path)), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (r,) = out["runs"]
    assert isinstance(r["step_seconds"], float) and r["step_seconds"] > 0
    assert r["step_seconds_overlap"] <= r["step_seconds"] and "step_seconds_simulated" not in r
    assert r["step_seconds_overlap"] <= r["step_seconds_no_overlap"]
    assert 0 <= r["latency_seconds"] <= r["step_seconds"]
    assert r["utilisation"] == pytest.approx(r["compute_seconds"] / r["step_seconds"])
    assert [set(s) for s in r["stages"]] == [{"stage", "compute_seconds", "utilisation"}] * 2
    assert r["bound_kind"] in {"compute", "link", "latency"}
    assert r["bound_by"] in {x["name"] for x in r["links"]} | {"compute"} or \
        r["bound_by"].startswith("latency")
    for link in r["links"]:
        assert {"name", "bytes_per_step", "seconds_per_step", "bound", "mbps_for"} <= set(link)
        assert set(link["mbps_for"]) == {"50", "90", "99"}
    assert sum(x["bound"] for x in r["links"]) == (r["bound_kind"] == "link")


@pytest.mark.parametrize("body, needle", [
    ("{not json", "not JSON"),
    ('{"kind": "train", "topology": {"stages": 2}, "training": {"micro_batches": 0}}',
     "micro_batches"),
    ('{"name": "x", "sweep": {}}', "training_config"),
])
def test_a_bad_config_is_one_line_and_a_usage_error(tmp_path, capsys, body, needle):
    path = tmp_path / "bad.json"
    path.write_text(body)
    assert run(["predict", str(path)]) == ExitCode.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_a_swarm_wired_job_is_predicted_in_gpipe_s_order(tmp_path, capsys, monkeypatch):
    """A routed step runs GPipe's order whatever the training's schedule: a swarm-wired job
    under ``eager`` is predicted as GPipe plays it (where eager's order is faster), and says
    so; a chain under eager keeps eager's. A layout (stages of unequal cells) is played cell
    by cell: each stage deals the shares' micro-batches to its own cells, stage 0 too."""
    monkeypatch.setattr("swarm_tui.commands.predict.measure_stage",
                        lambda w: StageTimes(0.001, 0.002, 0.0005))

    def predicted(**topology) -> dict:
        path = _job(tmp_path, schedule="eager")
        body = json.loads(path.read_text())
        body["topology"] = {"stages": 2, "replicas": 2, **topology}
        path.write_text(json.dumps(body))
        assert run(["predict", str(path), "--format", "json"]) == 0
        (r,) = json.loads(capsys.readouterr().out)["runs"]
        return r

    chain, routed = predicted(), predicted(wiring="swarm")
    assert (chain["schedule"], routed["schedule"]) == ("eager", "gpipe")
    times = [StageTimes(0.001, 0.002, 0.0005)] * 2
    # (played cell by cell: stage 1's cells take micro-batches from both of stage 0's, so
    # a chain's GPipe is a floor, not the figure)
    assert routed["compute_seconds"] >= compute_critical_path("gpipe", times, 4, clipped=True)
    assert chain["compute_seconds"] < routed["compute_seconds"]
    assert routed["deals"] == [{"0": 4.0, "1": 4.0}] * 2 and chain["deals"] == []
    laid = predicted(wiring="swarm", layout=[[0], [0, 1, 2]])
    assert laid["deals"][0] == {"0": 8.0}
    assert sorted(laid["deals"][1]) == ["0", "1", "2"] and sum(laid["deals"][1].values()) == 8
    # (stage 0's one cell runs all eight micro-batches: the step is longer than the grid's)
    assert laid["compute_seconds"] > routed["compute_seconds"]
    assert {x["name"] for x in laid["links"]} >= {"stage 1 replica 2 tx", "stage 0 replica 0 tx"}
    path = _job(tmp_path, schedule="eager")
    body = json.loads(path.read_text())
    body["topology"] = {"stages": 2, "replicas": 2, "wiring": "swarm",
                        "layout": [[0], [0, 1, 2]]}
    path.write_text(json.dumps(body))
    assert run(["predict", str(path), "--slowdown", "0.1=2"]) == ExitCode.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--slowdown: no cell 0.1" in err[0] and "layout" in err[0]


# --- per-pair links (a link matrix) and the scenario library ------------------------------------


def test_a_matrix_network_takes_each_pairs_rate_and_the_sites_caps():
    from swarm_core.config.network import LinkMatrix
    from swarm_core.predict.network import MatrixNetwork

    m = structure({"sites": {"a": {"up_mbps": 50}, "b": {"down_mbps": 30}},
                   "links": {"a": {"b": {"mbps": 8, "latency_ms": 4}}}}, LinkMatrix)
    net = MatrixNetwork(m, 2, UniformNetwork("u", 100.0, 20.0, 1.0))
    assert (net.tx((0, 0)).mbps, net.rx((1, 0)).mbps, net.rx((0, 0)).mbps) == (50.0, 20.0, 20.0)
    assert net.pair((0, 0), (1, 0)).mbps == 8.0
    assert net.pair((1, 0), (0, 0)).latency_s == pytest.approx(0.005)  # (pair + profile)
    times = [StageTimes(1e-4, 1e-4)] * 2
    p = predict(attrs.evolve(_shape(2), network=net), times)
    busiest = max(p.links, key=lambda x: x.seconds)
    assert busiest.name == "stage 0 → stage 1"  # (8 Mbit/s: below every cap)
    # Its bytes take 16.7 ms a step at 8 Mbit/s; the 5 ms a hop adds 20 ms to the played-out
    # step (1F1B's round trips): latency bounds it.
    assert Link(8.0).seconds(busiest.nbytes) < p.latency_seconds
    assert (p.bound_kind, p.bound_by) == ("latency", "latency stage 0 ↔ stage 1")
    # At 2 Mbit/s the same pair's bytes outweigh the latency: the bandwidth-bound case names
    # its link.
    slow = attrs.evolve(m, links={"a": {"b": attrs.evolve(m.links["a"]["b"], mbps=2.0)}})
    p = predict(attrs.evolve(_shape(2), network=attrs.evolve(net, matrix=slow)), times)
    assert (p.bound_kind, p.bound_by) == ("link", "stage 0 → stage 1")
    assert [x.name for x in p.links if x.bound] == ["stage 0 → stage 1"]
    assert p.step_seconds > p.step_seconds_overlap == pytest.approx(
        Link(2.0, 0.005).seconds(busiest.nbytes))


LIBRARY = ["dtfm-datacenter", "dtfm-spot", "dtfm-multi-university", "dtfm-regional-us",
           "dtfm-worldwide", "home-asymmetric-500-110", "volunteer-200mbps-80ms",
           "uniform-80mbps"]


@pytest.mark.parametrize("scenario", LIBRARY)
def test_predict_runs_over_each_library_scenario(tmp_path, capsys, monkeypatch, scenario):
    from swarm_core.config.profiles import load_network_scenario

    monkeypatch.setattr("swarm_tui.commands.predict.measure_stage",
                        lambda w: StageTimes(0.001, 0.002, 0.0005))
    profile = load_network_scenario(scenario)
    assert profile.description  # (each names the source of its numbers)
    assert run(["predict", str(_job(tmp_path)), "--scenario", scenario, "--stages", "2",
                "--format", "json"]) == ExitCode.USAGE  # (CONFIG or the profile flags)
    capsys.readouterr()
    assert run(["predict", str(_job(tmp_path)), "--scenario", scenario,
                "--format", "json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["runs"]
    assert r["network"] == scenario and r["step_seconds"] > 0
    pairs = {x["name"]: x for x in r["links"] if "→" in x["name"] and "tx" not in x["name"]}
    if scenario == "dtfm-worldwide":  # (cells round robin: Oregon, then Virginia)
        assert pairs["stage 0 → stage 1"]["mbps"] == 790.0
        # (the scenario instead of the job's own 8 Mbit/s, 1 ms link)
        assert pairs["stage 0 → stage 1"]["latency_ms"] == pytest.approx(67.0)


def test_a_scenario_that_is_not_there_or_does_not_fit_is_one_line(tmp_path, capsys):
    assert run(["predict", str(_job(tmp_path)), "--scenario", "dtfm-mars"]) == ExitCode.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no network scenario 'dtfm-mars'" in err[0]
    pinned = tmp_path / "pinned.json"
    pinned.write_text(json.dumps({"name": "pinned", "matrix": {
        "sites": {"a": {}, "b": {}}, "links": {"a": {"b": {"mbps": 5}}},
        "stage_sites": ["a", "b", "a"]}}))
    assert run(["predict", str(_job(tmp_path)), "--scenario", str(pinned)]) == ExitCode.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stage_sites names 3 sites for 2 stages" in err[0]
    # (a layout's extra cell, id 2, needs a site as much as the shares' cells do)
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({**json.loads(_job(tmp_path).read_text()), "topology": {
        "stages": 2, "replicas": 2, "wiring": "swarm", "layout": [[0, 1], [0, 1, 2]]}}))
    by_replica = tmp_path / "by-replica.json"
    by_replica.write_text(json.dumps({"name": "by-replica", "matrix": {
        "sites": {"a": {}, "b": {}}, "links": {"a": {"b": {"mbps": 5}}},
        "replica_sites": ["a", "b"]}}))
    assert run(["predict", str(layout), "--scenario", str(by_replica)]) == ExitCode.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "replica_sites names 2 sites for 3 cell ids (the layout's) " \
        "(tiny is 2 x 2, layout [[0, 1], [0, 1, 2]])" in err[0], err


def test_the_predictor_prices_each_link_in_the_format_compress_when_gives_it():
    """Selective compression: replica 1's chain codes int8, replica 0's sends fp32; each
    flow's bytes are what its own link's sender sends (the stage's own expected bytes)."""
    from swarm_core.predict.traffic import step_flows

    mc = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16, compression="fixed_int8")
    tc = structure({"batch_size": 8, "micro_batches": 2,
                    "compress_when": {"replicas": [1], "applies_to": ["boundary"]}},
                   TrainingConfig)
    flows = {(f.src, f.dst): f.nbytes for f in step_flows(mc, tc, 2, 2)}
    for r in (0, 1):
        assert flows[((0, r), (1, r))] == expected_wire_bytes(mc, tc, 0, 2, 2, r)
        assert flows[((1, r), (0, r))] == expected_wire_bytes(mc, tc, 1, 2, 2, r)
    assert flows[((0, 1), (1, 1))] < flows[((0, 0), (1, 0))] / 3


def test_stages_sharing_one_machine_s_cores_wait_for_them(tmp_path, capsys, monkeypatch):
    """``--cores N``: every stage on one machine (a local cluster). Two stages on one core
    take at least their compute one after the other; on two cores, or a machine each, as
    the schedule lets them overlap. A core count that is not one is a one-line error."""
    monkeypatch.setattr("swarm_tui.commands.predict.measure_stage",
                        lambda w: StageTimes(0.01, 0.02, 0.0))
    steps = {}
    for cores in (None, "2", "1"):
        extra = [] if cores is None else ["--cores", cores]
        assert run(["predict", str(_job(tmp_path)), *extra, "--format", "json"]) == 0
        (r,) = json.loads(capsys.readouterr().out)["runs"]
        steps[cores] = r["step_seconds"]
    assert steps["2"] == pytest.approx(steps[None])
    # (one core: every op of both stages in turn, 4 micro-batches of 10 + 20 ms each)
    assert steps["1"] >= 2 * 4 * 0.03 - 1e-9 > steps[None]
    with pytest.raises(SystemExit) as bad:
        run(["predict", str(_job(tmp_path)), "--cores", "0"])
    assert bad.value.code == ExitCode.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "core count" in err[0]


# --- a routed step, cell by cell (swarm wiring, unequal deals, slowed cells) ----------------


def test_a_routed_step_is_played_cell_by_cell():
    """S=2, R=2, M=2, f=1, b=2: stage 1's cell 0 runs micro-batches 0, 2, 1 (in the order
    they are made), its cell 1 micro-batch 3. By hand: stage 1 cell 0's forwards end at 2, 3,
    4, its backwards (1, 2, 0) at 6, 8, 10; stage 0 cell 0's backwards of 1 and 0 at 8 and 12:
    a step of 12. Cell 1.1 slowed 4x: its forward of 3 computes 2-3 and pads to 6, its
    backward computes 6-8 (its frame queued then) and pads to 14; stage 0 cell 1's backwards
    of 3 and 2 end at 10 and 12: a step of 14, the slowed cell's padding last. One core for
    all: 24, every op in turn."""
    plan = [[0, 0, 1, 1], [0, 0, 0, 1]]
    times = (StageTimes(1.0, 2.0, 0.0),) * 2
    run = RoutedRun([plan], times, 2, clipped=False)
    assert run.step() == 12.0
    assert run.dealt() == [{0: 2.0, 1: 2.0}, {0: 3.0, 1: 1.0}]
    assert run.compute() == [6.0, 9.0]
    assert RoutedRun([plan], times, 2, {(1, 1): 4.0}, clipped=False).step() == 14.0
    assert RoutedRun([plan], times, 2, clipped=False, cores=1).step() == 24.0
    # (a hop of 0.5 s a frame, no latency: stage 1 cell 1's forward of 3 waits for it)
    assert RoutedRun([plan], times, 2, clipped=False).step(lambda s, k, a, b: (0.5, 0.0)) \
        > 12.0


def test_measured_routes_deal_by_speed_and_a_slowed_chain_holds_a_dp_step(tmp_path, capsys,
                                                                         monkeypatch):
    """``--slowdown 1.1=4``: a chain-wired dp step waits for replica 1's chain, its stage 1
    four times as slow; measured swarm routes deal that cell about a quarter of stage 1's
    share (SWARM's estimate converges to the cells' speeds) and the step comes close to the
    capacity bound, the slowest stage's summed cell speeds: R M (f + b) / (1 + 1/4)."""
    monkeypatch.setattr("swarm_tui.commands.predict.measure_stage",
                        lambda w: StageTimes(0.001, 0.002, 0.0))

    def predicted(*flags: str, **topology) -> dict:
        path = _job(tmp_path, micro_batches=8, batch_size=16, grad_clip=0.0)
        body = json.loads(path.read_text())
        body["topology"] = {"stages": 2, "replicas": 2, **topology}
        path.write_text(json.dumps(body))
        assert run(["predict", str(path), "--format", "json", *flags]) == 0
        (r,) = json.loads(capsys.readouterr().out)["runs"]
        return r

    chain = predicted()
    slow_chain = predicted("--slowdown", "1.1=4")
    assert slow_chain["compute_seconds"] > 3 * chain["compute_seconds"]
    routed = predicted("--slowdown", "1.1=4", wiring="swarm", routing="measured")
    deal = routed["deals"][1]
    assert deal["0"] + deal["1"] == 16 and 2 <= deal["1"] <= 4
    bound = 16 * 0.003 / 1.25
    assert bound <= routed["compute_seconds"] <= 1.25 * bound
    assert routed["compute_seconds"] < slow_chain["compute_seconds"] / 2


@pytest.mark.parametrize("flag", ["1.1", "x=4", "1.1=0.5", "1=4", "1.1=nan"])
def test_a_bad_slowdown_is_one_line(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as exc:
        run(["predict", str(_job(tmp_path)), "--slowdown", flag])
    assert exc.value.code == ExitCode.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--slowdown" in err[0]


def test_a_slowdown_of_a_cell_the_job_lacks_is_one_line(tmp_path, capsys):
    assert run(["predict", str(_job(tmp_path)), "--slowdown", "3.0=2"]) == ExitCode.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--slowdown: no cell 3.0" in err[0]


def test_a_routed_steps_frames_cross_the_pairs_its_plan_deals():
    """Each micro-batch's frames go from the cell that ran it to the cell that runs it next:
    with micro-batches 0 and 1 from cell 0.0 to 1.0, 2 from 0.1 to 1.0 and 3 from 0.1 to 1.1,
    the pairs carry 2, 1 and 1 frames' bytes each way (a chain link's frames over M), the
    norm exchange's frame rides the chain pairs (0.0-1.0, 0.1-1.1) alone, and all of them
    together carry the two chains' bytes."""
    from swarm_core.pipeline.wire_math import link_bytes
    from swarm_core.predict.traffic import routed_flows, step_flows

    t = _training(batch_size=4, micro_batches=2)
    flows = routed_flows(TINY, t, [[[0, 0, 1, 1], [0, 0, 0, 1]]])
    act = {(f.src, f.dst): f.nbytes for f in flows if f.what == "act"}
    frame = link_bytes(TINY, t, (0, 0), (1, 0), 2, 2, norm=False) / 2
    norm = link_bytes(TINY, t, (0, 0), (1, 0), 2, 2) - 2 * frame
    assert norm > 0  # (clipping is on)
    assert act == {((0, 0), (1, 0)): 2 * frame + norm, ((0, 1), (1, 0)): frame,
                   ((0, 1), (1, 1)): frame + norm}
    assert {(f.dst, f.src) for f in flows if f.what == "grad"} == set(act)
    chains = step_flows(TINY, t, 2, 2)
    assert sum(f.nbytes for f in flows) == pytest.approx(sum(f.nbytes for f in chains))


def test_a_slowdowns_padding_holds_no_core():
    """Two cells a stage, one micro-batch each, one core for all, cell 1.1 slowed 3x: its
    pad is slept, so cell 1.0's backward takes the core meanwhile. By hand: 1.1's forward
    computes 3-4 and sleeps to 6, 1.0's backward runs 4-5, 0.0's 5-6, 1.1's backward computes
    6-7 (its frame queued at 7) and sleeps to 9, 0.1's runs 7-8: 9 s, 1.1's padding last (12
    if the padding held the core and the frame waited for it)."""
    plan = [[0, 1], [0, 1]]
    times = (StageTimes(1.0, 1.0, 0.0),) * 2
    run = RoutedRun([plan], times, 1, {(1, 1): 3.0}, clipped=False, cores=1)
    assert run.step() == 9.0
    assert StageTimes(1.0, 2.0, 0.5, pace=3.0).per_step(2) == 18.5


def test_chains_that_share_cores_compete_for_them():
    """A dp step of two chains (2 stages, M = 4, f = 1, b = 2) on one machine of 2 cores:
    the four cells' 48 s of work take at least 24 s; one chain played alone (15 s) would
    leave the other chain's work out. On cores of their own the chains run alike."""
    from swarm_core.predict.critical_path import simulate_chains

    times = [StageTimes(1.0, 2.0)] * 2
    shared = simulate_chains("gpipe", [times, times], 4, False, cores=2)
    assert shared >= 24.0
    assert simulate_step("gpipe", times, 4, False, cores=2) == 15.0
    assert simulate_chains("gpipe", [times, times], 4, False) == 15.0
    assert predict(_shape(replicas=2, micro_batches=4, grad_clip=0.0, mbps=None),
                   times).compute_seconds == 15.0
    cored = attrs.evolve(_shape(replicas=2, micro_batches=4, grad_clip=0.0, mbps=None),
                         cores=2)
    assert predict(cored, times).compute_seconds == shared
