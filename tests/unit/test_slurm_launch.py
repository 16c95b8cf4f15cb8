"""``swarm launch --slurm``: the batch script's #SBATCH and srun lines, no token in it, bad flags
refused in one line with nothing written, --submit without sbatch; and the script run on this
machine with an ``srun`` that starts its tasks as local processes (sbatch --test-only is not
available here): the leader and two fellows come up on 127.0.0.1, the fellows register, and
everything is gone once they are released."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from swarm_core.launch.slurm import SlurmError, is_generated, make_plan, sbatch_script
from swarm_tui.cli import run
from tests.clusters import free_port, pid_alive, wait_until

SECRET = "s3cret-token-never-in-the-script"


def _srun_lines(script: str) -> list[list[str]]:
    return [shlex.split(line.removesuffix("&"))
            for line in script.splitlines() if line.startswith("srun ")]


def test_the_script_carries_the_allocation_and_no_token(monkeypatch, capsys):
    monkeypatch.setenv("SWARM_TOKEN", SECRET)
    assert run(["launch", "--slurm", "--nodes", "3", "--gpus-per-node", "4", "--partition",
                "gpu", "--time", "2-00:00:00", "--account", "proj-1", "--job-name", "lm",
                "--python", "/opt/swarm/bin/python", "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert script.startswith("#!/bin/bash\n")
    assert re.findall(r"^#SBATCH (\S+)$", script, re.M) == [
        "--job-name=lm", "--nodes=3", "--ntasks-per-node=4", "--gpus-per-node=4",
        "--partition=gpu", "--time=2-00:00:00", "--account=proj-1"]
    assert SECRET not in script and "--token" not in script
    assert is_generated(script)

    leader, fellows = _srun_lines(script)
    # The leader: one task on the first node of the allocation, bound for the other nodes.
    assert leader[:5] == ["srun", "--nodes=1", "--ntasks=1",
                          "--nodelist=$SWARM_LEADER_NODE", "--overlap"]
    assert leader[5:9] == ["$SWARM_PYTHON", "-m", "swarm_tui.cli", "leader"]
    assert "--allow-remote" in leader
    # The fellows: one per GPU on every node, each naming its GPU and itself by srun's ranks.
    assert fellows[:4] == ["srun", "--nodes=3", "--ntasks-per-node=4", "--overlap"]
    assert fellows[4:6] == ["bash", "-c"]
    task = fellows[6]
    assert 'RANK="$SLURM_PROCID" LOCAL_RANK="$SLURM_LOCALID"' in task
    assert "swarm_tui.cli fellow --devices cuda " in task
    assert "SWARM_PYTHON=${SWARM_PYTHON:-/opt/swarm/bin/python}" in script
    # The token comes from the environment, or from the leader's token file: never the text.
    assert 'SWARM_TOKEN=$(cat "$SWARM_STATE_DIR/token")' in script


@pytest.mark.parametrize(("kwargs", "devices", "per_node"), [
    ({}, "cpu", 1),
    ({"fellows_per_node": 3}, "cpu", 3),
    ({"gpus_per_node": 2}, "cuda", 2),
    ({"gpus_per_node": 2, "fellows_per_node": 1}, "cuda:0,cuda:1", 1),
])
def test_fellows_per_node_or_per_gpu(kwargs, devices, per_node):
    plan = make_plan(2, **kwargs)
    assert (plan.devices, plan.fellows_per_node) == (devices, per_node)
    script = sbatch_script(plan)
    assert f"#SBATCH --ntasks-per-node={per_node}\n" in script
    assert ("#SBATCH --gpus-per-node" in script) == ("gpus_per_node" in kwargs)
    assert f"fellow --devices {devices} " in script


@pytest.mark.parametrize(("flags", "message"), [
    (["--slurm"], "--slurm needs --nodes N"),
    (["--slurm", "--nodes", "0"], "node count must be >= 1"),
    (["--slurm", "--nodes", "2", "--gpus-per-node", "4", "--fellows-per-node", "3"],
     "--fellows-per-node 3 with --gpus-per-node 4: give 4 (one fellow per GPU) or 1"),
    (["--slurm", "--nodes", "2", "--time", "soon"], "--time: expected minutes"),
    (["--slurm", "--nodes", "2", "--partition", "gpu\n#SBATCH --x"], "--partition: expected"),
    (["--slurm", "--nodes", "2", "--job-name", "a b"], "--job-name: expected"),
    (["--slurm", "--nodes", "2", "--python", "/bin/py;rm"], "--python: expected a plain path"),
    (["--slurm", "--nodes", "2", "--port", "0"], "--port must be from 1 to 65535"),
    (["--slurm", "--nodes", "2", "--hostfile", "hosts"], "--hostfile is for the ssh launch"),
    (["--slurm", "--nodes", "2", "--dry-run", "--submit"], "--dry-run prints the script"),
    (["--nodes", "2"], "--nodes is for --slurm"),
    (["--gpus-per-node", "0", "--hostfile", "hosts"], "--gpus-per-node is for --slurm"),
    ([], "give --hostfile FILE (fellows over ssh) or --slurm --nodes N"),
])
def test_a_bad_flag_is_one_line_and_nothing_is_written(flags, message, tmp_path, capsys,
                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "job.sbatch"
    if "--dry-run" not in flags and "--slurm" in flags:
        flags = [*flags, "--output", str(out)]
    try:
        code = run(["launch", *flags])
    except SystemExit as exc:  # (argparse's own: a value of the wrong type)
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1
    assert captured.out == "" and list(tmp_path.iterdir()) == []


def test_make_plan_names_the_flag():
    with pytest.raises(SlurmError, match="--account: expected"):
        make_plan(1, account="x;y")


def test_the_script_is_written_but_never_over_another_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(["launch", "--slurm", "--nodes", "2", "--job-name", "lm"]) == 0
    assert capsys.readouterr().out.strip() == "wrote lm.sbatch: submit it with 'sbatch lm.sbatch'"
    assert "#SBATCH --nodes=2" in (tmp_path / "lm.sbatch").read_text()
    # Written again (over our own script), with other settings.
    assert run(["launch", "--slurm", "--nodes", "4", "--job-name", "lm"]) == 0
    assert "#SBATCH --nodes=4" in (tmp_path / "lm.sbatch").read_text()
    mine = tmp_path / "mine.sh"
    mine.write_text("#!/bin/bash\necho mine\n")
    assert run(["launch", "--slurm", "--nodes", "2", "--output", str(mine)]) == 2
    assert "was not written by 'swarm launch --slurm'" in capsys.readouterr().err
    assert mine.read_text() == "#!/bin/bash\necho mine\n"


def test_submit_needs_sbatch_and_hands_it_the_script(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    assert run(["launch", "--slurm", "--nodes", "1", "--submit"]) == 1
    err = capsys.readouterr().err
    assert "sbatch is not on PATH" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "swarm.sbatch").exists()

    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'sbatch-args'}\necho 4242\n")
    sbatch.chmod(0o755)
    assert run(["launch", "--slurm", "--nodes", "1", "--submit", "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert '"job_id": "4242"' in out
    assert (tmp_path / "sbatch-args").read_text().split() == ["--parsable", "swarm.sbatch"]
    assert is_generated((tmp_path / "swarm.sbatch").read_text())


# An srun for a one-node allocation: the step's tasks as local processes, each with the
# SLURM_* variables srun gives a task; it forwards SIGTERM to them, as srun does.
FAKE_SRUN = r"""#!/bin/bash
n=1
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes=*) [ "${1#*=}" = 1 ] || { echo "fake srun: one node only" >&2; exit 2; } ;;
    --ntasks=*|--ntasks-per-node=*) n=${1#*=} ;;
    --*) ;;
    *) break ;;
  esac
  shift
done
pids=()
for ((i = 0; i < n; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 SLURM_NTASKS=$n "$@" &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' TERM INT
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
exit $status
"""


def _session(sid: int) -> list[int]:
    """The live processes of session ``sid`` (the script and everything it started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _fellows(url: str, token: str) -> list[dict[str, Any]]:
    from swarm_core.client import SwarmClient

    async def call() -> list[dict[str, Any]]:
        async with SwarmClient(url, token) as client:
            res = await client.request("GET", "/api/v1/fellows")
            return list(res["fellows"])

    try:
        return asyncio.run(call())
    except Exception:  # (not up yet)
        return []


def _release(url: str, token: str) -> None:
    from swarm_core.client import SwarmClient

    async def call() -> None:
        async with SwarmClient(url, token) as client:
            await client.release(all=True)

    asyncio.run(call())


def test_the_scripts_srun_lines_start_a_leader_and_fellows_that_register(tmp_path, cli_env):
    script = tmp_path / "job.sbatch"
    assert run(["launch", "--slurm", "--nodes", "1", "--fellows-per-node", "2",
                "--python", sys.executable, "--output", str(script)]) == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    port = free_port()
    env = {**cli_env, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(tmp_path),
           "SLURM_JOB_NODELIST": "node-a",
           # Loopback only: what a site would leave at the first node's name and 0.0.0.0.
           "SWARM_LEADER_NODE": "127.0.0.1", "SWARM_LEADER_BIND": "127.0.0.1",
           "SWARM_DATA_HOST": "127.0.0.1", "SWARM_LEADER_PORT": str(port)}
    log = tmp_path / "job.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(script)], stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=tmp_path, start_new_session=True)
    try:
        state = tmp_path / "swarm-state-77"
        token = wait_until(lambda: (state / "token").exists()
                           and (state / "token").read_text().strip(), 60, "the leader's token")
        url = f"http://127.0.0.1:{port}"
        host = socket.gethostname()

        def registered() -> list[dict[str, Any]]:
            got = _fellows(url, token)
            return got if len(got) == 2 else []

        fellows = wait_until(registered, 90, "two fellows to register", interval=0.5)
        assert sorted(f["name"] for f in fellows) == [f"{host}-r0", f"{host}-r1"]
        assert all(f["devices"] == ["cpu"] for f in fellows)
        # The token reached the fellows through their environment, never a command line.
        for f in fellows:
            cmdline = Path(f"/proc/{f['pid']}/cmdline").read_bytes()
            assert token.encode() not in cmdline and b"fellow" in cmdline
            assert f"SWARM_TOKEN={token}".encode() in \
                Path(f"/proc/{f['pid']}/environ").read_bytes().split(b"\0")
        assert token not in script.read_text()
        # Released, the fellows leave; the script then stops the leader and ends.
        _release(url, token)
        assert proc.wait(60) == 0, log.read_text()[-2000:]
        assert f"swarm: leader at {url}" in log.read_text()
        deadline = time.monotonic() + 15
        while _session(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _session(proc.pid) == []
        assert not any(pid_alive(f["pid"]) for f in fellows)
    finally:
        if proc.poll() is None or _session(proc.pid):
            for pid in _session(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(10)
