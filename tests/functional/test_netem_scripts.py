"""exp/scripts/{setup,cleanup}_netem.sh inside a network namespace this test creates."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support import REPO

SCRIPTS = REPO / "exp" / "scripts"


def sh(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30)


@pytest.fixture
def netns():
    name = f"swt{os.getpid() % 100000}"
    made = sh("ip", "netns", "add", name)
    assert made.returncode == 0, f"cannot create a network namespace: {made.stderr}"
    sh("ip", "-n", name, "link", "set", "lo", "up")
    yield name
    sh("ip", "netns", "del", name)


def qdisc(ns: str) -> str:
    return sh("tc", "-n", ns, "qdisc", "show", "dev", "lo").stdout


def test_rate_applied_and_removed_only_in_the_namespace(netns):
    host_before = sh("tc", "qdisc", "show").stdout
    up = sh("bash", str(SCRIPTS / "setup_netem.sh"), "--netns", netns, "--rate-mbit", "25")
    assert up.returncode == 0, up.stderr
    assert "tbf" in qdisc(netns) and "25Mbit" in qdisc(netns)
    assert sh("tc", "qdisc", "show").stdout == host_before, "host interfaces untouched"
    down = sh("bash", str(SCRIPTS / "cleanup_netem.sh"), "--netns", netns)
    assert down.returncode == 0 and "removed" in down.stdout
    assert "tbf" not in qdisc(netns)
    again = sh("bash", str(SCRIPTS / "cleanup_netem.sh"), "--netns", netns)
    assert again.returncode == 0 and "nothing to remove" in again.stdout


def test_delay_without_netem_is_said_clearly(netns):
    has_netem = sh("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", "lo", "root",
                   "netem", "delay", "1ms").returncode == 0
    sh("ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", "lo", "root")
    up = sh("bash", str(SCRIPTS / "setup_netem.sh"), "--netns", netns, "--rate-mbit", "10",
            "--delay-ms", "20")
    assert up.returncode == 0, up.stderr
    if has_netem:
        assert "netem" in qdisc(netns) and "20 ms delay" in up.stdout
    else:
        assert "netem is not available in this kernel" in up.stderr
        assert "tbf" in qdisc(netns)


@pytest.mark.parametrize("argv, message", [
    (["--dev", "lo", "--rate-mbit", "5"], "refusing to shape the host's loopback"),
    (["--rate-mbit", "5"], "name a --netns or a --dev"),
    (["--netns", "no-such-ns-xyz", "--rate-mbit", "5"], "no network namespace"),
    (["--dev", "eth0"], "--rate-mbit is required"),
    (["--dev", "x", "--rate-mbit", "fast"], "must be a number"),
])
def test_refuses_what_it_must_not_touch(argv, message):
    res = sh("bash", str(SCRIPTS / "setup_netem.sh"), *argv)
    assert res.returncode == 2 and message in res.stderr
