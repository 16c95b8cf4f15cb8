"""What tests share besides fixtures: the test token, the repository root, how to run the CLI,
and a set of shards written as fellows write them."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
REPO = Path(__file__).resolve().parents[1]


def write_config(tmp: Path, name: str, data: Any) -> Path:
    """A config file at ``tmp / name`` (folders made): ``data`` as JSON, or a string as is
    (a file that is not JSON)."""
    p = tmp / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


async def wait_async(cond: Callable[[], Awaitable[Any]], what: str,
                     timeout: float = 20.0) -> Any:
    """Poll ``cond`` until it returns something true; that value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := await cond()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
    return value


def swarm_argv(*args: str) -> list[str]:
    """Run the CLI as the installed entry point would, via the current interpreter."""
    return [sys.executable, "-m", "swarm_tui.cli", *args]


# A model export to glue: three stages, a learned int8 bottleneck at each boundary.
GLUE_MODEL = {"d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8,
              "compression": "learned_dim4_int8"}
GLUE_RANGES = [(0, 1), (1, 3), (3, 4)]


def export(tmp: Path, ranges=GLUE_RANGES, model=GLUE_MODEL, seed=0, steps=None, skip=(),
           job_id="job-1", vocab=40, training=None, tokenizer=None) -> Path:
    """Shards of freshly initialised stages under ``tmp/model_export``, as fellows write them
    (``skip``: stages left out; ``steps``: each stage's step)."""
    from swarm_core.artifacts.shards import build_manifest, npz_bytes, state_arrays, write_shard
    from swarm_core.config.schemas import ModelConfig
    from swarm_core.pipeline.model import StageModule

    root = tmp / "model_export"
    mc = ModelConfig(**model)
    for s, (a, b) in enumerate(ranges):
        if s in skip:
            continue
        module = StageModule(mc, vocab, seed, a, b, s, len(ranges))
        arrays = state_arrays(module)
        weights = npz_bytes(arrays)
        step = steps[s] if steps else 10
        manifest = build_manifest(job_id=job_id, stage=s, num_stages=len(ranges), fellow_id=s,
                                  fellow_name=f"f{s}", layers=(a, b), step=step, model=model,
                                  seed=seed, vocab_size=vocab,
                                  tokenizer=tokenizer or {"name": "byte"}, arrays=arrays,
                                  weights=weights, training=training or {"seed": 0})
        write_shard(root / "shards", manifest, weights)
    return root
