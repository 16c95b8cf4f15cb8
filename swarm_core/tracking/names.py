"""What a run's figures are called in TensorBoard and MLflow, and how its events read.

Input is what a run directory holds (``train_progress.ndjson`` lines, ``config_resolved.json``,
the summary's link changes and restarts), as plain JSON values: the live runner and the
converter of finished runs feed the same dicts, so both write the same tags. Values of the
wrong type (a hand-edited file) are left out, never raised on.
"""

from __future__ import annotations

import math
from typing import Any

from swarm_core import jsonio
from swarm_core.contract.metrics import MetricName, perplexity

# A progress line's figure -> its tag (one value per step).
STEP_TAGS = {
    MetricName.LOSS: "train/loss",
    MetricName.TOKENS_PER_S: "train/tokens_per_s",
    MetricName.STEP_SECONDS: "train/step_seconds",
    MetricName.LR: "train/lr",
    MetricName.WIRE_BYTES: "wire/bytes_per_step",
    # (replicas: what the stage groups' sync sent)
    MetricName.SYNC_BYTES: "sync/bytes_per_step",
    MetricName.EVAL_LOSS: "eval/loss",
    MetricName.PERPLEXITY: "eval/perplexity",
}
# A progress line's per-stage figure -> its tag's folder (one value per stage and step); TB
# groups by the folder, so one chart compares the stages. A folder is the figure's own name but
# for the link wait's (test_tracking pins them: logs already written carry these tags).
STAGE_TAGS = {
    MetricName.WAIT_SECONDS: "link_wait_s",
    MetricName.STAGE_SECONDS: MetricName.STAGE_SECONDS,
    MetricName.ACTIVATION_PEAK_BYTES: MetricName.ACTIVATION_PEAK_BYTES,
}
CODEC_TAG = MetricName.CODEC_ERROR
SET_SPEED_TAG = "events/set_speed"
MEMBERSHIP_TAG = "events/membership"


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def step_scalars(line: dict[str, Any]) -> list[tuple[str, float]]:
    """A progress line's figures as (tag, value), in a fixed order."""
    out: list[tuple[str, float]] = []
    for field, tag in STEP_TAGS.items():
        v = _number(line.get(field))
        if field == MetricName.PERPLEXITY and v is None:  # (lines written before the field)
            loss = _number(line.get(MetricName.EVAL_LOSS))
            v = perplexity(loss) if loss is not None and math.isfinite(loss) else None
        if v is not None:
            out.append((tag, v))
    for field, folder in STAGE_TAGS.items():
        by_stage = line.get(field)
        if isinstance(by_stage, dict):
            for stage in sorted(by_stage, key=_stage_order):
                v = _number(by_stage[stage])
                if v is not None:
                    out.append((f"{folder}/stage_{stage}", v))
    codec = line.get(MetricName.CODEC_ERROR)
    if isinstance(codec, dict):
        for stage in sorted(codec, key=_stage_order):
            errs = codec[stage]
            if isinstance(errs, dict):
                for direction in sorted(errs):
                    v = _number(errs[direction])
                    if v is not None:
                        out.append((f"{CODEC_TAG}/stage_{stage}_{direction}", v))
    return out


def _stage_order(label: str) -> tuple[int, ...]:
    """Stage labels are "0", "1" (one replica) or "0.1"-like cells: numeric order."""
    try:
        return tuple(int(p) for p in str(label).replace("r", ".").split(".") if p)
    except ValueError:
        return (1 << 30,)


def hparams(resolved: dict[str, Any]) -> dict[str, bool | int | float | str]:
    """A run's resolved config (``config_resolved.json``) as flat hyperparameters for the
    HParams view: ``model.d_model``, ``training.lr``, ``compression`` and so on. Lists become
    JSON text; nulls are left out (a hparam of two types across runs splits TB's column)."""
    job: dict[str, Any] = resolved["job"] if isinstance(resolved.get("job"), dict) else {}
    network = resolved.get("network_profile")
    top: dict[str, Any] = {
        "experiment": resolved.get("experiment"),
        "compression": (job.get("model") or {}).get("compression")
        if isinstance(job.get("model"), dict) else None,
        "network": network.get("name") if isinstance(network, dict) else None,
        "seed": resolved.get("seed"), "repeat": resolved.get("repeat"),
        "variant": resolved.get("variant"), "model": job.get("model"),
        "training": job.get("training"),
        "topology": job.get("topology"),
    }
    out: dict[str, bool | int | float | str] = {}
    _flatten("", top, out)
    return out


def _flatten(prefix: str, value: Any, out: dict[str, bool | int | float | str]) -> None:
    if value is None:
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, bool | int | float | str):
        out[prefix] = value
    else:
        out[prefix] = jsonio.dumps(value).decode()


def link_change_text(change: dict[str, Any]) -> str | None:
    """A set-speed while the run trained, as one line; None for a malformed entry."""
    link = change.get("link")
    fellow = change.get("fellow_id")
    slowdown = _number(change.get("slowdown"))
    if not isinstance(fellow, int) or not (isinstance(link, dict) or slowdown is not None):
        return None

    def rate(v: Any) -> str:
        return "unlimited" if v is None else f"{v:g} Mbit/s"

    parts = []
    if isinstance(link, dict):  # (None: a slowdown alone, the link left as it was)
        latency = _number(link.get("latency_ms")) or 0.0
        parts.append(f"tx {rate(link.get('tx_mbps'))}, rx {rate(link.get('rx_mbps'))}, "
                     f"latency {latency:g} ms")
    if slowdown is not None:
        parts.append(f"compute slowdown {slowdown:g}x (emulated)")
    return (f"set-speed: fellow {fellow} " + ", ".join(parts)
            + f" (from step {change.get('at_step')})")


def restart_text(restart: dict[str, Any]) -> str | None:
    """A recovery (a fellow lost, its stage handed on, the run resumed) as one line."""
    if not isinstance(restart.get("resume_step"), int):
        return None
    replaced: dict[str, Any] = restart["replaced"] \
        if isinstance(restart.get("replaced"), dict) else {}
    moves = [f"stage {stage}: fellow {r.get('from')} -> {r.get('to')} ({r.get('lost')})"
             for stage, r in sorted(replaced.items()) if isinstance(r, dict)]
    text = (f"membership: at step {restart.get('at_step')} resumed from step "
            f"{restart['resume_step']}")
    if moves:
        text += "; " + "; ".join(moves)
    if restart.get("reason"):
        text += f"; {restart['reason']}"
    return text
