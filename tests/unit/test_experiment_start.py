"""Queuing a sweep is all or nothing: when the leader refuses a run, the runs queued before it
are cancelled and the error names the run. Against a real leader on a loopback port."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import attrs
import pytest

from swarm_core.config.profiles import load_experiment
from swarm_core.experiments.runner import Experiment, ExperimentError
from tests.tui_support import live_cluster, no_engine  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("no_engine")


def _config(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "training").mkdir()
    tiny = {"d_model": 32, "n_heads": 2, "seq_len": 16}
    (tmp_path / "model" / "two.json").write_text(json.dumps({"name": "two", "n_layers": 2,
                                                             **tiny}))
    (tmp_path / "model" / "one.json").write_text(json.dumps({"name": "one", "n_layers": 1,
                                                             **tiny}))
    (tmp_path / "training" / "t.json").write_text(json.dumps(
        {"steps": 200, "batch_size": 4, "micro_batches": 2, "cluster_profile": {"fellows": 2},
         "artifacts": {"runs_dir": "../runs"}}))
    cfg = tmp_path / "exp.json"
    cfg.write_text(json.dumps({"name": "partial", "training_config": "training/t.json",
                               "model_configs": ["model/two.json", "model/one.json"]}))
    return cfg


async def test_a_refused_run_cancels_the_runs_queued_before_it(tmp_path: Path) -> None:
    exp = load_experiment(_config(tmp_path))
    assert len(exp.runs) == 2
    # The loader refuses what the leader would (four stages leave one with nothing to do on a
    # one-layer model); to see the runner meet a refusal, the second run is changed after it.
    exp.runs[1] = attrs.evolve(exp.runs[1], fellows=4)
    async with live_cluster(tmp_path, n=4) as (leader, _fellows), leader.client() as client:
        for _ in range(200):  # the in-process fellows register within a moment
            if sum(f.status == "ready" for f in await client.fellows()) == 4:
                break
            await asyncio.sleep(0.05)
        runner = Experiment(client, exp)
        with pytest.raises(ExperimentError) as err:
            await runner.start()
        message = str(err.value)
        assert message.startswith("run 2/2 one-")
        assert "the leader refused it" in message and "$.topology" in message
        assert message.endswith("cancelled the 1 run(s) queued before it")
        first = runner.states[0]
        assert first.job_id is not None and runner.states[1].job_id is None
        assert (await client.job(first.job_id)).state == "CANCELLED"
        assert len(await client.jobs()) == 1  # nothing else reached the queue
    for st in runner.states:
        manifest = json.loads((st.run_dir / "manifest.json").read_text())
        assert manifest["note"] == "sweep not queued: run 2 was refused"
    assert json.loads((runner.states[0].run_dir / "manifest.json").read_text())["status"] \
        == "CANCELLED"


async def test_sweeps_started_in_the_same_second_get_their_own_run_folders(
        tmp_path: Path) -> None:
    """Two sweeps of one config stamped alike (a double launch, two consoles) must not write
    into each other's run folders: the second takes ``<stamp>-2``."""
    exp = load_experiment(_config(tmp_path))
    async with live_cluster(tmp_path, n=2) as (leader, _fellows), leader.client() as client:
        for _ in range(200):
            if sum(f.status == "ready" for f in await client.fellows()) == 2:
                break
            await asyncio.sleep(0.05)
        first = Experiment(client, exp, stamp="20261129T000000")
        second = Experiment(client, exp, stamp="20261129T000000")
        await first.start()
        await second.start()
        jobs = {j.job_id: j for j in await client.jobs()}
        assert len(jobs) == 4
        for runner in (first, second):
            for st in runner.states:
                config = json.loads((st.run_dir / "config_resolved.json").read_text())
                assert config["run_id"] == st.run_id == st.run_dir.name
                assert jobs[st.job_id].name == st.run_id
        dirs = {st.run_dir for r in (first, second) for st in r.states}
        assert len(dirs) == 4
        assert all(st.run_id.startswith("20261129T000000-partial-") for st in first.states)
        assert all(st.run_id.startswith("20261129T000000-2-partial-") for st in second.states)
        for runner in (first, second):
            await runner.cancel_open()
