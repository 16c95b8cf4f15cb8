"""The console and the local cluster: it follows the record to a restarted leader, and its quit
stops only the processes it started itself, in the background."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm_core import local_cluster
from swarm_core.client import LeaderUnreachable
from swarm_core.local_cluster import ClusterRecord, ProcessEntry
from swarm_tui.app import main as console_main
from swarm_tui.app.app import SwarmApp
from tests.tui_support import FakeClient, frozen_clock, screen_text, wait_for

# Stands in for a leader or fellow: named like one (the pid guard reads the command line), and
# slow to go on SIGTERM, as a fellow saying goodbye to its leader is.
SLOW_EXIT = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.5), sys.exit(0)))\n"
             "time.sleep(120)\n")


@pytest.fixture
def procs() -> list[subprocess.Popen[bytes]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def spawn(procs: list[subprocess.Popen[bytes]], n: int) -> list[int]:
    new = [subprocess.Popen([sys.executable, "-c", SLOW_EXIT, "swarm_tui.cli"])
           for _ in range(n)]
    procs.extend(new)
    time.sleep(0.3)  # (their SIGTERM handler is in place)
    return [p.pid for p in new]


def record(leader: int, fellows: list[int], port: int, started: float) -> ClusterRecord:
    return ClusterRecord(leader_url=f"http://127.0.0.1:{port}", state_dir="/nowhere",
                         leader=ProcessEntry(leader, "leader", "l.log"),
                         fellows=[ProcessEntry(p, f"local-{i}", "f.log")
                                  for i, p in enumerate(fellows)], started_at=started)


def alive(procs: list[subprocess.Popen[bytes]], pid: int) -> bool:
    return next(p for p in procs if p.pid == pid).poll() is None


def args(**kw: object) -> argparse.Namespace:
    base = dict(leader_url=None, token=None, local=None, read_only=False, configs=None,
                keymap=None)
    return argparse.Namespace(**{**base, **kw})


def test_quit_leaves_a_cluster_that_restart_cluster_put_in_its_place(
        swarm_home: Path, procs: list[subprocess.Popen[bytes]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    ours = spawn(procs, 3)
    theirs = spawn(procs, 3)
    mine = record(ours[0], ours[1:], 1111, 1.0)
    monkeypatch.setattr(local_cluster, "start_cluster", lambda spec: (
        local_cluster._write(mine), mine)[1])
    monkeypatch.setattr(local_cluster, "token_for", lambda rec: "t")

    def run(self: SwarmApp, **_kw: object) -> None:  # while it runs: kill -9, restart-cluster
        for p in ours:
            next(x for x in procs if x.pid == p).kill()
        local_cluster._write(record(theirs[0], theirs[1:], 2222, 2.0))

    monkeypatch.setattr(SwarmApp, "run", run)
    assert console_main.run_console(args(local=2)) == 0
    time.sleep(2.0)  # (a background stop, had one started, would be under way)
    assert all(alive(procs, p) for p in theirs)
    assert local_cluster.read_record().leader.pid == theirs[0]  # type: ignore[union-attr]


def test_quit_is_back_at_once_and_the_cluster_stops_in_the_background(
        swarm_home: Path, procs: list[subprocess.Popen[bytes]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    ours = spawn(procs, 3)
    mine = record(ours[0], ours[1:], 1111, 1.0)
    monkeypatch.setattr(local_cluster, "start_cluster", lambda spec: (
        local_cluster._write(mine), mine)[1])
    monkeypatch.setattr(local_cluster, "token_for", lambda rec: "t")
    monkeypatch.setattr(SwarmApp, "run", lambda self, **_kw: None)  # q, y: quit at once
    t0 = time.monotonic()
    assert console_main.run_console(args(local=2)) == 0
    assert time.monotonic() - t0 < 1.0  # each process takes 1.5 s to go
    deadline = time.monotonic() + 15
    while any(alive(procs, p) for p in ours):
        assert time.monotonic() < deadline, "the cluster was not stopped"
        time.sleep(0.1)
    while local_cluster.read_record() is not None:
        assert time.monotonic() < deadline, "the record was left behind"
        time.sleep(0.1)


class DeadLeader(FakeClient):
    async def fellows(self):  # type: ignore[no-untyped-def]
        raise LeaderUnreachable("cannot reach the leader at http://127.0.0.1:1111: "
                                "connection refused")

    async def events(self, *, types=None, job_id=None):  # type: ignore[no-untyped-def]
        raise LeaderUnreachable("connection refused")
        yield {}


async def test_a_restarted_local_leader_is_followed_to_its_new_port() -> None:
    where = {"url": "http://127.0.0.1:1111"}
    connected: list[tuple[str, str | None]] = []

    def connect(url: str, token: str | None) -> FakeClient:
        connected.append((url, token))
        return FakeClient()

    app = SwarmApp(DeadLeader(), leader_url="http://127.0.0.1:1111", clock=frozen_clock,
                   refresh_s=None, tick_s=None, flush_s=0,
                   follow=lambda: (where["url"], "new-token"), connect=connect)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.connection == "lost", "the leader lost")
        assert connected == [] and app.model.fellows == {}
        where["url"] = "http://127.0.0.1:2222"  # swarm restart-cluster
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: app.connection == "live" and app.model.fellows,
                       "the new leader's fellows")
        assert connected == [("http://127.0.0.1:2222", "new-token")]
        assert app.leader_url == "http://127.0.0.1:2222"
        await pilot.pause()
        assert "127.0.0.1:2222" in screen_text(app).splitlines()[0]
