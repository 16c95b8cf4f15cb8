"""``training.optimizer: muon`` (issue "Replica sync at the field's frontier", point 4): Muon on the
hidden matrices and AdamW on the rest, against a one-process trainer written here in plain torch
(torch.optim.Muon and AdamW side by side), a pipeline of stages and DiLoCo's replicas (MuLoCo)
alike; its state in checkpoints."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
import torch

from swarm_core.config.schemas import ModelConfig, SyncConfig, TrainingConfig
from swarm_core.contract import split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.stage import StageResult
from swarm_core.schema import SchemaError, structure
from tests.unit.test_replicas import MODEL, _Checkpoints, _diloco_reference, _step_losses


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


def _training(**more: Any) -> TrainingConfig:
    return structure({"steps": 6, "batch_size": 8, "micro_batches": 2, "eval_batches": 0,
                      "lr": 3e-3, "warmup_steps": 2, "optimizer": "muon", **more},
                     TrainingConfig)


class _MuonAndAdamW:
    """The papers' split, in plain torch: Muon (Nesterov 0.95, lr matched to AdamW's RMS) on
    every 2-D weight inside the transformer blocks, AdamW on the embeddings, the head and the
    vectors (matrices decayed)."""

    def __init__(self, model: torch.nn.Module, tc: TrainingConfig) -> None:
        named = list(model.named_parameters())
        hidden = [p for n, p in named if p.dim() == 2 and ".blocks." in n]
        rest = [p for n, p in named if not (p.dim() == 2 and ".blocks." in n)]
        self.muon = torch.optim.Muon([{"params": hidden, "weight_decay": tc.weight_decay}],
                                     lr=tc.lr, momentum=0.95, nesterov=True,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(
            [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": tc.weight_decay},
             {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
            lr=tc.lr, betas=tuple(tc.betas), eps=1e-8)
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)


def _reference(mc: ModelConfig, tc: TrainingConfig, data, stages: int) -> list[float]:
    """One process, the whole batch, the schedule and clipping of the pipeline's."""
    from swarm_core.pipeline.model import lm_loss
    from swarm_core.pipeline.whole import ExperimentModel

    model = ExperimentModel(mc, data.vocab_size, tc.seed,
                            split_layers(mc.n_layers, [1] * stages))
    opt = _MuonAndAdamW(model, tc)
    losses = []
    for step in range(tc.steps):
        lr = tc.lr * (step + 1) / tc.warmup_steps if step < tc.warmup_steps else \
            tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(
                math.pi * (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = data.batch(step, tc.batch_size, mc.seq_len, tc.seed)
        total = 0.0
        for xm, ym in zip(x.chunk(tc.micro_batches), y.chunk(tc.micro_batches), strict=True):
            loss = lm_loss(model(xm), ym) / tc.micro_batches
            total += float(loss.detach())
            loss.backward()
        params = list(model.parameters())
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
        if norm + 1e-6 > tc.grad_clip:
            for p in params:
                p.grad.mul_(tc.grad_clip / (norm + 1e-6))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _close(ref: list[float], got: list[float]) -> float:
    assert len(ref) == len(got)
    return max(abs(a - b) for a, b in zip(ref, got, strict=True))


@pytest.mark.parametrize("stages", [1, 2])
def test_a_muon_pipeline_trains_what_one_process_of_muon_and_adamw_trains(data, stages):
    mc = ModelConfig(**MODEL)
    tc = _training()
    res = run_local_pipeline(mc, tc, data, stages, timeout=120)
    assert all(isinstance(r, StageResult) for r in res.values()), res
    got = res[stages - 1].losses
    assert _close(_reference(mc, tc, data, stages), got) <= 1e-5
    adamw = run_local_pipeline(mc, attrs.evolve(tc, optimizer="adamw"), data, stages,
                               timeout=120)
    assert _close(adamw[stages - 1].losses, got) > 1e-3  # (not AdamW under another name)


def test_muloco_trains_what_a_simulation_of_diloco_with_muon_inside_trains(data):
    """DiLoCo, two replicas, H = 3, Muon the inner optimiser (MuLoCo, arXiv 2505.23725): the
    one-process simulation of DiLoCo whose copies each step Muon and AdamW, to 1e-5."""
    mc = ModelConfig(**MODEL)
    tc = _training(steps=9, sync={"mode": "diloco", "inner_steps": 3})
    ref = _diloco_reference(mc, tc, data, 1, 2, inner=lambda m: _MuonAndAdamW(m, tc))
    res = run_local_pipeline(mc, tc, data, 1, replicas=2, timeout=120)
    assert all(isinstance(r, StageResult) for r in res.values()), res
    assert _close(ref, _step_losses(res, 1, 2)) <= 1e-5


def test_muons_momentum_goes_to_the_checkpoint_and_a_resumed_run_trains_on_exactly(data):
    """The hidden matrices' checkpoint state is Muon's momentum buffer, the rest AdamW's; a run
    resumed from step 4 computes steps 5-8 of the uninterrupted one-process trainer."""
    mc = ModelConfig(**MODEL)
    tc = _training(steps=8, shard_push_interval_steps=4)
    ckpt = _Checkpoints(1)
    res = run_local_pipeline(mc, tc, data, 1, timeout=120, stage_kwargs=ckpt.kwargs(1))
    assert isinstance(res[0], StageResult), res
    weights, opt = ckpt.saved[0][4][:2]
    fields = {k.rpartition(".")[0]: set() for k in opt}
    for k in opt:
        fields[k.rpartition(".")[0]].add(k.rpartition(".")[2])
    assert fields["blocks.0.attn.qkv.weight"] == {"momentum_buffer"}
    assert fields["embed.tok.weight"] == {"step", "exp_avg", "exp_avg_sq"}
    assert fields["blocks.0.ln1.weight"] == {"step", "exp_avg", "exp_avg_sq"}
    again = run_local_pipeline(mc, tc, data, 1, timeout=120, stage_kwargs={0: {
        "start_step": 4, "initial_state": weights, "initial_optimizer": opt}})
    assert isinstance(again[0], StageResult), again
    assert _close(_reference(mc, tc, data, 1)[4:], again[0].losses) <= 1e-5


def test_a_muon_state_missing_its_momentum_is_refused_by_name():
    from swarm_core.pipeline.model import StageModule
    from swarm_core.pipeline.optim import (
        OptimizerStateError,
        load_optimizer_arrays,
        make_optimizer,
        optimizer_arrays,
    )

    module = StageModule(ModelConfig(**MODEL), 256, 0, 0, 1, 0, 1)
    opt = make_optimizer(module, _training())
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    arrays = optimizer_arrays(opt, module)
    load_optimizer_arrays(opt, module, arrays)  # (its own state loads back)
    # (AdamW's moments where Muon's momentum belongs)
    arrays["blocks.0.attn.proj.weight.exp_avg"] = \
        arrays.pop("blocks.0.attn.proj.weight.momentum_buffer")
    with pytest.raises(OptimizerStateError,
                       match=r"^optimiser state of blocks\.0\.attn\.proj\.weight is incomplete"):
        load_optimizer_arrays(opt, module, arrays)


def test_muon_under_demo_is_refused_by_name():
    with pytest.raises(SchemaError, match=r"^\$\.training\.optimizer: must be adamw under "
                                          r"sync\.mode demo"):
        structure({"optimizer": "muon", "sync": {"mode": "demo"}}, TrainingConfig, "$.training")
    assert TrainingConfig(optimizer="muon", sync=SyncConfig(mode="diloco")).optimizer == "muon"
