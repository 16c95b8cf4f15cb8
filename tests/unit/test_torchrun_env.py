"""``swarm fellow`` under torchrun: what it takes from RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT (flags win), and a malformed one refused in one line."""

from __future__ import annotations

import pytest

from swarm_core.launch.torchrun import (
    LaunchEnv,
    LaunchEnvError,
    fellow_devices,
    fellow_name,
    leader_url,
    read_launch_env,
)
from swarm_tui.cli import run

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node-a",
            "MASTER_PORT": "29500"}


def test_torchruns_variables_name_the_fellow_its_gpu_and_its_leader():
    env = read_launch_env({**TORCHRUN, "PATH": "/bin"})
    assert env == LaunchEnv(rank=5, world_size=8, local_rank=1, master_addr="node-a",
                            master_port=29500)
    assert fellow_name("gpu-a", env) == "gpu-a-r5"
    assert fellow_devices("cuda", env, None, has_gpu=True) == "cuda:1"
    assert fellow_devices("auto", env, "0,1,2,3", has_gpu=True) == "cuda:1"
    # The launcher bound this process to one GPU: it is cuda:0 whatever LOCAL_RANK says.
    assert fellow_devices("cuda", env, "3", has_gpu=True) == "cuda:0"
    assert fellow_devices("auto", env, None, has_gpu=False) == "cpu"
    # Explicit devices win, and cpu (the default) stays cpu.
    assert fellow_devices("cuda:3", env, None, has_gpu=True) == "cuda:3"
    assert fellow_devices("cpu", env, None, has_gpu=True) == "cpu"
    # The leader's default port on MASTER_ADDR's host: MASTER_PORT is torchrun's own store.
    assert leader_url(env) == "http://node-a:8765"
    assert leader_url(read_launch_env({"MASTER_ADDR": "fd00::1"})) == "http://[fd00::1]:8765"


def test_without_a_launcher_nothing_changes():
    env = read_launch_env({"PATH": "/bin"})
    assert env == LaunchEnv()
    assert fellow_name("gpu-a", env) == "gpu-a"
    assert fellow_devices("cuda", env, None, has_gpu=True) == "cuda:0"
    assert leader_url(env) is None


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "one"}, "RANK must be a whole number >= 0, got 'one'"),
    ({"RANK": ""}, "RANK must be a whole number >= 0, got ''"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK must be a whole number >= 0, got '-1'"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE must be a whole number >= 1, got '0'"),
    ({"RANK": "8", "WORLD_SIZE": "8"}, "RANK 8 is not below WORLD_SIZE 8"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT must be a port from 1 to 65535"),
    ({"MASTER_ADDR": "http://a b"}, "MASTER_ADDR: expected a host name or address"),
])
def test_a_malformed_variable_is_named(env, message):
    with pytest.raises(LaunchEnvError) as err:
        read_launch_env(env)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_fellow_refuses_a_malformed_variable_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "x1")
    assert run(["--leader-url", "http://127.0.0.1:9", "fellow"]) == 2
    err = capsys.readouterr().err
    assert err == "swarm: LOCAL_RANK must be a whole number >= 0, got 'x1'\n"


def test_flags_win_over_the_launchers_variables(monkeypatch):
    """--name and --leader-url are taken as given; MASTER_ADDR only fills in a missing URL,
    and RANK only the default name (seen where the daemon would be made, before it connects)."""
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    seen: dict[str, object] = {}

    class Stop(BaseException):  # (run() turns an Exception into an "internal error" line)
        pass

    def fake_daemon(opts):
        seen.update(url=opts.leader_url, name=opts.name, devices=opts.devices)
        raise Stop

    monkeypatch.setattr("swarm_core.fellow.FellowDaemon", fake_daemon)
    monkeypatch.setattr("socket.gethostname", lambda: "gpu-a")
    with pytest.raises(Stop):
        run(["fellow"])
    assert seen == {"url": "http://node-a:8765", "name": "gpu-a-r5", "devices": ["cpu"]}
    with pytest.raises(Stop):
        run(["--leader-url", "http://127.0.0.1:9", "fellow", "--name", "mine"])
    assert seen == {"url": "http://127.0.0.1:9", "name": "mine", "devices": ["cpu"]}
    monkeypatch.setenv("SWARM_LEADER_URL", "http://127.0.0.1:10")
    with pytest.raises(Stop):
        run(["fellow"])
    assert seen["url"] == "http://127.0.0.1:10"
