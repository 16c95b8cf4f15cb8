"""DeMo (``sync.mode: demo``, arXiv 2411.19870): its replicas over real loopback TCP in threads of
one process, against a one-process simulation of R replicas written here in plain torch from the
paper's algorithm (bloc97/DeMo's step, Psyche's 1-bit signs); its message's bytes from the
rules."""

from __future__ import annotations

import math
import threading
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from swarm_core.config.schemas import ModelConfig, SyncConfig, TrainingConfig
from swarm_core.contract import split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline.frames import HEADER_SIZE
from swarm_core.pipeline.local import LocalCoordinator, run_local_pipeline
from swarm_core.pipeline.optim import MOMENTUM_FIELD
from swarm_core.pipeline.stage import StageResult
from swarm_core.pipeline.syncs import make_sync
from swarm_core.schema import SchemaError, structure
from tests.unit.sync_support import (
    backward_shares,
    close,
    divisor,
    lr_at,
    present,
    resumed_runs,
)
from tests.unit.test_replicas import MODEL, _Crash, _step_losses


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


def _training(**sync: Any) -> TrainingConfig:
    return structure({"steps": 6, "batch_size": 8, "micro_batches": 2, "eval_batches": 0,
                      "lr": 3e-3, "warmup_steps": 2, "frame_timeout_s": 20,
                      "sync": {"mode": "demo", **sync}}, TrainingConfig)


# --- the reference: DeMo in one process, written from the paper --------------------------------


def _dct(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix: row k is sqrt(2/n) cos(pi (2i+1) k / 2n), row 0 over
    sqrt(2)."""
    k, i = np.arange(n)[:, None], np.arange(n)[None, :]
    d = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * np.sqrt(2.0 / n)
    d[0] /= np.sqrt(2.0)
    return torch.from_numpy(d.astype(np.float32))


class _Blocks:
    """A tensor's chunk x chunk blocks (each side the largest divisor up to the chunk; a
    vector in runs) and their 2-D DCT, the coefficients of a block in a row."""

    def __init__(self, shape: torch.Size, chunk: int) -> None:
        self.shape = shape
        rows, cols = (shape[0], math.prod(shape) // shape[0]) if len(shape) > 1 \
            else (1, math.prod(shape))
        self.rows, self.cols = rows, cols
        self.h = divisor(rows, chunk) if len(shape) > 1 else 1
        self.w = divisor(cols, chunk)
        self.dh, self.dw = _dct(self.h), _dct(self.w)

    def dct(self, x: torch.Tensor) -> torch.Tensor:
        h, w = self.h, self.w
        b = x.reshape(self.rows // h, h, self.cols // w, w).transpose(1, 2).reshape(-1, h, w)
        return (self.dh @ b @ self.dw.T).reshape(b.shape[0], h * w)

    def idct(self, c: torch.Tensor) -> torch.Tensor:
        h, w = self.h, self.w
        b = self.dh.T @ c.reshape(-1, h, w) @ self.dw
        return b.reshape(self.rows // h, self.cols // w, h, w).transpose(1, 2) \
            .reshape(self.shape)


def _demo_reference(mc: ModelConfig, tc: TrainingConfig, data, stages: int, replicas: int,
                    leaves: dict[int, int] | None = None,
                    joins: dict[int, tuple[int, int]] | None = None) -> list[float]:
    """R copies from the same seed, each on its share of every step's windows, its gradients
    clipped by its own norm; then each: m <- decay m + lr g, the DCT of m in blocks, its topk
    largest coefficients per block q (positions ascending), m <- m - IDCT(q); the group's q
    (their signs, with sign_values) averaged at each position over those that sent one; every
    copy takes SGD (no momentum, the matrices decayed) on sign(IDCT(mean)). ``leaves[r]``:
    replica r is gone from that step on; ``joins[r] = (step, donor)``: back from that step,
    the donor's weights, its own momentum zero."""
    from swarm_core.pipeline.whole import ExperimentModel

    s, leaves, joins = tc.sync, leaves or {}, joins or {}
    ranges = split_layers(mc.n_layers, [1] * stages)
    models = [ExperimentModel(mc, data.vocab_size, tc.seed, ranges) for _ in range(replicas)]
    params = [list(m.parameters()) for m in models]
    opts = [torch.optim.SGD(
        [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": tc.weight_decay},
         {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}], lr=tc.lr,
        momentum=0.0) for ps in params]
    blocks = [_Blocks(p.shape, s.dct_chunk) for p in params[0]]
    momenta = [[torch.zeros_like(p) for p in params[0]] for _ in range(replicas)]

    losses: list[float] = []
    for step in range(tc.steps):
        x, y = data.batch(step, tc.batch_size, mc.seq_len, tc.seed)
        for r, (at, donor) in joins.items():
            if at == step:
                models[r].load_state_dict(models[donor].state_dict())
                momenta[r] = [torch.zeros_like(p) for p in params[0]]
        here = present(replicas, step, tc.steps, leaves, joins)
        total = backward_shares(models, here, x, y, tc, replicas)
        losses.append(total)
        with torch.no_grad():
            for i, b in enumerate(blocks):
                k = min(b.h * b.w, s.topk)
                total_q = torch.zeros(b.rows * b.cols // (b.h * b.w), b.h * b.w)
                count = torch.zeros_like(total_q)
                for r in here:
                    acc = momenta[r][i] * s.momentum_decay + params[r][i].grad * lr_at(tc, step)
                    c = b.dct(acc)
                    order = torch.argsort(c.abs(), dim=1, descending=True, stable=True)
                    pos = order[:, :k].sort(dim=1).values  # (of equal ones, the first)
                    vals = c.gather(1, pos)
                    momenta[r][i] = acc - b.idct(torch.zeros_like(c).scatter(1, pos, vals))
                    if s.sign_values:
                        vals = torch.where(torch.signbit(vals), -1.0, 1.0)
                    total_q.scatter_add_(1, pos, vals)
                    count.scatter_add_(1, pos, torch.ones_like(vals))
                direction = torch.sign(b.idct(total_q / count.clamp(min=1)))
                for r in here:
                    params[r][i].grad = direction.clone()
        for r in here:
            for g in opts[r].param_groups:
                g["lr"] = lr_at(tc, step)
            opts[r].step()
            opts[r].zero_grad(set_to_none=True)
    return losses



# --- exactness ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stages, sync", [
    (1, {}),  # (Psyche's: blocks of 64 (here the whole 32-wide matrices), top 8, 1-bit)
    (2, {}),
    (1, {"dct_chunk": 8, "topk": 5, "sign_values": False, "momentum_decay": 0.9}),
])
def test_demo_trains_what_a_one_process_simulation_of_its_replicas_trains(data, stages, sync):
    """Two replicas, six steps: the step losses of the simulation (to 1e-5), every cell
    sending exactly its messages' bytes, and not data parallel's losses."""
    mc = ModelConfig(**MODEL)
    tc = _training(**sync)
    ref = _demo_reference(mc, tc, data, stages, 2)
    res = run_local_pipeline(mc, tc, data, stages, replicas=2, timeout=120)
    assert all(isinstance(r, StageResult) for r in res.values()), res
    got = _step_losses(res, stages, 2)
    assert close(ref, got) <= 1e-5
    for cell in range(2 * stages):
        metrics = res[cell].metrics
        assert metrics.sync_tx_bytes_per_step == metrics.expected_sync_tx_bytes_per_step > 0
    dp = run_local_pipeline(mc, attrs.evolve(tc, sync=SyncConfig()), data, stages, replicas=2,
                            timeout=120)
    assert close(_step_losses(dp, stages, 2), got) > 1e-3


def test_demo_goes_on_without_a_replica_that_dies(data):
    """Three replicas; replica 1 dies after step 3. The exchange of step 4 breaks; the others
    regroup and exchange their own components only: the simulation in which replica 1 is
    gone from step 4 (0-based 3), to 1e-5."""
    mc = ModelConfig(**MODEL)
    tc = attrs.evolve(_training(), batch_size=12)
    stop = threading.Event()
    coord = LocalCoordinator(1, 3, stop)
    crash = _Crash(1, 3)
    res = run_local_pipeline(mc, tc, data, 1, replicas=3, timeout=120, stop=stop,
                             coordinator=coord, on_step=crash)
    assert isinstance(res[1], RuntimeError)
    assert all(isinstance(res[r], StageResult) for r in (0, 2))
    assert [(c.step, c.members, c.left) for c in coord.changes] == [(4, [0, 2], [1])]
    ref = _demo_reference(mc, tc, data, 1, 3, leaves={1: 3})
    assert close(ref, crash.step_losses()) <= 1e-5


def test_a_demo_run_resumed_from_its_checkpoint_trains_on_exactly(data):
    """A checkpoint after step 4 holds each replica's own momentum; a run resumed from it
    computes steps 5-8 of the simulation of the uninterrupted run (to 1e-5); resumed
    without the momenta, it does not."""
    mc = ModelConfig(**MODEL)
    tc = attrs.evolve(_training(), steps=8, shard_push_interval_steps=4)
    ref = _demo_reference(mc, tc, data, 1, 2)
    with_state, without = resumed_runs(mc, tc, data, 4, MOMENTUM_FIELD)
    assert close(ref[4:], with_state) <= 1e-5
    assert close(ref[4:], without) > 1e-4


# --- the message -------------------------------------------------------------------------------

def test_a_message_is_its_positions_and_signs_to_the_byte():
    """Per tensor: topk positions per block (ceil(log2 block size) bits each) and one sign bit
    each; an all-gather's R-1 forwards and the confirmation every step."""
    shapes = [(96, 40), (40,), (7,)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    tc = _training()  # chunk 64, top 8, signs
    # (96, 40): blocks 48 x 40, two of them, 8 kept each, positions in 11 bits (1920 places).
    # (40,): one run of 40, 8 kept, 6 bits. (7,): one run of 7, all 7 kept: no positions
    # cross (each tile's every element, in order).
    def tensor(kept: int, index_bits: int) -> int:
        return math.ceil(kept / 8) + math.ceil(kept * index_bits / 8)

    message = tensor(16, 11) + tensor(8, 6) + tensor(7, 0)
    for replicas in (1, 2, 3):
        sync = make_sync(tc, params, None, None, 0, replicas, torch.device("cpu"))
        confirm = (replicas - 1) * (HEADER_SIZE + 4)
        assert sync.expected_bytes() == (replicas - 1) * (HEADER_SIZE + message) + confirm
    tc32 = _training(sign_values=False)
    sync = make_sync(tc32, params, None, None, 0, 2, torch.device("cpu"))
    message32 = sum(4 * kept + math.ceil(kept * bits / 8)
                    for kept, bits in ((16, 11), (8, 6), (7, 0)))
    assert sync.max_payload == message32


def test_a_dct_block_round_trips_and_keeps_its_energy():
    from swarm_core.pipeline.syncs.demo import Blocks
    from swarm_core.pipeline.syncs.sparse import Tiling

    x = torch.randn(12, 20)
    blocks = Blocks(Tiling.blocks((12, 20), 8, 4), torch.device("cpu"))
    c = blocks.encode(x)
    assert c.shape == (2 * 4, 6 * 5)  # (blocks of 6 x 5: the largest divisors up to 8)
    assert torch.allclose(blocks.decode(c), x, atol=1e-5)
    assert torch.allclose(c.pow(2).sum(), x.pow(2).sum(), rtol=1e-5)


# --- the configuration -------------------------------------------------------------------------

@pytest.mark.parametrize("sync, message", [
    ({"compression": "int8"}, r"compression: must be none under demo"),
    ({"topk": 0}, r"topk: must be > 0"),
    ({"dct_chunk": 5000}, r"dct_chunk: must be <= 4096"),
    ({"momentum_decay": 1.0}, r"momentum_decay: must be <= 0.9999"),
])
def test_a_demo_field_out_of_its_range_is_refused_by_name(sync, message):
    with pytest.raises(SchemaError, match=rf"^\$\.training\.sync\.{message}"):
        structure({"sync": {"mode": "demo", **sync}}, TrainingConfig, "$.training")


def test_a_group_runs_plain_sgd_under_demo_and_adamw_alone():
    from swarm_core.pipeline.optim import make_optimizer

    module = torch.nn.Linear(4, 4)
    tc = _training()
    assert type(make_optimizer(module, tc, grouped=True)) is torch.optim.SGD
    assert type(make_optimizer(module, tc)) is torch.optim.AdamW  # (one replica: no sync)
    assert SyncConfig(mode="demo").label == "demo top8/64 1-bit"
