"""What a fellow runs when START arrives, by job kind.

``smoke`` is a control-plane check: it walks the job through RUNNING steps to COMPLETED without
training anything, so a new cluster can be shown to dispatch, report and finish. ``train`` is the
pipeline stage runner, which lands with the training engine; until then a fellow refuses it with
a FAILED report that says so, rather than pretending.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from swarm_core.protocol import JobStatusUpdate

Report = Callable[[JobStatusUpdate], Awaitable[None]]


@attrs.define
class Progress:
    """What the fellow's heartbeat says about the job in hand."""

    job_id: str | None = None
    stage: int | None = None
    step: int = 0
    loss: float | None = None
    tokens_per_s: float = 0.0


class JobRefused(Exception):
    pass


async def run_smoke(start: dict[str, Any], fellow_id: int, progress: Progress,
                    report: Report) -> None:
    training = start.get("training") or {}
    steps = int(training.get("steps", 5))
    step_s = float(training.get("step_seconds", 0.2))
    if not 1 <= steps <= 100_000 or not 0 <= step_s <= 60:
        raise JobRefused(f"smoke job wants 1-100000 steps of 0-60 s, got {steps} x {step_s}")
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        await asyncio.sleep(step_s)
        progress.step = step
        progress.tokens_per_s = 0.0
        await report(JobStatusUpdate(fellow_id=fellow_id, state="RUNNING", step=step))
    elapsed = time.monotonic() - t0
    await report(JobStatusUpdate(
        fellow_id=fellow_id, state="COMPLETED", step=steps,
        message=f"smoke: {steps} control-plane round trips in {elapsed:.2f}s",
    ))


async def run_job(start: dict[str, Any], fellow_id: int, progress: Progress,
                  report: Report) -> None:
    kind = start.get("kind")
    if kind == "smoke":
        await run_smoke(start, fellow_id, progress, report)
        return
    raise JobRefused(f"this fellow cannot run {kind!r} jobs yet (the training engine is issue 3)")
