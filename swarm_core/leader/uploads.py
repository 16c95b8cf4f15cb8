"""Shard pushes from fellows: streamed to disk under the job's run dir, never buffered whole.

No numpy here (the leader stays light): the weights are checked as a zip of ``.npy`` members
against the manifest's parameter names and sha256, then moved into place, manifest last.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from swarm_core import jsonio
from swarm_core.leader.errors import ApiError
from swarm_core.paths import atomic_write

MAX_MANIFEST = 4 << 20
SHARDS = "model_export/shards"


def shard_dir(runs_dir: Path, job_id: str, stage: int, fellow_id: int) -> Path:
    # Built from a job id the leader issued and integers: no user text reaches a path.
    return runs_dir / job_id / SHARDS / f"stage-{stage}-fellow-{fellow_id}"


def checkpoint_dir(runs_dir: Path, job_id: str, step: int, stage: int) -> Path:
    return runs_dir / job_id / "checkpoints" / f"step-{step}" / f"stage-{stage}"


KEEP_CHECKPOINTS = 2


def publish(runs_dir: Path, job_id: str, step: int, stage: int, fellow_id: int,
            num_stages: int) -> None:
    """Make a received checkpoint the stage's latest export shard, and prune old checkpoints
    (keeping the newest complete ones)."""
    src = checkpoint_dir(runs_dir, job_id, step, stage)
    dest = shard_dir(runs_dir, job_id, stage, fellow_id)
    # Another fellow may have held this stage before a restart: one shard per stage.
    for old in dest.parent.glob(f"stage-{stage}-fellow-*"):
        if old != dest:
            shutil.rmtree(old, ignore_errors=True)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("weights.npz", "shard_manifest.json"):  # manifest last
        tmp = dest / f".{name}.tmp"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        try:
            os.link(src / name, tmp)
        except OSError:
            shutil.copyfile(src / name, tmp)
        os.replace(tmp, dest / name)
    root = runs_dir / job_id / "checkpoints"
    complete = sorted(
        (int(d.name.removeprefix("step-")) for d in root.glob("step-*")
         if all((d / f"stage-{k}" / "shard_manifest.json").exists() for k in range(num_stages))),
        reverse=True)
    if len(complete) > KEEP_CHECKPOINTS:
        cutoff = complete[KEEP_CHECKPOINTS - 1]
        for d in root.glob("step-*"):
            if int(d.name.removeprefix("step-")) < cutoff:
                shutil.rmtree(d, ignore_errors=True)


async def receive_shard(request: web.Request, dest_for: Callable[[dict[str, Any]], Path],
                        limit: int, expect: dict[str, Any]) -> dict[str, Any]:
    """Read ``manifest`` then ``weights`` parts; returns the manifest once both are in place.

    ``expect``: manifest fields that must hold (job, stage, fellow) before anything is written.
    """
    if not request.content_type.startswith("multipart/"):
        raise ApiError(415, "a shard push is multipart/form-data: manifest, then weights")
    if request.content_length is not None and request.content_length > limit + MAX_MANIFEST:
        raise ApiError(413, f"shard of {request.content_length} bytes exceeds the upload limit "
                            f"of {limit} bytes", code="body_too_large")
    reader = await request.multipart()
    part = await reader.next()
    if part is None or getattr(part, "name", None) != "manifest":
        raise ApiError(400, "first part must be 'manifest'", field="manifest")
    raw = await part.read(decode=False)  # type: ignore[union-attr]
    if len(raw) > MAX_MANIFEST:
        raise ApiError(413, "shard manifest too large", code="body_too_large")
    try:
        manifest = jsonio.loads(raw)
    except jsonio.JSONDecodeError:
        raise ApiError(400, "manifest is not valid JSON", field="manifest") from None
    if not isinstance(manifest, dict):
        raise ApiError(400, "manifest must be an object", field="manifest")
    for key, want in expect.items():
        if manifest.get(key) != want:
            raise ApiError(400, f"manifest {key} is {manifest.get(key)!r}, expected {want!r}",
                           field=f"manifest.{key}")
    step = manifest.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ApiError(400, "manifest step must be a non-negative integer",
                       field="manifest.step")
    part = await reader.next()
    if part is None or getattr(part, "name", None) != "weights":
        raise ApiError(400, "second part must be 'weights'", field="weights")
    dest = dest_for(manifest)
    dest.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".weights.", dir=dest)
    digest = hashlib.sha256()
    size = 0
    try:
        with os.fdopen(fd, "wb") as fh:
            while chunk := await part.read_chunk(1 << 20):  # type: ignore[union-attr]
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"shard exceeds the upload limit of {limit} bytes",
                                   code="body_too_large")
                digest.update(chunk)
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        _check_weights(Path(tmp), manifest, digest.hexdigest(), size)
        os.replace(tmp, dest / "weights.npz")
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    manifest["received_at"] = time.time()
    atomic_write(dest / "shard_manifest.json", jsonio.dumps(manifest, pretty=True))
    return manifest


def _check_weights(path: Path, manifest: dict[str, Any], sha256: str, size: int) -> None:
    if manifest.get("weights_sha256") != sha256:
        raise ApiError(400, "weights do not match the manifest's weights_sha256",
                       field="weights")
    if manifest.get("weights_bytes") not in (None, size):
        raise ApiError(400, f"weights are {size} bytes, the manifest says "
                            f"{manifest.get('weights_bytes')}", field="weights")
    try:
        with zipfile.ZipFile(path) as z:
            names = {n.removesuffix(".npy") for n in z.namelist()}
            bad = [n for n in z.namelist() if not n.endswith(".npy") or "/" in n]
    except zipfile.BadZipFile:
        raise ApiError(400, "weights are not an .npz archive", field="weights") from None
    if bad:
        raise ApiError(400, f"unexpected members in weights: {bad[:3]}", field="weights")
    params = manifest.get("params")
    if not isinstance(params, dict) or set(params) != names:
        raise ApiError(400, "weights and manifest list different parameters",
                       field="manifest.params")
