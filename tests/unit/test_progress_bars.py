"""``swarm sweep`` at a terminal draws a bar per run (step of steps, loss, ETA); elsewhere it
keeps its plain progress lines. The terminal is a real pseudo-terminal, the leader real, and
the two stages are played over HTTP so the test can look at the screen between steps."""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import struct
import sys
import termios
import threading

import pytest

from swarm_core.client import SwarmClient
from swarm_tui.commands.progress_bars import wants_bars
from tests.support import REPO, TOKEN, swarm_argv, wait_async
from tests.tracking_support import play_step, register_stages, report_step, write_config

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Screen:
    """What a process wrote to its terminal, read on a thread, escape sequences removed."""

    def __init__(self, fd: int) -> None:
        self.fd, self.raw = fd, b""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # (the other side closed)
                return
            if not chunk:
                return
            self.raw += chunk

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode(errors="replace"))


async def test_a_sweep_at_a_terminal_draws_a_bar_per_run(api, tmp_path, cli_env):
    stages = await register_stages(api, 2)
    cfg = write_config(tmp_path, steps=3)
    url = f"http://127.0.0.1:{api.server.port}"
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    env = {**cli_env, "TERM": "xterm-256color", "COLUMNS": "120"}
    proc = await asyncio.create_subprocess_exec(
        *swarm_argv("--leader-url", url, "--token", TOKEN, "sweep", "--config", str(cfg),
                    "--poll", "0.1", "--no-tensorboard"),
        stdin=asyncio.subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, cwd=REPO)
    os.close(slave)
    screen = Screen(master)
    try:
        async with SwarmClient(url, TOKEN) as client:
            async def running():
                jobs = await client.jobs("RUNNING")
                return jobs[0] if jobs and jobs[0].placement is not None else None

            job = await wait_async(running, "the sweep's job to run", timeout=90)  # (a loaded CI)
            by_stage = {s.stage: next(f for f in stages if f["fellow_id"] == s.fellow_id)
                        for s in job.placement.stages}
            for step in (1, 2):
                await play_step(api, job.job_id, by_stage, step)

            async def drawn():
                return re.search(r"━.* 2/3 loss 4\.5000 RUNNING ETA", screen.text)

            await wait_async(drawn, "a bar at step 2 of 3", timeout=60)
            assert re.search(r"tiny\S* +━", screen.text), screen.text  # the run's name
            await play_step(api, job.job_id, by_stage, 3)
            for s in (0, 1):
                await report_step(api, job.job_id, by_stage[s], 3, state="COMPLETED",
                                  metrics={"wire_tx_bytes_per_step": 1.0})
            assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        screen.thread.join(5)
        os.close(master)
    text = screen.text
    assert re.search(r"3/3 loss 4\.2500 COMPLETED ETA \d+:\d\d:\d\d", text), text
    # The bars replace the plain step lines; the closing table still follows.
    assert not re.search(r"\[1/1\] \S+ job-\d+ RUNNING step", text)
    assert "final loss" in text


def test_bars_only_for_table_output_to_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    assert not wants_bars("table")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    assert wants_bars("table") and not wants_bars("json")


pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")
