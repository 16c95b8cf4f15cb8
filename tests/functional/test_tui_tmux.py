"""The real `swarm-tui` binary in a real terminal (tmux, 80x24), as someone over SSH runs it:
`--local 2` starts a leader and two fellow processes, the keys work, `q` stops it all.

Needs the `tmux` program (CI installs it: `apt-get install -y tmux`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.clusters import cli_json, leader_call, pid_alive, run_cli

pytestmark = pytest.mark.slow
TMUX = shutil.which("tmux")
WIDTH, HEIGHT = 80, 24


def tui_command() -> list[str]:
    script = Path(sys.executable).with_name("swarm-tui")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from swarm_tui.cli import main_tui; "
            "sys.exit(main_tui())"]


class Tmux:
    def __init__(self, socket: str, env: dict[str, str]) -> None:
        assert TMUX is not None
        self.base = [TMUX, "-u", "-L", socket, "-f", "/dev/null"]  # -u: UTF-8 whatever LANG says
        self.env = env

    def run(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], capture_output=True, text=True, check=True,
                              env=self.env, timeout=10).stdout

    def send(self, *keys: str) -> None:
        self.run("send-keys", "-t", "tui", *keys)

    def type(self, text: str) -> None:
        self.run("send-keys", "-t", "tui", "-l", text)

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "tui")

    def pane(self, fmt: str) -> str:
        return self.run("display-message", "-p", "-t", "tui", fmt).strip()

    def wait(self, cond: Callable[[str], bool], what: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.screen()
            if cond(text):
                return text
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; the screen:\n{text}")


@pytest.fixture
def tmux(cli_env: dict[str, str], tmp_path: Path) -> Iterator[Tmux]:
    if TMUX is None:
        pytest.fail("tmux is not installed (CI installs it with apt-get install -y tmux)")
    env = {**cli_env, "TERM": "xterm-256color", "COLORTERM": "", "TMUX": "",
           "TEXTUAL": "", "LANG": os.environ.get("LANG") or "C.UTF-8"}
    t = Tmux(f"swarm-tui-test-{os.getpid()}-{tmp_path.name}", env)
    try:
        yield t
    finally:
        with_suppressed(lambda: t.run("kill-server"))
        run_cli("stop-cluster", env=cli_env, timeout=30)  # whatever the test left running


def with_suppressed(fn: Callable[[], object]) -> None:
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        fn()


def table_rows(screen: str) -> list[str]:
    return [line for line in screen.splitlines() if re.match(r"\s+\d+\s+local-\d", line)]


def test_swarm_tui_local_cluster_in_tmux(tmux: Tmux, cli_env: dict[str, str],
                                         swarm_home: Path) -> None:
    # The shell stays for the exit status (tmux 3.3 does not report one for a dead pane).
    cmd = " ".join([*tui_command(), "--local", "2"]) + '; echo "swarm-tui exited $?"'
    cmd = f"sh -c {shlex.quote(cmd)}"
    tmux.run("new-session", "-d", "-s", "tui", "-x", str(WIDTH), "-y", str(HEIGHT), cmd)
    tmux.run("set-option", "-t", "tui", "remain-on-exit", "on")
    assert tmux.pane("#{pane_width}x#{pane_height}") == f"{WIDTH}x{HEIGHT}"

    # The embedded cluster comes up and the home view fills.
    screen = tmux.wait(lambda s: len([r for r in table_rows(s) if "ready" in r]) == 2
                       and "● live" in s, "two ready fellows", timeout=90)
    lines = screen.splitlines()
    assert lines[0].startswith(" fellows ") and "2 fellows" in lines[0]
    assert "? Help" in lines[-1] and "q Quit" in lines[-1]
    assert all(len(line) <= WIDTH for line in lines)
    record = json.loads((swarm_home / "local-cluster" / "cluster.json").read_text())
    pids = [record["leader"]["pid"], *(f["pid"] for f in record["fellows"])]

    # ? shows every key; escape closes it.
    tmux.send("?")
    tmux.wait(lambda s: "Keys" in s and "fellows.set_speed" in s, "the help screen")
    tmux.send("Escape")
    tmux.wait(lambda s: "Keys" not in s and len(table_rows(s)) == 2, "help closed")

    # / filters by regex.
    tmux.send("/")
    tmux.wait(lambda s: "filter /" in s, "the filter bar")
    tmux.type("local-1")
    tmux.send("Enter")
    screen = tmux.wait(lambda s: len(table_rows(s)) == 1, "one row after filtering")
    assert "local-1" in table_rows(screen)[0]
    tmux.send("Escape")
    tmux.wait(lambda s: len(table_rows(s)) == 2, "the filter cleared")

    # s on the selected fellow: the dialog, a bad value refused in place, then a good one applied.
    tmux.send("s")  # the cursor stayed on local-1 through the filter
    tmux.wait(lambda s: re.search(r"Set link speed: \d+ local-1 ", s), "the set-speed dialog")
    tmux.type("abc")
    tmux.send("Enter")
    tmux.wait(lambda s: "'abc' is not a number" in s, "the inline error")
    tmux.send("C-u")  # (wait for it: a binding's action may run after keys typed behind it)
    tmux.wait(lambda s: re.search(r"tx Mbit/s +unlimited", s), "the field cleared")
    tmux.type("50")
    tmux.send("Enter")
    tmux.wait(lambda s: "Set link speed" not in s, "the dialog closed")
    deadline = time.monotonic() + 30
    while True:
        fellows = {f["name"]: f for f in cli_json("fellows", env=cli_env)["fellows"]}
        if fellows["local-1"]["link"]["tx_mbps"] == 50:
            break
        if time.monotonic() > deadline:
            logs = "".join(p.read_text()[-3000:] for p in
                           sorted((swarm_home / "local-cluster" / "logs").glob("*.log")))
            raise AssertionError(f"set-speed did not reach the fellow: {fellows}\n"
                                 f"{tmux.screen()}\n{logs}")
        time.sleep(0.2)
    assert fellows["local-0"]["link"]["tx_mbps"] is None

    # A job running on the cluster: q asks first, saying that quitting (which stops the
    # embedded cluster) makes the job fail, then quits and stops it, in well under a second
    # (issue 36: 0.86-1.9 s measured).
    leader_call("POST", "/jobs", cli_env, {
        "name": "smoky", "kind": "smoke", "topology": {"fellows": 2},
        "training": {"steps": 500, "step_seconds": 0.5}})
    tmux.wait(lambda s: "1 running" in s.splitlines()[0], "the job running")
    tmux.send("q")
    screen = tmux.wait(lambda s: "quitting stops" in s, "the quit confirmation")
    assert re.search(r"smoky,\W+running\W+on\W+it,\W+will\W+fail", screen), screen
    tmux.send("y")
    t0 = time.monotonic()
    # The shell is back at once (the fellows' goodbyes take seconds); the cluster stops in
    # the background.
    screen = tmux.wait(lambda s: "swarm-tui exited" in s, "the console to exit", timeout=5)
    assert time.monotonic() - t0 < 1.0
    assert "swarm-tui exited 0" in screen and "stopping the local cluster" in screen
    deadline = time.monotonic() + 30
    while any(pid_alive(pid) for pid in pids) or \
            (swarm_home / "local-cluster" / "cluster.json").exists():
        assert time.monotonic() < deadline, "the local cluster was not stopped"
        time.sleep(0.1)
