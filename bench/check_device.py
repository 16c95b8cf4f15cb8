"""Device check (not a test): the training engine on an accelerator, held against the CPU.

The GPU path of a stage (weights moved to the slot's device, frames encoded from it and decoded
onto it, autocast, checkpoints written from it and resumed onto it) cannot run in CI here, which
has no GPU. This is the one short script to run where a GPU is lent. For each compute dtype it
trains the same small GPT-style model as a 2-stage pipeline in threads of this process (loopback
TCP between the stages, as fellows run it) on the device, and as one process on the CPU, and
prints a table:

* the largest per-step |loss difference| against the CPU reference (float32 on a GPU differs by
  kernel rounding only; bfloat16 by bfloat16 rounding),
* whether the loss falls, tokens/s, and that the weights ended up on the device asked for,
* the same with a learned bottleneck whose int8 code (one scale per 8 elements) crosses the
  boundary (the bottleneck and the block int8 codec, both ways, on the device),
* a resume row: the pipeline restarted on the device from its own step-k checkpoints (weights
  and AdamW state through their npz bytes, as a fellow pushes them) against the uninterrupted run,
* a torch-transport row: the same pipeline with its frames over a two-rank gloo group
  (``training.transport: torch``; gloo carries the encoded bytes from host memory, as the shaped
  link does: NCCL is not wired), against the same CPU reference.

With two GPUs the stages sit on cuda:0 and cuda:1 (activations cross devices through the host,
as between machines). Usage::

    .venv/bin/python bench/check_device.py              # cuda:0 (and cuda:1) when torch sees them
    .venv/bin/python bench/check_device.py --device cpu --quick   # the same checks on the CPU

Exits 0 when every row is within its tolerance, 1 when one is not, 2 when the device is missing.
Only ever uses 127.0.0.1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

from swarm_core.artifacts.shards import npz_arrays, npz_bytes, state_arrays  # noqa: E402
from swarm_core.config.schemas import ModelConfig, TrainingConfig  # noqa: E402
from swarm_core.contract.placement import split_layers  # noqa: E402
from swarm_core.data import load_token_data  # noqa: E402
from swarm_core.pipeline.devices import DeviceError, resolve_device  # noqa: E402
from swarm_core.pipeline.local import run_local_pipeline  # noqa: E402
from swarm_core.pipeline.reference import train_reference  # noqa: E402
from swarm_core.pipeline.stage import StageResult  # noqa: E402

STAGES = 2
# |loss - CPU reference| allowed per step: the CPU itself is exact; a GPU's float32 kernels
# round differently (and TF32 stays off for matmuls by default); bfloat16 rounds at 2^-8.
TOLERANCE = {("cpu", "float32"): 1e-5, ("cpu", "bfloat16"): 1e-5,
             ("cuda", "float32"): 2e-3, ("cuda", "bfloat16"): 5e-2}
# Resumed against uninterrupted, on the same device: the CPU is bit for bit; CUDA's attention
# backward may sum in another order, which in bfloat16 can move a value by a whole ulp.
RESUME_TOLERANCE = {("cpu", "float32"): 0.0, ("cpu", "bfloat16"): 0.0,
                    ("cuda", "float32"): 1e-4, ("cuda", "bfloat16"): 2e-3}
# A second model per dtype crosses its boundary as a learned bottleneck's int8 code, one scale
# per 8 elements: the bottleneck and the block int8 codec (both ways) run on the device too.
COMPRESSED = "learned_dim16_int8_b8"


def check(mc: ModelConfig, tc: TrainingConfig, data: Any, devices: list[str],
          resume: bool = True) -> list[dict]:
    kind = torch.device(devices[0]).type
    name = f"{mc.dtype} {mc.compression}" + (f" ({tc.transport} transport)"
                                             if tc.transport != "shaped" else "")
    ranges = split_layers(mc.n_layers, [1] * STAGES)
    ref, _ = train_reference(mc, tc, data, ranges)
    where: dict[int, str] = {}
    saved: dict[int, dict[int, tuple[bytes, bytes]]] = {s: {} for s in range(STAGES)}

    def hook(s: int) -> Any:
        def on_checkpoint(ck: Any) -> None:
            where[s] = str(next(ck.module.parameters()).device)
            saved[s][ck.step] = (npz_bytes(state_arrays(ck.module)),
                                 npz_bytes(ck.optimizer_arrays()))
        return on_checkpoint

    t0 = time.perf_counter()
    res = run_local_pipeline(mc, tc, data, STAGES, devices=devices, timeout=600,
                             stage_kwargs={s: {"on_checkpoint": hook(s)}
                                           for s in range(STAGES)})
    wall = time.perf_counter() - t0
    failed = {s: r for s, r in res.items() if not isinstance(r, StageResult)}
    rows: list[dict] = []
    if failed:
        s, exc = next(iter(failed.items()))
        return [{"check": f"train {name}", "ok": False,
                 "detail": f"stage {s}: {type(exc).__name__}: {exc}"}]
    got = res[STAGES - 1].losses
    diff = max(abs(a - b) for a, b in zip(ref, got, strict=True))
    tol = TOLERANCE[(kind, mc.dtype)]
    falls = got[-1] < got[0]
    placed = [where.get(s) for s in range(STAGES)] == [str(torch.device(d)) for d in devices]
    tokens = tc.steps * tc.batch_size * mc.seq_len
    rows.append({"check": f"train {name}", "ok": diff <= tol and falls and placed,
                 "detail": f"max |loss - CPU ref| {diff:.2e} (tol {tol:g}); loss "
                           f"{got[0]:.4f} -> {got[-1]:.4f}; {tokens / wall:,.0f} tokens/s; "
                           f"weights on {', '.join(where[s] for s in sorted(where))}"})
    if not resume:
        return rows
    # Resume on the device from the mid-run checkpoints, through their npz bytes.
    k = tc.shard_push_interval_steps
    kwargs = {s: {"start_step": k,
                  "initial_state": {n: torch.from_numpy(a)
                                    for n, a in npz_arrays(saved[s][k][0]).items()},
                  "initial_optimizer": npz_arrays(saved[s][k][1])} for s in range(STAGES)}
    again = run_local_pipeline(mc, tc, data, STAGES, devices=devices, timeout=600,
                               stage_kwargs=kwargs)
    last = again.get(STAGES - 1)
    if not isinstance(last, StageResult):
        rows.append({"check": f"resume {name}", "ok": False,
                     "detail": f"{type(last).__name__}: {last}"})
        return rows
    rdiff = max(abs(a - b) for a, b in zip(got[k:], last.losses, strict=True))
    rtol = RESUME_TOLERANCE[(kind, mc.dtype)]
    rows.append({"check": f"resume {name}", "ok": rdiff <= rtol,
                 "detail": f"from step {k}: max |loss - uninterrupted| {rdiff:.2e} "
                           f"(tol {rtol:g})"})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None,
                    help="cuda:N or cpu (default: cuda:0 when torch sees a GPU, else cpu)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 8; quick 4)")
    ap.add_argument("--quick", action="store_true", help="a tiny model, 4 steps (seconds)")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 2:
        ap.error("--steps: at least 2 (the resume check restarts halfway)")
    name = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        first = resolve_device(name)
    except DeviceError as exc:
        print(f"check_device: {exc}", file=sys.stderr)
        return 2
    devices = [name] * STAGES
    if first.type == "cuda" and args.device is None and torch.cuda.device_count() > 1:
        devices = ["cuda:0", "cuda:1"]
    steps = args.steps or (4 if args.quick else 8)
    mc = ModelConfig(**(dict(d_model=32, n_layers=2, n_heads=2, seq_len=16) if args.quick else
                        dict(d_model=256, n_layers=4, n_heads=4, seq_len=128)))
    tc = TrainingConfig(steps=steps, batch_size=8, micro_batches=4, schedule="1f1b",
                        eval_batches=1, shard_push_interval_steps=steps // 2, lr=3e-3,
                        frame_timeout_s=120)
    data = load_token_data(tc, mc.seq_len)
    label = f"{', '.join(devices)}" + (f" ({torch.cuda.get_device_name(first)})"
                                       if first.type == "cuda" else "")
    print(f"check_device: {STAGES} stages on {label}; d_model={mc.d_model} "
          f"n_layers={mc.n_layers} seq_len={mc.seq_len}, {steps} steps of {tc.batch_size} "
          f"sequences; torch {torch.__version__}")
    rows: list[dict] = []
    for dtype in (d.strip() for d in args.dtypes.split(",") if d.strip()):
        if dtype not in ("float32", "bfloat16"):
            print(f"check_device: --dtypes: {dtype!r} is not float32 or bfloat16",
                  file=sys.stderr)
            return 2
        rows += check(attrs.evolve(mc, dtype=dtype), tc, data, devices)
        rows += check(attrs.evolve(mc, dtype=dtype, compression=COMPRESSED), tc, data, devices,
                      resume=False)
        # The torch transport: the same frames over a two-rank gloo group (from host memory,
        # as the shaped link's: NCCL is not wired), held to the same CPU reference.
        rows += check(attrs.evolve(mc, dtype=dtype), attrs.evolve(tc, transport="torch"), data,
                      devices, resume=False)
    w = max(len(r["check"]) for r in rows)
    print(f"{'check':<{w}}  {'result':<6}  detail")
    for r in rows:
        print(f"{r['check']:<{w}}  {'ok' if r['ok'] else 'FAILED':<6}  {r['detail']}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
