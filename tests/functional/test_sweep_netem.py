"""A sweep whose network profile has a tc_profile shapes a namespace around each run, one run at
a time, and cleans up after success and after failure alike."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.clusters import run_cli

pytestmark = pytest.mark.slow


def test_tc_profile_is_applied_around_each_run_and_removed(cli_env, tmp_path):
    ns = f"swsweep{os.getpid() % 100000}"
    assert subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode == 0
    subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], capture_output=True)
    (tmp_path / "model").mkdir()
    (tmp_path / "training").mkdir()
    (tmp_path / "model" / "m.json").write_text(json.dumps(
        {"name": "m", "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}))
    (tmp_path / "training" / "t.json").write_text(json.dumps(
        {"steps": 2, "batch_size": 4, "micro_batches": 2, "eval_batches": 1,
         "cluster_profile": {"fellows": 2}, "artifacts": {"runs_dir": "../runs"}}))
    tc = {"netns": ns, "rate_mbit": 30}
    cfg = tmp_path / "exp.json"
    cfg.write_text(json.dumps({
        "name": "tc", "training_config": "training/t.json", "model_configs": ["model/m.json"],
        "sweep": {"network_profiles": [
            {"name": "ok", "tc_profile": tc},
            # Its setup fails (no such namespace): the run fails, cleanup still runs.
            {"name": "bad", "tc_profile": {"netns": "no-such-ns-x", "rate_mbit": 30}}],
            "overrides": {}}}))
    assert run_cli("restart-cluster", "--fellows", "2", env=cli_env, timeout=90).returncode == 0
    try:
        res = run_cli("sweep", "--config", str(cfg), "--format", "json", env=cli_env,
                      timeout=240)
        skipped = run_cli("sweep", "--config", str(cfg), "--skip-netem", "--detach",
                          "--format", "json", env=cli_env, timeout=60)
    finally:
        run_cli("stop-cluster", env=cli_env)
        left = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "lo"],
                              capture_output=True, text=True).stdout
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert res.returncode == 1, res.stderr  # one run failed
    runs = json.loads(res.stdout)["runs"]
    assert [r["state"] for r in runs] == ["COMPLETED", "FAILED"]
    ok = json.loads((tmp_path / "runs" / runs[0]["run_id"] / "netem.json").read_text())
    assert "30.0 Mbit/s" in ok["setup"] and "shaping removed" in ok["cleanup"]
    bad = json.loads((tmp_path / "runs" / runs[1]["run_id"] / "netem.json").read_text())
    assert "setup" not in bad and "cleanup" in bad
    manifest = json.loads((tmp_path / "runs" / runs[1]["run_id"] / "manifest.json").read_text())
    assert "no network namespace named no-such-ns-x" in manifest["note"]
    assert "tbf" not in left, "no shaping left behind"
    assert "one at a time" in res.stderr
    assert skipped.returncode == 0  # --skip-netem queues everything at once, no tc
