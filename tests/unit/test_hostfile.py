"""Hostfiles: what a line means, and one line naming the line for what is wrong; the ssh
command a launch runs carries no secret; the far end refuses a bad request in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarm_core.launch.hostfile import FellowPlan, HostfileError, parse_hostfile, read_hostfile
from swarm_core.launch.launcher import ssh_argv, start_request
from swarm_tui.cli import run
from tests.support import REPO


def test_a_line_names_its_fellows_and_deals_out_the_device_slots():
    hosts = parse_hostfile("""
# comment
gpu-a slots=2 devices=cuda:0,cuda:1 python=/opt/venv/bin/python   # trailing comment
alice@gpu-b slots=1 devices=cuda:0,cuda:1
cpu-box
cpus slots=3 devices=cpu data_host=0.0.0.0 data_advertise=10.0.0.7
""")
    assert [h.host for h in hosts] == ["gpu-a", "alice@gpu-b", "cpu-box", "cpus"]
    assert hosts[0].python == "/opt/venv/bin/python" and hosts[2].python == "python3"
    assert hosts[0].fellows() == [FellowPlan("gpu-a-0", ("cuda:0",)),
                                  FellowPlan("gpu-a-1", ("cuda:1",))]
    assert hosts[1].fellows() == [FellowPlan("gpu-b", ("cuda:0", "cuda:1"))]
    assert hosts[2].fellows() == [FellowPlan("cpu-box", ("cpu",))]
    assert [f.devices for f in hosts[3].fellows()] == [("cpu",)] * 3
    assert [h.line for h in hosts] == [3, 4, 5, 6]
    assert start_request(hosts[3], "http://l:1", None, "127.0.0.1")["fellows"][0]["args"] == \
        ["--data-host", "0.0.0.0", "--data-advertise", "10.0.0.7"]


@pytest.mark.parametrize(("text", "message"), [
    ("a slots=two", "line 1: slots must be a whole number from 1 to 64, got 'two'"),
    ("a slots=0", "line 1: slots must be a whole number"),
    ("\n\na devices=gpu0", "line 3: devices: 'gpu0' is not 'cpu' or 'cuda:N'"),
    ("a slots=2 devices=cuda:0,cuda:1,cuda:2", "line 1: 3 device slot(s) do not split evenly"),
    ("a colour=red", "line 1: unknown key 'colour' (known: slots, devices, python, "
                     "data_host, data_advertise)"),
    ("a data_advertise=0.0.0.0", "line 1: data_advertise: 0.0.0.0 is a bind-all address"),
    ("a data_host=a;b", "line 1: data_host: 'a;b' is not a host name or address"),
    ("a slots", "line 1: expected key=value, got 'slots'"),
    ("a slots=1 slots=2", "line 1: slots is given twice"),
    ("a python=", "line 1: python is empty"),
    ("a python=/bin/py;rm", "line 1: python: '/bin/py;rm' is not a plain path"),
    ("-oProxyCommand=x", "line 1: '-oProxyCommand=x' is not a host"),
    ("a\nb\na", "line 3: host a is already on line 1"),
    ("a-0\na slots=2", "line 2: fellow name a-0 is also line 1's"),
    ("# nothing\n", "no hosts"),
])
def test_a_bad_line_is_one_error_naming_it(text, message):
    with pytest.raises(HostfileError) as err:
        parse_hostfile(text, "hosts")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("hosts")


def test_a_missing_hostfile_is_one_line_and_a_usage_error(tmp_path, capsys):
    with pytest.raises(HostfileError, match="no such hostfile"):
        read_hostfile(tmp_path / "nope")
    (tmp_path / "hosts").write_text("a slots=x\n")
    assert run(["launch", "--hostfile", str(tmp_path / "hosts"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("hosts line 1: slots must be a whole number from 1 to 64, got 'x'")
    assert len(err.splitlines()) == 1


def test_the_ssh_command_carries_no_secret(tmp_path):
    [host] = parse_hostfile("gpu-a python=/opt/my-venv/bin/python")
    argv = ssh_argv(host, tmp_path / "cfg")
    assert argv[:4] == ["ssh", "-T", "-o", "BatchMode=yes"]
    assert argv[-3:] == ["gpu-a", "--", "exec /opt/my-venv/bin/python -m "
                                        "swarm_core.launch.remote"]
    req = start_request(host, "http://leader:8765", "s3cret", "0.0.0.0")
    assert req["token"] == "s3cret" and not any("s3cret" in a for a in argv)
    assert req["fellows"] == [{"name": "gpu-a", "devices": ["cpu"],
                               "args": ["--data-host", "0.0.0.0"]}]


def test_a_launch_without_a_token_is_refused_before_any_ssh(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # (no ssh to be found: none may run)
    (tmp_path / "hosts").write_text("h1\n")
    assert run(["--leader-url", "http://127.0.0.1:9", "launch", "--hostfile",
                str(tmp_path / "hosts")]) == 2
    assert "no token for the fellows" in capsys.readouterr().err


def test_a_dry_run_prints_the_commands_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SWARM_TOKEN", "s3cret")
    (tmp_path / "hosts").write_text("h1 slots=2\nh2 devices=cuda:0\n")
    assert run(["launch", "--hostfile", str(tmp_path / "hosts"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "h1: start h1-0 (cpu), h1-1 (cpu)" in out and "h2: start h2 (cuda:0)" in out
    assert "ssh -T -o BatchMode=yes -o ConnectTimeout=10 h1 -- 'exec python3 -m " \
           "swarm_core.launch.remote'" in out
    assert "s3cret" not in out


def test_the_far_end_refuses_a_bad_request_in_one_line(tmp_path):
    env = {"SWARM_HOME": str(tmp_path), "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    for body in (b"not json", json.dumps({"action": "dance"}).encode()):
        proc = subprocess.run([sys.executable, "-m", "swarm_core.launch.remote"], input=body,
                              capture_output=True, env=env, timeout=60)
        assert proc.returncode == 2
        assert json.loads(proc.stdout)["error"].startswith("bad request")
    # Stopping what is not running stops nothing, and says so.
    proc = subprocess.run([sys.executable, "-m", "swarm_core.launch.remote"],
                          input=json.dumps({"action": "stop", "names": ["x"]}).encode(),
                          capture_output=True, env=env, timeout=60)
    assert json.loads(proc.stdout)["fellows"] == [{"name": "x", "ok": True, "stopped": False}]
    assert not Path(tmp_path, "launch", "x.json").exists()


def test_the_far_end_never_signals_a_pid_that_is_no_longer_the_fellow(tmp_path):
    """A record whose pid now belongs to another process (the fellow died, the pid was
    reused) is dropped; that process is left alone."""
    other = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "launch").mkdir()
        (tmp_path / "launch" / "h1.json").write_text(json.dumps({"pid": other.pid}))
        env = {"SWARM_HOME": str(tmp_path), "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
        proc = subprocess.run([sys.executable, "-m", "swarm_core.launch.remote"],
                              input=json.dumps({"action": "stop", "names": ["h1"]}).encode(),
                              capture_output=True, env=env, timeout=60)
        assert json.loads(proc.stdout)["fellows"][0]["stopped"] is False
        assert other.poll() is None
        assert not (tmp_path / "launch" / "h1.json").exists()
    finally:
        other.kill()
        other.wait()
