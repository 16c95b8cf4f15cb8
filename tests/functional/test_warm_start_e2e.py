"""A warm start across real processes: a one-stage job trains, then ``swarm submit
--warm-start`` starts a two-stage job from its last checkpoint; the second job's losses are
those of one process that loads the same weights and trains from step 0 with a fresh AdamW."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarm_core.artifacts.shards import load_shard
from swarm_core.config.schemas import TrainingConfig
from swarm_core.data import load_token_data
from swarm_core.schema import structure
from tests.clusters import cli_json, job_view, run_cli, wait_until
from tests.unit.test_warm_start import MODEL, _reference_from

pytestmark = pytest.mark.slow

TRAINING = {"batch_size": 4, "micro_batches": 2, "eval_batches": 1, "frame_timeout_s": 20}


def _finished(job_id: str, env: dict[str, str]) -> dict:
    return wait_until(lambda: (j := job_view(job_id, env))["state"] in
                      ("COMPLETED", "FAILED", "CANCELLED") and j, 240, f"{job_id} to end")


def test_a_two_stage_job_warm_starts_from_a_one_stage_jobs_checkpoint(cli_env, tmp_path,
                                                                       swarm_home):
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"name": "tiny", **MODEL}))
    source = tmp_path / "source.json"
    source.write_text(json.dumps({"name": "source", "kind": "train",
                                  "model": {"name": "tiny", **MODEL},
                                  "training": {**TRAINING, "steps": 6, "seed": 4},
                                  "topology": {"fellows": 1}}))
    profile = tmp_path / "training.json"
    profile.write_text(json.dumps({**TRAINING, "steps": 4}))
    up = run_cli("restart-cluster", "--fellows", "2", env=cli_env, timeout=120)
    assert up.returncode == 0, up.stderr
    try:
        # (read now: stop-cluster removes it)
        record = json.loads((swarm_home / "local-cluster" / "cluster.json").read_text())
        src = cli_json("submit", "--payload", str(source), env=cli_env)["job_id"]
        done = _finished(src, cli_env)
        assert done["state"] == "COMPLETED", done["reason"]
        warm = cli_json("submit", "--model", str(model), "--training", str(profile),
                        "--stages", "2", "--fellows", "2", "--warm-start", src, env=cli_env)
        assert warm["training"]["warm_start"] == {"job_id": src, "step": 6}
        job = _finished(warm["job_id"], cli_env)
        # A sweep's warm-up (sweep.warm_up): trained first, every run from its weights.
        swept = run_cli("sweep", "--config", str(_sweep(tmp_path)), "--runs-dir",
                        str(tmp_path / "runs"), env=cli_env, timeout=240)
        # The same config again, from that warm-up (--warm-start): nothing trained first.
        shared = None
        if swept.returncode == 0:
            [first] = (tmp_path / "runs").glob("warmed-warm-up-*")
            shared = run_cli("sweep", "--config", str(_sweep(tmp_path)), "--runs-dir",
                             str(tmp_path / "shared"), "--warm-start",
                             f"{json.loads(first.read_text())['job_id']}:3", env=cli_env,
                             timeout=240)
    finally:
        run_cli("stop-cluster", env=cli_env)
    assert job["state"] == "COMPLETED", job["reason"]
    shard = Path(record["state_dir"]) / "runs" / src / "checkpoints" / "step-6" / "stage-0"
    _, arrays = load_shard(shard)
    state = {k: torch.from_numpy(v) for k, v in arrays.items()}
    tc = structure(job["training"], TrainingConfig)
    ref = _reference_from(state, tc, load_token_data(tc, MODEL["seq_len"]))
    losses = [loss for _, loss in job["loss_history"]]
    assert len(losses) == 4
    assert max(abs(a - b) for a, b in zip(ref, losses, strict=True)) <= 1e-5, (ref, losses)
    # The sweep: its warm-up job of 3 steps (run 0's without its variant's lr), then its
    # two variants' runs of 4 from its weights, each named by its variant.
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert "[warm-up] warmed-warm-up job-" in swept.stdout
    runs = sorted(d for d in (tmp_path / "runs").iterdir() if d.is_dir())
    [warm_up] = [json.loads(f.read_text()) for f in (tmp_path / "runs").glob("warmed-warm-up-*")]
    assert warm_up["state"] == "COMPLETED" and warm_up["training"]["steps"] == 3
    assert warm_up["training"]["lr"] == TrainingConfig().lr != 1e-3
    resolved = [json.loads((r / "config_resolved.json").read_text())["job"] for r in runs]
    starts = [job["training"]["warm_start"] for job in resolved]
    assert len(runs) == 2 and starts[0] == starts[1] == {"job_id": warm_up["job_id"], "step": 3}
    shard = Path(record["state_dir"]) / "runs" / starts[0]["job_id"] / "checkpoints" / \
        "step-3" / "stage-0"
    _, arrays = load_shard(shard)
    state = {k: torch.from_numpy(v) for k, v in arrays.items()}
    for run, body in zip(runs, resolved, strict=True):
        summary = json.loads((run / "metrics_summary.json").read_text())
        assert summary["status"] == "COMPLETED"
        assert f"-{summary['variant']}-s0-" in run.name
        assert json.loads((run / "config_resolved.json").read_text())["variant"] == \
            summary["variant"]
        assert summary["warm_start"] == f"{warm_up['job_id']}@3"
        assert body["training"]["lr"] == {"slow": 1e-3, "plain": TrainingConfig().lr}[
            summary["variant"]]
        tc = structure(body["training"], TrainingConfig)
        got = [json.loads(line)["loss"] for line in
               (run / "train_progress.ndjson").read_text().splitlines()]
        ref = _reference_from(state, tc, load_token_data(tc, MODEL["seq_len"]))
        assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5, (ref, got)
    # The second sweep shared the first's warm-up: each run the first's, loss for loss.
    assert shared is not None and shared.returncode == 0, shared and shared.stdout + shared.stderr
    assert "[warm-up]" not in shared.stdout
    assert "the config's warm-up of 3 steps is not trained" in shared.stdout
    again = sorted(d for d in (tmp_path / "shared").iterdir() if d.is_dir())
    assert [json.loads((r / "config_resolved.json").read_text())["job"]["training"]
            ["warm_start"] for r in again] == starts
    for run, first_run in zip(again, runs, strict=True):
        assert [json.loads(line)["loss"] for line in
                (run / "train_progress.ndjson").read_text().splitlines()] == \
            [json.loads(line)["loss"] for line in
             (first_run / "train_progress.ndjson").read_text().splitlines()]


def _sweep(tmp_path: Path) -> Path:
    (tmp_path / "training").mkdir(exist_ok=True)
    (tmp_path / "training" / "sweep.json").write_text(json.dumps(
        {**TRAINING, "steps": 4, "cluster_profile": {"fellows": 1}}))
    cfg = tmp_path / "sweep.json"
    cfg.write_text(json.dumps({"name": "warmed", "training_config": "training/sweep.json",
                               "model_configs": ["model.json"],
                               "sweep": {"seeds": [0], "warm_up": {"steps": 3},
                                         # (two rows: the warm-up is neither's)
                                         "variants": [
                                             {"name": "slow", "overrides": {"lr": 1e-3}},
                                             {"name": "plain"}]}}))
    return cfg
