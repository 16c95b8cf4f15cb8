"""Every benchmark runs (``--quick``) and prints its table. Speed targets are read from the
full runs, not asserted here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

BENCHES = {
    "bench_codec.py": "int8",
    "bench_links.py": "step/bound",
    "bench_leader.py": "p99 ms",
    "bench_pipeline.py": "tokens/s",
    "bench_tui.py": "ms",
}


@pytest.mark.parametrize("script, needle", sorted(BENCHES.items()))
def test_benchmark_runs_quick(script, needle, cli_env):
    res = subprocess.run([sys.executable, str(REPO / "bench" / script), "--quick"],
                         capture_output=True, text=True, env=cli_env, cwd=REPO, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert needle in res.stdout, res.stdout[-2000:]
