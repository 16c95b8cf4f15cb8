"""Each stage's compute on this machine, measured once and kept: the real stage modules run a
few micro-batches forward and backward in this process, plus the optimiser's step.

Kept per machine in ``<swarm home>/predict/calibration.json`` by a key of what the time
depends on: the model's shape and spec, the stage's layers and place in the pipeline, the
micro-batch, the vocabulary, the optimiser, the torch threads, the host and torch's version.
A later prediction of the same stage reads it back (``force`` measures again). torch is
imported only when something has to be measured or built.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract.placement import split_layers
from swarm_core.paths import atomic_write, swarm_home
from swarm_core.predict.critical_path import StageTimes
from swarm_core.schema import unstructure

WARMUP = 1  # micro-batches run before the timed ones (allocations, lazy inits)
REPEATS = 3  # timed micro-batches (and optimiser steps); the median is kept


@attrs.frozen
class StageWork:
    """One stage as the calibration builds it: everything its time depends on."""

    model: ModelConfig
    training: TrainingConfig
    vocab: int
    layers: tuple[int, int]
    stage: int
    stages: int
    micro_batch: int

    def key(self) -> str:
        t = self.training
        shape = {k: v for k, v in unstructure(self.model).items() if k != "name"}
        what = {"model": shape, "vocab": self.vocab, "layers": self.layers,
                "stage": self.stage, "stages": self.stages, "micro_batch": self.micro_batch,
                "optimizer": t.optimizer, "threads": t.threads, "host": platform.node(),
                "machine": platform.machine(), "torch": _torch_version()}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


Measure = Callable[[StageWork], StageTimes]


def vocab_of(model: ModelConfig, training: TrainingConfig) -> int:
    """The vocabulary the job's stages are built with: the model's, else the tokenizer's
    (a BPE tokenizer's asked-for size; a trained one may come out a little smaller)."""
    if model.vocab_size is not None:
        return model.vocab_size
    return 256 if training.tokenizer == "byte" else training.bpe_vocab_size


def stage_works(model: ModelConfig, training: TrainingConfig, stages: int,
                replicas: int) -> list[StageWork]:
    """Each stage of the run, its layers split as the planner splits them (equally, unless
    ``training.stage_weights`` say otherwise)."""
    mb = training.batch_size // replicas // training.micro_batches
    vocab = vocab_of(model, training)
    weights = training.stage_weights or [1.0] * stages
    return [StageWork(model, training, vocab, layers, s, stages, mb)
            for s, layers in enumerate(split_layers(model.n_layers, weights))]


def default_cache() -> Path:
    return swarm_home() / "predict" / "calibration.json"


@attrs.define
class Calibration:
    """Per stage its times, and whether they came from the cache."""

    times: list[StageTimes]
    cached: list[bool]


def calibrate(works: Sequence[StageWork], cache: Path | None = None, force: bool = False,
              measure: Measure | None = None) -> Calibration:
    """Each stage's times: from ``cache`` where it holds the stage's key (unless ``force``),
    else measured (``measure``: :func:`measure_stage`) and written back."""
    cache = cache or default_cache()
    store = _read(cache)
    out = Calibration([], [])
    changed = False
    for work in works:
        key = work.key()
        hit = store.get(key)
        if hit is not None and not force:
            out.times.append(StageTimes(hit["forward"], hit["backward"], hit["optimizer"]))
            out.cached.append(True)
            continue
        times = (measure or measure_stage)(work)
        store[key] = {**attrs.asdict(times), "measured_at": time.time(),
                      "what": f"stage {work.stage}/{work.stages} layers {list(work.layers)} "
                              f"mb {work.micro_batch} threads {work.training.threads}"}
        out.times.append(times)
        out.cached.append(False)
        changed = True
    if changed:
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(cache, json.dumps(store, indent=1, sort_keys=True).encode())
    return out


def _read(cache: Path) -> dict[str, Any]:
    """The cache, or empty where it is missing or unreadable (it is only a cache)."""
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def build_stage(work: StageWork) -> Any:
    """The stage's module, as a fellow builds it (the job's seed)."""
    from swarm_core.pipeline.model import StageModule

    return StageModule(work.model, work.vocab, work.training.seed, work.layers[0],
                       work.layers[1], work.stage, work.stages)


def measure_stage(work: StageWork) -> StageTimes:
    """Median seconds of a micro-batch's forward (the loss on the last stage) and backward,
    and of the optimiser's step, on this machine's CPU with the job's torch threads."""
    import torch

    from swarm_core.pipeline.model import lm_loss
    from swarm_core.pipeline.optim import make_optimizer
    from swarm_core.pipeline.wire_math import boundary_width

    threads = torch.get_num_threads()
    torch.set_num_threads(work.training.threads)
    try:
        module = build_stage(work)
        module.train()
        opt = make_optimizer(module, work.training)
        gen = torch.Generator().manual_seed(0)
        shape = (work.micro_batch, work.model.seq_len)
        tokens = torch.randint(work.vocab, shape, generator=gen)
        fwd: list[float] = []
        bwd: list[float] = []
        for i in range(WARMUP + REPEATS):
            x = tokens if work.stage == 0 else torch.randn(
                (*shape, boundary_width(work.model)), generator=gen).requires_grad_()
            t0 = time.perf_counter()
            out = module(x, tokens)
            loss = lm_loss(out, tokens) if work.stage == work.stages - 1 else None
            t1 = time.perf_counter()
            if loss is not None:
                loss.backward()
            else:
                out.backward(torch.randn(out.shape, generator=gen))
            t2 = time.perf_counter()
            if i >= WARMUP:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        steps = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            opt.step()
            steps.append(time.perf_counter() - t0)
        return StageTimes(statistics.median(fwd), statistics.median(bwd),
                          statistics.median(steps))
    finally:
        torch.set_num_threads(threads)
