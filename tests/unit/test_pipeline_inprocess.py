"""The stage runner with real TCP between stages in threads of one process.

The cross-process version (fellow processes placed by a leader) is in test_training_e2e.py;
this one covers schedules, specs and failure modes quickly.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import attrs
import pytest
import torch

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract.placement import split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline.frames import HEADER_SIZE
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.reference import train_reference
from swarm_core.pipeline.stage import StageResult, StageSpec, StageStopped, expected_wire_bytes
from swarm_core.pipeline.transport import LinkAborted, LinkClosed, PeerTimeout
from swarm_core.schema import unstructure

MODEL = dict(d_model=32, n_layers=3, n_heads=2, seq_len=16)


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


def run_pipeline(mc: ModelConfig, tc: TrainingConfig, data, n: int,
                 stop: threading.Event | None = None,
                 sabotage: dict[int, Any] | None = None,
                 stage_kwargs: dict[int, dict[str, Any]] | None = None) -> dict[int, Any]:
    try:
        return run_local_pipeline(mc, tc, data, n, stop=stop, prepare=sabotage,
                                  stage_kwargs=stage_kwargs)
    except TimeoutError:
        raise AssertionError("a stage hung") from None


@pytest.mark.parametrize("n, schedule", [(2, "gpipe"), (2, "1f1b"), (3, "gpipe"), (3, "1f1b"),
                                         (3, "eager")])
def test_pipeline_equals_single_process(data, n, schedule):
    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=6, batch_size=8, micro_batches=4, schedule=schedule,
                        eval_batches=1)
    ref, _ = train_reference(mc, tc, data, split_layers(mc.n_layers, [1] * n))
    res = run_pipeline(mc, tc, data, n)
    got = res[n - 1].losses
    assert len(got) == 6
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    assert ref[-1] < ref[0], "the loss falls"


@pytest.mark.parametrize("n, schedule", [(2, "1f1b"), (3, "gpipe")])
def test_pipeline_with_dropout_equals_single_process(data, n, schedule):
    """Dropout masks depend on (seed, stage, step, micro-batch) alone: stages in threads that
    share torch's generators still draw what the single process draws, and a second run draws
    the same again."""
    mc = ModelConfig(**MODEL, dropout=0.2)
    tc = TrainingConfig(steps=5, batch_size=8, micro_batches=4, schedule=schedule,
                        eval_batches=1)
    ranges = split_layers(mc.n_layers, [1] * n)
    ref, _ = train_reference(mc, tc, data, ranges)
    got = run_pipeline(mc, tc, data, n)[n - 1].losses
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    assert run_pipeline(mc, tc, data, n)[n - 1].losses == got, "repeatable"
    plain, _ = train_reference(attrs.evolve(mc, dropout=0.0), tc, data, ranges)
    assert max(abs(a - b) for a, b in zip(plain, got, strict=True)) > 1e-3, "dropout was on"


def test_tied_weights_train_one_shared_matrix_in_a_one_stage_job(data):
    mc = ModelConfig(**MODEL, tie_weights=True)
    tc = TrainingConfig(steps=4, batch_size=8, micro_batches=2, eval_batches=1,
                        shard_push_interval_steps=4)
    ref, model = train_reference(mc, tc, data)
    assert model.stages[0].tied
    hooks, saved = _checkpoint_bytes(1)
    got = run_pipeline(mc, tc, data, 1, stage_kwargs=hooks)[0].losses
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    untied, _ = train_reference(attrs.evolve(mc, tie_weights=False), tc, data)
    assert max(abs(a - b) for a, b in zip(untied, got, strict=True)) > 1e-4, "tying was on"
    from swarm_core.artifacts.shards import npz_arrays

    weights = npz_arrays(saved[0][4][0])
    assert (weights["head.lm_head.weight"] == weights["embed.tok.weight"]).all()
    # One parameter, one set of AdamW moments, under its first name.
    state = npz_arrays(saved[0][4][1])
    assert "embed.tok.weight.exp_avg" in state and "head.lm_head.weight.exp_avg" not in state


def test_activation_memory_is_what_the_schedule_keeps_alive(data):
    """Each stage reports the peak bytes it held for backward: GPipe keeps all m micro-batches'
    activations, 1F1B at most (stages from here to the end), and the meter lets go of every
    byte once backward is done."""
    import torch

    from swarm_core.pipeline.memory import ActivationMeter
    from swarm_core.pipeline.model import StageModule

    mc = ModelConfig(**MODEL)
    one = StageModule(mc, data.vocab_size, 0, 0, 2, 0, 2)  # stage 0 of the 2-stage split
    meter = ActivationMeter(one.parameters())
    x = torch.randint(0, data.vocab_size, (2, MODEL["seq_len"]))  # one micro-batch
    with meter.saving():
        out = one(x)
    held = meter.hold(out)
    per_mb = meter.peak
    out.sum().backward()
    del out, held
    assert meter.live == 0, "all released after backward"

    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        tc = TrainingConfig(steps=2, batch_size=16, micro_batches=8, schedule=schedule,
                            split_backward=False, eval_batches=0)
        res = run_pipeline(mc, tc, data, 2)
        peaks[schedule] = [res[s].metrics.activation_peak_bytes for s in (0, 1)]
    assert 7.5 * per_mb <= peaks["gpipe"][0] <= 8.5 * per_mb
    assert 1.5 * per_mb <= peaks["1f1b"][0] <= 2.5 * per_mb
    assert peaks["1f1b"][1] * 6 < peaks["gpipe"][1]  # the last stage: 1 against 8


def test_each_stage_reports_the_time_it_waited_on_a_slow_link(data):
    """Stage 0 sends its activations at 2 Mbit/s to a stage that computes in milliseconds:
    stage 1 spends nearly all of each step waiting for them (all but its compute, which
    overlaps the next frame's transfer), and stage 0 waits for its sends to drain; the steady
    steps' waits make the run's share."""
    from swarm_core.pipeline.links import LinkShaper

    mc = ModelConfig(d_model=64, n_layers=2, n_heads=2, seq_len=64)
    tc = TrainingConfig(steps=3, batch_size=16, micro_batches=4, schedule="1f1b",
                        eval_batches=0)
    shapers = [LinkShaper(), LinkShaper()]
    shapers[0].tx.set_mbps(2.0)
    reports: dict[int, list[Any]] = {0: [], 1: []}
    res = run_local_pipeline(mc, tc, data, 2, shapers=shapers,
                             on_step=lambda s, r: reports[s].append(r))
    frame = HEADER_SIZE + 4 * 64 * 64 * 4  # one micro-batch's activation, fp32
    # The bucket's 64 KiB burst is free, and it refills while the gradients come back.
    transfer = (tc.micro_batches * frame - 65536) * 8 / 2e6  # about 0.8 s
    for r in reports[1][1:]:
        assert 0.75 * transfer <= r.wait_seconds <= r.seconds, (r.wait_seconds, transfer)
        assert r.wait_fraction > 0.7
    assert all(r.wait_fraction > 0.5 for r in reports[0][1:])
    for s in (0, 1):  # the run's share leaves out the first step (neighbours starting)
        steady = reports[s][1:]
        share = sum(r.wait_seconds for r in steady) / sum(r.seconds for r in steady)
        assert res[s].metrics.wait_fraction == pytest.approx(share)


def test_the_meter_keeps_autograds_in_place_check():
    """Autograd skips its own check that a saved tensor was not changed in place when saves go
    through hooks; the meter makes that check itself."""
    import torch

    from swarm_core.pipeline.memory import ActivationMeter

    x = torch.randn(4, requires_grad=True)
    meter = ActivationMeter()
    with meter.saving():
        y = x * 2
        z = y.sin()  # saves y
    y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()



def test_the_meter_runs_on_the_first_step_and_every_tenth(data, monkeypatch):
    """Metering every saved tensor costs a Python call each, so a runner meters its first step
    and every METER_EVERY-th; the steps between report the latest metered peak."""
    from swarm_core.pipeline import stage as stage_mod
    from swarm_core.pipeline.memory import ActivationMeter

    metered: list[int] = []
    original = ActivationMeter.start_step

    def counting_start(self):  # type: ignore[no-untyped-def]
        metered.append(1)
        return original(self)

    monkeypatch.setattr(ActivationMeter, "start_step", counting_start)
    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=12, batch_size=8, micro_batches=4, schedule="1f1b",
                        eval_batches=0)
    peaks: dict[int, list[int]] = {0: [], 1: []}
    losses = run_local_pipeline(mc, tc, data, 2, on_step=lambda s, r: peaks[s].append(
        r.activation_peak_bytes))[1].losses
    assert stage_mod.METER_EVERY == 10
    assert len(metered) == 2 * 2  # steps 0 and 10, on both stages
    for s in (0, 1):
        assert len(peaks[s]) == 12 and peaks[s][0] > 0
        assert peaks[s][1:10] == [peaks[s][0]] * 9  # repeated until the next metered step
        assert peaks[s][10] > 0 and peaks[s][11] == peaks[s][10]
    ref, _ = train_reference(mc, tc, data, split_layers(mc.n_layers, [1, 1]))
    assert max(abs(a - b) for a, b in zip(ref, losses, strict=True)) <= 1e-5

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_split_backward_trains_exactly_as_a_fused_backward(data, schedule, monkeypatch):
    """The stage runner with deferred weight passes (filling waits, capped, drained before
    clipping) and without them: the same losses, and the W passes really ran deferred."""
    from swarm_core.pipeline import wgrad

    mc = ModelConfig(**MODEL)
    runs = {}
    deferred: list[int] = []
    original = wgrad.WeightGradQueue.capture

    def counting_capture(self):  # type: ignore[no-untyped-def]
        deferred.append(1)
        return original(self)

    monkeypatch.setattr(wgrad.WeightGradQueue, "capture", counting_capture)
    for split in (False, True):
        deferred.clear()
        tc = TrainingConfig(steps=4, batch_size=8, micro_batches=4, schedule=schedule,
                            eval_batches=1, split_backward=split)
        res = run_pipeline(mc, tc, data, 3)
        runs[split] = res[2].losses
        # Only when split, and only backwards a neighbour waits behind (hurried_backwards):
        # every one on stages 1 and 2; on stage 0 those a forward follows, which is B0 alone
        # under 1F1B (F0 F1 F2 B0 F3 B1 B2 B3) and none under GPipe. Four steps.
        per_step = 2 * 4 + (1 if schedule == "1f1b" else 0)
        assert len(deferred) == (per_step * 4 if split else 0)
    assert max(abs(a - b) for a, b in zip(runs[False], runs[True], strict=True)) <= 1e-6


def _checkpoint_bytes(n: int) -> tuple[dict[int, dict[str, Any]], dict[int, dict[int, Any]]]:
    """on_checkpoint hooks for n stages, and where they keep what they wrote, by stage and step:
    the npz bytes a fellow pushes (weights, optimiser state)."""
    from swarm_core.artifacts.shards import npz_bytes, state_arrays

    saved: dict[int, dict[int, Any]] = {s: {} for s in range(n)}

    def hook(s: int):  # type: ignore[no-untyped-def]
        def on_checkpoint(ck):  # type: ignore[no-untyped-def]
            saved[s][ck.step] = (npz_bytes(state_arrays(ck.module)),
                                 npz_bytes(ck.optimizer_arrays()))
        return on_checkpoint

    return {s: {"on_checkpoint": hook(s)} for s in range(n)}, saved


@pytest.mark.parametrize("schedule, dropout, compression", [
    ("1f1b", 0.0, "none"), ("gpipe", 0.0, "none"), ("1f1b", 0.2, "none"),
    # (the backward's stochastic rounding: its draws keyed by step and micro-batch)
    ("1f1b", 0.0, "hadamard_int4_b16")])
def test_a_resumed_run_continues_exactly(data, schedule, dropout, compression):
    """Stages restarted from the step-3 checkpoints (weights and optimiser state, through their
    npz bytes) train steps 4-6 exactly as the uninterrupted run did, dropout masks and
    stochastically rounded gradients included; from the weights alone (fresh AdamW moments)
    they do not. The uninterrupted run is one process's to 1e-5."""
    import torch

    from swarm_core.artifacts.shards import npz_arrays

    mc = ModelConfig(**MODEL, dropout=dropout, compression=compression)
    tc = TrainingConfig(steps=6, batch_size=8, micro_batches=4, schedule=schedule,
                        eval_batches=0, shard_push_interval_steps=3, lr=3e-3)
    hooks, saved = _checkpoint_bytes(3)
    whole = run_pipeline(mc, tc, data, 3, stage_kwargs=hooks)[2].losses
    assert sorted(saved[0]) == [3, 6]
    ref, _ = train_reference(mc, tc, data, split_layers(mc.n_layers, [1, 1, 1]))
    assert max(abs(a - b) for a, b in zip(ref, whole, strict=True)) <= 1e-5

    resumed = {}
    for with_optimizer in (True, False):
        kwargs = {}
        for s in range(3):
            weights, optimizer = saved[s][3]
            kwargs[s] = {"start_step": 3,
                         "initial_state": {k: torch.from_numpy(v)
                                           for k, v in npz_arrays(weights).items()},
                         "initial_optimizer": npz_arrays(optimizer) if with_optimizer else None}
        resumed[with_optimizer] = run_pipeline(mc, tc, data, 3, stage_kwargs=kwargs)[2].losses
    assert len(resumed[True]) == 3
    assert resumed[True] == whole[3:], "bit for bit"
    # Fresh moments: AdamW's first step after the restart is a full-size step again.
    assert max(abs(a - b) for a, b in zip(resumed[False], whole[3:], strict=True)) > 1e-4


def test_a_checkpoint_that_does_not_fit_is_a_resume_error(data):
    import numpy as np

    from swarm_core.pipeline.stage import ResumeError

    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=2, batch_size=4, micro_batches=2, eval_batches=0,
                        frame_timeout_s=5)
    bad = {"blocks.9.attn.qkv.weight.exp_avg": np.zeros(3, np.float32)}
    res = run_pipeline(mc, tc, data, 2,
                       stage_kwargs={0: {"start_step": 1, "initial_optimizer": bad}})
    assert isinstance(res[0], ResumeError)
    assert str(res[0]) == "optimiser state 'blocks.9.attn.qkv.weight.exp_avg' names no " \
        "parameter of this stage"


def test_each_stage_reports_what_its_wire_codec_changed(data):
    """Per step, each stage reports the relative error its codec put on what it sent, for
    micro-batch 0: activations downstream ("act"), gradients upstream ("grad"). At step 0 the
    weights are the initial ones, so stage 0's figure is the int8 round trip of the first
    micro-batch's activation, recomputed here from scratch; an fp32 wire changes nothing."""
    import torch

    from swarm_core.pipeline.codecs import Codec, roundtrip
    from swarm_core.pipeline.model import StageModule

    tc = TrainingConfig(steps=2, batch_size=8, micro_batches=2, eval_batches=0)
    reports: dict[int, list[Any]] = {0: [], 1: [], 2: []}
    mc = ModelConfig(**MODEL, compression="fixed_int8")
    res = run_local_pipeline(mc, tc, data, 3, on_step=lambda s, r: reports[s].append(r))
    assert [sorted(unstructure(reports[s][0].codec_error)) for s in (0, 1, 2)] == [
        ["act"], ["act", "grad"], ["grad"]]
    assert all(0 < e < 0.05 for s in (0, 1, 2) for r in reports[s]
               for e in unstructure(r.codec_error).values())
    x, _ = data.batch(0, tc.batch_size, mc.seq_len, tc.seed)
    with torch.no_grad():
        stage0 = StageModule(mc, data.vocab_size, tc.seed, *split_layers(3, [1] * 3)[0], 0, 3)
        act = stage0(x.chunk(tc.micro_batches)[0])
        expected = float((roundtrip(act, Codec.INT8) - act).norm() / act.norm())
    assert reports[0][0].codec_error.act == pytest.approx(expected, rel=1e-4)
    assert res[1].metrics.codec_error.grad == pytest.approx(
        sum(r.codec_error.grad for r in reports[1]) / 2)

    plain: dict[int, list[Any]] = {0: [], 1: []}
    run_local_pipeline(ModelConfig(**MODEL), tc, data, 2,
                       on_step=lambda s, r: plain[s].append(r))
    assert [unstructure(r.codec_error) for r in plain[0]] == [{"act": 0.0}] * 2
    assert [unstructure(r.codec_error) for r in plain[1]] == [{"grad": 0.0}] * 2


@pytest.mark.parametrize("spec, extra, width, per_elem, scales_per_row", [
    ("none", {}, 32, 4, 0), ("fixed_int8", {}, 32, 1, 1), ("fixed_int8_b8", {}, 32, 1, 4),
    ("learned_dim8", {}, 8, 4, 0), ("learned_dim8_int8", {}, 8, 1, 1),
    ("learned_dim8_int8_b4", {}, 8, 1, 2),
    ("learned_bottleneck", {"bottleneck_dim": 4}, 4, 4, 0),
    # The wire dtype codes what crosses uncompressed (int8 specs take no wire dtype).
    ("none", {"wire_dtype": "fp16"}, 32, 2, 0), ("none", {"wire_dtype": "bf16"}, 32, 2, 0),
    ("learned_dim8", {"wire_dtype": "bf16"}, 8, 2, 0),
    ("fixed_int8", {"wire_dtype": "fp16"}, 32, 1, 1),
])
def test_wire_bytes_match_the_spec(data, spec, extra, width, per_elem, scales_per_row):
    mc = ModelConfig(**MODEL, compression=spec, **extra)
    tc = TrainingConfig(steps=2, batch_size=8, micro_batches=2, eval_batches=0)
    res = run_pipeline(mc, tc, data, 2)
    rows = (8 // 2) * MODEL["seq_len"]
    payload = rows * width * per_elem + rows * scales_per_row * 4
    norm_frame = HEADER_SIZE + 8
    # Each stage sends 2 micro-batches one way and one norm frame per step.
    expected = 2 * (HEADER_SIZE + payload) + norm_frame
    for s in (0, 1):
        assert res[s].metrics.wire_tx_bytes_per_step == expected
        assert res[s].metrics.expected_wire_tx_bytes_per_step == expected
        assert expected_wire_bytes(mc, tc, s, 2) == expected


@pytest.mark.parametrize("spec", ["learned_dim8_int8", "fixed_int8_b8", "hadamard_int4_b16",
                                  "hadamard_int2_b8", "learned_dim16_int4_b8"])
def test_compressed_pipeline_matches_its_own_reference(data, spec):
    # Compression changes the model, not the exactness: the in-process simulation of the same
    # boundary (codec forward and backward, bottleneck halves) gives the same losses.
    mc = ModelConfig(**MODEL, compression=spec)
    tc = TrainingConfig(steps=4, batch_size=8, micro_batches=2, eval_batches=0)
    ref, _ = train_reference(mc, tc, data, split_layers(mc.n_layers, [1, 1]))
    got = run_pipeline(mc, tc, data, 2)[1].losses
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    if spec == "fixed_int8_b8":
        # Blocks are not rows: per-row scales give other losses.
        rows, _ = train_reference(attrs.evolve(mc, compression="fixed_int8"), tc, data,
                                  split_layers(mc.n_layers, [1, 1]))
        assert max(abs(a - b) for a, b in zip(rows, got, strict=True)) > 1e-6


@pytest.mark.parametrize("compression, schedule", [("none", "1f1b"),
                                                   ("learned_dim8_int8", "gpipe")])
def test_bfloat16_pipeline_matches_its_own_reference(data, compression, schedule):
    """dtype bfloat16 is mixed precision on every stage (and in the reference), with the
    boundary in float32 and the wire's codec on top: still the single process's losses."""
    mc = ModelConfig(**MODEL, dtype="bfloat16", compression=compression)
    tc = TrainingConfig(steps=4, batch_size=8, micro_batches=4, schedule=schedule,
                        eval_batches=1)
    ranges = split_layers(mc.n_layers, [1] * 3)
    ref, _ = train_reference(mc, tc, data, ranges)
    res = run_pipeline(mc, tc, data, 3)
    got = res[2].losses
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5
    assert ref[-1] < ref[0], "the loss falls"
    fp32, _ = train_reference(attrs.evolve(mc, dtype="float32"), tc, data, ranges)
    # (3x the exactness bound; GPT-2's small init keeps bf16's early drift small: 8e-5 here)
    assert max(abs(a - b) for a, b in zip(fp32, got, strict=True)) > 3e-5, "bf16 was used"


def test_a_stage_on_a_device_this_machine_lacks_is_refused(data):
    from swarm_core.pipeline.devices import DeviceError

    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=2, batch_size=4, micro_batches=2, eval_batches=0,
                        frame_timeout_s=2.0)

    def elsewhere(spec: StageSpec) -> None:
        spec.device = "cuda:99"

    res = run_pipeline(mc, tc, data, 2, sabotage={1: elsewhere})
    assert isinstance(res[1], DeviceError)
    assert str(res[1]).startswith("cuda:99: ")
    assert not isinstance(res[0], StageResult), "stage 0 did not train on alone"


async def test_a_start_for_a_device_this_fellow_lacks_is_refused(make_start):
    """The fellow's own check, before any link or thread: the job fails naming the slot."""
    from swarm_core.fellow.jobs import JobContext, JobRefused, Progress
    from swarm_core.fellow.train import run_train

    async def report(_update: Any) -> None:
        raise AssertionError("nothing to report")

    start = make_start(MODEL, {"steps": 1}, devices=["cuda:99"])
    with pytest.raises(JobRefused, match=r"^cannot run stage 0 on cuda:99: "):
        await run_train(start, JobContext(fellow_id=0, progress=Progress(), report=report))


async def test_a_model_narrower_than_its_tokenizer_is_refused_by_name(tmp_path, make_start):
    """A BPE vocabulary is known only once trained: the fellow checks the model's vocab_size
    against it before training, rather than fail on an IndexError in the first forward."""
    from swarm_core.fellow.jobs import JobContext, JobRefused, Progress
    from swarm_core.fellow.train import run_train
    from swarm_core.pipeline.links import LinkShaper

    updates: list[Any] = []

    async def report(update: Any) -> None:
        updates.append(update)

    (tmp_path / "c.txt").write_text(" ".join(f"word{i % 50} thing{i % 7}" for i in range(4000)))
    start = make_start({**MODEL, "vocab_size": 260},
                       {"steps": 1, "dataset": "textfiles", "tokenizer": "bpe",
                        "bpe_vocab_size": 300, "dataset_paths": [str(tmp_path / "c.txt")]})
    with pytest.raises(JobRefused, match=r"^model vocab_size 260 is smaller than the bpe "
                                         r"tokenizer's 3\d\d tokens$"):
        await run_train(start, JobContext(fellow_id=0, progress=Progress(), report=report,
                                          shaper=LinkShaper()))
    assert not any(u.state == "RUNNING" for u in updates), "no step was taken"


def _no_downstream_address(payload: dict) -> None:
    payload["placement"]["stages"][1]["data_addr"] = None


@pytest.mark.parametrize("change, message", [
    ({"stage": "x"}, r"bad START payload: \$\.stage: expected an integer, got a string"),
    ({"stage": -1}, r"bad START payload: \$\.stage: stage -1 of a 2-stage placement"),
    (_no_downstream_address,
     r"bad START payload: \$\.placement: stage 1 has no data address to dial: None"),
])
def test_a_start_that_does_not_fit_is_refused(change, message, make_start):
    """The leader's own START for a 2-stage job, spoiled one way each: the fellow refuses it
    by the field, before anything runs."""
    from swarm_core.fellow.daemon import parse_start
    from swarm_core.fellow.jobs import JobRefused

    payload = unstructure(make_start(MODEL, {"steps": 1}, ["127.0.0.1:9", "127.0.0.1:10"]))
    assert parse_start(payload).downstream_addr == "127.0.0.1:10"
    if callable(change):
        change(payload)
    else:
        payload.update(change)
    with pytest.raises(JobRefused, match=f"^{message}$"):
        parse_start(payload)


@pytest.mark.parametrize("ending", ["failed", "stopped"])
async def test_a_stage_that_ends_early_frees_its_model_at_once(ending, monkeypatch, make_start):
    """A failed or STOPped stage's model, optimiser and activations go when the job does, not
    at some later garbage collection (the next job on that GPU wants the memory)."""
    import asyncio
    import gc
    import weakref

    from swarm_core.fellow.jobs import JobContext, Progress
    from swarm_core.fellow.train import run_train
    from swarm_core.pipeline import stage as stage_mod
    from swarm_core.pipeline.links import LinkShaper
    from swarm_core.pipeline.listener import DataListener

    modules: list[weakref.ref] = []
    built = stage_mod.StageRunner.__init__

    def spy(self, *args: Any, **kwargs: Any) -> None:
        built(self, *args, **kwargs)
        modules.append(weakref.ref(self.module))

    monkeypatch.setattr(stage_mod.StageRunner, "__init__", spy)

    async def report(_update: Any) -> None:
        pass

    listener = DataListener()
    # Stage 0 dials a port nobody listens on (fails); stage 1 waits for a dial (stopped).
    start = make_start(MODEL, {"steps": 2, "batch_size": 4, "micro_batches": 2,
                               "frame_timeout_s": 1.0 if ending == "failed" else 30.0},
                       [listener.addr, "127.0.0.1:1"], stage=0 if ending == "failed" else 1)
    ctx = JobContext(fellow_id=0, progress=Progress(), report=report, shaper=LinkShaper(),
                     listener=listener)
    # torch's first optimiser keeps its construction frames in a one-time cache: warm it.
    from swarm_core.pipeline.model import StageModule
    from swarm_core.pipeline.optim import make_optimizer

    make_optimizer(StageModule(ModelConfig(**MODEL), 8, 0, 0, 1, 0, 2), TrainingConfig())
    gc.collect()
    gc.disable()
    try:
        job = asyncio.ensure_future(run_train(start, ctx))
        if ending == "stopped":
            while not modules:
                await asyncio.sleep(0.05)
            job.cancel()
        with pytest.raises(PeerTimeout if ending == "failed" else asyncio.CancelledError):
            await job
        del job
        assert modules and modules[0]() is None, "the model outlived its job"
    finally:
        gc.enable()
        listener.close()


def test_a_frame_of_the_wrong_shape_fails_the_stage(data):
    """The stage names the shape it expects: stage 1 configured for micro-batches of 4
    sequences refuses stage 0's 2-sequence activations instead of training on them."""
    from swarm_core.pipeline.frames import FrameError

    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=1, batch_size=4, micro_batches=2, eval_batches=0,
                        frame_timeout_s=5)

    def other_batch(spec: StageSpec) -> None:
        spec.training = attrs.evolve(spec.training, batch_size=8)

    res = run_pipeline(mc, tc, data, 2, sabotage={1: other_batch})
    assert isinstance(res[1], FrameError)
    assert "has shape [2, 16, 32], expected [4, 16, 32]" in str(res[1])


def test_dead_neighbour_times_out_instead_of_hanging(data):
    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=3, batch_size=4, micro_batches=2, eval_batches=0,
                        frame_timeout_s=1.0)

    def vanish(spec: StageSpec) -> None:
        raise RuntimeError("stage 1 died before connecting")

    res = run_pipeline(mc, tc, data, 2, sabotage={1: vanish})
    assert isinstance(res[1], RuntimeError)
    # Stage 0 either could not complete the step (timeout / closed link) or was told to stop.
    assert isinstance(res[0], PeerTimeout | LinkClosed | LinkAborted | StageStopped)


def test_a_neighbour_busy_past_the_frame_timeout_is_waited_for(data):
    """The last of three stages spends 2.5 s in a checkpoint after step 1, with a 1 s frame
    timeout: it pulses its link, and stage 1, waiting on it, pulses stage 0's, so all three
    train to the end with the same losses as the single process."""
    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=3, batch_size=4, micro_batches=2, eval_batches=0,
                        frame_timeout_s=1.0, shard_push_interval_steps=1)
    slept: list[int] = []

    def slow_checkpoint(ck: Any) -> None:
        if ck.step == 1:
            time.sleep(2.5)
            slept.append(ck.step)

    res = run_pipeline(mc, tc, data, 3, stage_kwargs={2: {"on_checkpoint": slow_checkpoint}})
    assert slept == [1]
    assert all(isinstance(res[s], StageResult) for s in range(3)), res
    ref, _ = train_reference(mc, tc, data, split_layers(mc.n_layers, [1] * 3))
    assert max(abs(a - b) for a, b in zip(ref, res[2].losses, strict=True)) <= 1e-5


def test_a_middle_stage_holds_no_tokens_and_trains_the_same(data):
    """Only the first stage reads inputs and only the last targets: the middle stage of three
    gets the tokenizer with empty splits (no corpus held), training and evaluation included,
    and the losses are still the single process's."""
    from swarm_core.data import load_token_data

    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=3, batch_size=4, micro_batches=2, eval_batches=2)
    middle = load_token_data(tc, mc.seq_len, tokens=False)
    assert len(middle.train) == len(middle.val) == 0 and middle.vocab_size == data.vocab_size
    res = run_pipeline(mc, tc, lambda s: middle if s == 1 else data, 3)
    assert all(isinstance(res[s], StageResult) for s in range(3)), res
    ref, _ = train_reference(mc, tc, data, split_layers(mc.n_layers, [1] * 3))
    assert max(abs(a - b) for a, b in zip(ref, res[2].losses, strict=True)) <= 1e-5
    whole = run_pipeline(mc, tc, data, 3)
    assert res[2].metrics.eval_loss == whole[2].metrics.eval_loss


def test_links_within_one_fellow_leave_its_shaper_out(data):
    """Stages 0 and 1 share a fellow (one shaper, as a two-slot fellow does); stage 2 is
    elsewhere. The 0-1 link never leaves the machine, so it is neither shaped nor counted: the
    fellow's shaper sees stage 1's link to stage 2 alone. Without the placement's word, it
    counts both stages' traffic."""
    from swarm_core.pipeline.links import LinkShaper

    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=3, batch_size=4, micro_batches=2, eval_batches=0)
    per_step = [expected_wire_bytes(mc, tc, s, 3) for s in range(3)]

    def together(spec: StageSpec) -> None:
        spec.local_down = spec.stage == 0
        spec.local_up = spec.stage == 1

    fellow, other = LinkShaper(), LinkShaper()
    res = run_local_pipeline(mc, tc, data, 3, shapers=[fellow, fellow, other],
                             prepare={0: together, 1: together})
    assert all(isinstance(res[s], StageResult) for s in range(3)), res
    # Stage 1's half of its traffic goes down (activations and the norm), plus its HELLO.
    down = tc.steps * per_step[1] // 2
    assert down <= fellow.tx_bytes <= down + 256, (fellow.tx_bytes, down)
    assert down <= fellow.rx_bytes <= down + 256  # gradients and the norm, from stage 2
    both = LinkShaper()
    run_local_pipeline(mc, tc, data, 3, shapers=[both, both, LinkShaper()])
    assert both.tx_bytes >= tc.steps * (per_step[0] + per_step[1])


def test_a_stage_slow_to_load_its_data_is_waited_for(data, monkeypatch):
    """Stage 0 takes 4 s to load its data (a BPE tokenizer trained on a cold cache, say)
    with a 1 s frame timeout, and (here) a stage counted as stuck after 2 s without progress:
    its links were opened first and pulse meanwhile, preparing counting as progress, so stage
    1 neither times out on the dial nor on the quiet link, and both train to the single
    process's losses."""
    from swarm_core.pipeline import stage as stage_mod

    monkeypatch.setattr(stage_mod, "STUCK_AFTER", 2)
    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=2, batch_size=4, micro_batches=2, eval_batches=1,
                        frame_timeout_s=1.0)
    loaded: list[int] = []

    def load(stage: int):
        if stage == 0:
            time.sleep(4.0)
        loaded.append(stage)
        return data

    res = run_pipeline(mc, tc, load, 2)
    assert sorted(loaded) == [0, 1]
    assert all(isinstance(res[s], StageResult) for s in range(2)), res
    ref, _ = train_reference(mc, tc, data, split_layers(mc.n_layers, [1] * 2))
    assert max(abs(a - b) for a, b in zip(ref, res[1].losses, strict=True)) <= 1e-5


def test_a_stage_whose_data_fails_to_load_ends_its_dial_at_once(data):
    """A loader that fails ends the stage with its own error, and the accept it had begun for
    its upstream neighbour ends with it instead of waiting out the 20 s connect timeout (a
    thread left in accept() would take the next job's connection)."""
    from swarm_core.data import DataError
    from swarm_core.pipeline.links import LinkShaper
    from swarm_core.pipeline.listener import DataListener
    from swarm_core.pipeline.stage import run_stage

    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=2, batch_size=4, micro_batches=2, eval_batches=0,
                        frame_timeout_s=20.0)
    spec = StageSpec("job-local", "k" * 32, 1, 2, (2, 3), None, mc, tc)
    listener, stop = DataListener(), threading.Event()

    def load():
        time.sleep(0.3)  # the accept is under way
        raise DataError("no such corpus")

    t0 = time.monotonic()
    try:
        with pytest.raises(DataError, match=r"^no such corpus$"):
            run_stage(spec, load, LinkShaper(), listener, stop, lambda r: None,
                      connect_timeout=20.0)
        assert time.monotonic() - t0 < 5
        assert stop.is_set()
        assert not [t for t in threading.enumerate() if t.name == "stage-links"]
    finally:
        listener.close()


def test_a_neighbour_stuck_without_progress_is_timed_out(data, monkeypatch):
    """A checkpoint that never returns (a hung disk, say) keeps the process alive, but once the
    stage has shown no progress for STUCK_AFTER frame timeouts its links stop pulsing and the
    neighbour fails the job with a timeout instead of waiting for ever."""
    from swarm_core.pipeline import stage as stage_mod

    monkeypatch.setattr(stage_mod, "STUCK_AFTER", 3)
    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=3, batch_size=4, micro_batches=2, eval_batches=0,
                        frame_timeout_s=0.5, shard_push_interval_steps=1)
    stop = threading.Event()  # set by the first failure: only then does the "disk" answer

    def hung_checkpoint(ck: Any) -> None:
        stop.wait(30)

    t0 = time.monotonic()
    res = run_pipeline(mc, tc, data, 2, stop=stop,
                       stage_kwargs={1: {"on_checkpoint": hung_checkpoint}})
    assert isinstance(res[0], PeerTimeout), res
    assert res[0].peer_stage == 1, "the timeout blames the stage at the other end"
    assert time.monotonic() - t0 < 15


def test_stop_event_ends_a_waiting_stage_quickly(data):
    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=1000, batch_size=4, micro_batches=2, eval_batches=0)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    res = run_pipeline(mc, tc, data, 2, stop=stop)
    assert all(not isinstance(r, StageResult) for r in res.values()), "both stages stopped early"


def test_mid_run_evaluations_are_the_models_validation_loss_at_their_step(data):
    """eval_every 2 over 6 steps: evaluations at steps 2 and 4 and at the end, each the
    validation loss of the single process's model after as many steps, and none of them
    changes the training (the losses equal a run without them)."""
    from swarm_core.pipeline.model import lm_loss

    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=6, batch_size=8, micro_batches=2, eval_batches=2, eval_every=2)
    evals: list[tuple[int, float]] = []
    res = run_pipeline(mc, tc, data, 2,
                       stage_kwargs={1: {"on_eval": lambda s, v: evals.append((s, v))}})
    assert [s for s, _ in evals] == [2, 4, 6]
    assert evals[-1][1] == res[1].metrics.eval_loss
    plain = run_pipeline(mc, attrs.evolve(tc, eval_every=0), data, 2)
    assert res[1].losses == plain[1].losses
    ranges = split_layers(mc.n_layers, [1, 1])
    for step, got in evals:
        _, model = train_reference(mc, tc, data, ranges, steps=step)
        model.eval()
        with torch.no_grad():
            batches = data.eval_batches(tc.eval_batches, tc.batch_size // tc.micro_batches,
                                        mc.seq_len)
            want = sum(float(lm_loss(model(x), y)) for x, y in batches) / len(batches)
        assert abs(got - want) <= 1e-5, (step, got, want)


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_a_step_counts_its_own_bytes_and_losses_when_frames_cross_a_latency(data, grad_clip):
    """Over links with an added latency a step's end no longer waits for its last frames to
    cross (``flush(in_flight=True)``): clipping's norm total, or the last gradient without
    clipping, leaves during the next step, or during the evaluation between them. Each step
    still reports its own frames' bytes, as planned, and the losses are the unshaped run's."""
    from swarm_core.pipeline.links import LinkShaper
    from swarm_core.protocol import LinkLimits

    mc = ModelConfig(**MODEL)
    tc = TrainingConfig(steps=3, batch_size=4, micro_batches=2, eval_batches=1, eval_every=1,
                        grad_clip=grad_clip)
    shapers = [LinkShaper() for _ in range(2)]
    for shaper in shapers:
        shaper.apply(LinkLimits(latency_ms=40.0))
    reports: dict[int, list[int]] = {0: [], 1: []}
    res = run_local_pipeline(mc, tc, data, 2, shapers=shapers,
                             on_step=lambda s, r: reports[s].append(r.wire_tx_bytes))
    assert all(isinstance(res[s], StageResult) for s in range(2)), res
    for s in range(2):
        assert reports[s] == [expected_wire_bytes(mc, tc, s, 2)] * tc.steps
    plain = run_local_pipeline(mc, tc, data, 2)
    assert res[1].losses == plain[1].losses  # type: ignore[union-attr]
