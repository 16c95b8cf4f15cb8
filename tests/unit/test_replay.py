"""Network scenarios that change while a run trains (issue 40 pts 2-3): link traces and churn
scripts, their loaders and one-line errors, the churn generator's determinism, how sweeps and
suites name them, and a trace's changes landing in the leader's events as set-speeds do."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from swarm_core.config.profiles import ConfigError, load_experiment
from swarm_core.config.traces import (
    LIBRARY,
    ChurnScript,
    LinkTraceSpec,
    TraceError,
    churn_timeline,
    library_or_path,
    load_churn,
    load_trace,
    resolve_trace,
)
from swarm_core.protocol import LinkLimits
from swarm_core.schema import SchemaError, structure
from tests.support import AUTH


def _w(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- traces ---------------------------------------------------------------------------------------


def test_a_csv_trace_carries_blank_cells_and_leaves_missing_columns_to_the_base(tmp_path):
    p = _w(tmp_path / "t.csv", "# a comment: where the numbers come from\n"
           "t_s,tx_mbps,latency_ms\n0,100,10\n\n5,,20\n7.5,50,20\n")
    trace = load_trace(p)
    assert [pt.t_s for pt in trace.points] == [0.0, 5.0, 7.5]
    assert trace.points[1].values == {"tx_mbps": 100.0, "latency_ms": 20.0}  # (carried)
    base = LinkLimits(tx_mbps=1.0, rx_mbps=300.0, latency_ms=1.0)
    # rx_mbps is in no row: the network profile's stays.
    assert trace.points[2].link(base) == LinkLimits(tx_mbps=50.0, rx_mbps=300.0,
                                                    latency_ms=20.0)
    assert trace.points[0].link(None) == LinkLimits(tx_mbps=100.0, latency_ms=10.0)


def test_an_ndjson_trace_takes_null_as_unlimited(tmp_path):
    p = _w(tmp_path / "t.ndjson", '{"t_s": 0, "rx_mbps": 8}\n{"t_s": 2, "rx_mbps": null}\n')
    trace = load_trace(p)
    assert trace.points[1].link(None) == LinkLimits()


def test_a_looped_trace_repeats_every_lap_and_a_plain_one_ends(tmp_path):
    p = _w(tmp_path / "t.csv", "t_s,latency_ms\n0,1\n2,5\n4,9\n")
    spec, trace = resolve_trace(LinkTraceSpec(file="t.csv", loop=True), tmp_path)
    assert spec.file == str(p)  # (made absolute, relative to the file naming it)
    looped = [(t, pt.values["latency_ms"]) for t, pt in itertools.islice(trace.schedule(True), 5)]
    # (the last row's time is the lap: the next lap's first row replaces it)
    assert looped == [(0, 1), (2, 5), (4, 1), (6, 5), (8, 1)]
    assert [t for t, _ in trace.schedule(False)] == [0, 2, 4]


@pytest.mark.parametrize("name, text, wanted", [
    ("t.csv", "t_s,tx_mbps\n0,10\n5,10\n3,10\n",
     "line 4: time not monotone: t_s 3 after 5"),
    ("t.csv", "t_s,tx_mbps\n0,10\n0,20\n", "line 3: time not monotone"),
    ("t.csv", "t_s,tx_mbps\n0,10\n1,-5\n", "line 3: negative rate: tx_mbps -5"),
    ("t.csv", "t_s,latency_ms\n0,-1\n", "line 2: negative latency: latency_ms -1"),
    ("t.csv", "tx_mbps,rx_mbps\n10,10\n", "missing column t_s"),
    ("t.csv", "t_s\n0\n1\n", "missing column: give at least one of tx_mbps"),
    ("t.csv", "t_s,tx_mbps,speed\n0,1,2\n", "unknown column 'speed'"),
    ("t.csv", "t_s,tx_mbps\n0,fast\n", "line 2: tx_mbps is not a number ('fast')"),
    ("t.csv", "t_s,tx_mbps\n", "no rows"),
    ("t.ndjson", '{"t_s": 0, "tx_mbps": 1}\n{"t_s": 1, "tx_mbps": 1, "rx_mbps": 2}\n',
     "line 1: missing rx_mbps (the first row must give every value"),
    ("t.ndjson", '{"t_s": 0, "tx_mbps": 1}\n[1]\n', "line 2: expected an object"),
    ("t.ndjson", '{"tx_mbps": 1}\n', "line 1: missing column t_s"),
    ("t.txt", "t_s,tx_mbps\n0,1\n", "must be a .csv or .ndjson file"),
])
def test_a_bad_trace_is_one_line_naming_the_file_and_what_is_wrong(tmp_path, name, text,
                                                                    wanted):
    p = _w(tmp_path / name, text)
    with pytest.raises(TraceError) as err:
        load_trace(p)
    msg = str(err.value)
    assert wanted in msg and str(p) in msg and "\n" not in msg


def test_an_unreadable_trace_is_named(tmp_path):
    with pytest.raises(TraceError, match=r"missing\.csv: file not found"):
        load_trace(tmp_path / "missing.csv")
    (tmp_path / "dir.csv").mkdir()
    with pytest.raises(TraceError, match=r"dir\.csv: cannot read"):
        load_trace(tmp_path / "dir.csv")
    _w(tmp_path / "one.csv", "t_s,tx_mbps\n5,1\n")
    with pytest.raises(TraceError, match="a looped trace needs two rows"):
        resolve_trace(LinkTraceSpec(file="one.csv", loop=True), tmp_path)


def test_the_library_is_found_by_name_and_every_entry_loads():
    p = library_or_path("home-evening-dip", "traces", Path("/nowhere"))
    assert p == LIBRARY / "traces" / "home-evening-dip.csv"
    assert load_trace(p).points[0].values["rx_mbps"] == 500
    for f in sorted((LIBRARY / "churn").glob("*.json")):
        script = load_churn(f)
        assert script.name == f.stem and script.source and script.description
    assert library_or_path("kill-every-15s", "churn", Path("/x")).parent == LIBRARY / "churn"
    # (not a library name: a path relative to the naming file)
    assert library_or_path("mine.json", "churn", Path("/x")) == Path("/x/mine.json")


# --- churn ----------------------------------------------------------------------------------------


def _script(**body: Any) -> ChurnScript:
    return structure({"name": "c", **body}, ChurnScript)


def test_the_same_seed_plans_the_same_timeline_and_another_seed_another():
    script = _script(generator={"every_s": 15, "jitter_s": 5, "restart_after_s": 4})

    def plan(seed: int) -> list[Any]:
        return list(itertools.islice(churn_timeline(script, seed, 3, 1), 40))

    assert plan(7) == plan(7)
    assert plan(7) != plan(8)
    kills = [e for e in plan(7) if e.action == "kill"]
    # Each within its jitter of k x 15 s, in order, cycling over replicas 1 and 2.
    assert all(abs(e.at_s - 15 * (k + 1)) <= 5 for k, e in enumerate(kills))
    assert [e.at_s for e in plan(7)] == sorted(e.at_s for e in plan(7))
    assert [e.replica for e in kills[:4]] == [1, 2, 1, 2]
    # Each kill's fellow comes back restart_after_s later, named by the kill it undoes.
    timeline = plan(7)
    for e in timeline:
        if e.action == "join":
            assert timeline[e.of_event].action == "kill"
            assert e.at_s == pytest.approx(timeline[e.of_event].at_s + 4, abs=1e-3)
    # A seed in the script wins over the run's.
    pinned = _script(generator={"every_s": 15, "jitter_s": 5, "seed": 3})
    a = list(itertools.islice(churn_timeline(pinned, 1, 3, 1), 5))
    assert a == list(itertools.islice(churn_timeline(pinned, 2, 3, 1), 5))


def test_explicit_events_and_a_spot_trace_plan_as_written(tmp_path):
    script = _script(events=[
        {"at_s": 3, "action": "kill", "replica": 1, "restart_after_s": 2},
        {"at_s": 4, "action": "leave", "fellow": "local-2"},
        {"at_s": 9, "action": "join", "fellow": "spare-0"}])
    plan = list(churn_timeline(script, 0, 2, 1))
    assert [(e.at_s, e.action, e.target) for e in plan] == [
        (3, "kill", "replica 1 stage 0"), (4, "leave", "fellow local-2"),
        (5, "join", "the fellow of event 0"), (9, "join", "fellow spare-0")]
    assert script.kills
    assert not _script(events=[{"at_s": 1, "action": "leave", "replica": 1}]).kills
    _w(tmp_path / "spot.csv", "# preemptions\nt_s,fellow\n10,\n25,local-1\n")
    _w(tmp_path / "c.json", json.dumps({"name": "spot", "spot_trace": {
        "file": "spot.csv", "restart_after_s": 30}}))
    spot = load_churn(tmp_path / "c.json")
    assert spot.spot_trace is not None and spot.spot_trace.file == str(tmp_path / "spot.csv")
    assert [(e.at_s, e.action, e.target) for e in churn_timeline(spot, 0, 3, 1)] == [
        (10, "kill", "replica 1 stage 0"), (25, "kill", "fellow local-1"),
        (40, "join", "the fellow of event 0"), (55, "join", "fellow local-1")]


@pytest.mark.parametrize("body, wanted", [
    ({}, "give exactly one of events, generator, spot_trace"),
    ({"events": [{"at_s": 1, "action": "kill", "replica": 1}],
      "generator": {"every_s": 5}}, "(got events, generator)"),
    ({"events": [{"at_s": 1, "action": "join", "replica": 1}]}, "a join names the fellow"),
    ({"events": [{"at_s": 1, "action": "kill"}]}, "give exactly one of fellow or replica"),
    ({"events": [{"at_s": 5, "action": "kill", "replica": 1},
                 {"at_s": 1, "action": "kill", "replica": 1}]}, "at_s not monotone"),
    ({"events": [{"at_s": -1, "action": "kill", "replica": 1}]}, "must be a finite number"),
    ({"generator": {"every_s": 10, "jitter_s": 6}}, "at most every_s / 2"),
    ({"generator": {"every_s": 0}}, "must be > 0"),
    ({"events": [{"at_s": 1, "action": "crash", "replica": 1}]},
     "$.events[0].action: expected one of 'kill', 'leave', 'join'"),
])
def test_a_bad_churn_script_is_one_line(tmp_path, body, wanted):
    p = _w(tmp_path / "c.json", json.dumps({"name": "c", **body}))
    with pytest.raises(TraceError) as err:
        load_churn(p)
    assert wanted in str(err.value) and str(p) in str(err.value)
    assert "\n" not in str(err.value)


def test_churn_that_needs_a_second_replica_or_a_missing_cell_says_so():
    gen = _script(generator={"every_s": 5})
    with pytest.raises(TraceError, match="the run has 1 replica"):
        next(churn_timeline(gen, 0, 1, 2))
    cell = _script(events=[{"at_s": 1, "action": "kill", "replica": 3}])
    with pytest.raises(TraceError, match="a cell the run's 1x2 grid lacks"):
        list(churn_timeline(cell, 0, 2, 1))


# --- configs --------------------------------------------------------------------------------------


@pytest.fixture
def layout(tmp_path):
    _w(tmp_path / "model/m.json", json.dumps({"name": "m", "d_model": 32, "n_layers": 2,
                                               "n_heads": 2, "seq_len": 16}))
    _w(tmp_path / "traces/t.csv", "t_s,latency_ms\n0,5\n10,20\n")

    def exp(network: dict[str, Any] | None = None, **sweep: Any) -> Path:
        training = {"steps": 3, "batch_size": 4, "micro_batches": 1,
                    "cluster_profile": {"fellows": 2, "replicas": 2}}
        if network is not None:
            training["network_profile"] = network
        _w(tmp_path / "training/t.json", json.dumps(training))
        return _w(tmp_path / "e.json", json.dumps({
            "name": "e", "training_config": "training/t.json",
            "model_configs": ["model/m.json"], "sweep": sweep}))

    return tmp_path, exp


def test_a_sweep_names_a_churn_script_and_a_network_profile_its_trace(layout):
    tmp, exp = layout
    r = load_experiment(exp({"name": "n", "latency_ms": 1,
                             "trace": {"file": "../traces/t.csv", "loop": True}},
                            churn="kill-every-120s"))
    (run,) = r.runs
    assert run.network["trace"] == {"file": str(tmp / "traces/t.csv"), "loop": True,
                                    "fellows": None, "to": None}
    assert run.churn is not None and run.churn["name"] == "kill-every-120s"
    assert run.churn["generator"]["every_s"] == 120
    # A swept network profile's trace is relative to the experiment config.
    r = load_experiment(exp(network_profiles=[{"name": "a", "trace": {"file": "traces/t.csv"}},
                                              {"name": "b"}]))
    assert [x.network.get("trace", {}) and x.network["trace"]["file"] for x in r.runs] == \
        [str(tmp / "traces/t.csv"), None]


def test_a_named_scenarios_trace_is_relative_to_the_scenario_file(layout):
    """A scenario named by name (``network/<name>.json`` beside the training folder) whose
    trace path is relative to that file: read from there, not from the naming config's
    folder (where a file of the same name would be another trace)."""
    tmp, exp = layout
    _w(tmp / "network/traces/t.csv", "t_s,latency_ms\n0,7\n")
    _w(tmp / "network/scen.json", json.dumps({"name": "scen", "latency_ms": 1,
                                              "trace": {"file": "traces/t.csv"}}))
    _w(tmp / "training/traces/t.csv", "t_s,latency_ms\n0,99\n")  # (the wrong one)
    (run,) = load_experiment(exp("scen")).runs
    assert run.network["trace"]["file"] == str(tmp / "network/traces/t.csv")


def test_a_bad_trace_or_churn_in_a_config_names_the_file_and_field(layout):
    tmp, exp = layout
    _w(tmp / "traces/bad.csv", "t_s,tx_mbps\n0,10\n5,-1\n")
    with pytest.raises(ConfigError) as err:
        load_experiment(exp({"name": "n", "trace": {"file": "../traces/bad.csv"}}))
    assert str(err.value).startswith(f"{tmp / 'training/t.json'}: $.network_profile.trace: ")
    assert "line 3: negative rate" in str(err.value)
    with pytest.raises(ConfigError, match=r"\$\.sweep\.network_profiles\[0\]\.trace: .*file "
                                          "not found"):
        load_experiment(exp(network_profiles=[{"name": "a", "trace": {"file": "nope.csv"}}]))
    with pytest.raises(ConfigError, match=r"e\.json: \$\.sweep\.churn: .*no-such-script: file "
                                          "not found"):
        load_experiment(exp(churn="no-such-script"))


def test_a_suite_scenario_names_churn_and_a_trace(tmp_path):
    from swarm_core.experiments.suites import as_experiment, load_suite

    _w(tmp_path / "model.json", json.dumps({"name": "m", "d_model": 32, "n_layers": 2,
                                             "n_heads": 2, "seq_len": 16}))
    _w(tmp_path / "training.json", json.dumps({"steps": 3, "batch_size": 4,
                                                "micro_batches": 1}))
    _w(tmp_path / "infra.json", json.dumps({"name": "i", "nodes": [{"name": "a",
                                                                     "fellows": 2}]}))
    scenario = {"name": "s", "model": "model.json", "training": "training.json",
                "infra": "infra.json", "artifacts": {"dir": "s"},
                "grid": {"stages": 1, "replicas": 2}, "churn": "kill-every-15s",
                "trace": {"file": "home-evening-dip", "fellows": ["local-1"]}}
    _w(tmp_path / "suite.json", json.dumps({"name": "su", "scenarios": [scenario]}))
    exp = as_experiment(load_suite(tmp_path / "suite.json"), tmp_path / "out")
    (run,) = exp.runs
    assert run.churn is not None and run.churn["generator"]["every_s"] == 15
    assert run.network["trace"]["file"].endswith("traces/home-evening-dip.csv")
    assert run.network["trace"]["fellows"] == ["local-1"]


async def test_churn_that_kills_against_a_remote_leader_is_refused_up_front(layout):
    from swarm_core.client import SwarmClient
    from swarm_core.experiments.runner import Experiment, ExperimentError

    tmp, exp = layout
    resolved = load_experiment(exp(churn="kill-every-120s"))
    async with SwarmClient("http://127.0.0.2:9", None) as client:
        runner = Experiment(client, resolved, tracking=None)
        with pytest.raises(ExperimentError) as err:
            runner._check_churn()
    msg = str(err.value)
    assert "churn script kill-every-120s kills or starts fellows" in msg
    assert "is not the local cluster's" in msg and "\n" not in msg
    # A script that only releases fellows goes through the leader: any leader will do.
    _w(tmp / "leave.json", json.dumps(
        {"name": "leave", "events": [{"at_s": 1, "action": "leave", "replica": 1}]}))
    leaving = load_experiment(exp(churn="leave.json"))
    async with SwarmClient("http://127.0.0.2:9", None) as client:
        Experiment(client, leaving, tracking=None)._check_churn()


def test_structuring_a_trace_spec_refuses_an_empty_fellow_list():
    with pytest.raises(SchemaError, match="at least one fellow"):
        structure({"file": "t.csv", "fellows": []}, LinkTraceSpec)


# --- replay against a leader ----------------------------------------------------------------------


async def _set_speeds_played(replay: Any, client: Any, seconds: float) -> list[dict]:
    """The set-speeds the leader published while ``replay`` played its trace for ``seconds``
    from now."""
    import asyncio
    import time

    replay.t0, replay.t0_wall = time.monotonic(), time.time()
    task = asyncio.create_task(replay._play_trace())
    await asyncio.sleep(seconds)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    events = (await client.request("GET", "/api/v1/events"))["events"]
    return [e["data"] for e in events if e["type"] == "fellow.set_speed"]


async def test_a_traces_changes_land_in_the_events_as_set_speeds(api, tmp_path):
    """In-process leader, two registered fellows: each change of the trace is a set-speed the
    leader publishes (fellow.set_speed), in order, with the trace's link over the base; and
    trace_timeline.json says planned beside actual time."""

    from swarm_core.client import SwarmClient
    from swarm_core.experiments.replay import TRACE_FILE, Replay
    from tests.api_support import register

    ids = [(await register(api, f"f{i}"))["fellow_id"] for i in range(2)]
    trace = _w(tmp_path / "t.csv", "t_s,tx_mbps,latency_ms\n0,100,5\n0.3,50,10\n0.6,50,10\n"
               "0.9,25,15\n")
    url = str(api.make_url("")).rstrip("/")
    async with SwarmClient(url, AUTH["Authorization"].split()[1]) as client:
        class Fixed(Replay):
            def _trace_targets(self) -> list[int]:  # (no job here: no placement to read)
                return ids

        replay = Fixed(client, "job-x", tmp_path, trace_spec=LinkTraceSpec(file=str(trace)),
                       base_link=LinkLimits(rx_mbps=300.0))
        sets = await _set_speeds_played(replay, client, 1.3)
    # (the row at 0.6 s repeats the one before: nothing is sent for it)
    assert [(e["fellow_id"], e["tx_mbps"], e["rx_mbps"], e["latency_ms"]) for e in sets] == [
        (f, tx, 300.0, lat) for tx, lat in ((100, 5), (50, 10), (25, 15)) for f in ids]
    written = json.loads((tmp_path / TRACE_FILE).read_text())
    changes = written["changes"]
    assert [c["planned_s"] for c in changes] == [0.0, 0.3, 0.9]
    assert all(abs(c["actual_s"] - c["planned_s"]) < 0.5 for c in changes)
    assert all(c["fellow_ids"] == ids and "errors" not in c for c in changes)


async def test_a_per_pair_trace_sets_only_the_named_pairs_links(api, tmp_path):
    """``to``: fellow a's pair link to b follows the trace (set-speed --to, recorded as such);
    b's own limits and its link to a stay; the timeline names the pairs."""
    from types import SimpleNamespace

    from swarm_core.client import SwarmClient
    from swarm_core.experiments.replay import TRACE_FILE, Replay
    from tests.api_support import heartbeat, register

    a, b = await register(api, "a"), await register(api, "b")
    await heartbeat(api, a, peers=[{"job_id": "job-x", "cell": "0.0", "peer": "1.0",
                                    "site": "s", "peer_site": "t",
                                    "peer_fellow": b["fellow_id"], "tx_mbps": 80.0}])
    trace = _w(tmp_path / "t.csv", "t_s,tx_mbps,latency_ms\n0,40,5\n0.3,20,10\n")
    url = str(api.make_url("")).rstrip("/")
    async with SwarmClient(url, AUTH["Authorization"].split()[1]) as client:
        replay = Replay(client, "job-x", tmp_path,
                        trace_spec=LinkTraceSpec(file=str(trace), fellows=["a"], to=["b"]))
        replay._job = SimpleNamespace(placement=SimpleNamespace(stages=[  # (its cells only)
            SimpleNamespace(fellow_id=a["fellow_id"], name="a", stage=0, replica=0),
            SimpleNamespace(fellow_id=b["fellow_id"], name="b", stage=1, replica=0)]))
        sets = await _set_speeds_played(replay, client, 0.7)
    assert [(e["fellow_id"], e["to_fellow"], e["tx_mbps"], e["latency_ms"]) for e in sets] == [
        (a["fellow_id"], b["fellow_id"], 40.0, 5.0), (a["fellow_id"], b["fellow_id"], 20.0, 10.0)]
    changes = json.loads((tmp_path / TRACE_FILE).read_text())["changes"]
    assert [c["pairs"] for c in changes] == [[[a["fellow_id"], b["fellow_id"]]]] * 2
    assert all("errors" not in c for c in changes)


def test_a_trace_spec_refuses_an_empty_peer_list():
    with pytest.raises(SchemaError, match="at least one peer fellow"):
        structure({"file": "t.csv", "to": []}, LinkTraceSpec)


def test_the_config_docs_cover_every_field_of_a_trace_and_a_churn_script():
    import attrs

    from swarm_core.config import traces
    from tests.support import REPO

    text = (REPO / "docs" / "configs.md").read_text()
    for cls in (traces.LinkTraceSpec, traces.ChurnScript, traces.ChurnEvent,
                traces.ChurnGenerator, traces.SpotTrace):
        assert f"## {cls.__name__} (" in text
        for f in attrs.fields(cls):
            assert f"`{f.name}`" in text, f"docs/configs.md misses {cls.__name__}.{f.name}"


class _Procs:
    """Fellow processes as a churn replay sees them, in memory: who runs, what was done."""

    def __init__(self, running: set[str]) -> None:
        self.running, self.calls = set(running), []
        self.pid = 100

    def kill(self, name: str) -> int | None:
        self.calls.append(("kill", name))
        if name not in self.running:
            return None
        self.running.discard(name)
        return 1

    def start(self, name: str) -> int:
        self.calls.append(("start", name))
        self.running.add(name)
        self.pid += 1
        return self.pid


async def test_a_churn_replay_kills_restarts_and_owes_what_the_run_outlived(tmp_path):
    """Named fellows, fake processes: each event at its planned time, a kill of a fellow that
    is down is skipped (and its restart with it), and a restart due after the run's end is
    done at the end, all in churn_timeline.json."""
    import asyncio
    import time

    from swarm_core.experiments.replay import CHURN_FILE, Replay

    script = _script(events=[
        {"at_s": 0.1, "action": "kill", "fellow": "a", "restart_after_s": 0.2},
        {"at_s": 0.15, "action": "kill", "fellow": "b", "restart_after_s": 0.1},
        {"at_s": 0.2, "action": "kill", "fellow": "c", "restart_after_s": 60}])
    procs = _Procs({"a", "c"})
    replay = Replay(None, "job-x", tmp_path, churn=script, processes=procs,  # type: ignore
                    on_line=lambda _: None)
    replay.t0, replay.t0_wall = time.monotonic(), time.time()
    task = asyncio.create_task(replay._play_churn())
    await asyncio.sleep(0.6)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await replay._restart_owed()
    replay._write()
    events = json.loads((tmp_path / CHURN_FILE).read_text())["events"]
    assert [(e["event"], e.get("fellow"), e["outcome"]) for e in events] == [
        ("kill", "a", "done"), ("kill", "b", "skipped: not running"), ("kill", "c", "done"),
        ("join", None, "skipped: event 1 took no fellow down"), ("join", "a", "done"),
        ("join", "c", "done")]
    assert [e["planned_s"] for e in events] == [0.1, 0.15, 0.2, 0.25, 0.3, None]
    assert events[-1]["note"] == "after the run ended" and events[-1]["restarts"] == 2
    assert all(abs(e["actual_s"] - e["planned_s"]) < 0.3 for e in events[:-1])
    assert procs.running == {"a", "c"}
    assert ("start", "b") not in procs.calls


def test_sweep_detach_refuses_a_sweep_that_replays(layout, capsys):
    from swarm_tui.cli import run

    _, exp = layout
    assert run(["sweep", "--config", str(exp(churn="kill-every-15s")), "--detach"]) == 2
    assert "--detach: run " in capsys.readouterr().err
