"""``transport: torch`` across fellow processes (issue 35): a local leader and four fellows
run an S=2 x R=2 data-parallel job whose frames cross two-rank gloo groups and whose stage
groups all-reduce with gloo. Its losses are one process's at the same global batch; a link
set-speed on it is refused as unshaped; a replica's fellow SIGKILLed mid-run leaves, and the
other chain trains on to the end without a restart."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract import split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline.reference import train_reference
from swarm_core.schema import structure
from tests.clusters import cli_json, job_view, run_cli, wait_until

pytestmark = pytest.mark.slow

MODEL = {"name": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16,
         "compression": "none", "wire_dtype": "fp32"}
STALE_S, FRAME_TIMEOUT_S = 4, 10  # (a survivor late 2 s on a loaded machine is no corpse)


def test_a_torch_transport_job_trains_exactly_refuses_shaping_and_survives_a_kill(
        cli_env, tmp_path: Path, swarm_home: Path):
    training = {"name": "gloo", "steps": 300, "batch_size": 8, "micro_batches": 2,
                "eval_batches": 1, "seed": 3, "frame_timeout_s": FRAME_TIMEOUT_S,
                "transport": "torch"}
    up = run_cli("restart-cluster", "--fellows", "4", "--stale-after", str(STALE_S),
                 env=cli_env, timeout=120)
    assert up.returncode == 0, up.stderr
    try:
        path = tmp_path / "job.json"
        path.write_text(json.dumps({"name": "gloo", "kind": "train", "model": MODEL,
                                    "training": training,
                                    "topology": {"stages": 2, "replicas": 2}}))
        job_id = cli_json("submit", "--payload", str(path), env=cli_env)["job_id"]
        running = wait_until(lambda: (j := job_view(job_id, cli_env))["last_step"] >= 3
                             and j, 120, "the job's third step")
        cells = running["placement"]["stages"]
        # A link setting would change nothing gloo sends: refused in one line, not pretended.
        some = cells[0]["fellow_id"]
        bad = run_cli("set-speed", "--fellow-id", str(some), "--tx-mbps", "5", env=cli_env)
        assert bad.returncode != 0 and "torch transport" in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
        # Replica 1's first stage dies; its chain leaves, replica 0 trains on alone.
        record = json.loads((swarm_home / "local-cluster" / "cluster.json").read_text())
        doomed = next(c for c in cells if c["replica"] == 1 and c["stage"] == 0)
        killed_at = time.time()
        os.kill(next(f["pid"] for f in record["fellows"] if f["name"] == doomed["name"]),
                signal.SIGKILL)
        job = wait_until(lambda: (j := job_view(job_id, cli_env))["state"] in (
            "COMPLETED", "FAILED") and j, 240, "the job's end")
        shown = run_cli("job", job_id, env=cli_env)
    finally:
        run_cli("stop-cluster", env=cli_env)
    assert job["state"] == "COMPLETED", job["reason"]
    assert job["restarts"] == [] and job["training"]["transport"] == "torch"
    assert shown.returncode == 0 and "torch (gloo; unshaped" in shown.stdout
    [change] = job["membership"]
    assert change["left"] == [1] and change["members"] == [0]
    # (gloo's own error is cut to its first sentence: the reason stays one readable line)
    assert "This is typically" not in change["reason"] and "\n" not in change["reason"]
    # The survivors went on within the heartbeat timeout plus the collective timeout.
    assert change["at"] - killed_at < STALE_S + FRAME_TIMEOUT_S + 5
    losses = [loss for _, loss in job["loss_history"]]
    assert [s for s, _ in job["loss_history"]] == list(range(1, 301))
    # Before the kill, both replicas trained: one process at the same global batch, to 1e-5
    # (two replicas' sum has one order; the whole run's exactness is the unit test's).
    mc, tc = structure(MODEL, ModelConfig), structure(job["training"], TrainingConfig)
    ref, _ = train_reference(mc, tc, load_token_data(tc, mc.seq_len), split_layers(2, [1, 1]))
    before = change["step"] - 2
    assert before >= 3
    assert max(abs(a - b) for a, b in zip(ref[:before], losses[:before], strict=True)) <= 1e-5
