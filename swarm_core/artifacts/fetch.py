"""A job's export copied from the leader next to a run: ``<dest>/shards/stage-K-fellow-F/``
(each stage's newest pushed shard) and ``<dest>/run_manifest.json``, so glue, eval and generate
work on the run's own directory, whether the leader is on this machine or another.

Over HTTP with the token (``GET /jobs/{id}/export`` and ``/export/{stage}/{part}``), the
weights streamed to a file beside the shards (a model's weights may not fit in memory twice).
No shard is put in place before every stage's parts are in and its weights match the
manifest's sha256, and then weights first, manifest last: a shard directory with a manifest
is complete, and a failed or refused download leaves none.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from swarm_core import jsonio
from swarm_core.artifacts.layout import RUN_MANIFEST, WEIGHTS, install_shard, shard_dir_name
from swarm_core.artifacts.manifests import shard_manifest
from swarm_core.client import SwarmClient, shown_url
from swarm_core.contract.job import ShardReceipt, export_complete
from swarm_core.paths import atomic_write
from swarm_core.schema import SchemaError, unstructure

# A periodic push may land between a stage's manifest and its weights: fetch both again.
ATTEMPTS = 3


class FetchError(Exception):
    """The export could not be copied; the line says which stage and why."""


async def fetch_export(client: SwarmClient, job_id: str, dest: Path) -> dict[str, Any]:
    """Copy the job's newest shard of every stage into ``dest`` and write its run manifest
    there (returned). Raises FetchError (or ClientError when the leader cannot answer)."""
    leader_view = await client.export_manifest(job_id)
    root = dest / "shards"
    # Every stage downloaded (streamed to disk beside the shards, never whole in memory)
    # before any is put in place: a stage that fails leaves the export as it was (one shard
    # at a time would leave a mix of two pushes).
    try:
        root.mkdir(parents=True, exist_ok=True)
        incoming = Path(tempfile.mkdtemp(prefix=".incoming-", dir=root))
    except OSError as exc:
        raise FetchError(f"{job_id}: cannot write under {root}: {exc.strerror or exc}") from None
    try:
        got = [await _fetch_stage(client, job_id, int(entry["stage"]), incoming)
               for entry in leader_view.get("shards", [])]
        for _receipt, manifest, weights in got:
            install_shard(root, manifest, weights)
    except OSError as exc:
        raise FetchError(f"{job_id}: cannot write the export under {root}: "
                         f"{exc.strerror or exc}") from None
    finally:
        shutil.rmtree(incoming, ignore_errors=True)
        if not any(root.iterdir()):
            root.rmdir()  # (nothing came: no empty shards/ for glue to trip on)
    receipts = [r for r, _m, _w in got]
    steps = {r.step for r in receipts}
    run = {**leader_view,
           "step": max(steps) if steps else None,
           "complete": export_complete(receipts, int(leader_view["num_stages"])),
           "shards": [{**unstructure(r), "dir": f"shards/{shard_dir_name(r.stage, r.fellow_id)}"}
                      for r in receipts],
           "fetched_from": shown_url(client.base_url), "fetched_at": time.time()}
    atomic_write(dest / RUN_MANIFEST, jsonio.dumps(run, pretty=True))
    return run


async def _fetch_stage(client: SwarmClient, job_id: str, stage: int, incoming: Path
                       ) -> tuple[ShardReceipt, dict[str, Any], Path]:
    where = f"{job_id} stage {stage}"
    weights = incoming / f"stage-{stage}.{WEIGHTS}"
    for _ in range(ATTEMPTS):
        raw = await client.export_part(job_id, stage, "manifest")
        weights.unlink(missing_ok=True)
        sha, size = await client.export_part_to(job_id, stage, "weights", weights)
        try:
            data = jsonio.loads(raw)
            m, _cfg = shard_manifest(data)
        except (jsonio.JSONDecodeError, SchemaError) as exc:
            raise FetchError(f"{where}: the shard manifest is not one: {exc}") from None
        if m.job_id != job_id or m.stage != stage:
            raise FetchError(f"{where}: the leader sent the shard of {m.job_id} stage {m.stage}")
        if sha == m.weights_sha256:
            receipt = ShardReceipt(stage=m.stage, fellow_id=m.fellow_id, step=m.step,
                                   weights_sha256=m.weights_sha256, weights_bytes=size,
                                   config_fingerprint=m.config_fingerprint)
            return receipt, data, weights
    raise FetchError(f"{where}: the weights do not match their manifest's sha256 "
                     f"({ATTEMPTS} downloads)")
