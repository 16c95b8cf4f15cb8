"""Shard pushes from fellows: streamed to disk under the job's run dir, never buffered whole.

No numpy here (the leader stays light): the weights are checked as a zip of ``.npy`` members
against the manifest's parameter names and sha256, then moved into place, manifest last.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from aiohttp import web

from swarm_core import jsonio
from swarm_core.artifacts.layout import (
    MANIFEST,
    OPTIMIZER,
    WEIGHTS,
    drop_other_holders,
    shard_dir_name,
)
from swarm_core.artifacts.manifests import (
    PushedManifest,
    ReplicaStateManifest,
    ShardManifest,
    pushed_manifest,
)
from swarm_core.leader import content_coding
from swarm_core.leader.errors import ApiError
from swarm_core.paths import atomic_write, fsync_dir
from swarm_core.schema import SchemaError, structure

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


log = logging.getLogger("swarm.leader")

UNDONE_PREFIX = ".undone-"  # a dropped checkpoint on its way out (no ``step-*`` name)


def drop_checkpoints_from(runs_dir: Path, job_id: str, step: int) -> list[int]:
    """Remove the job's checkpoints at ``step`` (1-based, steps done) and after: states a
    step that is trained again has undone (swarm wiring's redo), which a resume must never
    take up. Each is renamed out of the checkpoints' names at once (nothing reads it from
    then on) and its files are removed in a thread, with any an earlier leader left: the
    leader's loop, which calls this, does not wait on a disk. Returns the steps removed."""
    root = runs_dir / job_id / "checkpoints"
    dropped, gone = [], list(root.glob(f"{UNDONE_PREFIX}*"))
    for d in root.glob("step-*"):
        at = _step_of(d)
        if at is None or at < step:
            continue
        out = root / f"{UNDONE_PREFIX}{d.name}-{os.urandom(4).hex()}"
        try:
            d.rename(out)
        except FileNotFoundError:
            continue  # (pruned meanwhile)
        except OSError as exc:  # (a rename refused: removed where it is, in the thread)
            log.warning("checkpoint %s of %s: %s; removing it in place", d.name, job_id, exc)
            out = d
        dropped.append(at)
        gone.append(out)
    if gone:
        threading.Thread(target=_remove_trees, args=(gone,), daemon=True,
                         name="drop-checkpoints").start()
    return sorted(dropped)


def _remove_trees(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def _stage_complete(d: Path) -> bool:
    try:
        # (written by this leader, checked as it came in)
        manifest = structure(jsonio.loads((d / MANIFEST).read_bytes()), ShardManifest,
                             trust=True)
    except (OSError, jsonio.JSONDecodeError, SchemaError):
        return False
    return all((d / f"replica-{r}" / MANIFEST).exists() for r in manifest.replica_states)


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
    if MANIFEST not in files:  # (the checkpoint was dropped as undone while it was linked)
        raise FileNotFoundError(src / MANIFEST)
    manifest = files.pop(MANIFEST)
    _swap_in(dest, files)
    os.replace(manifest, dest / MANIFEST)
    fsync_dir(dest)
    root = runs_dir / job_id / "checkpoints"
    complete = complete_checkpoints(runs_dir, job_id, num_stages)
    if len(complete) > KEEP_CHECKPOINTS:
        cutoff = complete[KEEP_CHECKPOINTS - 1]
        for d in root.glob("step-*"):
            older = _step_of(d)
            if older is not None and older < cutoff:
                shutil.rmtree(d, ignore_errors=True)
    # (an undone checkpoint a leader that stopped mid-removal left behind: this is a thread)
    _remove_trees(list(root.glob(f"{UNDONE_PREFIX}*")))


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


@attrs.frozen
class PushTarget:
    """Whose push a route takes: its manifest must name this job, stage and fellow before
    anything is written."""

    job_id: str
    stage: int
    fellow_id: int


async def receive_shard(request: web.Request, dest_for: Callable[[PushedManifest], Path],
                        limit: int, expect: PushTarget,
                        still_wanted: Callable[[PushedManifest], None] = lambda m: None
                        ) -> PushedManifest:
    """Read the ``manifest``, ``weights`` and (optional) ``optimizer`` parts; returns the
    manifest once all are in place. ``limit`` bounds the weights, and OPTIMIZER_TIMES it (plus
    a little) the optimiser state. A manifest with no ``weights_sha256`` is a replica's own
    state (ReplicaStateManifest): its parts are ``manifest`` and ``optimizer``.

    ``still_wanted(manifest)``: called once the manifest is read and again once every part
    has arrived, just before the files are swapped in; an ApiError it raises discards the push
    (the world may have changed while it arrived).
    """
    _check_push_request(request, limit)
    reader = await request.multipart()
    sent, manifest = await _read_manifest(reader, expect)
    still_wanted(manifest)
    part = await reader.next()
    want = "optimizer" if isinstance(manifest, ReplicaStateManifest) else "weights"
    if part is None or getattr(part, "name", None) != want:
        raise ApiError(400, f"second part must be '{want}'", field=want)
    dest = dest_for(manifest)
    dest.mkdir(parents=True, exist_ok=True)
    tmps: dict[str, Path] = {}
    try:
        await _receive_files(reader, part, dest, manifest, limit, tmps)
        still_wanted(manifest)
        await asyncio.to_thread(_swap_in, dest, tmps)
    except FileNotFoundError:
        # publish() of a newer complete checkpoint pruned this older step while it arrived.
        _discard(dest, tmps)
        raise ApiError(409, f"checkpoint step {manifest.step} was pruned while it arrived: a "
                            "newer complete checkpoint exists", code="checkpoint_pruned") from None
    except BaseException:
        _discard(dest, tmps)
        raise
    manifest.received_at = sent["received_at"] = time.time()
    # The file is the manifest as it came, keys this leader does not know included: it reads
    # back as the fellow wrote it, but for the leader's received_at.
    await asyncio.to_thread(atomic_write, dest / MANIFEST, jsonio.dumps(sent, pretty=True))
    return manifest


def _check_push_request(request: web.Request, limit: int) -> None:
    """What the request's headers already refuse, before any part is read."""
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


async def _read_manifest(reader: Any, expect: PushTarget
                         ) -> tuple[dict[str, Any], PushedManifest]:
    """The first part: the manifest as it came (what goes to disk) and structured, once, into
    its class, which everything after reads; it must be ``expect``'s."""
    part = await reader.next()
    if part is None or getattr(part, "name", None) != "manifest":
        raise ApiError(400, "first part must be 'manifest'", field="manifest")
    raw = await part.read(decode=False)
    if len(raw) > MAX_MANIFEST:
        raise ApiError(413, "shard manifest too large", code="body_too_large")
    try:
        data = jsonio.loads(raw)
    except jsonio.JSONDecodeError:
        raise ApiError(400, "manifest is not valid JSON", field="manifest") from None
    try:
        manifest = pushed_manifest(data, "manifest")
    except SchemaError as exc:
        raise ApiError(400, exc.message, field=exc.field) from None
    for name, got, want in (("job_id", manifest.job_id, expect.job_id),
                            ("stage", manifest.stage, expect.stage),
                            ("fellow_id", manifest.fellow_id, expect.fellow_id)):
        if got != want:
            raise ApiError(400, f"manifest {name} is {got!r}, expected {want!r}",
                           field=f"manifest.{name}")
    return data, manifest


async def _receive_files(reader: Any, part: Any, dest: Path, manifest: PushedManifest,
                         limit: int, tmps: dict[str, Path]) -> None:
    """The weights (a stage shard's) from ``part`` on, then the optimiser state, each into a
    temp file in ``dest`` (in ``tmps`` by its final name, for the caller to swap in or
    discard) and checked against the manifest."""
    # The disk work (fsyncs, reading the archive's listing, renames) runs in a worker thread:
    # a large shard's fsync takes long enough to stall every heartbeat on the event loop.
    if isinstance(manifest, ShardManifest):
        tmps[WEIGHTS], size, digest = await _receive_part(part, dest, limit)
        await asyncio.to_thread(_check_weights, tmps[WEIGHTS], manifest, digest, size)
        part = await reader.next()
    if part is not None:
        if getattr(part, "name", None) != "optimizer":
            raise ApiError(400, "third part, if any, must be 'optimizer'", field="optimizer")
        tmps[OPTIMIZER], opt_size, digest = await _receive_part(
            part, dest, OPTIMIZER_TIMES * limit + OPTIMIZER_SLACK)
        await asyncio.to_thread(_check_optimizer, tmps[OPTIMIZER], manifest, digest, opt_size)
    elif manifest.names_optimizer:
        raise ApiError(400, "the manifest names optimizer state but no 'optimizer' part came",
                       field="optimizer")
    if await reader.next() is not None:
        raise ApiError(400, "a shard push has at most three parts: manifest, weights, "
                            "optimizer", field="optimizer")


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


def _check_digest(part: str, sha256: str, size: int, named_sha256: str | None,
                  named_bytes: int | None) -> None:
    """The part's bytes are the ones the manifest names (its ``<part>_sha256`` and
    ``<part>_bytes``)."""
    if named_sha256 != sha256:
        raise ApiError(400, f"the {part} part does not match the manifest's {part}_sha256",
                       field=part)
    if named_bytes not in (None, size):
        raise ApiError(400, f"the {part} part is {size} bytes, the manifest says "
                            f"{named_bytes}", field=part)


def _check_optimizer(path: Path, manifest: PushedManifest, sha256: str, size: int) -> None:
    _check_digest("optimizer", sha256, size, manifest.optimizer_sha256,
                  manifest.optimizer_bytes)
    # "<parameter>.<field>": the fields are the optimiser's business, the parameters the shard's.
    stray = sorted(n for n in _npy_members(path, "optimizer")
                   if n.rpartition(".")[0] not in manifest.params)
    if stray:
        raise ApiError(400, f"optimizer state for parameters the shard does not hold: "
                            f"{stray[:3]}", field="optimizer")


def _check_weights(path: Path, manifest: ShardManifest, sha256: str, size: int) -> None:
    _check_digest("weights", sha256, size, manifest.weights_sha256, manifest.weights_bytes)
    if set(manifest.params) != _npy_members(path, "weights"):
        raise ApiError(400, "weights and manifest list different parameters",
                       field="manifest.params")
