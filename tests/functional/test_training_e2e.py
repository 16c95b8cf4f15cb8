"""The correctness anchor: fellow processes placed by a real leader, activations and gradients
over real TCP, compute the same per-step losses as one process with the same seed."""

from __future__ import annotations

import json
import time

import pytest
import torch

from swarm_core.artifacts.shards import load_shard
from swarm_core.config.defaults import DEFAULT_MODEL, DEFAULT_TRAINING
from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract.placement import split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline.reference import train_reference
from swarm_core.pipeline.stage import expected_wire_bytes
from swarm_core.schema import structure
from swarm_tui.fmt import fmt_bytes
from tests.clusters import cli_json, job_view, run_cli
from tests.support import REPO

pytestmark = pytest.mark.slow

MODEL = {"name": "tiny", "d_model": 32, "n_layers": 3, "n_heads": 2, "seq_len": 32,
         "compression": "none", "wire_dtype": "fp32"}
TRAINING = {"name": "exact", "dataset": "shakespeare", "steps": 20, "batch_size": 8,
            "micro_batches": 4, "schedule": "1f1b", "eval_batches": 1, "seed": 7}


def _wait_job(job_id: str, env: dict[str, str], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = job_view(job_id, env)
        if job["state"] in ("COMPLETED", "FAILED", "CANCELLED"):
            return job
        time.sleep(0.3)
    raise AssertionError(f"{job_id} did not finish in {timeout}s")


@pytest.fixture(scope="module")
def data():
    return load_token_data(structure(TRAINING, TrainingConfig), MODEL["seq_len"])


def test_two_and_three_stage_runs_match_a_single_process(cli_env, tmp_path, data, swarm_home):
    up = run_cli("restart-cluster", "--fellows", "3", env=cli_env, timeout=90)
    assert up.returncode == 0, up.stderr
    try:
        results, tables = {}, {}
        for n, schedule in ((2, "gpipe"), (3, "1f1b")):
            payload = {"name": f"exact-{n}", "kind": "train", "model": MODEL,
                       "training": {**TRAINING, "schedule": schedule},
                       "topology": {"fellows": n}}
            path = tmp_path / f"job{n}.json"
            path.write_text(json.dumps(payload))
            job = cli_json("submit", "--payload", str(path), env=cli_env)
            results[n] = (_wait_job(job["job_id"], cli_env), schedule)
            tables[n] = run_cli("job", job["job_id"], env=cli_env)
        # The same cluster, data parallel: one stage, two replicas.
        path = tmp_path / "replicas.json"
        path.write_text(json.dumps({"name": "dp-2", "kind": "train", "model": MODEL,
                                    "training": TRAINING,
                                    "topology": {"stages": 1, "replicas": 2}}))
        replicated = _wait_job(cli_json("submit", "--payload", str(path),
                                        env=cli_env)["job_id"], cli_env)
        shown_dp = run_cli("job", replicated["job_id"], env=cli_env)
    finally:
        run_cli("stop-cluster", env=cli_env)

    # (every job here trains the same weights: its eval loss is the 2-stage job's)
    _check_replicas(replicated, results[2][0], shown_dp, data)

    mc = structure(MODEL, ModelConfig)
    for n, (job, schedule) in results.items():
        assert job["state"] == "COMPLETED", job["reason"]
        tc = structure({**TRAINING, "schedule": schedule}, TrainingConfig)
        ref, ref_model = train_reference(mc, tc, data, split_layers(mc.n_layers, [1] * n))
        got = [loss for _step, loss in job["loss_history"]]
        assert [s for s, _ in job["loss_history"]] == list(range(1, 21))
        diff = max(abs(a - b) for a, b in zip(ref, got, strict=True))
        assert diff <= 1e-5, f"{n} stages: max |pipeline - single process| = {diff}"
        assert got[-1] < got[0]
        # Placement as planned: contiguous global layer ranges, one fellow per stage.
        stages = job["placement"]["stages"]
        assert [(s["layers"]["start"], s["layers"]["stop"]) for s in stages] == \
            split_layers(3, [1] * n)
        # Measured wire bytes per step equal what the spec predicts, per stage.
        for s in range(n):
            measured = job["metrics"]["stages"][str(s)]["wire_tx_bytes_per_step"]
            assert measured == expected_wire_bytes(mc, tc, s, n)
        assert job["metrics"]["eval_loss"] > 0 and job["metrics"]["perplexity"] > 1
        # Each stage's run figures: its link wait, activation memory and codec error (an fp32
        # wire: none), in the job's metrics and in `swarm job`'s table.
        shown = tables[n]
        assert shown.returncode == 0, shown.stderr
        for s in range(n):
            figures = job["metrics"]["stages"][str(s)]
            assert 0 < figures["wait_fraction"] < 1 and figures["activation_peak_bytes"] > 0
            sends = ["act"] * (s < n - 1) + ["grad"] * (s > 0)
            assert figures["codec_error"] == {k: 0.0 for k in sends}
            line = next(ln for ln in shown.stdout.splitlines() if ln.startswith(f"stage {s}"))
            assert f"link wait {figures['wait_fraction']:.0%}" in line
            assert "act mem" in line and "codec error" in line
        # Every stage pushed its final shard; together they are the single-process weights.
        pushes = job["latest_shard_pushes"]
        assert sorted(pushes) == [str(s) for s in range(n)]
        assert {p["step"] for p in pushes.values()} == {20}
        export = swarm_home / "leader" / "runs" / job["job_id"] / "model_export"
        run_manifest = json.loads((export / "run_manifest.json").read_text())
        assert run_manifest["complete"] is True and run_manifest["step"] == 20
        weights = {}
        for shard in run_manifest["shards"]:
            _manifest, arrays = load_shard(export / shard["dir"])
            weights.update(arrays)
        expected = ref_model.flat_state_dict()
        assert set(weights) == set(expected)
        worst = max(float((torch.from_numpy(weights[k]) - v).abs().max())
                    for k, v in expected.items())
        assert worst <= 1e-4, f"{n} stages: shard weights differ from single process by {worst}"
        # Glued into one model, it scores the held-out batches as the pipeline did at the end.
        glued = run_cli("glue", str(export), env=cli_env)
        assert glued.returncode == 0, glued.stderr
        ev = cli_json("eval", "--model", str(export / "full_model"), env=cli_env)
        assert ev["step"] == 20
        assert abs(ev["eval_loss"] - job["metrics"]["eval_loss"]) <= 1e-5, \
            (ev["eval_loss"], job["metrics"]["eval_loss"])


def test_embedded_defaults_mirror_the_profiles():
    model = json.loads((REPO / "exp/configs/model/small_none.json").read_text())
    training = json.loads((REPO / "exp/configs/training/quickstart_shakespeare.json").read_text())
    assert model == DEFAULT_MODEL and training == DEFAULT_TRAINING
    structure(model, ModelConfig)
    structure(training, TrainingConfig)


def test_the_readmes_main_job_trains_and_stops_its_cluster(cli_env):
    """`swarm quickstart` (the README's first command, fewer steps): a local leader and two
    fellow processes train the embedded default on Shakespeare; the loss falls, the
    validation loss and wire bytes are shown, and the cluster is stopped afterwards."""
    import re

    res = run_cli("quickstart", "--steps", "12", env=cli_env, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    loss = re.search(r"loss (\d+\.\d+) at step 1 -> (\d+\.\d+) at step 12", out)
    assert loss, out
    assert float(loss.group(2)) < float(loss.group(1)) - 0.5, loss.group(0)
    assert re.search(r"validation loss \d+\.\d+, perplexity \d+\.\d+, \d+ tokens/s, "
                     r"\d+\.\d+ MB on the wire per step", out), out
    assert out.rstrip().endswith("local cluster stopped"), out
    after = run_cli("fellows", env=cli_env)
    assert after.returncode == 3 and "no leader" in after.stderr, after.stderr


def test_a_fellow_with_two_slots_runs_two_stages_exactly(cli_env, tmp_path, data):
    up = run_cli("restart-cluster", "--fellows", "2", "--devices", "cpu,cpu", env=cli_env,
                 timeout=90)
    assert up.returncode == 0, up.stderr
    model = {**MODEL, "n_layers": 4}
    payload = {"name": "slots", "kind": "train", "model": model,
               "training": {**TRAINING, "steps": 8},
               "topology": {"fellows": 2, "slots_per_fellow": 2}}
    path = tmp_path / "slots.json"
    path.write_text(json.dumps(payload))
    try:
        job = _wait_job(cli_json("submit", "--payload", str(path), env=cli_env)["job_id"],
                        cli_env)
        time.sleep(1.5)  # a heartbeat after the job: the fellows' final byte counters
        nodes = {n["fellow_id"]: n for n in cli_json("nodes", env=cli_env)["nodes"]}
    finally:
        run_cli("stop-cluster", env=cli_env)
    assert job["state"] == "COMPLETED", job["reason"]
    stages = job["placement"]["stages"]
    # Neighbouring stages share a fellow: its two slots first, then the next fellow's.
    a, b = stages[0]["fellow_id"], stages[2]["fellow_id"]
    assert [(s["fellow_id"], s["slot"]) for s in stages] == [(a, 0), (a, 1), (b, 0), (b, 1)]
    assert a != b and stages[0]["data_addr"] != stages[1]["data_addr"]
    mc = structure(model, ModelConfig)
    tc = structure({**TRAINING, "steps": 8}, TrainingConfig)
    ref, _ = train_reference(mc, tc, data, split_layers(mc.n_layers, [1, 1, 1, 1]))
    got = [loss for _s, loss in job["loss_history"]]
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    for s in range(4):  # each stage counts only its own links
        measured = job["metrics"]["stages"][str(s)]["wire_tx_bytes_per_step"]
        assert measured == expected_wire_bytes(mc, tc, s, 4)
    # The link between a fellow's own two slots never leaves it: the fellow's data counters
    # (and its link shaping) cover the one boundary between the fellows. Fellow a sends stage
    # 1's activations down (half of stage 1's bytes a step, plus the evaluation's), and none
    # of stage 0's.
    per_step = [expected_wire_bytes(mc, tc, s, 4) for s in range(4)]
    across = tc.steps * per_step[1] // 2
    assert across <= nodes[a]["data_tx"] < across + per_step[0] // 2, nodes[a]
    assert across <= nodes[b]["data_tx"] < across + per_step[3] // 2, nodes[b]


def _check_replicas(job: dict, same_weights: dict, shown, data) -> None:
    """A replicas: 2 job through the leader reports the losses of one process at the same
    global batch, each replica on its own fellow; the group's gradient average crossed between
    them as its figures say, and only the first replica pushed. ``same_weights``: a job of
    another shape that trains the same weights (its eval loss is this job's)."""
    mc, tc = structure(MODEL, ModelConfig), structure(TRAINING, TrainingConfig)
    assert job["state"] == "COMPLETED", job["reason"]
    ref, _ = train_reference(mc, tc, data, split_layers(mc.n_layers, [1]))
    two = [loss for _s, loss in job["loss_history"]]
    assert len(two) == 20
    assert max(abs(a - b) for a, b in zip(ref, two, strict=True)) <= 1e-5
    cells = job["placement"]["stages"]
    assert [(c["stage"], c["replica"]) for c in cells] == [(0, 0), (0, 1)]
    assert cells[0]["fellow_id"] != cells[1]["fellow_id"]
    figures = job["metrics"]["stages"]
    for label in ("0.0", "0.1"):
        assert figures[label]["sync_tx_bytes_per_step"] == \
            figures[label]["expected_sync_tx_bytes_per_step"] > 0
    assert job["metrics"]["sync_bytes_per_step"] == sum(
        figures[k]["sync_tx_bytes_per_step"] for k in ("0.0", "0.1"))
    assert job["metrics"]["eval_loss"] == pytest.approx(same_weights["metrics"]["eval_loss"],
                                                        abs=1e-5)
    assert sorted(job["latest_shard_pushes"]) == ["0"]
    assert shown.returncode == 0, shown.stderr
    # The job's own lines, then the grid: no stage rows repeat its cells.
    assert "stage 0 replica" not in shown.stdout and "sync " in shown.stdout
    # The grid: a row per cell, with the run's sync bytes a step (what the figures say).
    assert "grid: 1 stage(s) x 2 replicas" in shown.stdout
    row = next(line for line in shown.stdout.splitlines() if line.startswith("s0/r1"))
    assert fmt_bytes(int(figures["0.1"]["sync_tx_bytes_per_step"])) in row

