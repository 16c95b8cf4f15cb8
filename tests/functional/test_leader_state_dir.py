"""`swarm leader --state-dir DIR` makes a new directory 0700 and never changes an existing
one's mode: as root, `--state-dir /tmp` once stripped the system's /tmp to 0700. One that others
can write is refused (they could swap the token or the database), with nothing written."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.clusters import free_port, run_cli, spawn, stop, wait_until

pytestmark = pytest.mark.slow


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mode", [0o1777, 0o770], ids=oct)
def test_a_state_dir_others_can_write_is_refused_and_left_as_it_was(cli_env, tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    # (the local cluster's leader too: refused before the running cluster is stopped)
    for argv in (["leader", "--port", str(free_port())], ["restart-cluster", "--fellows", "1"]):
        proc = run_cli(*argv, "--state-dir", str(shared), env=cli_env, timeout=15)
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith(f"swarm: --state-dir: {shared} is writable by "), \
            proc.stderr
        assert _mode(shared) == mode
        assert list(shared.iterdir()) == []


def test_an_existing_private_state_dir_keeps_its_mode_and_a_new_one_is_made_0700(
        cli_env, tmp_path):
    existing, new = tmp_path / "existing", tmp_path / "parent" / "new"
    existing.mkdir()
    os.chmod(existing, 0o755)  # (readable by others, writable by its owner alone: fine)
    for state in (existing, new):
        port = str(free_port())
        log = tmp_path / f"{state.name}.log"
        leader = spawn(["leader", "--state-dir", str(state), "--port", port], cli_env, log)
        try:
            wait_until(lambda log=log: "leader listening" in log.read_text(), 30,
                       f"the leader on {state} to listen")
            assert (state / "token").is_file()
        finally:
            assert stop(leader) == 0
    assert _mode(existing) == 0o755
    assert _mode(new) == 0o700
