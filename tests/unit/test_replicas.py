"""Replicas of every stage (data parallel): the grid in threads of one process over real
loopback TCP, against a single process at the same global batch."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
import torch

from swarm_core.config.schemas import ModelConfig, SyncConfig, TrainingConfig
from swarm_core.contract import FellowSlots, plan, split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline.frames import HEADER_SIZE
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.model import StageModule
from swarm_core.pipeline.reference import train_reference
from swarm_core.pipeline.stage import StageResult, expected_wire_bytes
from swarm_core.schema import SchemaError, structure
from tests.replica_support import SurvivorWindows

MODEL = dict(d_model=32, n_layers=3, n_heads=2, seq_len=16)


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


def _run(mc: ModelConfig, tc: TrainingConfig, data, stages: int,
         replicas: int) -> dict[int, StageResult]:
    res = run_local_pipeline(mc, tc, data, stages, replicas=replicas, timeout=120)
    failed = {k: v for k, v in res.items() if not isinstance(v, StageResult)}
    assert not failed, failed
    return res  # type: ignore[return-value]


def _step_losses(res: dict[int, StageResult], stages: int, replicas: int) -> list[float]:
    """The step's loss: the mean of each replica's last stage's (each over its equal share)."""
    per_replica = [res[r * stages + stages - 1].losses for r in range(replicas)]
    return [sum(step) / replicas for step in zip(*per_replica, strict=True)]


@pytest.mark.parametrize("stages, replicas, bucket_mb", [(1, 2, 25.0), (2, 2, 25.0),
                                                        (1, 2, 0.02)])
def test_replicas_train_what_one_process_trains_at_the_same_global_batch(data, stages,
                                                                         replicas, bucket_mb):
    """With compression none, an fp32 wire and the same seed, S x R computes the losses of
    one process over the same global batch (each replica its own share of the step's
    windows), to 1e-5 over 20 steps; and the first replica's validation loss is the single
    process's model's. Also with the gradients in many small buckets, each all-reduced while
    the backward goes on."""
    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 20, "batch_size": 8, "micro_batches": 2, "eval_batches": 1,
                    "lr": 3e-3, "sync": {"bucket_mb": bucket_mb}}, TrainingConfig)
    ref, model = train_reference(mc, tc, data, split_layers(mc.n_layers, [1] * stages))
    res = _run(mc, tc, data, stages, replicas)
    got = _step_losses(res, stages, replicas)
    assert len(got) == 20 and ref[-1] < ref[0]
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    # Each bucket its own ring: what crosses is what the buckets' rings must send.
    assert all(r.metrics.sync_tx_bytes_per_step == r.metrics.expected_sync_tx_bytes_per_step
               for r in res.values())
    # Only the first replica's chain evaluates (the others hold the same weights).
    assert res[stages - 1].metrics.eval_loss is not None
    assert all(res[r * stages + stages - 1].metrics.eval_loss is None
               for r in range(1, replicas))
    with torch.no_grad():
        x, y = data.eval_batches(1, tc.batch_size // tc.micro_batches, mc.seq_len)[0]
        logits = model(x)
        expected = float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    assert res[stages - 1].metrics.eval_loss == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("model", [{"compression": "hadamard_int4_b16"}, {"dropout": 0.2}])
def test_chain_replicas_draw_as_one_process_over_the_whole_batch(data, model):
    """What draws random numbers per micro-batch (a stochastic rounding of the backward's
    boundary, dropout's masks) keys them by the micro-batch's place in the step's whole
    batch: replica r's i-th of M is r x M + i, so replicas draw apart, and 2 x 2 computes
    the losses of one process that runs the whole batch as R x M micro-batches (keyed by
    the replica's own i, both replicas drew alike and matched no such process)."""
    mc = ModelConfig(**MODEL, **model)
    tc = structure({"steps": 6, "batch_size": 8, "micro_batches": 2, "eval_batches": 0,
                    "lr": 3e-3}, TrainingConfig)
    whole = attrs.evolve(tc, micro_batches=4)  # (the same rows, in R x M pieces)
    ref, _ = train_reference(mc, whole, data, split_layers(mc.n_layers, [1, 1]))
    res = _run(mc, tc, data, 2, 2)
    got = _step_losses(res, 2, 2)
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5, (ref, got)


def _stage_params(mc: ModelConfig, stage: int, stages: int, vocab: int) -> int:
    a, b = split_layers(mc.n_layers, [1] * stages)[stage]
    return sum(p.numel() for p in StageModule(mc, vocab, 0, a, b, stage, stages).parameters())


@pytest.mark.parametrize("compression, bytes_per_elem, tol", [
    ("none", 4, 1e-5), ("fp16", 2, 5e-3), ("int8", 1, 5e-2), ("int8_b64", 1 + 4 / 64, 5e-2)])
def test_each_replica_sends_what_a_ring_all_reduce_must(data, compression, bytes_per_elem,
                                                        tol):
    """A ring all-reduce moves 2(R-1)/R of the gradients from each member a step: with 3
    replicas, 4/3 of every parameter's bytes in the group's codec (int8 adds a scale a chunk),
    in 2(R-1) frames. The pipeline's own bytes are what one replica's share sends. A lossy
    codec trains close to, not exactly as, one process. (int8 with a block: a scale every
    64 elements, the chunks whole blocks, the buffer padded to them.)"""
    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 4, "batch_size": 12, "micro_batches": 2, "eval_batches": 0,
                    "sync": {"compression": compression}}, TrainingConfig)
    res = _run(mc, tc, data, 2, 3)
    frames = 2 * (3 - 1)
    scales = frames * 4 if compression == "int8" else 0  # one fp32 scale a chunk
    block = 64 if compression == "int8_b64" else 1
    confirm = (3 - 1) * (HEADER_SIZE + 4)  # each member's "finished", passed round the ring
    for stage in range(2):
        n = _stage_params(mc, stage, 2, data.vocab_size)
        for r in range(3):
            m = res[r * 2 + stage].metrics
            assert m.sync_tx_bytes_per_step == m.expected_sync_tx_bytes_per_step
            assert m.sync_fraction is not None and 0 < m.sync_fraction < 1  # (its share)
            elems = (m.sync_tx_bytes_per_step - frames * HEADER_SIZE - scales - confirm) \
                / bytes_per_elem
            # 2(R-1) chunks of n/R elements, the chunks a element (block) apart where R does
            # not divide
            assert elems.is_integer() and frames * (n // 3 - block) <= elems \
                <= frames * (-(-n // 3) + block)
            assert m.wire_tx_bytes_per_step == expected_wire_bytes(mc, tc, stage, 2, 3)
    ref, _ = train_reference(mc, tc, data, split_layers(mc.n_layers, [1, 1]))
    got = _step_losses(res, 2, 3)
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= tol


def test_gradients_go_in_buckets_from_the_last_layer_back():
    from swarm_core.pipeline.syncs.dp import buckets_of

    mib = 1 << 20
    # 1 MiB first (as DDP), then up to the cap; from the last parameter back; none split.
    sizes = [mib // 4] * 6 + [mib // 8]  # 1 MiB each but the last, 0.5 MiB
    assert buckets_of(sizes, 2 * mib) == [[6], [5, 4], [3, 2], [1, 0]]
    assert buckets_of(sizes, 100 * mib) == [[6], [5, 4, 3, 2, 1, 0]]
    assert buckets_of([10 * mib], 2 * mib) == [[0]]  # (one parameter larger than a bucket)


def test_the_placement_is_a_grid_each_replica_a_chain():
    fellows = [FellowSlots(i, f"f{i}", ["cpu", "cpu"], None, [f"h:{i}0", f"h:{i}1"])
               for i in range(2)]
    p = plan(fellows, 2, 4, slots_per_fellow=2, replicas=2)
    # Each fellow's two slots hold one replica's whole chain: its pipeline links stay local.
    assert [(s.stage, s.replica, s.fellow_id, s.slot, s.layers.as_tuple()) for s in p.stages] \
        == [(0, 0, 0, 0, (0, 2)), (1, 0, 0, 1, (2, 4)), (0, 1, 1, 0, (0, 2)),
            (1, 1, 1, 1, (2, 4))]
    assert [c.fellow_id for c in p.group(1)] == [0, 1]
    assert p.downstream(0, 1).data_addr == "h:11" and p.label(1, 1) == "1.1"


def test_a_batch_the_replicas_cannot_share_is_refused_by_name():
    from swarm_core.config.schemas import job_shape_error
    from swarm_core.contract import JobSubmit

    job = structure({"model": MODEL, "training": {"batch_size": 8, "micro_batches": 4},
                     "topology": {"stages": 1, "replicas": 4}}, JobSubmit)
    assert job_shape_error(job.model, job.train, 1, 4) == (
        "batch_size 8 is not divisible by 4 replicas x 4 micro_batches", "training.batch_size")
    with pytest.raises(SchemaError, match=r"^\$\.training\.sync\.compression: unknown sync"):
        structure({"sync": {"compression": "int4"}}, TrainingConfig, "$.training")


def _diloco_reference(mc: ModelConfig, tc: TrainingConfig, data, stages: int,
                      replicas: int, leaves: dict[int, int | list[int]] | None = None,
                      joins: dict[int, tuple[int, int]] | None = None, overlap: int = 0,
                      holds: frozenset[int] = frozenset(), average: bool = False,
                      inner: Any = None) -> list[float]:
    """DiLoCo in one process, written from the paper (arXiv 2311.08105) in plain torch: R
    copies of the model from the same seed, each with its own AdamW (matrices decay) on its
    share of every step's windows, clipped by its own global norm; every H steps (and at the
    end) the mean of (weights at the last sync - weights now) goes to an outer SGD with
    Nesterov momentum on the weights at the last sync, which every copy then takes.
    ``leaves[r]``: the step from which replica r is gone (its change since the last sync
    too); the outer steps average those left, and a step's loss is theirs. A list gives that
    step by stage (a stage group that had finished the broken outer step kept the replica's
    change in it; the replica trained until the last of them). ``joins[r] =
    (step, donor)``: replica r is back from that step (after an outer step), a copy of the
    donor's weights and inner optimiser state (overlapped: a step after the result of an
    outer step was taken, so ``step`` need not follow one).

    ``overlap`` d (Streaming DiLoCo's overlap, arXiv 2501.18512): an outer step's mean
    change, taken after step s, is applied after step s + d (or the last step): the anchor
    takes the outer step, and each copy becomes the new anchor plus what it trained since s.
    The outer steps after the steps in ``holds`` (0-based), and the last, apply at once.
    ``average``: no outer optimiser at all, each copy takes the mean of the copies' weights
    (what outer lr 1 without momentum must come to). ``inner(model)``: each copy's inner
    optimiser, where not AdamW.

    ``sync.fragments`` P (Streaming DiLoCo's, arXiv 2501.18512): each stage's parameters in P
    contiguous fragments of about equal elements (a parameter in the fragment its middle
    element falls in); fragment f takes its outer step (its own mean change, momentum and
    anchor) after the 1-based steps n with n mod H = floor((f+1) H / P) mod H; after a step
    in ``holds`` and the last, every fragment does."""
    import copy

    leaves, joins = leaves or {}, joins or {}
    import math

    from swarm_core.pipeline.model import lm_loss
    from swarm_core.pipeline.whole import ExperimentModel

    sync = tc.sync
    ranges = split_layers(mc.n_layers, [1] * stages)
    models = [ExperimentModel(mc, data.vocab_size, tc.seed, ranges) for _ in range(replicas)]
    params = [[p for p in m.parameters()] for m in models]
    opts = [torch.optim.AdamW(
        [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": tc.weight_decay},
         {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
        lr=tc.lr, betas=tuple(tc.betas), eps=1e-8) if inner is None else inner(model)
        for ps, model in zip(params, models, strict=True)]
    anchor = [torch.nn.Parameter(p.detach().clone()) for p in params[0]]
    stage_of = [s for s, st in enumerate(models[0].stages) for _ in st.parameters()]
    assert len(stage_of) == len(anchor)
    from tests.unit.sync_support import fragment_of, fragments_after

    fragments = sync.fragments
    frag_of = fragment_of(list(models[0].stages), fragments, sync.fragment_pattern)
    by_stage = {r: v if isinstance(v, list) else [v] * stages for r, v in leaves.items()}
    gone = {r: max(v) for r, v in by_stage.items()}  # (it trains until the last stage's)
    outer_lr, outer_momentum = sync.outer_step  # (the fields, or DiLoCo's 0.7 and 0.9)
    outer = torch.optim.SGD(anchor, lr=outer_lr, momentum=outer_momentum,
                            nesterov=outer_momentum > 0)

    def lr(step: int) -> float:  # linear warm-up, then cosine to min_lr
        if step < tc.warmup_steps:
            return tc.lr * (step + 1) / tc.warmup_steps
        progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
        return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * progress))

    pending: tuple[int, list[torch.Tensor], dict[int, list[torch.Tensor]]] | None = None
    share, m, losses = tc.batch_size // replicas, tc.micro_batches, []
    for step in range(tc.steps):
        x, y = data.batch(step, tc.batch_size, mc.seq_len, tc.seed)
        total = 0.0
        for r, (at, donor) in joins.items():
            if at == step:
                models[r].load_state_dict(models[donor].state_dict())
                opts[r].load_state_dict(copy.deepcopy(opts[donor].state_dict()))
        here = [r for r in range(replicas) if gone.get(r, tc.steps + 1) > step
                or (r in joins and joins[r][0] <= step)]
        for r, (model, opt) in enumerate(zip(models, opts, strict=True)):
            if r not in here:
                continue
            for g in opt.param_groups:
                g["lr"] = lr(step)
            xs, ys = x[r * share:(r + 1) * share], y[r * share:(r + 1) * share]
            for xm, ym in zip(xs.chunk(m), ys.chunk(m), strict=True):
                loss = lm_loss(model(xm), ym) / m
                total += float(loss.detach()) / len(here)
                loss.backward()
            norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params[r]))
            if norm + 1e-6 > tc.grad_clip:
                for p in params[r]:
                    p.grad.mul_(tc.grad_clip / (norm + 1e-6))
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(total)
        last = step + 1 == tc.steps
        if pending is not None and (step >= pending[0] + overlap or last):
            with torch.no_grad():
                _s0, mean, then = pending
                for a, g in zip(anchor, mean, strict=True):
                    a.grad = g
                outer.step()
                for r in here:
                    for p, a, p0, g in zip(params[r], anchor, then[r], mean, strict=True):
                        if g is not None:
                            p.copy_(a + (p - p0))
            pending = None
        taking = fragments_after(tc, step, step in holds)
        if taking:
            every = last or step in holds
            with torch.no_grad():
                mean: list[torch.Tensor | None] = []
                for i, a in enumerate(anchor):
                    mine = [r for r in here if r not in by_stage or (r in joins and joins[
                        r][0] <= step) or by_stage[r][stage_of[i]] > step]
                    mean.append(sum(a - params[r][i] for r in mine) / len(mine)
                                if frag_of[i] in taking else None)
                if overlap and not every:
                    pending = (step, mean,
                               {r: [p.detach().clone() for p in params[r]] for r in here})
                    continue
                if average:
                    assert not leaves and not joins and not overlap and fragments == 1
                    for i, a in enumerate(anchor):
                        a.copy_(sum(ps[i] for ps in params) / replicas)
                else:
                    for a, g in zip(anchor, mean, strict=True):
                        a.grad = g
                    outer.step()
                for ps in params:
                    for p, a, g in zip(ps, anchor, mean, strict=True):
                        if g is not None or average:
                            p.copy_(a)
    return losses


def _trains_the_reference(res: dict[int, StageResult], ref: list[float],
                          stages: int) -> list[float]:
    """Two replicas' step losses are the reference's (to 1e-5), and every cell sent what its
    ring must: returns the losses."""
    got = _step_losses(res, stages, 2)
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    for cell in range(2 * stages):
        m = res[cell].metrics
        assert m.sync_tx_bytes_per_step == m.expected_sync_tx_bytes_per_step > 0
    return got


@pytest.mark.parametrize("stages", [1, 2])
def test_diloco_trains_what_a_single_process_simulation_of_its_replicas_trains(data, stages):
    """Two replicas, 3 inner steps, over 3 outer steps: the losses of the one-process
    simulation (to 1e-5), and the group syncs once every H steps, a ring's bytes each time."""
    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 9, "batch_size": 8, "micro_batches": 2, "eval_batches": 0,
                    "lr": 3e-3, "warmup_steps": 2,
                    "sync": {"mode": "diloco", "inner_steps": 3}}, TrainingConfig)
    ref = _diloco_reference(mc, tc, data, stages, 2)
    res = _run(mc, tc, data, stages, 2)
    _trains_the_reference(res, ref, stages)
    dp = attrs.evolve(tc, sync=attrs.evolve(tc.sync, mode="dp"))
    every_step = _run(mc, dp, data, stages, 2)
    # Three syncs in nine steps: a third of data parallel's traffic; and DiLoCo is not data
    # parallel under another name (the reference tells them apart).
    assert res[0].metrics.sync_tx_bytes_per_step == pytest.approx(
        every_step[0].metrics.sync_tx_bytes_per_step / 3)
    dp_losses = _step_losses(every_step, stages, 2)
    assert max(abs(a - b) for a, b in zip(ref, dp_losses, strict=True)) > 1e-3


def test_diloco_with_outer_lr_1_and_no_momentum_averages_the_replicas_weights(data):
    """outer_lr 1, outer_momentum 0: the outer step is plain SGD (no Nesterov without a
    momentum), so every H steps each replica takes the mean of the replicas' weights (local
    SGD / FedAvg): the losses of a simulation that averages the copies' weights and nothing
    else (no optimiser), to 1e-5."""
    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 6, "batch_size": 8, "micro_batches": 2, "eval_batches": 0,
                    "lr": 3e-3, "warmup_steps": 2,
                    "sync": {"mode": "diloco", "inner_steps": 3, "outer_lr": 1.0,
                             "outer_momentum": 0.0}}, TrainingConfig)
    _trains_the_reference(_run(mc, tc, data, 1, 2),
                          _diloco_reference(mc, tc, data, 1, 2, average=True), 1)


@pytest.mark.parametrize("stages", [1, 2])
def test_overlapped_diloco_trains_what_a_simulation_of_the_delayed_outer_step_trains(data,
                                                                                    stages):
    """overlap_steps 2, H = 4, 10 steps: the outer step after step 4 crosses while steps 5-6
    train and applies after step 6, each replica keeping what it trained meanwhile; the one
    after step 8 lands at the last step, whose own outer step then blocks. The losses of the
    one-process simulation (to 1e-5), a ring's bytes per outer step as without overlap, and
    not the losses of DiLoCo that waits for its average."""
    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 10, "batch_size": 8, "micro_batches": 2, "eval_batches": 0,
                    "lr": 3e-3, "warmup_steps": 2,
                    "sync": {"mode": "diloco", "inner_steps": 4, "overlap_steps": 2}},
                   TrainingConfig)
    ref = _diloco_reference(mc, tc, data, stages, 2, overlap=2)
    got = _trains_the_reference(_run(mc, tc, data, stages, 2), ref, stages)
    waiting = _diloco_reference(mc, tc, data, stages, 2)
    assert max(abs(a - b) for a, b in zip(waiting, got, strict=True)) > 1e-4


@pytest.mark.parametrize("stages, overlap, inner, pattern", [
    (1, 0, 4, "strided"), (2, 0, 4, "strided"), (2, 1, 4, "strided"), (1, 1, 5, "strided"),
    (1, 0, 4, "sequential")])
def test_fragmented_diloco_trains_what_a_simulation_of_its_fragments_trains(
        data, stages, overlap, inner, pattern):
    """Streaming DiLoCo's fragments: H = 4 in 2 fragments, 10 steps. Fragment 0 takes its
    outer step after steps 2 and 6, fragment 1 after 4 and 8, both after the last (10),
    each overlapped by ``overlap`` steps but the last (H = 5: after 2 and 7, and 5). Strided,
    a stage of three blocks has blocks 0 and 2 in fragment 0 (a stage of one: sequential).
    The losses of the one-process simulation (to 1e-5), each cell sending exactly what its
    fragments' rings must, and not whole-model DiLoCo's losses."""
    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 10, "batch_size": 8, "micro_batches": 2, "eval_batches": 0,
                    "lr": 3e-3, "warmup_steps": 2,
                    "sync": {"mode": "diloco", "inner_steps": inner, "fragments": 2,
                             "overlap_steps": overlap, "fragment_pattern": pattern}},
                   TrainingConfig)
    ref = _diloco_reference(mc, tc, data, stages, 2, overlap=overlap)
    got = _trains_the_reference(_run(mc, tc, data, stages, 2), ref, stages)
    whole = attrs.evolve(tc, sync=attrs.evolve(tc.sync, fragments=1))
    other = _diloco_reference(mc, whole, data, stages, 2, overlap=overlap)
    assert max(abs(a - b) for a, b in zip(other, got, strict=True)) > 1e-4


def test_fragments_take_turns_as_torchfts_streaming_diloco_orders_them():
    """Fragment f after the steps n with n mod H = floor((f+1) H / P) mod H: evenly apart
    where P divides H, else as near as whole steps allow; the checkpoints and the joins'
    next sync follow the turns."""
    def sync(h: int, p: int) -> SyncConfig:
        return SyncConfig(mode="diloco", inner_steps=h, fragments=p)

    assert sync(8, 4).turns == (2, 4, 6, 0) and sync(10, 4).turns == (2, 5, 7, 0)
    s = sync(10, 4)
    assert [n for n in range(1, 21) if s.syncs_after(n, 100)] == [2, 5, 7, 10, 12, 15, 17, 20]
    assert [s.fragment_after(n) for n in (2, 5, 7, 10, 12)] == [0, 1, 2, 3, 0]
    assert (s.period, s.next_sync(1), s.next_sync(4), s.last_sync_before(12)) == (3, 4, 6, 10)
    tc = TrainingConfig(steps=100, shard_push_interval_steps=6, sync=s)
    assert [n for n in range(1, 30) if tc.checkpoint_after(n, True)] == [7, 12, 20, 25]


def test_strided_fragments_take_every_pth_block_and_the_edges_with_their_neighbours():
    """Strided (the paper's): block k in fragment k mod P, the embedding with the first
    block and the head with the last; a stage of fewer blocks than fragments falls back to
    contiguous runs of about equal size."""
    from swarm_core.pipeline.syncs.diloco import fragment_bounds

    mc = ModelConfig(d_model=32, n_layers=4, n_heads=2, seq_len=16)
    named = list(StageModule(mc, 256, 0, 0, 4, 0, 1).named_parameters())
    names, sizes = [n for n, _ in named], [p.numel() for _, p in named]
    parts = fragment_bounds(sizes, 2, names)
    where = {names[i].split(".")[0] + (f".{names[i].split('.')[1]}" if names[i].startswith(
        "blocks") else ""): f for f, part in enumerate(parts) for i in part}
    assert where == {"embed": 0, "blocks.0": 0, "blocks.1": 1, "blocks.2": 0, "blocks.3": 1,
                     "head": 1}
    assert fragment_bounds(sizes, 2, names, "sequential") == fragment_bounds(sizes, 2)
    few = fragment_bounds(sizes, 8, names)  # (4 blocks, 8 fragments: sequential)
    assert few == fragment_bounds(sizes, 8) and sum(map(len, few)) == len(sizes)


def test_each_fragment_sends_its_share_of_the_model():
    """4 fragments: each sync sends one fragment's ring, at most a third of the whole
    model's (the issue's bound for the largest burst), and the four together what the whole
    model's ring sends, but for each ring's own frame headers and confirmation; a step that
    holds one set of weights sends every fragment's."""
    from swarm_core.pipeline.syncs import make_sync

    mc = ModelConfig(**MODEL)
    module = StageModule(mc, 256, 0, 0, mc.n_layers, 0, 1)
    params = [p for p in module.parameters() if p.requires_grad]

    def sync_of(fragments: int):  # (two members; no links: only the plan is asked)
        tc = structure({"steps": 100, "sync": {"mode": "diloco", "inner_steps": 8,
                                               "fragments": fragments}}, TrainingConfig)
        return make_sync(tc, params, None, None, 0, 2, torch.device("cpu"))

    whole, parts = sync_of(1), sync_of(4)
    full = whole.planned_bytes(7, False, False)
    bursts = [parts.planned_bytes(s, False, False) for s in (1, 3, 5, 7)]
    assert [parts.planned_bytes(s, False, False) for s in (0, 2, 4, 6)] == [0] * 4
    assert max(bursts) <= full / 3
    headers = 3 * 2 * 64 + 3 * (64 + 4)  # (three more rings' frames and confirmations)
    assert sum(bursts) - full == headers
    assert parts.planned_bytes(7, False, True) == sum(bursts) - 3 * (64 + 4)
    assert all(len(r) for r in parts.fragments)


def test_an_overlap_as_long_as_the_outer_period_is_refused_by_name():
    with pytest.raises(SchemaError, match=r"^\$\.training\.sync\.overlap_steps: must be below "
                                          r"inner_steps \(3\)"):
        structure({"sync": {"mode": "diloco", "inner_steps": 3, "overlap_steps": 3}},
                  TrainingConfig, "$.training")
    dp = structure({"sync": {"mode": "dp", "inner_steps": 3, "overlap_steps": 3}},
                   TrainingConfig)  # (dp syncs every step: it has nothing to overlap)
    assert dp.sync.overlap_steps == 3


@pytest.mark.parametrize("sync, message", [
    ({"mode": "diloco", "inner_steps": 3, "fragments": 4},
     r"fragments: must be at most inner_steps \(3\)"),
    ({"mode": "dp", "fragments": 2}, r"fragments: must be 1 under dp, which syncs every step"),
    ({"mode": "demo", "fragments": 2}, r"fragments: must be 1 under demo"),
    ({"mode": "diloco", "inner_steps": 10, "fragments": 4, "overlap_steps": 2},
     r"overlap_steps: must be below inner_steps // fragments \(2\)"),
    ({"mode": "diloco", "fragments": 0}, r"fragments: must be > 0"),
    ({"mode": "diloco", "fragments": 65}, r"fragments: must be <= 64"),
])
def test_fragments_that_cannot_take_turns_are_refused_by_name(sync, message):
    with pytest.raises(SchemaError, match=r"^\$\.training\.sync\." + message):
        structure({"sync": sync}, TrainingConfig, "$.training")


class _Crash:
    """Each cell's step losses as reported, and one cell that dies after a step."""

    def __init__(self, cell: int, step: int) -> None:
        self.cell, self.step = cell, step
        self.losses: dict[int, dict[int, float]] = {}

    def __call__(self, cell: int, rep) -> None:
        if rep.loss is not None:
            self.losses.setdefault(rep.step - 1, {})[cell] = rep.loss
        if cell == self.cell and rep.step == self.step:
            raise RuntimeError(f"cell {cell} dies after step {self.step}")

    def step_losses(self) -> list[float]:
        """Each step's loss: the mean over the replicas that trained it."""
        return [sum(v.values()) / len(v) for _k, v in sorted(self.losses.items())]


@pytest.mark.parametrize("stages, lost, transport", [(1, 0, "shaped"), (2, 2, "shaped"),
                                                     (1, 0, "torch"), (2, 2, "torch")])
def test_a_replica_that_dies_leaves_and_the_others_train_on_the_smaller_batch(data, stages,
                                                                              lost, transport):
    """Data parallel, three replicas; one cell dies after step 4. Its replica leaves (with
    two stages, the whole chain: its other stage finds its link closed), the others regroup
    at step 5 and train on to the end without stopping, each on its own share: the losses of
    one process that trains on the full batch for 4 steps, then on the survivors' windows
    (to 1e-5). The change is recorded; when replica 0 left, the next member evaluates. The
    same over the torch transport (gloo links, the group's mean a gloo all_reduce on a fresh
    group after the regroup), well within the collective timeout (the dead member's group is
    let go at once)."""
    import time

    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 10, "batch_size": 12, "micro_batches": 2, "eval_batches": 1,
                    "lr": 3e-3, "frame_timeout_s": 20, "transport": transport}, TrainingConfig)
    import threading

    from swarm_core.pipeline.local import LocalCoordinator
    from swarm_core.pipeline.stage import StageDropped
    stop = threading.Event()
    coord = LocalCoordinator(stages, 3, stop)
    dead = lost * stages  # the first stage of replica ``lost``
    crash = _Crash(dead, 4)
    t0 = time.monotonic()
    res = run_local_pipeline(mc, tc, data, stages, replicas=3, timeout=120, stop=stop,
                             coordinator=coord, on_step=crash)
    assert time.monotonic() - t0 < tc.frame_timeout_s
    assert isinstance(res[dead], RuntimeError)
    for s in range(1, stages):  # (the rest of its chain left)
        assert isinstance(res[lost * stages + s], Exception)
    survivors = [r for r in range(3) if r != lost]
    for r in survivors:
        for s in range(stages):
            assert isinstance(res[r * stages + s], StageResult), res[r * stages + s]
    assert [(c.step, c.members, c.left) for c in coord.changes] == [(5, survivors, [lost])]
    ref, _ = train_reference(mc, tc, SurvivorWindows(data, 3, {lost}, 4),
                                 split_layers(mc.n_layers, [1] * stages))
    got = crash.step_losses()
    assert len(got) == 10
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    lead = res[survivors[0] * stages + stages - 1].metrics
    assert lead.eval_loss is not None
    assert not isinstance(res[dead], StageDropped)


@pytest.mark.parametrize("overlap", [0, 1])
def test_diloco_goes_on_without_a_replica_that_dies_between_outer_steps(data, overlap):
    """DiLoCo, three replicas, H = 3: replica 1 dies after inner step 4. The next outer step
    (after step 6) breaks on the survivors' ring; they regroup and average their own
    changes only, then train on: the one-process simulation in which replica 1 is gone from
    step 4 (its change since the last outer step too), to 1e-5. Overlapped by a step, the
    break shows when the survivors take that outer step's result (after step 7): they do it
    again over the new ring and keep what they trained meanwhile."""
    import threading

    from swarm_core.pipeline.local import LocalCoordinator

    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 9, "batch_size": 12, "micro_batches": 2, "eval_batches": 0,
                    "lr": 3e-3, "warmup_steps": 2, "frame_timeout_s": 20,
                    "sync": {"mode": "diloco", "inner_steps": 3, "overlap_steps": overlap}},
                   TrainingConfig)
    stop = threading.Event()
    coord = LocalCoordinator(1, 3, stop)
    crash = _Crash(1, 4)
    res = run_local_pipeline(mc, tc, data, 1, replicas=3, timeout=120, stop=stop,
                             coordinator=coord, on_step=crash)
    assert isinstance(res[1], RuntimeError)
    assert all(isinstance(res[r], StageResult) for r in (0, 2))
    assert [(c.step, c.members, c.left) for c in coord.changes] == [(6, [0, 2], [1])]
    ref = _diloco_reference(mc, tc, data, 1, 3, leaves={1: 4}, overlap=overlap)
    got = crash.step_losses()
    assert len(got) == 9
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5


@pytest.mark.parametrize("overlap", [0, 1])
def test_fragmented_diloco_goes_on_without_a_replica_that_dies_between_fragments(data,
                                                                                 overlap):
    """H = 4 in 2 fragments, three replicas; replica 1 dies after step 3, between fragment
    0's outer step (after step 2) and fragment 1's (after 4), which breaks on the survivors'
    ring: they regroup and average their own changes only, then train on. The one-process
    simulation in which replica 1 is gone from step 3, to 1e-5."""
    import threading

    from swarm_core.pipeline.local import LocalCoordinator

    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 8, "batch_size": 12, "micro_batches": 2, "eval_batches": 0,
                    "lr": 3e-3, "warmup_steps": 2, "frame_timeout_s": 20,
                    "sync": {"mode": "diloco", "inner_steps": 4, "fragments": 2,
                             "overlap_steps": overlap}}, TrainingConfig)
    stop = threading.Event()
    coord = LocalCoordinator(1, 3, stop)
    crash = _Crash(1, 3)
    res = run_local_pipeline(mc, tc, data, 1, replicas=3, timeout=120, stop=stop,
                             coordinator=coord, on_step=crash)
    assert isinstance(res[1], RuntimeError)
    assert all(isinstance(res[r], StageResult) for r in (0, 2))
    assert [(c.step, c.members, c.left) for c in coord.changes] == [(4, [0, 2], [1])]
    ref = _diloco_reference(mc, tc, data, 1, 3, leaves={1: 3}, overlap=overlap)
    got = crash.step_losses()
    assert len(got) == 8
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5


def test_a_fragmented_diloco_run_resumed_from_its_checkpoint_trains_on_exactly(data):
    """H = 4 in 2 fragments, a checkpoint asked for every 3 steps: taken after steps 4 and 6
    (the first fragment syncs at or past each multiple), where every fragment takes its
    outer step, so the replicas hold one set of weights. A run resumed at step 6, each
    replica its own optimiser state, computes steps 7-10 of the simulation of the
    uninterrupted run, to 1e-5."""
    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 10, "batch_size": 8, "micro_batches": 2, "eval_batches": 0,
                    "lr": 3e-3, "warmup_steps": 2, "shard_push_interval_steps": 3,
                    "sync": {"mode": "diloco", "inner_steps": 4, "fragments": 2}},
                   TrainingConfig)
    ref = _diloco_reference(mc, tc, data, 1, 2, holds=frozenset({3, 5}))
    ckpt = _Checkpoints(2)
    res = run_local_pipeline(mc, tc, data, 1, replicas=2, timeout=120,
                             stage_kwargs=ckpt.kwargs(2))
    _trains_the_reference(res, ref, 1)
    assert sorted(ckpt.saved[0]) == [4, 6, 10]
    w0, w1 = ckpt.saved[0][6][0], ckpt.saved[1][6][0]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    kwargs = {c: {"start_step": 6, "initial_state": w0,
                  "initial_optimizer": ckpt.saved[c][6][1]} for c in (0, 1)}
    again = run_local_pipeline(mc, tc, data, 1, replicas=2, timeout=120, stage_kwargs=kwargs)
    assert all(isinstance(r, StageResult) for r in again.values()), again
    got = _step_losses(again, 1, 2)
    assert len(got) == 4
    assert max(abs(a - b) for a, b in zip(ref[6:], got, strict=True)) <= 1e-5


class _Checkpoints:
    """on_checkpoint hooks by cell, keeping what each cell handed over by step: the weights,
    its optimiser arrays (AdamW's and the outer momentum), and who it said it was."""

    def __init__(self, cells: int) -> None:
        self.saved: dict[int, dict[int, Any]] = {c: {} for c in range(cells)}

    def kwargs(self, cells: int) -> dict[int, dict[str, Any]]:
        def hook(c: int):  # type: ignore[no-untyped-def]
            def on_checkpoint(ck) -> None:  # type: ignore[no-untyped-def]
                self.saved[c][ck.step] = (
                    {k: v.detach().clone() for k, v in ck.module.state_dict().items()},
                    ck.optimizer_arrays(), ck.leads, ck.replica_states)
            return on_checkpoint
        return {c: {"on_checkpoint": hook(c)} for c in range(cells)}


@pytest.mark.parametrize("stages, overlap", [(1, 0), (2, 0), (2, 1)])
def test_a_diloco_run_resumed_from_its_checkpoint_trains_on_exactly(data, stages, overlap):
    """DiLoCo, two replicas, H = 3, a checkpoint asked for every 4 steps: it is taken at the
    next outer step (6, where the replicas hold one set of weights), every replica hands over
    its own AdamW state and the outer momentum. A second run resumed from it at step 6 (the
    first member's weights, each replica its own optimiser state) computes steps 7-9 of the
    one-process simulation of the uninterrupted run, to 1e-5; resumed the old way (every
    replica from the first member's moments, no outer momentum) it does not. With the outer
    steps overlapped, the one before the checkpoint blocks, so the checkpoint still holds
    one set of weights."""
    from swarm_core.pipeline.optim import OUTER_FIELD

    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 9, "batch_size": 8, "micro_batches": 2, "eval_batches": 0,
                    "lr": 3e-3, "warmup_steps": 2, "shard_push_interval_steps": 4,
                    "sync": {"mode": "diloco", "inner_steps": 3, "overlap_steps": overlap}},
                   TrainingConfig)
    cells = 2 * stages
    ref = _diloco_reference(mc, tc, data, stages, 2, overlap=overlap, holds=frozenset({5}))
    ckpt = _Checkpoints(cells)
    res = run_local_pipeline(mc, tc, data, stages, replicas=2, timeout=120,
                             stage_kwargs=ckpt.kwargs(cells))
    assert all(isinstance(r, StageResult) for r in res.values()), res
    for c in range(cells):
        lead = c < stages  # (replica 0's cells)
        assert sorted(ckpt.saved[c]) == ([6, 9] if lead else [6])
        _w, opt, leads, others = ckpt.saved[c][6]
        assert (leads, others) == ((True, (1,)) if lead else (False, (0,)))
        assert any(k.endswith(f".{OUTER_FIELD}") for k in opt)
    # The replicas' weights agree at the outer step; their inner moments do not.
    for s in range(stages):
        w0, o0 = ckpt.saved[s][6][:2]
        w1, o1 = ckpt.saved[stages + s][6][:2]
        assert all(torch.equal(w0[k], w1[k]) for k in w0)
        assert any(not np.array_equal(o0[k], o1[k]) for k in o0 if "exp_avg" in k)

    def resumed(own_state: bool) -> list[float]:
        kwargs = {}
        for c in range(cells):
            s = c % stages
            weights = ckpt.saved[s][6][0]
            opt = ckpt.saved[c if own_state else s][6][1]
            if not own_state:
                opt = {k: v for k, v in opt.items() if not k.endswith(f".{OUTER_FIELD}")}
            kwargs[c] = {"start_step": 6, "initial_state": weights, "initial_optimizer": opt}
        again = run_local_pipeline(mc, tc, data, stages, replicas=2, timeout=120,
                                   stage_kwargs=kwargs)
        assert all(isinstance(r, StageResult) for r in again.values()), again
        return _step_losses(again, stages, 2)

    got = resumed(own_state=True)
    assert len(got) == 3
    assert max(abs(a - b) for a, b in zip(ref[6:], got, strict=True)) <= 1e-5
    old_way = resumed(own_state=False)
    assert max(abs(a - b) for a, b in zip(ref[6:], old_way, strict=True)) > 1e-4


def test_the_regroup_rule_commits_what_a_survivor_committed_and_redoes_the_rest():
    """A member that committed the operation of step 5 proves every member finished it: one
    still waiting for the confirmation commits it too, and the next operation (step 7, which
    the first was in) is done again by both. A member that committed what another had not
    finished cannot be: the rule refuses it. A chain with a silent cell is out."""
    from swarm_core.contract import RegroupConflict, RegroupReport, regroup_orders

    def rep(r: int, op: int, synced: int, finished: bool = False) -> RegroupReport:
        return RegroupReport(fellow_id=r, stage=0, replica=r, op_step=op, synced_step=synced,
                             finished=finished)

    members, orders = regroup_orders({(0, 0): rep(0, 7, 5), (0, 1): rep(1, 5, 3, True)},
                                     1, broken={2}, epoch=1)
    assert members == [0, 1]
    assert (orders[(0, 0)].commit, orders[(0, 1)].commit) == (False, True)
    with pytest.raises(RegroupConflict, match="replica 1 had not finished"):
        regroup_orders({(0, 0): rep(0, 7, 5), (0, 1): rep(1, 5, 3, False)}, 1, {2}, 1)
    # Two stages: replica 1's second stage never reported, so its first stage is dropped.
    members, orders = regroup_orders({(0, 0): rep(0, 5, 3), (1, 0): rep(0, 5, 3),
                                      (0, 1): rep(1, 5, 3)}, 2, broken=set(), epoch=2)
    assert members == [0] and orders[(0, 1)].drop and not orders[(0, 0)].drop
