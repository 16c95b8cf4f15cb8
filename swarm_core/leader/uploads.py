"""Shard pushes from fellows: streamed to disk under the job's run dir, never buffered whole.

No numpy here (the leader stays light): the weights are checked as a zip of ``.npy`` members
against the manifest's parameter names and sha256, then moved into place, manifest last.
"""

from __future__ import annotations

import asyncio
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
from swarm_core.artifacts.layout import (
    MANIFEST,
    OPTIMIZER,
    WEIGHTS,
    drop_other_holders,
    names_optimizer,
    shard_dir_name,
)
from swarm_core.leader import content_coding
from swarm_core.leader.errors import ApiError
from swarm_core.paths import atomic_write, fsync_dir

MAX_MANIFEST = 4 << 20
SHARDS = "model_export/shards"
# The optimiser state is two moments per parameter and, under DiLoCo, the outer momentum:
# up to OPTIMIZER_TIMES the weights, plus its own
# per-member overhead.
OPTIMIZER_SLACK = 1 << 20
OPTIMIZER_TIMES = 3


def shard_dir(runs_dir: Path, job_id: str, stage: int, fellow_id: int) -> Path:
    # Built from a job id the leader issued and integers: no user text reaches a path.
    return runs_dir / job_id / SHARDS / shard_dir_name(stage, fellow_id)


def checkpoint_dir(runs_dir: Path, job_id: str, step: int, stage: int) -> Path:
    return runs_dir / job_id / "checkpoints" / f"step-{step}" / f"stage-{stage}"


def replica_state_dir(runs_dir: Path, job_id: str, step: int, stage: int,
                      replica: int) -> Path:
    """Where one replica's own optimiser state (DiLoCo) lies beside its stage's checkpoint."""
    return checkpoint_dir(runs_dir, job_id, step, stage) / f"replica-{replica}"


KEEP_CHECKPOINTS = 2


def complete_checkpoints(runs_dir: Path, job_id: str, num_stages: int) -> list[int]:
    """Steps at which every stage's checkpoint is in place (its manifest written, and the
    replica states it names), newest first."""
    steps = []
    for d in (runs_dir / job_id / "checkpoints").glob("step-*"):
        step = _step_of(d)
        if step is not None and all(_stage_complete(d / f"stage-{k}")
                                    for k in range(num_stages)):
            steps.append(step)
    return sorted(steps, reverse=True)


def _stage_complete(d: Path) -> bool:
    try:
        manifest = jsonio.loads((d / MANIFEST).read_bytes())
    except (OSError, jsonio.JSONDecodeError):
        return False
    others = manifest.get("replica_states") if isinstance(manifest, dict) else None
    return all((d / f"replica-{r}" / MANIFEST).exists() for r in others or ())


def publish(runs_dir: Path, job_id: str, step: int, stage: int, fellow_id: int,
            num_stages: int) -> None:
    """Make a received checkpoint the stage's latest export shard, and prune old checkpoints
    (keeping the newest complete ones)."""
    src = checkpoint_dir(runs_dir, job_id, step, stage)
    dest = shard_dir(runs_dir, job_id, stage, fellow_id)
    drop_other_holders(dest.parent, stage, dest)
    dest.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in (WEIGHTS, OPTIMIZER, MANIFEST):
        if (src / name).exists():
            tmp = files[name] = dest / f".{name}.tmp"
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            try:
                os.link(src / name, tmp)
            except OSError:
                shutil.copyfile(src / name, tmp)
    manifest = files.pop(MANIFEST)
    _swap_in(dest, files)
    os.replace(manifest, dest / MANIFEST)
    fsync_dir(dest)
    root = runs_dir / job_id / "checkpoints"
    complete = complete_checkpoints(runs_dir, job_id, num_stages)
    if len(complete) > KEEP_CHECKPOINTS:
        cutoff = complete[KEEP_CHECKPOINTS - 1]
        for d in root.glob("step-*"):
            step = _step_of(d)
            if step is not None and step < cutoff:
                shutil.rmtree(d, ignore_errors=True)


def _swap_in(dest: Path, files: dict[str, Path]) -> None:
    """Move a shard's new files (temp paths by final name) into ``dest``, the old manifest
    out first: files on disk are complete only while a manifest names them. The caller
    writes the new manifest last. State the new shard does not carry does not stay."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(dest / MANIFEST)
    if OPTIMIZER not in files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dest / OPTIMIZER)
    for name, tmp in files.items():
        os.replace(tmp, dest / name)


def _step_of(d: Path) -> int | None:
    rest = d.name.removeprefix("step-")
    return int(rest) if rest != d.name and rest.isdigit() else None


def is_replica_state(manifest: dict[str, Any]) -> bool:
    """A push of one replica's own optimiser state (no weights: they are its stage's)."""
    return manifest.get("weights_sha256") is None


async def receive_shard(request: web.Request, dest_for: Callable[[dict[str, Any]], Path],
                        limit: int, expect: dict[str, Any],
                        still_wanted: Callable[[dict[str, Any]], None] = lambda m: None
                        ) -> dict[str, Any]:
    """Read the ``manifest``, ``weights`` and (optional) ``optimizer`` parts; returns the
    manifest once all are in place. ``limit`` bounds the weights, and OPTIMIZER_TIMES it (plus
    a little) the optimiser state. A manifest with no ``weights_sha256`` is a replica's own
    state: its parts are ``manifest`` and ``optimizer``.

    ``expect``: manifest fields that must hold (job, stage, fellow) before anything is written.
    ``still_wanted(manifest)``: called once the manifest is read and again once every part
    has arrived, just before the files are swapped in; an ApiError it raises discards the push
    (the world may have changed while it arrived).
    """
    if not request.content_type.startswith("multipart/"):
        raise ApiError(415, "a shard push is multipart/form-data: manifest, weights, and "
                            "optionally optimizer")
    if content_coding.named(request) != "identity":
        raise ApiError(415, "a shard push is sent without a Content-Encoding (weights do not "
                            "compress)")
    most = (1 + OPTIMIZER_TIMES) * limit + OPTIMIZER_SLACK + MAX_MANIFEST
    if request.content_length is not None and request.content_length > most:
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
    # What the job's record keeps of the push (its ShardReceipt): checked before anything is
    # written, so a stored job never holds what it cannot read back.
    if not isinstance(manifest.get("config_fingerprint"), str | None):
        raise ApiError(400, "manifest config_fingerprint must be a string",
                       field="manifest.config_fingerprint")
    opt_bytes = manifest.get("optimizer_bytes")
    if opt_bytes is not None and (isinstance(opt_bytes, bool) or not isinstance(opt_bytes, int)
                                  or not 0 <= opt_bytes < 2**63):
        raise ApiError(400, "manifest optimizer_bytes must be a byte count or null",
                       field="manifest.optimizer_bytes")
    still_wanted(manifest)
    own_state = is_replica_state(manifest)
    if own_state and not names_optimizer(manifest):
        raise ApiError(400, "a push without weights is a replica's optimiser state: the "
                            "manifest must name it", field="manifest.optimizer_sha256")
    part = await reader.next()
    want = "optimizer" if own_state else "weights"
    if part is None or getattr(part, "name", None) != want:
        raise ApiError(400, f"second part must be '{want}'", field=want)
    dest = dest_for(manifest)
    dest.mkdir(parents=True, exist_ok=True)
    tmps: dict[str, Path] = {}
    # The disk work (fsyncs, reading the archive's listing, renames) runs in a worker thread:
    # a large shard's fsync takes long enough to stall every heartbeat on the event loop.
    try:
        if not own_state:
            tmps[WEIGHTS], size, digest = await _receive_part(part, dest, limit)
            await asyncio.to_thread(_check_weights, tmps[WEIGHTS], manifest, digest, size)
            part = await reader.next()
        if part is not None:
            if getattr(part, "name", None) != "optimizer":
                raise ApiError(400, "third part, if any, must be 'optimizer'", field="optimizer")
            tmps[OPTIMIZER], opt_size, digest = await _receive_part(
                part, dest, OPTIMIZER_TIMES * limit + OPTIMIZER_SLACK)
            await asyncio.to_thread(_check_optimizer, tmps[OPTIMIZER], manifest, digest,
                                    opt_size)
        elif names_optimizer(manifest):
            raise ApiError(400, "the manifest names optimizer state but no 'optimizer' part came",
                           field="optimizer")
        if await reader.next() is not None:
            raise ApiError(400, "a shard push has at most three parts: manifest, weights, "
                                "optimizer", field="optimizer")
        still_wanted(manifest)
        await asyncio.to_thread(_swap_in, dest, tmps)
    except FileNotFoundError:
        # publish() of a newer complete checkpoint pruned this older step while it arrived.
        _discard(dest, tmps)
        raise ApiError(409, f"checkpoint step {step} was pruned while it arrived: a newer "
                            "complete checkpoint exists", code="checkpoint_pruned") from None
    except BaseException:
        _discard(dest, tmps)
        raise
    manifest["received_at"] = time.time()
    await asyncio.to_thread(atomic_write, dest / MANIFEST, jsonio.dumps(manifest, pretty=True))
    return manifest


def _discard(dest: Path, tmps: dict[str, Path]) -> None:
    """Undo a refused push: its temp files, and the directories it made if they are empty."""
    for tmp in tmps.values():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    for d in (dest, dest.parent):
        with contextlib.suppress(OSError):
            d.rmdir()


async def _receive_part(part: Any, dest: Path, limit: int) -> tuple[Path, int, str]:
    """Stream one part into a temp file in ``dest``: (path, bytes, sha256), at most ``limit``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{part.name}.", dir=dest)
    digest = hashlib.sha256()
    size = 0
    try:
        with os.fdopen(fd, "wb") as fh:
            while chunk := await part.read_chunk(1 << 20):
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"shard {part.name} exceeds the upload limit of "
                                        f"{limit} bytes", code="body_too_large")
                digest.update(chunk)
                fh.write(chunk)
            await asyncio.to_thread(_flush, fh)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return Path(tmp), size, digest.hexdigest()


def _flush(fh: Any) -> None:
    fh.flush()
    os.fsync(fh.fileno())


def _npy_members(path: Path, field: str) -> set[str]:
    """Member names (without ``.npy``) of an ``.npz``; anything else in it is refused."""
    try:
        with zipfile.ZipFile(path) as z:
            members = z.namelist()
    except zipfile.BadZipFile:
        raise ApiError(400, f"{field} is not an .npz archive", field=field) from None
    bad = [n for n in members if not n.endswith(".npy") or "/" in n]
    if bad:
        raise ApiError(400, f"unexpected members in {field}: {bad[:3]}", field=field)
    return {n.removesuffix(".npy") for n in members}


def _check_digest(part: str, manifest: dict[str, Any], sha256: str, size: int) -> None:
    """The part's bytes are the ones the manifest names (``<part>_sha256``, ``<part>_bytes``)."""
    if manifest.get(f"{part}_sha256") != sha256:
        raise ApiError(400, f"the {part} part does not match the manifest's {part}_sha256",
                       field=part)
    if manifest.get(f"{part}_bytes") not in (None, size):
        raise ApiError(400, f"the {part} part is {size} bytes, the manifest says "
                            f"{manifest.get(f'{part}_bytes')}", field=part)


def _check_optimizer(path: Path, manifest: dict[str, Any], sha256: str, size: int) -> None:
    _check_digest("optimizer", manifest, sha256, size)
    params = manifest.get("params")
    params = params if isinstance(params, dict) else {}
    # "<parameter>.<field>": the fields are the optimiser's business, the parameters the shard's.
    stray = sorted(n for n in _npy_members(path, "optimizer")
                   if n.rpartition(".")[0] not in params)
    if stray:
        raise ApiError(400, f"optimizer state for parameters the shard does not hold: "
                            f"{stray[:3]}", field="optimizer")


def _check_weights(path: Path, manifest: dict[str, Any], sha256: str, size: int) -> None:
    _check_digest("weights", manifest, sha256, size)
    names = _npy_members(path, "weights")
    params = manifest.get("params")
    if not isinstance(params, dict) or set(params) != names:
        raise ApiError(400, "weights and manifest list different parameters",
                       field="manifest.params")
