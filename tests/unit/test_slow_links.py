"""A fellow on a starved link keeps heartbeating: it is reported as throttled, not dead."""

from __future__ import annotations

import time

from swarm_core.contract import Heartbeat
from swarm_core.leader.registry import FellowRegistry
from swarm_core.protocol import LinkLimits, RegisterRequest
from tests.support import AUTH

A = "/api/v1"


async def test_throttled_fellow_is_busy_with_a_note_not_stale(api):
    reg = await (await api.post(f"{A}/fellows/register", json={
        "name": "slow", "instance_id": "i"}, headers=AUTH)).json()
    headers = {**AUTH, "X-Swarm-Fellow-Session": reg["session"]}
    hb = {"status": "busy", "current_step": 3, "link": {"tx_mbps": 0.01, "rx_mbps": 0.05}}
    resp = await api.post(f"{A}/fellows/{reg['fellow_id']}/heartbeat", json=hb,
                          headers=headers)
    assert resp.status == 200
    view = await (await api.get(f"{A}/fellows/{reg['fellow_id']}", headers=AUTH)).json()
    assert view["status"] == "busy"
    assert view["note"] == ("throttled link: tx 0.01 Mbit/s; "
                            "throttled link: rx 0.05 Mbit/s")


def test_no_progress_is_noted_while_heartbeats_arrive():
    reg = FellowRegistry(stale_after_s=5.0, heartbeat_interval_s=1.0)
    rec, _ = reg.register(RegisterRequest(name="f", instance_id="i"))
    reg.heartbeat(rec, Heartbeat(status="busy", current_step=7, link=LinkLimits()))
    now = time.monotonic()
    assert reg.note(rec, now) == ""
    reg.heartbeat(rec, Heartbeat(status="busy", current_step=7))
    later = rec.step_changed + 45
    rec.last_seen = later  # heartbeats kept coming
    assert reg.status(rec, later) == "busy"
    assert reg.note(rec, later) == "no new step for 45s (at step 7)"
    reg.heartbeat(rec, Heartbeat(status="busy", current_step=8))
    assert reg.note(rec, time.monotonic()) == ""


def test_a_fellows_emulated_slowdown_is_in_its_view_and_noted():
    """Issue 34: the heartbeat says the fellow's emulated slowdown; the leader's view carries
    it and notes it, so a slow-on-purpose peer is told apart from a stuck one."""
    reg = FellowRegistry(stale_after_s=5.0, heartbeat_interval_s=1.0)
    rec, _ = reg.register(RegisterRequest(name="f", instance_id="i"))
    reg.heartbeat(rec, Heartbeat(status="busy", current_step=3, slowdown=4.0))
    now = time.monotonic()
    assert reg.info(rec, now).slowdown == 4.0
    assert reg.note(rec, now) == "slowed 4x (emulated)"
    assert rec.fellow_id in reg.dirty
    reg.heartbeat(rec, Heartbeat(status="busy", current_step=4))
    assert reg.info(rec, now).slowdown == 1.0 and reg.note(rec, time.monotonic()) == ""
