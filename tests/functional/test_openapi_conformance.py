"""schemathesis against /api/v1/openapi.json with a valid token: no 5xx, and every status,
content type, header and body the leader answers with matches its own document."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clusters import free_port, spawn, stop, wait_until

pytestmark = pytest.mark.slow

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance,response_headers_conformance")


def test_leader_conforms_to_its_openapi_document(cli_env, tmp_path):
    exe = Path(sys.executable).parent / "schemathesis"
    assert exe.exists() or shutil.which("schemathesis"), "schemathesis (test extra) missing"
    port = free_port()
    env = {**cli_env, "SWARM_TOKEN": "conformance-token"}
    leader = spawn(["leader", "--state-dir", str(tmp_path / "state"), "--port", str(port)],
                   env, tmp_path / "leader.log")
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        def up() -> bool:
            try:
                return urllib.request.urlopen(f"{url}/healthz", timeout=1).status == 200
            except OSError:
                return False

        wait_until(up, 20, "the leader to answer")
        res = subprocess.run(
            [str(exe), "run", f"{url}/api/v1/openapi.json",
             "-H", "Authorization: Bearer conformance-token", "--checks", CHECKS,
             "--max-examples", "10", "--seed", "20261129", "--no-color"],
            capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    finally:
        stop(leader)
    tail = res.stdout[-3000:]
    assert res.returncode == 0, tail
    assert "passed" in tail and "failures" not in tail.lower().split("summary")[-1], tail
    log = (tmp_path / "leader.log").read_text()
    assert "unhandled error" not in log, log[-2000:]
