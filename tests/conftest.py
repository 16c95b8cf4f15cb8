"""Shared fixtures: a real leader app on a loopback port, isolated SWARM_HOME per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from swarm_core.leader import LeaderConfig, create_app
from tests.support import AUTH, TOKEN


@pytest.fixture(autouse=True)
def swarm_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own SWARM_HOME, so nothing touches the user's data dir."""
    home = tmp_path / "swarm-home"
    monkeypatch.setenv("SWARM_HOME", str(home))
    for var in ("SWARM_TOKEN", "SWARM_LEADER_URL"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture
def leader_config(tmp_path: Path) -> LeaderConfig:
    return LeaderConfig(state_dir=tmp_path / "state", token=TOKEN, stale_after_s=5.0,
                        tick_s=0.05)


@pytest.fixture
async def api(aiohttp_client, leader_config: LeaderConfig) -> TestClient:
    """An aiohttp test client against a real leader app; send ``headers=AUTH`` yourself."""
    return await aiohttp_client(create_app(leader_config))


@pytest.fixture
def cli_env(swarm_home: Path) -> Iterator[dict[str, str]]:
    """Environment for CLI subprocesses: same SWARM_HOME, no inherited leader settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("SWARM_TOKEN", "SWARM_LEADER_URL")}
    env["SWARM_HOME"] = str(swarm_home)
    env["PYTHONUNBUFFERED"] = "1"
    yield env


@pytest.fixture
def auth() -> dict[str, str]:
    """The headers that carry the test token."""
    return dict(AUTH)


@pytest.fixture
def make_start():
    """A stage's START as the leader builds one (a planned placement, ``stage_starts``):
    ``make_start(model, training, addrs=[None], stage=0, devices=None)``, with the model and
    training given as dicts of fields."""
    from swarm_core.config.schemas import ModelConfig, TrainingConfig
    from swarm_core.contract import chain_starts
    from swarm_core.schema import structure

    def make(model: dict, training: dict, addrs: list | None = None, stage: int = 0,
             devices: list[str] | None = None):
        return chain_starts(structure(model, ModelConfig), structure(training, TrainingConfig),
                            addrs or [None], devices, job_id="job-000001")[stage]

    return make
