"""A fellow's own log through the leader: the fellow's ring, ``GET /fellows/{id}/log`` (its
bounds, what it says before anything came) and ``POST /fellows/{id}/log`` (only a fellow's own
session, continuing the held tail or replacing it), and a fellow daemon shipping its tail when
asked (in this event loop, over real HTTP on a loopback port)."""

from __future__ import annotations

import logging

import pytest

from swarm_core.contract.fellow_log import MAX_LINE_CHARS
from swarm_core.fellow.logring import LogRing
from swarm_core.leader.keys import STATE_KEY
from tests.api_support import AUTH, A, expect_error, expect_ok, heartbeat, register
from tests.tui_support import LiveLeader, no_engine, wait_for  # noqa: F401 (a fixture)


def test_the_ring_keeps_the_newest_lines_within_its_bytes_and_numbers_them():
    ring = LogRing(max_bytes=100, max_lines=1000)
    for i in range(50):
        ring.add(f"line {i:02d}")  # 7 characters + newline: 12 fit in 100 bytes
    seq, lines, whole = ring.since(None)
    assert (seq, whole) == (50, True)
    assert lines == [f"line {i:02d}" for i in range(38, 50)]
    assert ring.since(48) == (50, ["line 48", "line 49"], False)
    assert ring.since(50) == (50, [], False)
    # What was dropped cannot be continued: the whole ring again.
    assert ring.since(10)[2] is True
    ring.add("\x1b[2Jbell\x07" + "x" * 2000)
    newest = ring.since(50)[1][0]
    assert newest.startswith(" [2Jbell ") and len(newest) == MAX_LINE_CHARS
    assert newest.endswith("…")


def test_the_ring_takes_its_owners_records_and_a_formatted_traceback_line_by_line():
    from swarm_core.fellow.logring import current_owner

    mine, other = object(), object()
    ring = LogRing(mine)
    logger = logging.getLogger("swarm.test.ring")
    logger.addHandler(ring)
    logger.setLevel(logging.INFO)
    try:
        token = current_owner.set(other)
        logger.info("not mine")
        current_owner.reset(token)
        token = current_owner.set(mine)
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("it broke")
        current_owner.reset(token)
        logger.info("from a thread of no daemon")
        logger.debug("below the ring's level")
    finally:
        logger.removeHandler(ring)
    lines = ring.since(None)[1]
    assert not any("not mine" in ln for ln in lines)
    assert "swarm.test.ring ERROR it broke" in lines[0]
    assert lines[-2] == "ValueError: boom" and "from a thread of no daemon" in lines[-1]
    assert not any("below" in ln for ln in lines)


async def test_get_log_bounds_and_what_it_says_before_the_fellow_sent_any(api):
    f = await register(api, "a")
    url = f"{A}/fellows/{f['fellow_id']}/log"
    await expect_error(await api.get(url), 401, "unauthorized")
    for bad, says in (("0", "between 1 and 1000, got 0"), ("1001", "between 1 and 1000"),
                      ("ten", "must be an integer, got 'ten'"),
                      ("-1", "between 1 and 1000, got -1")):
        err = await expect_error(await api.get(url, params={"lines": bad}, headers=AUTH), 400,
                                 "invalid_param", field="lines")
        assert says in err["message"] and "\n" not in err["message"], err
    await expect_error(await api.get(f"{A}/fellows/9/log", headers=AUTH), 404, "unknown_fellow")
    # Nothing held yet: says so, and asks the fellow (its next heartbeat answer says send_log).
    assert (await heartbeat(api, f))["send_log"] is False
    got = await expect_ok(await api.get(url, headers=AUTH))
    assert got == {"fellow_id": f["fellow_id"], "name": "a", "lines": [], "seq": 0,
                   "received_at": None, "age_s": None,
                   "message": "fellow 0 has sent no log yet; asked it now, it sends with its "
                              "next heartbeat", "asked": True}
    assert (await heartbeat(api, f))["send_log"] is True
    # The ask lapses a few seconds after the last read.
    api.server.app[STATE_KEY].logs._wanted_until[f["fellow_id"]] = 0.0
    assert (await heartbeat(api, f))["send_log"] is False


async def test_post_log_own_session_only_then_continued_or_replaced(api):
    a, b = await register(api, "a"), await register(api, "b")
    url = f"{A}/fellows/{a['fellow_id']}/log"
    body = {"seq": 3, "lines": ["one", "two", "three"]}
    await expect_error(await api.post(url, json=body, headers=AUTH), 401, "unknown_session")
    # A fellow's session cannot post another fellow's log.
    err = await expect_error(await api.post(url, json=body, headers=b["headers"]), 403,
                             "wrong_fellow")
    assert "fellow 1, not fellow 0" in err["message"]
    await expect_error(await api.post(url, json={"seq": 1, "lines": ["a", "b"]},
                                      headers=a["headers"]), 400, field="$.seq")
    await expect_error(await api.post(url, json={"seq": 9, "lines": ["x" * 513]},
                                      headers=a["headers"]), 400)
    await expect_error(await api.post(url, json={"seq": 2000, "lines": ["x"] * 1001},
                                      headers=a["headers"]), 400)
    for bad in ({"seq": 1, "lines": [5]}, {"seq": -1, "lines": []}, {"lines": []},
                {"seq": 1, "lines": [], "extra": 1}):
        await expect_error(await api.post(url, json=bad, headers=a["headers"]), 400)
    assert (await expect_ok(await api.post(url, json=body, headers=a["headers"]))) == {"seq": 3}
    more = {"seq": 5, "lines": ["four", "five"], "replace": False}
    assert (await expect_ok(await api.post(url, json=more, headers=a["headers"])))["seq"] == 5
    # A post that does not continue the held tail is refused: the fellow sends all of it.
    gap = {"seq": 9, "lines": ["nine"], "replace": False}
    await expect_error(await api.post(url, json=gap, headers=a["headers"]), 409,
                       "log_out_of_step")
    got = await expect_ok(await api.get(url, params={"lines": "4"}, headers=AUTH))
    assert got["lines"] == ["two", "three", "four", "five"] and got["seq"] == 5
    assert 0 <= got["age_s"] < 5 and got["received_at"] > 0 and got["message"] == ""
    await expect_ok(await api.post(url, json={"seq": 1, "lines": ["anew"]},
                                   headers=a["headers"]))
    got = await expect_ok(await api.get(url, headers=AUTH))
    assert got["lines"] == ["anew"]
    # Fellow b's log is its own, and still empty.
    got = await expect_ok(await api.get(f"{A}/fellows/{b['fellow_id']}/log", headers=AUTH))
    assert got["lines"] == [] and got["received_at"] is None
    # A departed fellow's last log stays readable, and says how old it is.
    await heartbeat(api, a, status="leaving")
    got = await expect_ok(await api.get(url, headers=AUTH))
    assert got["lines"] == ["anew"] and got["message"].startswith("fellow 0 is leaving: its last")


async def test_the_leader_takes_a_posted_log_as_plain_lines_that_cannot_drive_a_terminal(api):
    """Whatever a poster runs (not our ring: its own client), the leader holds and relays
    printable lines only: an OSC 2 posted must not retitle the reader's terminal, a CSI not
    clear it, and a line stays one line."""
    a = await register(api, "a")
    url = f"{A}/fellows/{a['fellow_id']}/log"
    osc, csi, c1 = "\x1b]2;owned\x07", "\x1b[2J", "\x9b31m"
    body = {"seq": 3, "lines": [f"{osc}title", f"{csi}clear{c1}red", "two\nlines\r\x00"]}
    await expect_ok(await api.post(url, json=body, headers=a["headers"]))
    more = {"seq": 5, "replace": False,
            "lines": ["a\tb\x7f", "\t" + "x" * 511]}  # (512 characters: as long as allowed)
    await expect_ok(await api.post(url, json=more, headers=a["headers"]))
    got = await expect_ok(await api.get(url, headers=AUTH))
    assert got["lines"] == [" ]2;owned title", " [2Jclear 31mred", "two lines  ",
                            "a       b ", " " * 8 + "x" * (MAX_LINE_CHARS - 9) + "…"]
    assert got["seq"] == 5


def test_the_console_shows_a_local_fellows_log_file_as_plain_lines(swarm_home):
    """The log view's other source, a local-cluster fellow's own log file, holds whatever
    its process wrote: cleaned as a posted line is."""
    from swarm_core import local_cluster
    from swarm_core.local_cluster import ClusterRecord, ProcessEntry
    from swarm_tui.app.screens.record import local_log

    log = swarm_home / "f0.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"\x1b]2;owned\x07title\r\nstep\t1\x1b[2J\n")
    local_cluster._write(ClusterRecord(
        leader_url="http://127.0.0.1:9", state_dir="/nowhere",
        leader=ProcessEntry(1, "leader", "l.log"), fellows=[ProcessEntry(2, "f0", str(log))],
        started_at=1.0))
    assert local_log("f0", "http://127.0.0.1:9") == (str(log), " ]2;owned title\nstep    1 [2J")


@pytest.mark.usefixtures("no_engine")
async def test_a_fellow_daemon_ships_its_log_when_asked(tmp_path, caplog):
    from tests.tui_support import Fellows

    caplog.set_level(logging.INFO, logger="swarm.fellow")
    leader = LiveLeader(tmp_path / "state")
    await leader.start()
    fellows = Fellows(leader.url, ["sim-0", "sim-1"])
    await fellows.start()
    client = leader.client()
    try:
        await wait_for(_Idle(), lambda: len(fellows.daemons[1].log_ring.since(None)[1]) > 0
                       and fellows.daemons[1].fellow_id is not None, "sim-1 to register")
        fid = fellows.daemons[1].fellow_id
        first = await client.fellow_log(fid)
        assert first.lines == [] and "asked it now" in first.message

        async def shipped():
            got = await client.fellow_log(fid, lines=50)
            return got.lines and got

        got = await _until(shipped, "sim-1 to ship its log")
        assert any(f"registered as fellow {fid} (sim-1)" in ln for ln in got.lines), got.lines
        assert not any("(sim-0)" in ln for ln in got.lines)
        assert got.age_s is not None and got.age_s < 5
        # New lines follow as deltas while someone reads.
        logging.getLogger("swarm.fellow").info("a marker line")  # (this task: every ring)
        got = await _until(lambda: _has(client, fid, "a marker line"), "the new line")
        assert got.seq == fellows.daemons[1].log_ring.seq
    finally:
        await client.close()
        await fellows.stop()
        await leader.stop()


class _Idle:
    """A pilot stand-in for wait_for outside an app: pause is a sleep."""

    async def pause(self, s: float) -> None:
        import asyncio

        await asyncio.sleep(s)


async def _until(probe, what: str, timeout: float = 10.0):
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while True:
        got = await probe()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def _has(client, fid: int, text: str):
    got = await client.fellow_log(fid)
    return any(text in ln for ln in got.lines) and got
