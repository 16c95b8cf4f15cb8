"""Experiment tracking: TensorBoard files written while a run trains, read back with
TensorBoard's own accumulator, hold the numbers of the run's ``train_progress.ndjson``; a resumed
run's voided steps are purged; MLflow (a ``file:`` store) gets the same; without the packages,
one line says what to install."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import pytest

from swarm_core.client import SwarmClient
from swarm_core.config.profiles import load_experiment
from swarm_core.contract import ProgressRecord
from swarm_core.experiments.runner import Experiment
from swarm_core.protocol import SetSpeedRequest
from swarm_core.tracking import Tracking, TrackingUnavailable
from swarm_core.tracking.names import step_scalars
from swarm_core.tracking.run_log import RunLog, open_sinks, settled
from swarm_tui import cli
from tests.support import TOKEN, wait_async
from tests.tracking_support import (
    expected_scalars,
    play_step,
    read_tb,
    register_stages,
    report_step,
    write_config,
)


async def test_a_sweep_writes_tensorboard_files_while_its_run_trains(api, tmp_path,
                                                                     monkeypatch):
    """A real leader, a real sweep runner; the two stages are played over HTTP, so the test
    can look at the files between steps."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # (the sink sets it)
    stages = await register_stages(api, 2)
    exp = load_experiment(write_config(tmp_path))
    url = f"http://127.0.0.1:{api.server.port}"
    async with SwarmClient(url, TOKEN) as client:
        runner = Experiment(client, exp, poll_s=0.05, tracking=Tracking(tensorboard=True))
        await runner.start()
        st = runner.states[0]
        job = await wait_async(lambda: _placed(client, st.job_id), "the job to be placed")
        by_stage = {s.stage: next(f for f in stages if f["fellow_id"] == s.fellow_id)
                    for s in job.placement.stages}
        running = asyncio.create_task(runner.run())
        tb = st.run_dir / "tb"
        await play_step(api, st.job_id, by_stage, 1)
        await play_step(api, st.job_id, by_stage, 2)
        # Step 1 is settled (step 2 followed it); step 2 may still gain its eval loss.
        await wait_async(lambda: _tb_steps(tb, "train/loss", [1]), "step 1 in the TB files")
        assert (await client.job(st.job_id)).state == "RUNNING"
        assert not (st.run_dir / "train_progress.ndjson").exists()
        await client.set_speed(by_stage[1]["fellow_id"],
                               SetSpeedRequest(tx_mbps=80.0, rx_mbps=None, latency_ms=20.0))
        await play_step(api, st.job_id, by_stage, 3)
        await report_step(api, st.job_id, by_stage[1], 3, metrics={"eval_loss": 4.1})
        await wait_async(lambda: _tb_steps(tb, "train/loss", [1, 2]), "step 2 in the TB files")
        for s in (0, 1):
            await report_step(api, st.job_id, by_stage[s], 3, state="COMPLETED",
                          metrics={"wire_tx_bytes_per_step": 1.0})
        await asyncio.wait_for(running, 20)
    assert st.state == "COMPLETED"
    lines = [json.loads(x) for x in (st.run_dir / "train_progress.ndjson").read_text()
             .splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert lines[2]["perplexity"] == pytest.approx(math.exp(4.1))
    got = read_tb(tb)
    assert got["scalars"] == expected_scalars(lines)
    # Exact, not float32: the wire bytes per step are in the tens of millions.
    assert got["scalars"]["wire/bytes_per_step"][0] == (1, 60_000_002)
    assert {"link_wait_s/stage_0", "link_wait_s/stage_1", "activation_peak_bytes/stage_0",
            "codec_error/stage_0_act", "codec_error/stage_1_grad", "eval/perplexity",
            "train/tokens_per_s"} <= set(got["scalars"])
    [(_, said)] = got["text"]["events/set_speed"]
    assert said.startswith(f"set-speed: fellow {by_stage[1]['fellow_id']} tx 80 Mbit/s, "
                           "rx unlimited, latency 20 ms")
    resolved = json.loads((st.run_dir / "config_resolved.json").read_text())
    assert got["group"] == st.run_id
    assert got["hparams"]["model.d_model"] == 32
    assert got["hparams"]["compression"] == "fixed_int8"
    assert got["hparams"]["training.steps"] == resolved["job"]["training"]["steps"] == 3

    # The same run converted after the fact (as for runs written without the extra), and
    # logged to MLflow: the same numbers again.
    out, store = tmp_path / "converted", tmp_path / "mlruns"
    assert cli.run(["report", str(runner.runs_dir), "--tensorboard", str(out),
                    "--mlflow-uri", f"file:{store}", "--format", "json"]) == 0
    converted = read_tb(out / st.run_id)
    assert converted["scalars"] == got["scalars"] and converted["text"] == got["text"]
    assert converted["hparams"] == got["hparams"]
    from mlflow.tracking import MlflowClient

    ml = MlflowClient(tracking_uri=f"file:{store}")
    [run] = ml.search_runs([ml.get_experiment_by_name("tracked").experiment_id])
    assert run.info.run_name == st.run_id and run.info.status == "FINISHED"
    assert run.data.params["model.d_model"] == "32"
    for tag, points in expected_scalars(lines).items():
        history = ml.get_metric_history(run.info.run_id, tag)
        assert sorted((m.step, m.value) for m in history) == points, tag
    events = Path(run.info.artifact_uri.removeprefix("file://"), "events.txt").read_text()
    assert said in events


async def _placed(client: SwarmClient, job_id: str | None):
    job = await client.job(job_id or "")
    return job if job.placement is not None and job.state == "RUNNING" else None


async def _tb_steps(tb: Path, tag: str, steps: list[int]) -> bool:
    if not tb.is_dir():
        return False
    got = await asyncio.to_thread(read_tb, tb)
    return [s for s, _ in got["scalars"].get(tag, [])] == steps


def test_a_resumed_run_purges_the_steps_it_trains_again(tmp_path):
    """After a recovery the leader forgets the steps after the resume step and the stages
    train them again: TensorBoard shows the new values once, not both."""
    log = RunLog("r", open_sinks(Tracking(tensorboard=True), tmp_path / "tb", "e", "r"))
    log.progress([{"step": s, "loss": 4.0 - s / 10, "ts": 100.0 + s} for s in (1, 2, 3, 4)])
    log.restarts([{"at": 105.0, "at_step": 4, "resume_step": 2, "reason": "fellow 1 lost",
                   "replaced": {"1": {"from": 1, "to": 2, "lost": "missed heartbeats"}}}])
    log.progress([{"step": s, "loss": 9.0, "ts": 200.0 + s} for s in (3, 4)])
    log.close("COMPLETED")
    got = read_tb(tmp_path / "tb")
    assert got["scalars"]["train/loss"] == [(1, 3.9), (2, 3.8), (3, 9.0), (4, 9.0)]
    assert got["text"]["events/membership"] == [
        (2, "membership: at step 4 resumed from step 2; stage 1: fellow 1 -> 2 "
            "(missed heartbeats); fellow 1 lost")]


def test_only_the_complete_steps_from_the_first_are_settled():
    """A step is given to the sinks once every cell reported it and the next step, too (its
    eval loss comes after it); a step still missing a cell holds back the ones after it."""
    def rec(step: int, cells: list[int]) -> ProgressRecord:
        return ProgressRecord(step=step, stages_reported=cells)

    records = [rec(1, [0, 1]), rec(2, [1, 0]), rec(3, [0]), rec(4, [0, 1]), rec(5, [0, 1])]
    assert [r.step for r in settled(records, 2)] == [1]
    assert [r.step for r in settled(records[:2], 2)] == [1]
    assert settled(records[:1], 2) == [] and settled([], 2) == []


def test_scalars_leave_out_what_is_not_a_number():
    line = {"step": 3, "loss": "high", "wire_bytes": True, "eval_loss": 2.0,
            "wait_seconds": {"0": 0.5, "1": "x"}, "codec_error": {"0": {"act": None}}}
    assert step_scalars(line) == [("eval/loss", 2.0), ("eval/perplexity", math.exp(2.0)),
                                  ("link_wait_s/stage_0", 0.5)]


def test_without_tensorboard_tracking_is_off_and_asking_for_it_is_one_line(
        monkeypatch, tmp_path, capsys):
    for name in [m for m in sys.modules if m.split(".")[0] in ("tensorboard", "mlflow")] + [
            "tensorboard", "mlflow"]:
        monkeypatch.setitem(sys.modules, name, None)  # (importing them fails, as uninstalled)
    monkeypatch.setattr("importlib.util.find_spec",
                        lambda name, *a: None if name.split(".")[0] in ("tensorboard",
                                                                         "mlflow") else 1)
    assert Tracking.default() == Tracking(tensorboard=False)
    with pytest.raises(TrackingUnavailable, match=r"pip install 'silentswarm\[tracking\]'"):
        open_sinks(Tracking(tensorboard=True), tmp_path / "tb", "e", "r")
    cfg = write_config(tmp_path)
    for argv in (["sweep", "--config", str(cfg), "--tensorboard"],
                 ["report", str(tmp_path), "--tensorboard", str(tmp_path / "tb")],
                 ["report", str(tmp_path), "--mlflow-uri", "file:./mlruns"]):
        assert cli.run(argv) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert "not installed" in err and "pip install" in err
    assert not (tmp_path / "tb").exists()
