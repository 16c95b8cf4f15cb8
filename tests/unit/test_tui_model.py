"""The console's plain-Python parts: the cluster model, cells, forms, the launcher's sources, the
`swarm-tui` flags, and which of these stay free of Textual."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarm_core.contract import LinkChange, Topology
from swarm_core.protocol import FellowInfo, LinkLimits
from swarm_tui.app.cells import (
    FELLOW_COLUMNS,
    Cell,
    fellow_cells,
    progress_bar,
    watch_cells,
)
from swarm_tui.app.forms import FormError, parse_speed
from swarm_tui.app.launch import (
    TORCH_NOTE,
    ExperimentSource,
    LaunchChoice,
    LaunchPlan,
    ProfileSource,
    grid_text,
    launch_summary,
    run_summary,
)
from swarm_tui.app.model import ClusterModel, RateMeter
from swarm_tui.cli import main_tui
from swarm_tui.fmt import fmt_age, fmt_bytes, fmt_rate
from tests.support import REPO
from tests.tui_support import T0, fixed_fellows, fixed_jobs, snapshot_configs


def hb(fid: int, ts: float, seq: int, **data: object) -> dict[str, object]:
    body = {"fellow_id": fid, "name": f"f{fid}", "status": "ready", "job_id": None, "step": 0,
            "loss": None, "tokens_per_s": 0.0,
            "link": {"tx_mbps": None, "rx_mbps": None, "latency_ms": 0.0},
            "counters": {"control_tx": 0, "control_rx": 0, "data_tx": 0, "data_rx": 0}}
    body.update(data)
    return {"seq": seq, "ts": ts, "type": "fellow.heartbeat", "data": body}


def test_rate_meter_windows_and_resets() -> None:
    m = RateMeter()
    assert not m.sample(1000, 10.0) and m.rate is None
    assert not m.sample(1100, 10.2)  # too short a window: wait for a wider one
    assert m.sample(3000, 11.0) and m.rate == pytest.approx(2000.0)
    assert m.sample(500, 12.0) and m.rate is None  # went backwards: the fellow restarted
    assert m.sample(1500, 13.0) and m.rate == pytest.approx(1000.0)


def test_snapshot_then_events_update_in_place() -> None:
    clock = [T0]
    model = ClusterModel(lambda: clock[0])
    change = model.apply_fellows(fixed_fellows())
    assert change.fellow_rows and change.fellows == {0, 1, 2, 3, 4, 5}
    assert model.fellows[3].stale and model.heartbeat_age(model.fellows[3]) == pytest.approx(9)
    # An event for a known fellow changes that row only; rows neither come nor go.
    change = model.apply_event(hb(2, T0, 1, counters={"data_tx": 1_000_000, "data_rx": 0,
                                                       "control_tx": 0, "control_rx": 0}))
    assert change.fellows == {2} and not change.fellow_rows
    st = model.fellows[2]
    assert st.counters["data_tx"] == 1_000_000 and st.tx.rate == pytest.approx(1_000_000)
    assert st.tx_mbps == pytest.approx(8.0)
    # A snapshot older than the newest event does not roll the counters back.
    model.apply_fellows(fixed_fellows())
    assert st.counters["data_tx"] == 1_000_000
    # The leader's own judgement arrives without a heartbeat and keeps the age running.
    clock[0] = T0 + 7
    model.apply_event({"seq": 2, "ts": T0 + 7, "type": "fellow.status",
                       "data": {"fellow_id": 2, "status": "stale"}})
    assert st.stale and model.heartbeat_age(st) == pytest.approx(7)
    assert any("ready -> stale" in text for _, text in st.events)
    # A gap in sequence numbers asks for a snapshot.
    assert not model.need_refresh
    model.apply_event(hb(2, T0 + 8, 5))
    assert model.need_refresh


def test_a_set_speed_shows_in_the_fellows_log_with_the_job_that_records_it() -> None:
    model = ClusterModel(lambda: T0)
    model.apply_fellows(fixed_fellows())
    model.apply_event({"seq": 1, "ts": T0, "type": "fellow.set_speed", "data": {
        "fellow_id": 2, "job_id": "job-000007", "tx_mbps": 8.0, "rx_mbps": None,
        "latency_ms": 40.0}})
    model.apply_event({"seq": 2, "ts": T0, "type": "fellow.set_speed", "data": {
        "fellow_id": 2, "job_id": None, "tx_mbps": None, "rx_mbps": None, "latency_ms": 0.0}})
    assert [text for _, text in model.fellows[2].events][-2:] == [
        "set-speed requested: tx 8 Mbit/s, rx unlimited, +40 ms (recorded in job job-000007)",
        "set-speed requested: tx unlimited, rx unlimited"]


def test_unknown_fellow_and_job_events_ask_for_a_snapshot() -> None:
    model = ClusterModel(lambda: T0)
    change = model.apply_event(hb(9, T0, 1, name="new"))
    assert change.fellow_rows and model.fellows[9].name == "new" and model.need_refresh
    model.need_refresh = False
    change = model.apply_event({"seq": 2, "ts": T0, "type": "job.submitted", "data": {
        "job_id": "job-000007", "name": "x", "kind": "train", "state": "PENDING",
        "last_step": 0, "last_loss": None, "fellows": [], "reason": ""}})
    assert change.job_rows and model.jobs["job-000007"].partial and model.need_refresh
    assert model.jobs["job-000007"].info.kind == "train"  # (before the snapshot comes)


def test_metrics_extend_the_loss_curve_once_per_step() -> None:
    model = ClusterModel(lambda: T0)
    model.apply_jobs(fixed_jobs())
    view = model.jobs["job-000002"]
    n = len(view.info.loss_history)
    for fid in (0, 1):  # two fellows report the same step: one point
        model.apply_event({"seq": 1 + fid, "ts": T0, "type": "metric", "data": {
            "job_id": "job-000002", "fellow_id": fid, "step": 121, "loss": 2.4,
            "tokens_per_s": 1800.0, "state": "RUNNING", "metrics": {}}})
    assert len(view.info.loss_history) == n + 1 and view.info.last_step == 121
    assert view.per_stage[1].step == 121 and view.per_stage[1].tokens_per_s == 1800.0


def test_watch_row_shows_each_stages_memory_and_link_wait() -> None:
    model = ClusterModel(lambda: T0)
    model.apply_fellows(fixed_fellows())
    model.apply_jobs(fixed_jobs())
    view = model.jobs["job-000002"]
    event = {"job_id": "job-000002", "fellow_id": 1, "step": 121, "loss": 2.4,
             "tokens_per_s": 1800.0, "state": "RUNNING",
             "metrics": {"activation_peak_bytes": 9_700_000, "step_seconds": 0.5,
                         "wait_seconds": 0.11}}
    model.apply_event({"seq": 1, "ts": T0, "type": "metric", "data": event})
    cells = watch_cells(model, view, 1)
    assert cells["act"].plain == fmt_bytes(9_700_000, compact=True) and cells["wait"].plain == "22%"
    assert cells["wait"].sort_key[1] == pytest.approx(0.22)
    # A report without the timing (an eval) leaves the last step's share in place.
    model.apply_event({"seq": 2, "ts": T0, "type": "metric",
                       "data": {**event, "metrics": {"eval_loss": 2.5}}})
    assert watch_cells(model, view, 1)["wait"].plain == "22%"
    assert watch_cells(model, view, 0)["wait"].plain == "-"  # nothing reported yet


def test_watch_rows_are_stages_so_a_two_slot_fellow_shows_both() -> None:
    """A fellow with two device slots holds two stages of one job: each has its own row, with
    its own memory and waits, however the reports interleave."""
    model = ClusterModel(lambda: T0)
    model.apply_fellows(fixed_fellows())
    model.apply_jobs(fixed_jobs())
    view = model.jobs["job-000002"]
    view.info.fellows = [0, 0, 1]
    for seq, (stage, wait, peak) in enumerate(((0, 0.40, 50_000_000), (1, 0.02, 1_000_000))):
        model.apply_event({"seq": seq + 1, "ts": T0, "type": "metric", "data": {
            "job_id": "job-000002", "fellow_id": 0, "stage": stage, "step": 121, "loss": None,
            "tokens_per_s": 1800.0, "state": "RUNNING",
            "metrics": {"activation_peak_bytes": peak, "step_seconds": 1.0,
                        "wait_seconds": wait}}})
    rows = [watch_cells(model, view, s) for s in range(3)]
    assert [(r["id"].plain, r["stage"].plain) for r in rows] == [("0", "0"), ("0", "1"),
                                                                 ("1", "2")]
    assert [r["wait"].plain for r in rows] == ["40%", "2%", "-"]
    assert rows[0]["act"].plain == fmt_bytes(50_000_000, compact=True)
    assert rows[1]["act"].plain == fmt_bytes(1_000_000, compact=True)


def test_cells_sort_by_value_with_missing_values_last() -> None:
    a, b, missing = Cell("10", 10.0, key=1), Cell("9", 9.0, key=2), Cell("-", None, key=0)
    assert sorted([missing, a, b], key=lambda c: c.sort_key) == [b, a, missing]
    model = ClusterModel(lambda: T0)
    model.apply_fellows(fixed_fellows())
    cells = fellow_cells(model, model.fellows[3], marked=True)
    assert set(cells) == {c.key for c in FELLOW_COLUMNS}
    assert cells["sel"].plain == "●" and "red" in str(cells["name"].style)  # stale stands out
    assert cells["tx_lim"].plain == "∞" and cells["hb"].plain == "9s"


def test_number_formats() -> None:
    assert [fmt_age(x) for x in (None, 3.9, 150, 7200)] == ["-", "3s", "2m", "2h"]
    assert fmt_bytes(512, compact=True) == "512B" and \
        fmt_bytes(3 * 1024 * 1024, compact=True) == "3.0M"
    assert [fmt_rate(x) for x in (None, 1.234, 12.34, 1234.5)] == ["-", "1.23", "12.3", "1234"]
    assert progress_bar(5, 10, 4) == "██░░ 5/10"


@pytest.mark.parametrize(("tx", "rx", "lat", "error"), [
    ("fast", "", "", "tx Mbit/s: 'fast' is not a number"),
    # One form for every out-of-range value: what was typed, the range, what empty means.
    ("-1", "", "", "tx Mbit/s: '-1' is out of range (0.001 to 1e+06; leave it empty for "
     "unlimited)"),
    ("", "0", "", "rx Mbit/s: '0' is out of range (0.001 to 1e+06;"),
    ("1e9", "", "", "tx Mbit/s: '1e9' is out of range (0.001 to 1e+06; leave it empty for "
     "unlimited)"),
    ("inf", "", "", "tx Mbit/s: 'inf' is not a number (leave it empty for unlimited)"),
    ("1e999", "", "", "tx Mbit/s: '1e999' is out of range (0.001 to 1e+06; leave it empty "
     "for unlimited)"),
    ("-1e999", "", "", "tx Mbit/s: '-1e999' is out of range"),
    ("1_000", "", "", "tx Mbit/s: '1_000' is not a number"),
    ("\u0663", "", "", "tx Mbit/s: '\u0663' is not a number"),  # an Arabic-Indic 3
    ("9" * 5000, "", "", "tx Mbit/s: '999999999999999999999999...' is out of range"),
    ("x" * 5000, "", "", "tx Mbit/s: 'xxxxxxxxxxxxxxxxxxxxxxxx...' is not a number"),
    ("", "", "-2", "latency ms: '-2' is out of range (0 to 60000; leave it empty for 0 ms)"),
    ("", "", "1e9", "latency ms: '1e9' is out of range (0 to 60000; leave it empty for 0 ms)"),
    ("", "", "nan", "latency ms: 'nan' is not a number (leave it empty for 0 ms)"),
    ("", "", "unlimited", "latency ms: 'unlimited' is not a number (leave it empty for 0 ms)"),
])
def test_set_speed_form_errors(tx: str, rx: str, lat: str, error: str) -> None:
    with pytest.raises(FormError) as exc:
        parse_speed(tx, rx, lat)
    assert error in str(exc.value)


def test_set_speed_form_values() -> None:
    req = parse_speed(" 80 ", "", "")
    assert (req.tx_mbps, req.rx_mbps, req.latency_ms) == (80.0, None, 0.0)
    req = parse_speed("unlimited", "12.5", "20")
    assert (req.tx_mbps, req.rx_mbps, req.latency_ms) == (None, 12.5, 20.0)
    req = parse_speed("1e3", "+5", "-")  # ("none" and "-" mean nothing: no added latency)
    assert (req.tx_mbps, req.rx_mbps, req.latency_ms) == (1000.0, 5.0, 0.0)
    assert parse_speed(".5", "5.", "none").tx_mbps == 0.5


def test_profile_source_plans_one_train_job(tmp_path: Path) -> None:
    src = ProfileSource(snapshot_configs(tmp_path))
    assert src.options("model") == ["model/small_fixed_int8.json", "model/small_none.json"]
    assert src.options("training") == ["training/quickstart_shakespeare.json",
                                       "training/tiny_sweep.json"]
    assert src.options("fellows") == []
    plan = src.plan(LaunchChoice("model/small_none.json", "training/quickstart_shakespeare.json",
                                 fellows="3", steps="7"))
    assert plan.ok and len(plan.runs) == 1
    run = plan.runs[0]
    assert (run.kind, run.name, run.topology.fellows) == ("train", "small_none", 3)
    assert run.training.steps == 7 and run.model.compression == "none"
    bad = src.plan(LaunchChoice("model/small_none.json", "training/quickstart_shakespeare.json",
                                fellows="two"))
    assert not bad.ok and bad.field == "$.topology.fellows" and "whole number" in bad.error
    for typed in ("1_0", "\u0663", "9" * 5000):  # int() takes the first two, chokes on the last
        bad = src.plan(LaunchChoice("model/small_none.json",
                                    "training/quickstart_shakespeare.json", fellows=typed))
        assert not bad.ok and "whole number" in bad.error and len(bad.error) < 80, bad.error
    # A sweep's training profile (its cluster, network and artifacts sections) runs as one
    # job as `swarm submit --training` runs it: the cluster's fellows unless typed; replicas
    # split them into stages x replicas.
    plan = src.plan(LaunchChoice("model/small_none.json", "training/tiny_sweep.json"))
    assert plan.ok, plan.error
    topo = plan.runs[0].topology
    assert (topo.fellows, topo.stages, topo.replicas) == (2, 2, 1)
    assert plan.runs[0].training.shard_push_interval_steps == 0
    plan = src.plan(LaunchChoice("model/small_none.json", "training/tiny_sweep.json",
                                 fellows="4", replicas="2"))
    topo = plan.runs[0].topology
    assert (topo.fellows, topo.stages, topo.replicas) == (4, 2, 2)
    assert run_summary(plan.runs[0])[1].startswith("4 fellows · 2x2 · dp · 3 steps")
    bad = src.plan(LaunchChoice("model/small_none.json", "training/tiny_sweep.json",
                                fellows="3", replicas="2"))
    assert not bad.ok and bad.field == "$.topology.replicas" and "stages" in (bad.error or "")
    (tmp_path / "configs" / "training" / "bad.json").write_text('{"steps": -1}')
    bad = src.plan(LaunchChoice("model/small_none.json", "training/bad.json"))
    assert not bad.ok and (bad.error or "").startswith("training/bad.json: $.steps:")
    (tmp_path / "configs" / "model" / "broken.json").write_text('{"n_layers": "many"}')
    bad = src.plan(LaunchChoice("model/broken.json", "training/quickstart_shakespeare.json"))
    assert not bad.ok and bad.field is not None and bad.field.startswith("$.model")
    (tmp_path / "configs" / "model" / "notjson.json").write_text("{")
    bad = src.plan(LaunchChoice("model/notjson.json", "training/quickstart_shakespeare.json"))
    assert "not valid JSON" in (bad.error or "")


def test_the_launchers_grid_is_stages_by_replicas_as_the_cli_says(tmp_path: Path) -> None:
    """Issue 36 point 10: the form's field is stages (`swarm submit --stages`), so stages 2
    and replicas 2 are a 2 x 2 job of 4 fellows; the preview's notes state the grid."""
    src = ProfileSource(snapshot_configs(tmp_path))
    assert "stages" in src.fields and "fellows" not in src.fields
    model = "model/small_none.json"
    for profile, stages, replicas, want in (
            ("training/quickstart_shakespeare.json", "2", "2", (2, 2, 4)),
            ("training/quickstart_shakespeare.json", "", "", (2, 1, 2)),  # no cluster: 2
            ("training/quickstart_shakespeare.json", "", "2", (2, 2, 4)),
            ("training/tiny_sweep.json", "3", "", (3, 1, 3)),  # over its cluster's 2 fellows
            ("training/tiny_sweep.json", "", "2", (1, 2, 2))):  # its 2 fellows, as 1 x 2
        plan = src.plan(LaunchChoice(model, profile, stages=stages, replicas=replicas))
        assert plan.ok, plan.error
        topo = plan.runs[0].topology
        assert (topo.stages, topo.replicas, topo.fellows) == want
        assert plan.notes[0] == f"grid: {grid_text(topo)}"
    assert grid_text(Topology(stages=2, replicas=2)) == "2 stages x 2 replicas = 4 fellows"
    assert grid_text(Topology(fellows=1)) == "1 stage x 1 replica = 1 fellow"
    assert grid_text(Topology(stages=2, replicas=2, slots_per_fellow=2)) \
        == "2 stages x 2 replicas = 2 fellows of 2 slots"
    bad = src.plan(LaunchChoice(model, "training/tiny_sweep.json", stages="two"))
    assert not bad.ok and bad.field == "$.topology.stages" and "whole number" in bad.error
    # What the launch's question says: each run's name and grid, the first four of them.
    sweep = ExperimentSource(snapshot_configs(tmp_path)).plan(
        LaunchChoice(config="exp_tiny_sweep_v1.json"))
    assert "grid: 2 stages x 1 replica = 2 fellows" in sweep.notes
    text = launch_summary(sweep)
    assert text.splitlines()[0] == "exp_tiny_sweep_v1: 2 runs, queued at once"
    assert text.count(": 2 stages x 1 replica = 2 fellows") == 2
    many = LaunchPlan(runs=sweep.runs * 3, bodies=sweep.bodies * 3)
    assert launch_summary(many).splitlines()[-1] == "  and 2 more"


def test_profile_source_sets_the_replicas_sync_over_the_profiles(tmp_path: Path) -> None:
    src = ProfileSource(snapshot_configs(tmp_path))
    assert src.options("sync") == ["dp", "diloco", "sparseloco", "demo"]
    profile = "training/tiny_sweep.json"
    base = src.plan(LaunchChoice("model/small_none.json", profile, fellows="4", replicas="2"))
    assert base.ok and base.runs[0].training.sync.mode == "dp"  # blank: the profile's
    plan = src.plan(LaunchChoice("model/small_none.json", profile, fellows="4", replicas="2",
                                 sync="diloco", inner_steps="4", overlap_steps=" 1 "))
    assert plan.ok, plan.error
    sync = plan.runs[0].training.sync
    assert (sync.mode, sync.inner_steps, sync.overlap_steps) == ("diloco", 4, 1)
    # The fields not typed stay the profile's.
    assert sync.outer_lr == base.runs[0].training.sync.outer_lr
    assert plan.bodies[0]["training"]["sync"]["mode"] == "diloco"  # (what the preview shows)
    assert "2x2 · diloco H=4 overlap 1 ·" in run_summary(plan.runs[0])[1]
    # H alone changes the profile's sync and keeps its mode.
    plan = src.plan(LaunchChoice("model/small_none.json", profile, fellows="4", replicas="2",
                                 inner_steps="7"))
    assert (plan.runs[0].training.sync.mode, plan.runs[0].training.sync.inner_steps) \
        == ("dp", 7)
    bad = src.plan(LaunchChoice("model/small_none.json", profile, fellows="4", replicas="2",
                                sync="diloco", inner_steps="4", overlap_steps="4"))
    assert not bad.ok and bad.field == "$.training.sync.overlap_steps" \
        and "below inner_steps (4)" in (bad.error or "")
    bad = src.plan(LaunchChoice("model/small_none.json", profile, sync="diloco",
                                inner_steps="ten"))
    assert not bad.ok and bad.field == "$.training.sync.inner_steps" \
        and "whole number" in (bad.error or "")


def test_profile_source_sets_sparseloco_and_its_density(tmp_path: Path) -> None:
    src = ProfileSource(snapshot_configs(tmp_path))
    assert "density" in src.fields
    profile = "training/tiny_sweep.json"
    plan = src.plan(LaunchChoice("model/small_none.json", profile, fellows="4", replicas="2",
                                 sync="sparseloco", inner_steps="4", density=" 0.05 "))
    assert plan.ok, plan.error
    sync = plan.runs[0].training.sync
    assert (sync.mode, sync.inner_steps, sync.density, sync.outer_step) == \
        ("sparseloco", 4, 0.05, (1.0, 0.0))
    assert plan.bodies[0]["training"]["sync"]["density"] == 0.05  # (what the preview shows)
    assert "2x2 · sparseloco H=4 d=0.05 2-bit ·" in run_summary(plan.runs[0])[1]
    # A blank density is the profile's; its range is SyncConfig's, named as from a profile.
    blank = src.plan(LaunchChoice("model/small_none.json", profile, sync="sparseloco"))
    assert blank.ok and blank.runs[0].training.sync.density == 0.02
    for typed, says in (("0", "must be > 0"), ("1.5", "must be <= 1"), ("lots", "not a number")):
        bad = src.plan(LaunchChoice("model/small_none.json", profile, sync="sparseloco",
                                    density=typed))
        assert not bad.ok and bad.field == "$.training.sync.density" \
            and says in (bad.error or ""), (typed, bad.error)


def test_profile_source_sets_the_wiring_and_reads_a_layout_profile(tmp_path: Path) -> None:
    """The wiring as `swarm submit --wiring` sets it (blank: the profile's); the preview's
    grid says a swarm and a layout's cells; a layout profile is not given the form's default
    of 2 stages; chain over a layout is the topology's one line."""
    configs = snapshot_configs(tmp_path)
    src = ProfileSource(configs)
    assert "wiring" in src.fields and src.options("wiring") == ["chain", "swarm"]
    model, profile = "model/small_none.json", "training/tiny_sweep.json"
    plan = src.plan(LaunchChoice(model, profile, stages="2", replicas="2", wiring="swarm"))
    assert plan.ok, plan.error
    assert plan.runs[0].topology.wiring == "swarm"
    assert plan.notes[0] == "grid: 2 stages x 2 replicas = 4 fellows, swarm-wired"
    assert src.plan(LaunchChoice(model, profile, stages="2", replicas="2")).runs[0] \
        .topology.wiring == "chain"
    body = json.loads((configs / profile).read_text())
    body["cluster_profile"] = {"replicas": 2, "wiring": "swarm", "routing": "measured",
                               "layout": [[0], [0, 1, 2]]}
    (configs / "training" / "laid_out.json").write_text(json.dumps(body))
    plan = src.plan(LaunchChoice(model, "training/laid_out.json"))
    assert plan.ok, plan.error
    topo = plan.runs[0].topology
    assert (topo.layout, topo.stages, topo.fellows) == ([[0], [0, 1, 2]], 2, 4)
    assert plan.notes[0] == "grid: 2 stages of cells 1+3 = 4 fellows, swarm-wired " \
        "(measured routes)"
    bad = src.plan(LaunchChoice(model, "training/laid_out.json", wiring="chain"))
    assert not bad.ok and bad.field == "$.topology.layout" \
        and "need wiring swarm" in (bad.error or "")


def test_profile_source_sets_the_transport_and_refuses_torch_over_shaped_links(
        tmp_path: Path) -> None:
    """`training.transport` as `swarm submit --transport` sets it: none given is the
    profile's; torch says so in the notes and the run's summary; torch over a network profile
    that shapes links is the config's one line at `$.training.transport`."""
    configs = snapshot_configs(tmp_path)
    src = ProfileSource(configs)
    assert "transport" in src.fields and src.options("transport") == ["shaped", "torch"]
    profile, model = "training/tiny_sweep.json", "model/small_none.json"
    for given, want in ((None, "shaped"), ("shaped", "shaped"), ("torch", "torch")):
        plan = src.plan(LaunchChoice(model, profile, transport=given))
        assert plan.ok, plan.error
        assert plan.runs[0].train.transport == want
        assert plan.bodies[0]["training"]["transport"] == want  # (what the preview shows)
        torch_said = [n for n in plan.notes if n.startswith("transport: torch")]
        assert torch_said == ([TORCH_NOTE] if want == "torch" else [])
        assert run_summary(plan.runs[0])[1].endswith(
            "1f1b · torch transport" if want == "torch" else "1f1b")
    body = json.loads((configs / profile).read_text())
    # None given over a torch profile is the profile's torch; a transport given overrides it.
    (configs / "training" / "torch_profile.json").write_text(
        json.dumps({**body, "transport": "torch"}))
    for given, want in ((None, "torch"), ("shaped", "shaped"), ("torch", "torch")):
        plan = src.plan(LaunchChoice(model, "training/torch_profile.json", transport=given))
        assert plan.ok and plan.runs[0].train.transport == want, (given, plan.error)
    body["network_profile"] = {"name": "slow", "tx_mbps": 80, "rx_mbps": 80}
    (configs / "training" / "shaped_links.json").write_text(json.dumps(body))
    assert src.plan(LaunchChoice(model, "training/shaped_links.json", transport="shaped")).ok
    bad = src.plan(LaunchChoice(model, "training/shaped_links.json", transport="torch"))
    assert not bad.ok and bad.field == "$.training.transport" and not bad.runs
    assert (bad.error or "").startswith("must be 'shaped' where the job's link or network "
                                        "shapes its links") and "\n" not in (bad.error or "")


def test_experiment_source_expands_a_sweep(tmp_path: Path) -> None:
    configs = snapshot_configs(tmp_path)
    src = ExperimentSource(configs)
    assert src.fields == ("config",)
    assert src.options("config") == ["exp_tiny_sweep_v1.json"]  # not the profiles below
    plan = src.plan(LaunchChoice(config="exp_tiny_sweep_v1.json"))
    assert plan.ok and plan.experiment is not None
    assert [r.model.compression for r in plan.runs] == ["none", "fixed_int8"]
    assert [r.name for r in plan.runs] == [r.run_name for r in plan.experiment.runs]
    assert all(r.kind == "train" and r.topology.fellows == 2 and r.training.steps == 3
               for r in plan.runs)
    assert plan.experiment.runs_dir == (tmp_path / "runs").resolve()
    assert any("2 runs" in note for note in plan.notes)
    # Errors name the file and the field, as `swarm validate` does.
    body = json.loads((configs / "exp_tiny_sweep_v1.json").read_text())
    body["sweep"]["compressions"] = ["none", "int3"]
    (configs / "exp_bad.json").write_text(json.dumps(body))
    bad = src.plan(LaunchChoice(config="exp_bad.json"))
    assert not bad.ok and bad.error is not None
    assert bad.error.startswith("exp_bad.json: $.sweep.compressions[1]: ")
    body = json.loads((configs / "exp_tiny_sweep_v1.json").read_text())
    body["training_config"] = "training/missing.json"
    (configs / "exp_missing.json").write_text(json.dumps(body))
    bad = src.plan(LaunchChoice(config="exp_missing.json"))
    assert bad.error is not None and "file not found" in bad.error \
        and "$.training_config" in bad.error
    assert src.plan(LaunchChoice()).error == "pick an experiment config"


@pytest.mark.parametrize(("argv", "message"), [
    (["--local", "x"], "--local: expected a whole number (local fellow count), got 'x'"),
    # int() would take these two
    (["--local", "1_0"], "--local: expected a whole number (local fellow count), got '1_0'"),
    (["--local", "\u0663"], "expected a whole number"),  # an Arabic-Indic 3
    (["--local", "0"], "--local: local fellow count must be >= 1 and <= 64, got 0"),
    # What was parsed, cut short: one line whatever was typed.
    (["--local", "0\n"], "local fellow count must be >= 1 and <= 64, got 0 (see"),
    (["--local", "9" * 30], f"must be >= 1 and <= 64, got {'9' * 24}... (see"),
    (["--local", "2", "--leader-url", "http://h:1"], "leave out --leader-url"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_console_flags_are_checked(argv: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main_tui(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize(("body", "message"), [
    ('{"fellows.relase": "x"}', "unknown binding id 'fellows.relase' (did you mean "
                                "'fellows.release'?)"),
    ('{"fellows.release": "s"}', "key 's' would be both fellows.set_speed and fellows.release"),
    ('{"fellows.release": 3}', "fellows.release: expected keys as a string"),
    ('["x"]', "expected a JSON object of binding id -> keys"),
    ("{", "not valid JSON"),
    ('{"fellows.export": "/"}', "key 'slash' would be both fellows.filter and fellows.export"),
    ('{"app.quit_now": "x"}', "app.quit_now works even while typing in a field"),
    ('{"jobs.cancel": "enter"}', "'enter' belongs to the tables and fields"),
    # A key nobody can press would leave the action with none.
    ('{"fellows.release": "notakey"}', "fellows.release: 'notakey' is not a key"),
    ('{"fellows.release": "ctrl+shift+alt+meta+zz"}', "'ctrl+shift+alt+meta+zz' is not a key"),
    ('{"fellows.release": "F5"}', "'F5' is not a key"),
    ('{"fellows.release": "' + "k" * 5000 + '"}', "'kkkkkkkkkkkkkkkkkkkkkkkk...' is not a key"),
    # In a dialog only the app's priority keys stay live: those still clash.
    ('{"confirm.yes": "ctrl+q,y"}', "key 'ctrl+q' would be both app.quit_now and "
                                    "confirm.yes in the confirmation view"),
])
def test_a_bad_keymap_stops_the_console_before_anything_starts(
        body: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from swarm_core import local_cluster

    def no_cluster(*_a: object, **_k: object) -> None:
        raise AssertionError("a local cluster was started")

    monkeypatch.setattr(local_cluster, "start_cluster", no_cluster)
    keymap = tmp_path / "keymap.json"
    keymap.write_text(body)
    assert main_tui(["--keymap", str(keymap), "--local", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and str(keymap) in err and err.count("\n") == 1


def test_keymap_takes_every_key_textual_sends_in_its_long_form() -> None:
    from swarm_tui.app.keymap import check

    keys = {"£": "pound_sign", "euro_sign": "euro_sign", "pause": "pause", "f35": "f35",
            "ctrl+.": "ctrl+full_stop", "ctrl+/": "ctrl+slash", "ctrl+£": "ctrl+pound_sign",
            "é": "é", "shift+f5": "shift+f5", "ctrl+shift+up": "ctrl+shift+up"}
    for written, long_form in keys.items():
        assert check({"fellows.release": written}, "k.json") == {"fellows.release": long_form}


def test_keymap_checks_dialogs_against_the_keys_that_reach_them() -> None:
    """A modal screen (dialog, help) cuts off the app's keys but the priority ones: an app key
    may share a key with a dialog's, and the help screen's own keys are remappable."""
    from swarm_tui.app import keymap

    assert keymap.check({"app.help": "y"}, "k") == {"app.help": "y"}  # confirm.yes is y
    assert keymap.check({"help.close_q": "x"}, "k") == {"help.close_q": "x"}
    with pytest.raises(keymap.KeymapError, match="in the help view"):
        keymap.check({"help.close_q": "ctrl+q"}, "k")  # quits everywhere (priority)


def test_keys_that_open_a_field_remap_to_plain_keys() -> None:
    """`/` (filter, search) is a priority key, so that the keys typed behind it reach the
    field it opens (issue 36 point 8); it stands aside in a field, so a plain key is fine."""
    from swarm_tui.app import keymap

    assert keymap.check({"fellows.filter": "f", "describe.search": "f"}, "k") == \
        {"fellows.filter": "f", "describe.search": "f"}
    with pytest.raises(keymap.KeymapError, match=r"would be both fellows\.filter and "
                                                 r"fellows\.log"):
        keymap.check({"fellows.filter": "l"}, "k")


def test_keymap_file_is_read_from_the_default_place(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from swarm_tui.app import keymap

    monkeypatch.delenv("SWARM_KEYMAP", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert keymap.load() == {}  # none in the user config dir: the defaults
    user_file = tmp_path / "config" / "silentswarm" / "keymap.json"
    user_file.parent.mkdir(parents=True)
    user_file.write_text('{"jobs.cancel": " k , delete "}')
    assert keymap.load() == {"jobs.cancel": "k,delete"}
    # A file named explicitly (flag or SWARM_KEYMAP) must exist.
    with pytest.raises(keymap.KeymapError, match="No such file"):
        keymap.load(tmp_path / "missing.json")
    monkeypatch.setenv("SWARM_KEYMAP", str(tmp_path / "missing.json"))
    with pytest.raises(keymap.KeymapError, match="No such file"):
        keymap.load()


def test_export_renders_values_as_csv_and_json(tmp_path: Path) -> None:
    from swarm_tui.app.cells import Cell
    from swarm_tui.app.export import ExportError, cell_value, write_view

    assert cell_value(Cell("1.2 MB/s", 1_200_000.0)) == 1_200_000.0
    assert cell_value(Cell("-")) is None  # no value: empty, not the dash on screen
    assert cell_value(Cell("∞", float("inf"))) is None  # an unlimited link
    assert cell_value(Cell("job-7/1", ("job-7", 1))) == "job-7/1"  # a sort key: the text
    assert cell_value(Cell("2 dev", 2, export="cpu,cuda:0")) == "cpu,cuda:0"
    assert cell_value(None) is None
    rows = [{"id": 1, "name": "a,b", "rate": 2.5}, {"id": 2, "name": "=cmd()", "rate": None}]
    out = write_view(tmp_path / "v.csv", ["id", "name", "rate"], rows)
    # Text a spreadsheet would run as a formula is quoted away.
    assert out.read_text() == 'id,name,rate\n1,"a,b",2.5\n2,\'=cmd(),\n'
    out = write_view(tmp_path / "v.json", ["id", "name", "rate"], rows)
    assert json.loads(out.read_text()) == rows  # JSON keeps the text as it is
    (tmp_path / "d.csv").mkdir()
    for bad, says in [("", "give a file name ending in .csv or .json"),
                      (str(tmp_path / "v.xlsx"), "v.xlsx: the name must end in .csv or .json"),
                      (str(tmp_path / ".csv"), ".csv: give a name before the extension"),
                      (str(tmp_path / "nope" / "v.csv"), f"{tmp_path / 'nope'}: no such "
                                                         "directory"),
                      (str(tmp_path / "d.csv"), f"{tmp_path / 'd.csv'}: is a directory"),
                      (str(tmp_path / "v.csv"), "v.csv exists already: pick another name")]:
        with pytest.raises(ExportError) as exc:
            write_view(bad, ["id"], rows)
        assert str(exc.value) == says  # (the path once: it was named twice)
    # Paths the checks themselves choke on are refused in a line too, never a traceback.
    (tmp_path / "dangling.csv").symlink_to(tmp_path / "gone.csv")
    for bad, why in [(str(tmp_path / ("x" * 300 + ".csv")), "too long"),
                     ("~no-such-user-swarm/v.csv", "home directory"),
                     (str(tmp_path / "nul\x00.csv"), "null byte"),
                     (str(tmp_path / "dangling.csv"), "exists already")]:
        with pytest.raises(ExportError, match=why):
            write_view(bad, ["id"], rows)
    assert not (tmp_path / "gone.csv").exists()


def test_console_without_a_leader_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_tui([]) == 3
    err = capsys.readouterr().err
    assert "no leader" in err and err.count("\n") == 1


def test_plain_modules_and_headless_paths_import_no_textual() -> None:
    code = ("import json, sys\n"
            "import swarm_tui.cli, swarm_tui.app.model, swarm_tui.app.cells, "
            "swarm_tui.app.forms, swarm_tui.app.launch, swarm_tui.app.export, "
            "swarm_tui.app.cluster\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO)
    assert not any(m == "textual" or m.startswith("textual.") for m in json.loads(out.stdout))


def test_fixture_fellows_are_valid_infos() -> None:
    assert all(isinstance(f, FellowInfo) for f in fixed_fellows())


def test_every_binding_has_an_id_and_is_in_the_help() -> None:
    from textual.binding import Binding

    from swarm_tui.app.app import SwarmApp, help_sections
    from swarm_tui.app.screens.dialogs import HelpScreen

    classes = [SwarmApp, *SwarmApp.MODES.values()]
    classes += [cls for _, cls in _screens()] + [HelpScreen]
    ids: list[str] = []
    for cls in classes:
        for b in cls.BINDINGS:
            assert isinstance(b, Binding) and b.id, f"{cls.__name__}: {b}"
            ids.append(b.id)
    in_help = {b.id for _, bindings in help_sections() for b in bindings}
    assert set(ids) - {b.id for b in HelpScreen.BINDINGS} <= in_help
    own = [b.id for cls in classes for b in cls.BINDINGS]
    assert len(own) == len(set(own)), "binding ids are unique"


def _screens() -> list[tuple[str, type]]:
    from swarm_tui.app.screens.dialogs import ConfirmDialog, SetSpeedDialog
    from swarm_tui.app.screens.fellows import FellowDetailScreen
    from swarm_tui.app.screens.jobs import JobWatchScreen

    return [("detail", FellowDetailScreen), ("watch", JobWatchScreen),
            ("speed", SetSpeedDialog), ("confirm", ConfirmDialog)]


def test_mid_run_set_speeds_are_described_newest_last_with_the_count_of_the_rest():
    from swarm_tui.fmt import describe_link_changes

    changes = [LinkChange(at_step=s, fellow_id=1, at=0.0, link=LinkLimits(tx_mbps=float(s)))
               for s in (3, 7, 9, 12)]
    assert describe_link_changes(changes[:1]) == (
        "link set mid-run: @3 fellow 1 tx 3 Mbit/s, rx unlimited")
    text = describe_link_changes(changes)
    assert text.startswith("link set mid-run: @7 fellow 1 tx 7 Mbit/s") and "@12" in text
    assert text.endswith("(+1 earlier)")
    # The job's record kept 4 of 40: the count says so.
    assert describe_link_changes(changes, total=40).endswith("(+37 earlier)")


def test_a_fellows_events_agree_on_the_step_it_left_its_job_at() -> None:
    model = ClusterModel(lambda: T0)
    model.apply_fellows(fixed_fellows())
    model.apply_jobs(fixed_jobs())
    # Heartbeats lag behind the stage's reports: the last one said step 8.
    model.apply_event(hb(1, T0, 1, status="busy", job_id="job-000002", step=8, loss=3.0))
    model.apply_event({"seq": 2, "ts": T0, "type": "metric", "data": {
        "job_id": "job-000002", "fellow_id": 1, "stage": 1, "step": 12, "loss": 2.9,
        "tokens_per_s": 10.0, "state": "COMPLETED", "metrics": {}}})
    model.apply_event(hb(1, T0 + 1, 3, status="ready"))
    texts = [text for _, text in model.fellows[1].events]
    assert "job-000002: completed at step 12" in texts
    assert "left job-000002 at step 12" in texts


def test_an_earlier_stages_loss_pane_says_the_last_stage_computes_it() -> None:
    from swarm_tui.app.screens.fellows import loss_caption

    model = ClusterModel(lambda: T0)
    fellows = fixed_fellows()
    fellows[0].last_loss = None  # stage 0 of job-000002's two: it computes no loss
    model.apply_fellows(fellows)
    model.apply_jobs(fixed_jobs())
    model.fellows[0].step = 347
    assert model.fellows[0].stage == 0
    assert loss_caption(model, model.fellows[0]) == \
        "loss: computed on the last stage (1), not here"
    assert loss_caption(model, model.fellows[2]) == "loss: no job"
    assert loss_caption(model, model.fellows[1]).startswith("loss 3.0312")
