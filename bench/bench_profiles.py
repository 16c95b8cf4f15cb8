"""What a training step of each shipped model profile costs on one CPU core (not a test): one
table, one row per ``exp/configs/model/*.json``, each trained as one process with one thread
(the reference loop over a two-stage split, so a compressed profile's boundary runs as it does
between two fellows) on the quickstart training profile's batch and micro-batches.

The model profiles promise that ``small_*`` trains a step in well under a second on one core
(target: at most 0.5 s) and that ``xlarge_*`` still runs here (target: it takes its steps and
its loss is finite). The ratio column is each profile's step time over ``small_none``'s.

Usage::

    .venv/bin/python bench/bench_profiles.py                 # 2 warm-up + 5 timed steps, ~2 min
    .venv/bin/python bench/bench_profiles.py --steps 10
    .venv/bin/python bench/bench_profiles.py --quick         # 1 + 1 steps, batch 4 (smoke run)

Exits 0 when every profile ran (whether or not the targets are met), 1 when one failed.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

SMALL_TARGET_S = 0.5
TRAINING = REPO / "exp" / "configs" / "training" / "quickstart_shakespeare.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per profile")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--training", type=Path, default=TRAINING, help="training profile")
    ap.add_argument("--quick", action="store_true", help="1+1 steps at batch 4: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 1, 1

    import attrs
    import torch

    from swarm_core.config.profiles import ConfigError, load_model_profile, load_training_profile
    from swarm_core.contract.placement import split_layers
    from swarm_core.data import load_token_data
    from swarm_core.pipeline.reference import train_reference

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    try:
        training = load_training_profile(args.training).training
    except ConfigError as exc:
        print(f"bench_profiles: {exc}", file=sys.stderr)
        return 2
    training = attrs.evolve(training, threads=1, eval_every=0, real_min_tokens=0,
                            warmup_steps=0, steps=args.warmup + args.steps)
    if args.quick:
        training = attrs.evolve(training, batch_size=4, micro_batches=2)

    rows, failed, base = [], False, None
    paths = sorted((REPO / "exp" / "configs" / "model").glob("*.json"),
                   key=lambda p: (not p.stem.startswith("small_none"), p.stem))
    data_by_len: dict[int, object] = {}
    for path in paths:
        try:
            mc = load_model_profile(path)
            data = data_by_len.get(mc.seq_len) or load_token_data(training, mc.seq_len)
            data_by_len[mc.seq_len] = data
            marks: list[float] = [time.perf_counter()]
            losses, model = train_reference(
                mc, training, data, split_layers(mc.n_layers, [1, 1]),
                on_step=lambda _s, _l, marks=marks: marks.append(time.perf_counter()))
        except Exception as exc:  # a row that fails is reported, the others still run
            print(f"bench_profiles: {path.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            rows.append([path.stem, "-", "-", "-", "-", "-", "FAILED"])
            failed = True
            continue
        times = [b - a for a, b in itertools.pairwise(marks)][args.warmup:]
        step_s = statistics.median(times)
        params = sum(p.numel() for p in model.parameters())
        tokens = training.batch_size * mc.seq_len
        base = base or step_s
        if path.stem.startswith("small"):
            verdict = f"<= {SMALL_TARGET_S} s: " + ("met" if step_s <= SMALL_TARGET_S
                                                     else "NOT met")
        elif path.stem.startswith("xlarge"):
            verdict = "runs: " + ("met" if all(map(math.isfinite, losses)) else "NOT met "
                                  "(a loss is not finite)")
        else:
            verdict = "-"
        rows.append([path.stem, f"{params / 1e6:.2f}M", f"{mc.compression}",
                     f"{step_s * 1000:.0f}", f"{tokens / step_s:,.0f}",
                     f"{step_s / base:.2f}x", verdict])

    print(f"bench_profiles: one process, one thread; batch {training.batch_size} "
          f"({training.micro_batches} micro-batches) from {args.training.name}; "
          f"median of {args.steps} timed step(s) after {args.warmup} warm-up")
    head = ["profile", "params", "compression", "ms/step", "tokens/s", "vs small_none",
            "target"]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
