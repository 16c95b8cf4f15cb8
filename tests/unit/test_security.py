"""What the token guards, what paths may be written, and file modes of secrets."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from swarm_core.fellow.jobs import JobRefused
from swarm_core.fellow.train import export_root
from swarm_core.leader.routes import ROUTES
from tests.support import AUTH

A = "/api/v1"


async def test_every_route_but_healthz_needs_the_token(api):
    for r in ROUTES:
        path = re.sub(r"{(\w+)}", lambda m: "1" if m.group(1) != "job_id" else "job-000001",
                      r.path)
        resp = await api.request(r.method, path, headers={"Authorization": "Bearer wrong"})
        if r.path == "/healthz":
            assert resp.status == 200
        else:
            assert resp.status == 401, (r.method, r.path, resp.status)
            assert (await resp.json())["error"]["code"] == "unauthorized"


def test_state_dir_and_token_file_are_private(tmp_path):
    from swarm_core.leader import LeaderConfig, create_app

    state = tmp_path / "state"
    create_app(LeaderConfig(state_dir=state))
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(state / "token").st_mode) == 0o600
    assert len((state / "token").read_text().strip()) >= 32


def test_an_existing_state_dir_keeps_its_mode_and_one_others_can_write_is_refused(tmp_path):
    """A leader made in-process (tests, the console's own) checks as the CLI does: an
    existing directory is never chmodded (as root, /tmp once became 0700)."""
    from swarm_core.leader import LeaderConfig, create_app
    from swarm_core.paths import UnsafeDir

    mine, shared = tmp_path / "mine", tmp_path / "shared"
    mine.mkdir(mode=0o750)
    shared.mkdir()
    os.chmod(mine, 0o750)
    os.chmod(shared, 0o1777)
    create_app(LeaderConfig(state_dir=mine))
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o750 and (mine / "token").is_file()
    with pytest.raises(UnsafeDir, match=r"shared is writable by its group and others "
                                        r"\(mode 1777\)"):
        create_app(LeaderConfig(state_dir=shared))
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777 and not any(shared.iterdir())
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafeDir, match="file is not a directory"):
        create_app(LeaderConfig(state_dir=tmp_path / "file"))


def test_a_made_token_never_reads_as_an_option(tmp_path, monkeypatch):
    """One random token in 32 started with "-", and `swarm --token TOKEN ...` then failed
    with "--token: expected one argument" (a CI run of the ssh launch test drew one)."""
    import secrets

    from swarm_core.leader.auth import load_or_create_token

    draws = iter(["-starts-like-an-option" + "x" * 21, "A" * 43])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda _n: next(draws))
    token = load_or_create_token(tmp_path / "state")
    assert token == "A" * 43 == (tmp_path / "state" / "token").read_text().strip()


def test_a_fellows_runs_folder_and_shards_are_private(swarm_home):
    """Written under the default umask, what a fellow keeps for its jobs is its own alone."""
    from swarm_core.artifacts.layout import write_shard

    old = os.umask(0o022)
    try:
        root = export_root(None, "job-000001")
        d = write_shard(root / "shards", {"stage": 0, "fellow_id": 3}, b"weights", b"optim")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(swarm_home / "runs").st_mode) == 0o700
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in d.iterdir()} == {
        "weights.npz": 0o600, "optimizer.npz": 0o600, "shard_manifest.json": 0o600}


def test_an_atomic_write_syncs_the_file_then_its_directory(tmp_path, monkeypatch):
    """A rename is durable only once the directory holding the new name is on disk."""
    from swarm_core import paths

    synced: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(paths.os, "fsync", record)
    paths.atomic_write(tmp_path / "d" / "state.json", b"{}")
    assert len(synced) == 2
    assert Path(synced[0]).parent == tmp_path / "d"  # the temp file, before its rename
    assert synced[1] == str(tmp_path / "d")


def test_the_leaders_commits_survive_a_power_loss(tmp_path):
    from swarm_core.leader.store import Store

    store = Store(tmp_path / "leader.db")
    try:
        assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        store.close()


@pytest.mark.parametrize("export_dir", ["../up", "/etc", "a/../../b", "~/x", "C:\\x"])
async def test_export_dirs_outside_the_runs_dir_are_refused(api, export_dir):
    body = {"kind": "train", "training": {"export_dir": export_dir},
            "topology": {"fellows": 1}}
    resp = await api.post(f"{A}/jobs", json=body, headers=AUTH)
    assert resp.status == 400
    assert (await resp.json())["error"]["field"] == "$.training.export_dir"


def test_symlinks_out_of_the_runs_dir_are_refused(swarm_home, tmp_path):
    runs = swarm_home / "runs"
    runs.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (runs / "evil").symlink_to(outside)
    with pytest.raises(JobRefused, match="leads outside"):
        export_root("evil", "job-000001")
    inside = export_root("mine/sub", "job-000001")
    assert inside.is_relative_to(runs.resolve())
    assert export_root(None, "job-000002") == (runs / "job-000002" / "model_export").resolve()


async def test_job_ids_in_urls_never_become_paths(api, leader_config):
    for job_id in ("..", "..%2F..%2Fetc", "job-000001%2F..", "%2E%2E"):
        resp = await api.get(f"{A}/jobs/{job_id}/checkpoints/1/0/weights", headers=AUTH)
        assert resp.status in (401, 404), job_id
    runs = leader_config.state_dir / "runs"
    assert not runs.exists() or not any(runs.iterdir())

