"""What a stage's own machinery costs, on one thread (not a test): one stage module runs its
micro-batches' forward and backward passes the ways a stage runner can, round after round, and
the table gives each way's time as a ratio to the plain loop *in the same round* (this VM's core
speed drifts by ~10 % between seconds-long runs; a paired ratio cancels most of it).

* ``plain``: forward, backward, autograd's fused weight gradients;
* ``meter``: the same under the activation meter's ``saved_tensors_hooks`` (what a metered step
  pays, see ``METER_EVERY`` in pipeline/stage.py);
* ``split``: split backward, each micro-batch's W pass right after its B;
* ``split-lag``: W passes lagging by ``max(2, stages)`` micro-batches, as at the stage runner's
  cap when no wait comes to fill (the steady state of a balanced 1F1B);
* ``split+meter``: split backward on a metered step.

No links, no optimiser: those are the same whichever way. Usage::

    .venv/bin/python bench/bench_stage.py                       # the bench_pipeline model, ~3 min
    .venv/bin/python bench/bench_stage.py --model d_model=64,seq_len=16 --rounds 200
    .venv/bin/python bench/bench_stage.py --stage 0             # the first stage (embedding)
    .venv/bin/python bench/bench_stage.py --quick               # a smoke run, numbers meaningless
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

DEFAULT_MODEL = dict(d_model=256, n_layers=8, n_heads=8, seq_len=128)
QUICK_MODEL = dict(d_model=32, n_layers=2, n_heads=2, seq_len=16)
VARIANTS = ("plain", "meter", "split", "split-lag", "split+meter")
NUM_STAGES = 2


def _model_arg(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"--model wants key=int pairs, got {part!r}")
        out[key.strip()] = int(value)
    return out


class StageBench:
    def __init__(self, model: dict[str, int], stage: int, micro_batches: int, mb_size: int,
                 vocab: int = 256) -> None:
        import torch

        from swarm_core.config.schemas import ModelConfig
        from swarm_core.contract.placement import split_layers
        from swarm_core.pipeline.memory import ActivationMeter
        from swarm_core.pipeline.model import StageModule

        self.torch = torch
        self.cfg = ModelConfig(**model)
        start, stop = split_layers(self.cfg.n_layers, [1] * NUM_STAGES)[stage]
        self.module = StageModule(self.cfg, vocab, 0, start, stop, stage, NUM_STAGES)
        self.first, self.last = stage == 0, stage == NUM_STAGES - 1
        self.m = micro_batches
        g = torch.Generator().manual_seed(0)
        t, d = self.cfg.seq_len, self.cfg.d_model
        self.inputs = [torch.randint(0, vocab, (mb_size, t), generator=g) if self.first
                       else torch.randn(mb_size, t, d, generator=g) for _ in range(self.m)]
        self.targets = [torch.randint(0, vocab, (mb_size, t), generator=g)
                        for _ in range(self.m)]
        self.out_grads = [torch.randn(mb_size, t, d, generator=g) * 1e-3
                          for _ in range(self.m)]
        self.meter = ActivationMeter(self.module.parameters())

    def run(self, variant: str) -> float:
        """Seconds of thread CPU for all micro-batches' F and B (and W) passes."""
        from swarm_core.pipeline.model import lm_loss
        from swarm_core.pipeline.wgrad import WeightGradQueue, attach

        split = variant.startswith("split")
        metered = variant.endswith("meter")
        queue = WeightGradQueue(self.meter if metered else None) if split else None
        attach(self.module, queue)
        lag = NUM_STAGES if variant == "split-lag" else 0
        for p in self.module.parameters():
            p.grad = None
        t0 = time.thread_time()
        for i in range(self.m):
            x = self.inputs[i] if self.first else self.inputs[i].clone().requires_grad_(True)
            with self.meter.saving() if metered else contextlib.nullcontext():
                out = self.module(x)
                if self.last:
                    out = lm_loss(out, self.targets[i]) / self.m
            with queue.capture() if queue is not None else contextlib.nullcontext():
                out.backward(None if self.last else self.out_grads[i])
            if queue is not None and len(queue) > lag:
                queue.run_batch()
        if queue is not None:
            queue.drain()
        seconds = time.thread_time() - t0
        attach(self.module, None)
        return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=_model_arg, default=None,
                    help="ModelConfig fields, e.g. d_model=64,seq_len=16")
    ap.add_argument("--stage", type=int, choices=range(NUM_STAGES), default=1,
                    help="which stage of the 2-stage split (default 1: blocks, head, loss)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--mb-size", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 rounds (a smoke run)")
    args = ap.parse_args(argv)

    model = dict(QUICK_MODEL if args.quick else DEFAULT_MODEL)
    model.update(args.model or {})
    rounds = 3 if args.quick else args.rounds
    import torch

    from swarm_core.pipeline.heap import keep_large_blocks

    torch.set_num_threads(1)
    keep_large_blocks()  # as a stage runner does
    try:
        bench = StageBench(model, args.stage, args.micro_batches, args.mb_size)
    except (TypeError, ValueError) as exc:
        print(f"bench_stage: {exc}", file=sys.stderr)
        return 2
    for v in VARIANTS:  # warm-up
        bench.run(v)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v in VARIANTS:
            times[v].append(bench.run(v))
    desc = ", ".join(f"{k}={v}" for k, v in model.items())
    print(f"stage {args.stage} of {NUM_STAGES} ({desc}); {args.micro_batches} micro-batches of "
          f"{args.mb_size}; thread CPU; {rounds} rounds")
    print(f"{'variant':14s} {'ms':>9s} {'paired ratio to plain':>22s}  {'quartiles':>13s}")
    for v in VARIANTS:
        ratios = [a / b for a, b in zip(times[v], times["plain"], strict=True)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"{v:14s} {statistics.median(times[v]) * 1e3:9.1f} "
              f"{statistics.median(ratios):21.3f}x  {q[0]:.3f}-{q[2]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
