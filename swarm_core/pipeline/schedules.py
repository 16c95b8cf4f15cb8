"""Micro-batch schedules of one stage: the order of its forward (F) and backward (B) ops.

Both keep the backward ops in micro-batch order, so gradients accumulate in the same order as a
single process running micro-batches one after another (the exactness anchor).
"""

from __future__ import annotations

from typing import Literal

Op = tuple[Literal["F", "B"], int]


def gpipe(stage: int, num_stages: int, micro_batches: int) -> list[Op]:
    """All forwards, then all backwards: every micro-batch's activations stay alive."""
    return [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]


def one_f_one_b(stage: int, num_stages: int, micro_batches: int) -> list[Op]:
    """Warm up with (num_stages - stage - 1) forwards, then alternate F and B, then drain:
    at most num_stages - stage micro-batches alive."""
    warm = min(num_stages - stage - 1, micro_batches)
    ops: list[Op] = [("F", i) for i in range(warm)]
    for i in range(micro_batches - warm):
        ops += [("F", warm + i), ("B", i)]
    ops += [("B", i) for i in range(micro_batches - warm, micro_batches)]
    return ops


def eager(stage: int, num_stages: int, micro_batches: int) -> list[Op]:
    """Every stage but the last runs all its forwards first (as GPipe); the last stage runs
    each backward right after its forward (as 1F1B). On slow links this keeps the activation
    link busy from the first micro-batch to the last while gradients start flowing back at
    once: measured 1.15-1.7x faster than 1F1B with two stages over 18-80 Mbit/s
    (bench/bench_links.py). Costs GPipe's activation memory on the early stages."""
    if stage == num_stages - 1:
        return [op for i in range(micro_batches) for op in (("F", i), ("B", i))]
    return gpipe(stage, num_stages, micro_batches)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "eager": eager}


def ops_for(schedule: str, stage: int, num_stages: int, micro_batches: int) -> list[Op]:
    return SCHEDULES[schedule](stage, num_stages, micro_batches)


def hurried_backwards(ops: list[Op], first: bool) -> frozenset[int]:
    """The micro-batches whose backward should leave its weight gradients for later (split
    backward): those after which the stage still sends something a neighbour is waiting for.

    Every stage but the first sends each backward's input gradient upstream, so all of its
    backwards hurry. The first stage sends no gradient, only activations: a backward of its
    hurries only when a forward follows it (1F1B's steady phase, where the next activation
    leaves sooner). Under GPipe or eager all its forwards come first, so it splits nothing, and
    a deferred pass there would only cost its Python call and a second, cache-cold read of the
    layer's input and gradient."""
    if not first:
        return frozenset(i for kind, i in ops if kind == "B")
    hurried: set[int] = set()
    forwards_left = sum(kind == "F" for kind, _ in ops)
    for kind, i in ops:
        if kind == "F":
            forwards_left -= 1
        elif forwards_left:
            hurried.add(i)
    return frozenset(hurried)


def max_in_flight(ops: list[Op]) -> int:
    alive = peak = 0
    for kind, _ in ops:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak
