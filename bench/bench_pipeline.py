"""Pipeline throughput benchmark (not a test): one table, one invocation, the same GPT-style
model and global batch run several ways, as tokens/s and as a ratio to row (a).

* (a) one process, one thread: the plain loop of ``train_reference`` over the same micro-batches
  (the whole model, one micro-batch after another, then clip and one AdamW step);
* (b) our pipeline: two processes of one thread each, each running ``run_stage`` for its stage
  (stage 1 listens on a ``DataListener``, stage 0 dials it over loopback TCP), schedules
  ``gpipe`` and ``1f1b``;
* (c) ``torch.distributed.pipelining`` over gloo: two ranks of one thread each, ``ScheduleGPipe``
  and ``Schedule1F1B``; the stage modules are our ``StageModule`` for stage 0 and 1 (same split,
  same weights), the loss on the last stage, the same global clipping (an all-reduce) and AdamW;
* (x) a diagnostic ceiling: the same two processes computing their halves on local data with no
  communication and no bubble, i.e. the most two one-thread processes get out of this machine.

Tokens/s is global tokens (batch x seq_len) per step over the wall time of the timed steps, after
the warm-up steps. Every process sets one intra-op and one inter-op thread before any torch work
(and ``OMP_NUM_THREADS=1``), so two processes fill the two cores of the reference machine.

For (b) each stage process also records where its step time goes, by wrapping (in that process
only) the module forward, backward, the link's recv/send/flush, the norm exchange and the
optimiser, plus the CPU time of each of its threads (main, tx, rx). The breakdown is printed
under the table (``--no-profile`` runs (b) unwrapped).

Usage::

    .venv/bin/python bench/bench_pipeline.py                 # the default model, ~2-3 minutes
    .venv/bin/python bench/bench_pipeline.py --quick         # tiny model, 2 timed steps, < 30 s
    .venv/bin/python bench/bench_pipeline.py --steps 8 --warmup 2 \\
        --model d_model=384,n_layers=12,n_heads=6 --only a,b

Exits 0 when every row ran (whether or not the targets are met), 1 when a row failed.
Only ever uses 127.0.0.1.
"""

from __future__ import annotations

import os

# Before torch is imported anywhere: here, and in every spawned child (they inherit the env).
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import multiprocessing as mp  # noqa: E402
import queue  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

HOST = "127.0.0.1"
NUM_STAGES = 2
TARGET_VS_A = 1.70
TARGET_VS_C = 1.05
DEFAULT_MODEL = dict(d_model=256, n_layers=8, n_heads=8, seq_len=128)
QUICK_MODEL = dict(d_model=64, n_layers=2, n_heads=2, seq_len=32)
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


# --- configuration (plain dicts: they cross the spawn boundary) ---------------------------------


def _configs(cfg: dict[str, Any], schedule: str = "gpipe") -> tuple[Any, Any]:
    from swarm_core.config.schemas import ModelConfig, TrainingConfig

    mc = ModelConfig(**cfg["model"])
    tc = TrainingConfig(steps=cfg["warmup"] + cfg["steps"], batch_size=cfg["batch"],
                        micro_batches=cfg["micro_batches"], schedule=schedule,
                        eval_batches=0, eval_every=0, threads=1, seed=cfg["seed"],
                        warmup_steps=cfg["warmup"] + cfg["steps"], frame_timeout_s=300.0)
    return mc, tc


def _init_torch() -> Any:
    """First thing in every worker: one thread, before any torch work."""
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    return torch


# --- per-thread CPU time from /proc -------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process, keyed by the Python thread name's prefix
    (``MainThread``, ``tx``, ``rx``) or ``native`` for threads Python did not start."""
    names = {}
    for th in threading.enumerate():
        if th.native_id is not None:
            names[th.native_id] = th.name.split("-", 1)[0]
    out: dict[str, float] = defaultdict(float)
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[names.get(int(tid), "native")] += (int(fields[11]) + int(fields[12])) / _TICK
    return dict(out)


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}


# --- (b) instrumentation: exclusive wall time per bucket on the stage's compute thread ----------


class _Profiler:
    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []
        self._owner = threading.get_ident()

    def wrap(self, owner: Any, attr: str, name: str | Callable[[tuple], str]) -> None:
        orig = getattr(owner, attr)
        prof = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != prof._owner:
                return orig(*args, **kwargs)
            prof._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                inner = prof._stack.pop()
                key = name if isinstance(name, str) else name(args)
                prof.acc[key] += elapsed - inner
                if prof._stack:
                    prof._stack[-1] += elapsed

        setattr(owner, attr, wrapper)

    def install(self) -> None:
        import torch

        import swarm_core.pipeline.stage as stage_mod
        from swarm_core.data import TokenData
        from swarm_core.pipeline.frames import Kind
        from swarm_core.pipeline.model import StageModule
        from swarm_core.pipeline.transport import PeerLink

        self.wrap(StageModule, "forward", "forward")
        self.wrap(stage_mod, "lm_loss", "loss")
        self.wrap(torch.Tensor, "backward", "backward")
        self.wrap(PeerLink, "recv", lambda a: "norm wait" if a[1] == Kind.NORM else "recv wait")
        self.wrap(PeerLink, "recv_tensor", "decode")
        self.wrap(PeerLink, "send_tensor", "send+encode")
        self.wrap(PeerLink, "send_raw", "send+encode")
        self.wrap(PeerLink, "flush", "flush wait")
        self.wrap(stage_mod.StageRunner, "_global_sq", "grad norm")
        self.wrap(stage_mod, "scale_grads", "grad norm")
        self.wrap(torch.optim.Optimizer, "zero_grad", "optimizer")
        self.wrap(TokenData, "batch", "data")
        make = stage_mod.make_optimizer

        def make_wrapped(module: Any, cfg: Any) -> Any:
            opt = make(module, cfg)
            self.wrap(opt, "step", "optimizer")
            return opt

        stage_mod.make_optimizer = make_wrapped


PROFILE_COLUMNS = ["forward", "loss", "backward", "send+encode", "decode", "recv wait",
                   "grad norm", "norm wait", "optimizer", "flush wait", "data", "other"]


# --- workers --------------------------------------------------------------------------------


def _worker_single(cfg: dict[str, Any], rank: int, ctx: dict[str, Any]) -> dict[str, Any]:
    """(a): train_reference's loop, with a timestamp after every step."""
    torch = _init_torch()
    from swarm_core.data import load_token_data
    from swarm_core.pipeline.model import ExperimentModel, lm_loss
    from swarm_core.pipeline.optim import (
        clip_scale,
        grad_sq_sum,
        lr_at,
        make_optimizer,
        scale_grads,
        set_lr,
    )
    from swarm_core.pipeline.placement import split_layers

    mc, tc = _configs(cfg)
    data = load_token_data(tc, mc.seq_len)
    vocab = mc.vocab_size or data.vocab_size
    model = ExperimentModel(mc, vocab, tc.seed, split_layers(mc.n_layers, [1] * NUM_STAGES))
    opts = [make_optimizer(stage, tc) for stage in model.stages]
    params = [p for stage in model.stages for p in stage.parameters() if p.requires_grad]
    m = tc.micro_batches
    marks, losses = [], []
    cpu0 = time.thread_time()
    for step in range(tc.steps):
        if step == cfg["warmup"]:
            cpu0 = time.thread_time()
        model.train()
        for opt in opts:
            set_lr(opt, lr_at(step, tc))
        x, y = data.batch(step, tc.batch_size, mc.seq_len, tc.seed)
        total = 0.0
        for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
            loss = lm_loss(model(xs), ys) / m
            total += float(loss.detach())
            loss.backward()
        per_stage = [grad_sq_sum(p for p in s.parameters() if p.requires_grad)
                     for s in model.stages]
        acc = 0.0
        for sq in reversed(per_stage):
            acc = sq + acc
        scale_grads(params, clip_scale(acc, tc.grad_clip))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(total)
        marks.append(time.monotonic())
    del torch
    return {"marks": marks, "losses": losses, "main_cpu": time.thread_time() - cpu0}


def _worker_swarm(cfg: dict[str, Any], rank: int, ctx: dict[str, Any]) -> dict[str, Any]:
    """(b): one stage of our pipeline, via run_stage, in a process of its own."""
    _init_torch()
    from swarm_core.data import load_token_data
    from swarm_core.pipeline.links import LinkShaper
    from swarm_core.pipeline.listener import DataListener
    from swarm_core.pipeline.placement import split_layers
    from swarm_core.pipeline.stage import StageSpec, run_stage

    mc, tc = _configs(cfg, ctx["schedule"])
    data = load_token_data(tc, mc.seq_len)
    prof = _Profiler() if cfg["profile"] else None
    if prof is not None:
        prof.install()
    ranges = split_layers(mc.n_layers, [1] * NUM_STAGES)
    listener = DataListener(HOST) if rank > 0 else None
    if listener is not None:
        ctx["side"].put(listener.addr)  # the upstream stage dials this
        downstream = None
    else:
        downstream = ctx["side"].get(timeout=120)
    spec = StageSpec("bench-pipeline", "k" * 32, rank, NUM_STAGES, ranges[rank], downstream,
                     mc, tc)
    warm = cfg["warmup"]
    marks: list[float] = []
    step_s: list[float] = []
    snap: dict[str, Any] = {}

    def on_step(rep: Any) -> None:
        marks.append(time.monotonic())
        step_s.append(rep.seconds)
        if rep.step in (warm, tc.steps):  # threads still alive: the links close after the run
            key = "start" if rep.step == warm else "end"
            snap[key] = (dict(prof.acc) if prof else {}, _thread_cpu())

    try:
        metrics = run_stage(spec, data, LinkShaper(), listener, threading.Event(), on_step,
                            connect_timeout=120)
    finally:
        if listener is not None:
            listener.close()
    out: dict[str, Any] = {"marks": marks, "losses": metrics.get("losses", []),
                           "wire_tx_bytes_per_step": metrics["wire_tx_bytes_per_step"]}
    (acc0, cpu0), (acc1, cpu1) = snap["start"], snap["end"]
    timed_step_s = sum(step_s[warm:])
    out["cpu"] = _diff(cpu1, cpu0)
    out["step_s"] = timed_step_s
    if prof is not None:
        buckets = _diff(acc1, acc0)
        buckets["other"] = timed_step_s - sum(buckets.values())
        out["buckets"] = buckets
    return out


def _worker_torch(cfg: dict[str, Any], rank: int, ctx: dict[str, Any]) -> dict[str, Any]:
    """(c): torch.distributed.pipelining over gloo; stage modules are our StageModules."""
    torch = _init_torch()
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from swarm_core.data import load_token_data
    from swarm_core.pipeline.model import StageModule, lm_loss
    from swarm_core.pipeline.optim import (
        clip_scale,
        grad_sq_sum,
        lr_at,
        make_optimizer,
        scale_grads,
        set_lr,
    )
    from swarm_core.pipeline.placement import split_layers

    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(ctx["port"]), GLOO_SOCKET_IFNAME="lo")
    mc, tc = _configs(cfg, ctx["schedule"])
    data = load_token_data(tc, mc.seq_len)
    vocab = mc.vocab_size or data.vocab_size
    ranges = split_layers(mc.n_layers, [1] * NUM_STAGES)
    dist.init_process_group("gloo", rank=rank, world_size=NUM_STAGES)
    try:
        module = StageModule(mc, vocab, tc.seed, ranges[rank][0], ranges[rank][1], rank,
                             NUM_STAGES)
        params = [p for p in module.parameters() if p.requires_grad]
        m, mb, t, d = tc.micro_batches, tc.batch_size // tc.micro_batches, mc.seq_len, mc.d_model
        if rank == 0:
            example_in, example_out = torch.zeros(mb, t, dtype=torch.long), torch.zeros(mb, t, d)
        else:
            example_in, example_out = torch.zeros(mb, t, d), torch.zeros(mb, t, vocab)
        stage = PipelineStage(module, rank, NUM_STAGES, torch.device("cpu"),
                              input_args=example_in, output_args=example_out)
        cls = ScheduleGPipe if ctx["schedule"] == "gpipe" else Schedule1F1B
        sched = cls(stage, m, loss_fn=lm_loss)  # scale_grads: grads / m, as loss / m in (a)
        opt = make_optimizer(module, tc)
        last = rank == NUM_STAGES - 1
        marks, losses = [], []
        cpu0 = _thread_cpu()
        for step in range(tc.steps):
            if step == cfg["warmup"]:
                cpu0 = _thread_cpu()
            module.train()
            set_lr(opt, lr_at(step, tc))
            x, y = data.batch(step, tc.batch_size, mc.seq_len, tc.seed)
            if rank == 0:
                sched.step(x, return_outputs=False)
            else:
                mb_losses: list[Any] = []
                sched.step(target=y, losses=mb_losses, return_outputs=False)
                losses.append(float(sum(float(v) for v in mb_losses)) / m)
            sq = torch.tensor([grad_sq_sum(params)], dtype=torch.float64)
            dist.all_reduce(sq)
            scale_grads(params, clip_scale(float(sq), tc.grad_clip))
            opt.step()
            opt.zero_grad(set_to_none=True)
            marks.append(time.monotonic())
        cpu = _diff(_thread_cpu(), cpu0)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"marks": marks, "losses": losses if last else [], "cpu": cpu}


def _worker_ceiling(cfg: dict[str, Any], rank: int, ctx: dict[str, Any]) -> dict[str, Any]:
    """(x): this stage's forward+backward of every micro-batch, clip and AdamW, on local inputs:
    no communication, no bubble. Two of these side by side bound any 2-process pipeline."""
    torch = _init_torch()
    from swarm_core.data import load_token_data
    from swarm_core.pipeline.model import StageModule, lm_loss
    from swarm_core.pipeline.optim import (
        clip_scale,
        grad_sq_sum,
        lr_at,
        make_optimizer,
        scale_grads,
        set_lr,
    )
    from swarm_core.pipeline.placement import split_layers

    mc, tc = _configs(cfg)
    data = load_token_data(tc, mc.seq_len)
    vocab = mc.vocab_size or data.vocab_size
    ranges = split_layers(mc.n_layers, [1] * NUM_STAGES)
    module = StageModule(mc, vocab, tc.seed, ranges[rank][0], ranges[rank][1], rank, NUM_STAGES)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = make_optimizer(module, tc)
    m, mb = tc.micro_batches, tc.batch_size // tc.micro_batches
    gen = torch.Generator().manual_seed(rank)
    acts = torch.randn(m, mb, mc.seq_len, mc.d_model, generator=gen)
    grads = torch.randn(m, mb, mc.seq_len, mc.d_model, generator=gen) * 1e-3
    marks = []
    for step in range(tc.steps):
        module.train()
        set_lr(opt, lr_at(step, tc))
        x, y = data.batch(step, tc.batch_size, mc.seq_len, tc.seed)
        for i, (xs, ys) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
            if rank == 0:
                module(xs).backward(grads[i])
            else:
                inp = acts[i].clone().requires_grad_(True)
                (lm_loss(module(inp), ys) / m).backward()
        scale_grads(params, clip_scale(grad_sq_sum(params), tc.grad_clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append(time.monotonic())
    return {"marks": marks}


WORKERS: dict[str, Callable[[dict[str, Any], int, dict[str, Any]], dict[str, Any]]] = {
    "single": _worker_single, "swarm": _worker_swarm, "torch": _worker_torch,
    "ceiling": _worker_ceiling,
}


def _entry(kind: str, cfg: dict[str, Any], rank: int, ctx: dict[str, Any],
           results: Any) -> None:
    try:
        results.put((rank, WORKERS[kind](cfg, rank, ctx)))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


# --- orchestration --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def launch(kind: str, cfg: dict[str, Any], nprocs: int, schedule: str = "gpipe",
           timeout: float = 900.0) -> dict[int, dict[str, Any]]:
    """Run ``nprocs`` spawned workers of ``kind`` side by side; their results by rank."""
    mpc = mp.get_context("spawn")
    results = mpc.Queue()
    ctx = {"schedule": schedule, "side": mpc.Queue(),
           "port": _free_port() if kind == "torch" else 0}
    procs = [mpc.Process(target=_entry, args=(kind, cfg, r, ctx, results), daemon=True,
                         name=f"bench-{kind}-{r}") for r in range(nprocs)]
    for p in procs:
        p.start()
    out: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < nprocs:
            try:
                rank, res = results.get(timeout=0.5)
                out[rank] = res
                if "error" in res:
                    break
            except queue.Empty:
                dead = [p for i, p in enumerate(procs) if i not in out and p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode} "
                                       "without a result") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{kind} run did not finish in {timeout:g}s") from None
    finally:
        for p in procs:
            p.join(timeout=10 if len(out) == nprocs else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    errors = [f"rank {r}:\n{res['error']}" for r, res in sorted(out.items()) if "error" in res]
    if errors:
        raise RuntimeError("\n".join(errors))
    return out

