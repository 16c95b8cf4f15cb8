"""The leader's events as classes (swarm_core/contract/events.py): published as objects, JSON
only at the WebSocket edge, and the JSON exactly what the stream carried before they were
classes; consumers read each frame once and skip kinds they do not know."""

from __future__ import annotations

from typing import Any

import pytest

from swarm_core.client import ApiError, SwarmClient
from swarm_core.contract import MembershipChange, ShardReceipt, StageMetrics
from swarm_core.contract.events import (
    EVENT_CLASSES,
    Event,
    EventData,
    FellowReleased,
    FellowUpdate,
    Hello,
    JobMembership,
    JobShard,
    JobUpdate,
    MetricReport,
    SpeedSet,
    Unknown,
    event_data,
    event_json,
    read_event,
)
from swarm_core.contract.metrics import CodecErrors
from swarm_core.leader.events import EventHub
from swarm_core.protocol import ByteCounters, FellowStatus, LinkLimits
from swarm_tui.app.model import ClusterModel
from swarm_tui.commands.jobs import _describe
from tests.api_support import (
    A,
    expect_ok,
    get_job,
    heartbeat,
    register,
    report,
    submit,
    wait_for,
)
from tests.support import AUTH
from tests.tui_support import T0, fixed_fellows, fixed_jobs
from tests.unit.test_client import _event_server

CHANGE = MembershipChange(step=41, epoch=2, members=[0, 2], left=[1], reason="fellow 3 lost",
                          at=1700000000.5, stage_steps=[41, 42])
RECEIPT = ShardReceipt(stage=1, fellow_id=3, step=40, weights_sha256="ab" * 32,
                       weights_bytes=1024, optimizer_bytes=None, config_fingerprint="f",
                       received_at=1700000001.0)

# Each kind as the leader publishes it, beside the dict the leader's code wrote for it before
# events were classes (spelled out here as that code built it).
CASES: list[tuple[str, EventData, dict[str, Any]]] = [
    ("hello", Hello(), {}),
    ("fellow.heartbeat",
     FellowUpdate("fellow.heartbeat", 2, name="gpu-b", status=FellowStatus.BUSY.value,
                  job_id="job-000002", step=120, loss=2.5, tokens_per_s=1800.0,
                  link=LinkLimits(tx_mbps=80.0, rx_mbps=None, latency_ms=20.0),
                  counters=ByteCounters(control_tx=5, control_rx=6, data_tx=7, data_rx=8)),
     {"fellow_id": 2, "name": "gpu-b", "status": "busy", "job_id": "job-000002", "step": 120,
      "loss": 2.5, "tokens_per_s": 1800.0,
      "link": {"tx_mbps": 80.0, "rx_mbps": None, "latency_ms": 20.0},
      "counters": {"control_tx": 5, "control_rx": 6, "data_tx": 7, "data_rx": 8}}),
    ("fellow.set_speed",
     SpeedSet(2, "job-000007", LinkLimits(tx_mbps=8.0, rx_mbps=None, latency_ms=40.0)),
     {"fellow_id": 2, "job_id": "job-000007", "tx_mbps": 8.0, "rx_mbps": None,
      "latency_ms": 40.0}),
    ("fellow.release", FellowReleased(2, "gpu-b"), {"fellow_id": 2, "name": "gpu-b"}),
    ("job.failed",
     JobUpdate("job.failed", "job-000002", name="j", kind="train", state="FAILED",
               last_step=7, last_loss=None, fellows=[0, 1], reason="fellow 1 failed"),
     {"job_id": "job-000002", "name": "j", "kind": "train", "state": "FAILED",
      "last_step": 7, "last_loss": None, "fellows": [0, 1], "reason": "fellow 1 failed"}),
    ("job.membership", JobMembership("job-000002", CHANGE),
     {"job_id": "job-000002", "step": 41, "epoch": 2, "members": [0, 2], "left": [1],
      "joined": [], "reason": "fellow 3 lost", "at": 1700000000.5, "stage_steps": [41, 42]}),
    ("job.shard", JobShard("job-000002", RECEIPT),
     {"job_id": "job-000002", "stage": 1, "fellow_id": 3, "step": 40,
      "weights_sha256": "ab" * 32, "weights_bytes": 1024, "optimizer_bytes": None,
      "config_fingerprint": "f", "received_at": 1700000001.0}),
    ("metric",
     MetricReport(job_id="job-000002", fellow_id=1, stage=1, step=121, loss=2.4,
                  tokens_per_s=None, state="RUNNING",
                  metrics=StageMetrics(wire_tx_bytes=1000, codec_error=CodecErrors(act=0.01))),
     {"job_id": "job-000002", "fellow_id": 1, "stage": 1, "step": 121, "loss": 2.4,
      "tokens_per_s": None, "state": "RUNNING",
      "metrics": {"wire_tx_bytes": 1000, "codec_error": {"act": 0.01}}}),
    ("metric",  # of a job with replicas: the replica too, last
     MetricReport(job_id="job-000002", fellow_id=1, stage=0, step=3, loss=None,
                  tokens_per_s=10.0, state="COMPLETED", replica=1),
     {"job_id": "job-000002", "fellow_id": 1, "stage": 0, "step": 3, "loss": None,
      "tokens_per_s": 10.0, "state": "COMPLETED", "metrics": {}, "replica": 1}),
    ("metric",  # of a swarm-wired job: the membership its step was trained under, last
     MetricReport(job_id="job-000002", fellow_id=1, stage=1, step=3, loss=2.0,
                  tokens_per_s=None, state="RUNNING", replica=0, epoch=1),
     {"job_id": "job-000002", "fellow_id": 1, "stage": 1, "step": 3, "loss": 2.0,
      "tokens_per_s": None, "state": "RUNNING", "metrics": {}, "replica": 0, "epoch": 1}),
]


@pytest.mark.parametrize(("kind", "data", "wire"), CASES,
                         ids=[f"{k}-{i}" for i, (k, _d, _w) in enumerate(CASES)])
def test_each_event_class_is_the_json_the_stream_carried(kind: str, data: EventData,
                                                         wire: dict[str, Any]) -> None:
    event = Event(data, seq=9, ts=T0)
    frame = event_json(event)
    assert frame == {"seq": 9, "ts": T0, "type": kind, "data": wire}
    assert list(frame["data"]) == list(wire)  # (and in its order: the bytes are the same)
    assert read_event(frame) == event
    assert event_data(data) == wire


def test_every_kind_the_leader_publishes_has_its_class() -> None:
    kinds = {"hello", "fellow.registered", "fellow.heartbeat", "fellow.status",
             "fellow.set_speed", "fellow.release", "job.submitted", "job.started",
             "job.updated", "job.recovering", "job.resumed", "job.completed", "job.failed",
             "job.cancelled", "job.membership", "job.shard", "metric"}
    assert set(EVENT_CLASSES) == kinds
    with pytest.raises(ValueError, match="'type' must be in"):
        JobUpdate("job.paused", "job-000001")  # type: ignore[arg-type]


def test_the_hub_keeps_objects_and_encodes_a_frame_once_for_all_subscribers() -> None:
    hub = EventHub()
    subs = [hub.subscribe(), hub.subscribe(frozenset({"job"})), hub.subscribe()]
    hub.publish(FellowReleased(2, "gpu-b"))
    assert [s.queue.qsize() for s in subs] == [1, 0, 1]
    first, third = subs[0].queue.get_nowait(), subs[2].queue.get_nowait()
    assert first is third and first is not None
    assert first.frame() is first.frame()  # (encoded once)
    [recent] = hub.recent()
    assert recent.data == FellowReleased(2, "gpu-b") and recent.seq == 1


def test_a_frame_of_an_older_leader_reads_with_defaults() -> None:
    """A field a leader did not send reads as its default; one the reader does not know (a
    newer leader's) is ignored."""
    ev = read_event({"type": "fellow.status", "data": {"fellow_id": 2, "status": "stale",
                                                       "mood": "calm"}})
    assert ev.data == FellowUpdate("fellow.status", 2, status="stale")
    assert ev.seq is None and ev.ts is None


@pytest.mark.parametrize(("frame", "problem"), [
    ({"type": "metric", "data": {"step": "7"}},
     "$.data.step: expected an integer, got a string"),
    ({"type": "job.shard", "data": {"job_id": "j", "stage": 1, "fellow_id": 2}},
     "$.data.step: required field missing"),  # (named as the wire has it, beside job_id)
    ({"type": "fellow.release", "data": {"name": "x"}},
     "$.data.fellow_id: required field missing"),
    ({"type": "job.started", "data": [1]}, "$.data: expected an object"),
])
def test_a_frame_whose_data_does_not_read_is_unknown_with_the_field_named(
        frame: dict[str, Any], problem: str) -> None:
    ev = read_event({"seq": 4, **frame})
    assert ev.data == Unknown(frame["type"], problem) and ev.seq == 4


def test_the_console_reads_a_class_and_skips_a_kind_it_does_not_know() -> None:
    model = ClusterModel(lambda: T0)
    model.apply_fellows(fixed_fellows())
    model.apply_jobs(fixed_jobs())
    # A class, as SwarmClient.event_stream gives it.
    change = model.apply_event(Event(
        MetricReport(job_id="job-000002", fellow_id=1, stage=1, step=121, loss=2.4,
                     tokens_per_s=1800.0, state="RUNNING"), seq=1, ts=T0))
    assert change.jobs == {"job-000002"}
    view = model.jobs["job-000002"]
    assert view.per_stage[1].step == 121 and view.info.last_loss == 2.4
    # A newer leader's kind: nothing changes, no snapshot is asked for, and its seq counts
    # (the next event is no gap).
    for seq, ev in enumerate([{"type": "fellow.mood", "data": {"fellow_id": 1}},
                              {"type": "job.paused", "data": {"job_id": "job-000002"}}], 2):
        assert not model.apply_event({"seq": seq, "ts": T0, **ev})
    model.apply_event(Event(FellowReleased(1, "gpu-b"), seq=4, ts=T0))
    assert not model.need_refresh and model.last_seq == 4
    assert model.fellows[1].events[-1][1] == "release requested"
    # One whose data does not read is skipped too; the snapshot brings what it said.
    assert not model.apply_event({"seq": 5, "ts": T0, "type": "metric",
                                  "data": {"job_id": "job-000002", "step": "x"}})
    assert model.need_refresh


def test_a_membership_event_reaches_the_jobs_record_in_the_console() -> None:
    model = ClusterModel(lambda: T0)
    model.apply_jobs(fixed_jobs())
    event = Event(JobMembership("job-000002", CHANGE), seq=1, ts=T0)
    assert model.apply_event(event).jobs == {"job-000002"}
    model.apply_event(Event(JobMembership("job-000002", CHANGE), seq=2, ts=T0))  # (again)
    info = model.jobs["job-000002"].info
    assert info.membership == [CHANGE] and info.members == [0, 2]
    # Of a job the console does not show: nothing.
    assert not model.apply_event(Event(JobMembership("job-000099", CHANGE), seq=3, ts=T0))


def test_watch_lines_read_classes_and_say_nothing_of_an_unknown_kind() -> None:
    assert _describe(Event(MetricReport(step=3, fellow_id=1, loss=2.5, state="RUNNING"))) == \
        "step 3  fellow 1  loss 2.5000"
    assert _describe(Event(JobShard("job-000002", RECEIPT))) == \
        "stage 1 shard at step 40 reached the leader"
    assert _describe(Event(JobMembership("job-000002", CHANGE))) == (
        "job-000002 replicas @41: replica(s) 1 left (by stage from step s0 @41, s1 @42); "
        "training: 0,2 (fellow 3 lost)")
    assert _describe(Event(JobUpdate("job.updated", "job-000002"))) is None
    assert _describe({"type": "job.paused", "data": {"job_id": "job-000002"}}) is None


async def test_the_clients_stream_gives_classes_and_unknown_kinds_as_unknown(
        aiohttp_server: Any) -> None:
    url = await _event_server(
        aiohttp_server, '{"type": "hello", "seq": 1, "ts": 1.5}',
        '{"type": "fellow.mood", "seq": 2, "data": {"fellow_id": 1}}',
        '{"type": "fellow.release", "seq": 3, "data": {"fellow_id": 1, "name": "a"}}',
        '{"type": "metric", "seq": 4, "data": {"step": "x"}}')
    got = []
    async with SwarmClient(url, None) as client:
        with pytest.raises(ApiError) as info:
            async for event in client.event_stream():
                got.append(event)
    assert got == [Event(Hello(), 1, 1.5), Event(Unknown("fellow.mood"), 2),
                   Event(FellowReleased(1, "a"), 3)]
    assert info.value.code == "bad_response"
    assert str(info.value) == ("leader sent a metric event that does not read: "
                               "$.data.step: expected an integer, got a string")


async def test_every_frame_a_real_leader_sends_reads_back_to_itself(api: Any) -> None:
    """What the leader writes, its readers read: each frame of a fellow's and a job's life
    reads as a known class, and that class is the same JSON again."""
    f = await register(api, "a")
    await heartbeat(api, f, status="busy")
    await heartbeat(api, f, counters={"control_tx": 5}, status="busy")
    await heartbeat(api, f)
    await api.post(f"{A}/fellows/{f['fellow_id']}/speed", json={"tx_mbps": 3}, headers=AUTH)
    jid = (await submit(api))["job_id"]
    await wait_for(lambda: _job_state(api, jid, "RUNNING"))
    await report(api, jid, f, "RUNNING", step=3, loss=1.25, metrics={"wire_tx_bytes": 9})
    await report(api, jid, f, "COMPLETED", step=4)
    await api.post(f"{A}/fellows/release", json={"all": True}, headers=AUTH)
    frames = (await expect_ok(await api.get(f"{A}/events", headers=AUTH)))["events"]
    kinds = [fr["type"] for fr in frames]
    assert {"fellow.registered", "fellow.status", "fellow.heartbeat", "fellow.set_speed",
            "job.submitted", "job.started", "metric", "job.completed",
            "fellow.release"} <= set(kinds)
    for frame in frames:
        event = read_event(frame)
        assert not isinstance(event.data, Unknown), frame
        assert event_json(event) == frame


async def _job_state(api: Any, job_id: str, state: str) -> bool:
    return bool((await get_job(api, job_id))["state"] == state)
