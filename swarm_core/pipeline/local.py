"""Every stage of one pipeline as threads of this process, over real loopback TCP: the data
plane and schedules exactly as fellows run them, without a leader. For tests, device checks and
notebooks; fellows do not use it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract import chain_starts
from swarm_core.data import TokenData
from swarm_core.pipeline.links import LinkShaper
from swarm_core.pipeline.listener import DataListener
from swarm_core.pipeline.stage import StageResult, StageSpec, StepReport, run_stage

__all__ = ["run_local_pipeline"]


def run_local_pipeline(model: ModelConfig, training: TrainingConfig,
                       data: TokenData | Callable[[int], TokenData],
                       num_stages: int, *,
                       devices: Sequence[str] | None = None,
                       shapers: Sequence[LinkShaper] | None = None,
                       stop: threading.Event | None = None,
                       prepare: Mapping[int, Callable[[StageSpec], None]] | None = None,
                       stage_kwargs: Mapping[int, dict[str, Any]] | None = None,
                       on_step: Callable[[int, StepReport], None] | None = None,
                       timeout: float = 60.0,
                       replicas: int = 1) -> dict[int, StageResult | BaseException]:
    """Run ``num_stages`` equal stages (``replicas`` data-parallel replicas of each) to the
    end. Returns, by cell (replica r of stage s is cell r x num_stages + s: the stage itself
    for one replica), ``run_stage``'s :class:`StageResult` or the exception that ended it; the
    first failure sets ``stop`` for the others. ``devices``, ``shapers``, ``prepare`` and
    ``stage_kwargs`` are by cell too.
    ``data`` may be a loader ``data(s)``, which stage s calls as a fellow loads its data:
    while its links are being opened.
    ``prepare[s](spec)`` runs in stage s's thread before it starts (and may raise);
    ``stage_kwargs[s]`` go to its ``run_stage``; ``shapers[s]`` shapes stage s's links (as a
    fellow's set-speed would; unshaped by default). Raises TimeoutError if a stage is still
    running after ``timeout`` seconds.

    Each cell is a fellow of its own, and its START is built as the leader builds one."""
    cells = num_stages * replicas
    devs = list(devices or ["cpu"] * cells)
    if len(devs) != cells:
        raise ValueError(f"{len(devs)} devices for {cells} cells")
    shaping = list(shapers or [LinkShaper() for _ in range(cells)])
    if len(shaping) != cells:
        raise ValueError(f"{len(shaping)} shapers for {cells} cells")
    listeners = [DataListener() for _ in range(cells)]
    results: dict[int, Any] = {}
    stop = stop or threading.Event()
    starts = chain_starts(model, training, [ln.addr for ln in listeners], devs,
                          replicas=replicas)

    def go(s: int) -> None:
        spec = StageSpec.from_start(starts[s])
        try:
            if prepare and s in prepare:
                prepare[s](spec)
            mine = (lambda: data(s)) if callable(data) else data
            results[s] = run_stage(spec, mine, shaping[s], listeners[s], stop,
                                   (lambda r: on_step(s, r)) if on_step else (lambda r: None),
                                   connect_timeout=training.frame_timeout_s,
                                   **(stage_kwargs or {}).get(s, {}))
        except Exception as exc:
            results[s] = exc
            stop.set()

    threads = [threading.Thread(target=go, args=(s,), name=f"stage-{s}", daemon=True)
               for s in range(cells)]
    deadline = time.monotonic() + timeout
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    finally:
        for ln in listeners:
            ln.close()
    if any(t.is_alive() for t in threads):
        stop.set()
        raise TimeoutError(f"a stage was still running after {timeout:g}s")
    return results

