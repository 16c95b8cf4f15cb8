"""SparseLoCo (``sync.mode: sparseloco``, arXiv 2508.15706): its replicas over real loopback TCP
in threads of one process, against a one-process simulation of R replicas written here in plain
torch from the paper's equations and its code's quantiser; its message's bytes from the rules."""

from __future__ import annotations

import math
import threading
from typing import Any

import attrs
import pytest
import torch

from swarm_core.config.schemas import ModelConfig, SyncConfig, TrainingConfig
from swarm_core.contract import split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline.codecs import pack_bits, unpack_bits
from swarm_core.pipeline.frames import HEADER_SIZE, FrameError
from swarm_core.pipeline.local import LocalCoordinator, run_local_pipeline
from swarm_core.pipeline.stage import StageResult
from swarm_core.pipeline.syncs import make_sync
from swarm_core.schema import SchemaError, structure
from tests.unit.sync_support import (
    backward_shares,
    close,
    divisor,
    fragment_of,
    fragments_after,
    lr_at,
    present,
    resumed_runs,
)
from tests.unit.test_replicas import (
    MODEL,
    _Crash,
    _diloco_reference,
    _step_losses,
)


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


def _training(**sync: Any) -> TrainingConfig:
    return structure({"steps": 9, "batch_size": 8, "micro_batches": 2, "eval_batches": 0,
                      "lr": 3e-3, "warmup_steps": 2, "frame_timeout_s": 20,
                      "sync": {"mode": "sparseloco", "inner_steps": 3, **sync}},
                     TrainingConfig)


# --- the reference: SparseLoCo in one process, written from the paper --------------------------


def _tiles_of(shape: torch.Size, chunk: int) -> tuple[int, int, int, int]:
    """(rows, tile height, columns, tile width): a matrix in blocks of at most ``chunk``
    elements, as square as its divisors allow; a vector in runs."""
    n = math.prod(shape)
    if len(shape) < 2:
        return 1, 1, n, divisor(n, chunk)
    rows = shape[0]
    h = divisor(rows, math.isqrt(chunk))
    return rows, h, n // rows, divisor(n // rows, chunk // h)


def _compress(e: torch.Tensor, s: SyncConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """What a replica sends of its error feedback ``e``: its dense form, and the mask of where
    it sent. Each tile keeps its round(density x size) largest magnitudes (of equal ones, the
    first positions); their values in value_bits bits: less their mean, binned over 6
    standard deviations (the unbiased one), each bin read back as the mean of its values
    (the paper's code's quantiser)."""
    rows, h, cols, w = _tiles_of(e.shape, s.chunk)
    tiles = e.reshape(rows // h, h, cols // w, w).transpose(1, 2).reshape(-1, h * w)
    k = min(h * w, max(1, round(s.density * h * w)))
    order = torch.argsort(tiles.abs(), dim=1, descending=True, stable=True)[:, :k]
    pos = order.sort(dim=1).values
    vals = tiles.gather(1, pos).reshape(-1)
    if s.value_bits < 32:
        bins = 2 ** s.value_bits
        mean = vals.mean()
        c = vals - mean
        std = c.norm() / math.sqrt(c.numel() - 1) if c.numel() > 1 else torch.tensor(0.0)
        step = float(6.0 * std / bins) or 1.0
        code = torch.clamp(torch.round(c / step + bins // 2), 0, bins - 1).long()
        table = torch.stack([c[code == b].mean() if bool((code == b).any())
                             else torch.tensor(0.0) for b in range(bins)])
        vals = table[code] + mean
    dense = torch.zeros_like(tiles).scatter(1, pos, vals.reshape(pos.shape))
    mask = torch.zeros_like(tiles).scatter(1, pos, torch.ones_like(pos, dtype=tiles.dtype))

    def back(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(rows // h, cols // w, h, w).transpose(1, 2).reshape(e.shape)

    return back(dense), back(mask)


def _sparseloco_reference(mc: ModelConfig, tc: TrainingConfig, data, stages: int,
                          replicas: int, leaves: dict[int, int] | None = None,
                          joins: dict[int, tuple[int, int]] | None = None) -> list[float]:
    """R copies from the same seed, each its own AdamW (matrices decay) on its share of every
    step's windows, clipped by its own norm. Every H steps (and at the end) replica r adds
    its change (weights at the last sync - weights now) to its error feedback e_r (decayed
    by error_decay), sends C(e_r) and keeps e_r - C(e_r); every copy becomes the weights at
    the last sync less outer_lr x the mean of what was sent at each position over the
    replicas that sent there. ``leaves[r]``: replica r is gone from that step on.
    ``joins[r] = (step, donor)``: replica r is back from that step (after an outer step),
    a copy of the donor's weights and AdamW state, its error feedback zero. With
    ``fragments``, each fragment's outer step in its turn (as DiLoCo's simulation)."""
    import copy

    from swarm_core.pipeline.whole import ExperimentModel

    s, leaves, joins = tc.sync, leaves or {}, joins or {}
    ranges = split_layers(mc.n_layers, [1] * stages)
    models = [ExperimentModel(mc, data.vocab_size, tc.seed, ranges) for _ in range(replicas)]
    params = [list(m.parameters()) for m in models]
    opts = [torch.optim.AdamW(
        [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": tc.weight_decay},
         {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
        lr=tc.lr, betas=tuple(tc.betas), eps=1e-8) for ps in params]
    anchor = [torch.nn.Parameter(p.detach().clone()) for p in params[0]]
    errors = [[torch.zeros_like(p) for p in params[0]] for _ in range(replicas)]
    alpha, momentum = s.outer_step
    # (plain SGD, the paper's; with a momentum, Nesterov as DiLoCo's: MuLoCo's outer step)
    outer = torch.optim.SGD(anchor, lr=alpha, momentum=momentum, nesterov=momentum > 0)
    frag_of = fragment_of(list(models[0].stages), s.fragments, s.fragment_pattern)

    losses: list[float] = []
    for step in range(tc.steps):
        x, y = data.batch(step, tc.batch_size, mc.seq_len, tc.seed)
        for r, (at, donor) in joins.items():
            if at == step:
                models[r].load_state_dict(models[donor].state_dict())
                opts[r].load_state_dict(copy.deepcopy(opts[donor].state_dict()))
                errors[r] = [torch.zeros_like(p) for p in params[0]]
        here = present(replicas, step, tc.steps, leaves, joins)
        for r in here:
            for g in opts[r].param_groups:
                g["lr"] = lr_at(tc, step)
        total = backward_shares(models, here, x, y, tc, replicas)
        for r in here:
            opts[r].step()
            opts[r].zero_grad(set_to_none=True)
        losses.append(total)
        taking = fragments_after(tc, step, False)
        if not taking:
            continue
        with torch.no_grad():
            for i, a in enumerate(anchor):
                if frag_of[i] not in taking:
                    continue
                total_sent, count = torch.zeros_like(a), torch.zeros_like(a)
                for r in here:
                    acc = s.error_decay * errors[r][i] + (a - params[r][i])
                    sent, mask = _compress(acc, s)
                    errors[r][i] = acc - sent
                    total_sent += sent
                    count += mask
                a.grad = total_sent / count.clamp(min=1)
            if momentum == 0:  # (the paper's equation, as written)
                for a in anchor:
                    if a.grad is not None:
                        a.sub_(alpha * a.grad)
            else:
                outer.step()
            for a in anchor:
                a.grad = None
            for r in here:
                for i, (p, a) in enumerate(zip(params[r], anchor, strict=True)):
                    if frag_of[i] in taking:
                        p.copy_(a)
    return losses



# --- exactness ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stages, sync", [
    (1, {}),  # (the defaults: 2 % of each tile, 2 bits)
    (2, {"density": 0.1, "chunk": 256}),
    (1, {"density": 0.05, "value_bits": 4, "error_decay": 0.5, "outer_lr": 0.8}),
    (2, {"inner_steps": 4, "fragments": 2, "density": 0.1, "chunk": 256}),  # (Streaming's)
    # MuLoCo's (arXiv 2505.23725): every value, 2 bits, error feedback, DiLoCo's outer step
    (1, {"density": 1.0, "value_bits": 2, "outer_lr": 0.7, "outer_momentum": 0.9}),
])
def test_sparseloco_trains_what_a_one_process_simulation_of_its_replicas_trains(data, stages,
                                                                                sync):
    """Two replicas, H = 3, three outer steps: the step losses of the simulation (to 1e-5),
    each cell sending exactly the bytes its messages must, and not DiLoCo's losses."""
    mc = ModelConfig(**MODEL)
    tc = _training(**sync)
    ref = _sparseloco_reference(mc, tc, data, stages, 2)
    res = run_local_pipeline(mc, tc, data, stages, replicas=2, timeout=120)
    assert all(isinstance(r, StageResult) for r in res.values()), res
    assert close(ref, _step_losses(res, stages, 2)) <= 1e-5
    for cell in range(2 * stages):
        metrics = res[cell].metrics
        assert metrics.sync_tx_bytes_per_step == metrics.expected_sync_tx_bytes_per_step > 0
    diloco = attrs.evolve(tc, sync=SyncConfig(mode="diloco", inner_steps=3))
    assert close(_diloco_reference(mc, diloco, data, stages, 2), ref) > 1e-3


def test_every_value_sent_whole_with_no_feedback_is_weight_averaging(data):
    """density 1, float32 values, error_decay 0: every change crosses whole and nothing is
    kept, so with outer_lr 1 each outer step is the mean of the replicas' weights: the
    losses of DiLoCo's simulation that averages the copies and nothing else (to 1e-5)."""
    mc = ModelConfig(**MODEL)
    tc = _training(density=1.0, value_bits=32, error_decay=0.0)
    res = run_local_pipeline(mc, tc, data, 1, replicas=2, timeout=120)
    assert all(isinstance(r, StageResult) for r in res.values()), res
    averaging = attrs.evolve(tc, sync=SyncConfig(mode="diloco", inner_steps=3, outer_lr=1.0,
                                                 outer_momentum=0.0))
    ref = _diloco_reference(mc, averaging, data, 1, 2, average=True)
    assert close(ref, _step_losses(res, 1, 2)) <= 1e-5


def test_sparseloco_goes_on_without_a_replica_that_dies_between_outer_steps(data):
    """Three replicas, H = 3; replica 1 dies after step 4. The outer step after step 6 breaks
    on the survivors' ring; they regroup, exchange their own messages only (their error
    feedback as it was) and train on: the simulation in which replica 1 is gone from step 4,
    to 1e-5."""
    mc = ModelConfig(**MODEL)
    tc = attrs.evolve(_training(density=0.1), batch_size=12)
    stop = threading.Event()
    coord = LocalCoordinator(1, 3, stop)
    crash = _Crash(1, 4)
    res = run_local_pipeline(mc, tc, data, 1, replicas=3, timeout=120, stop=stop,
                             coordinator=coord, on_step=crash)
    assert isinstance(res[1], RuntimeError)
    assert all(isinstance(res[r], StageResult) for r in (0, 2))
    assert [(c.step, c.members, c.left) for c in coord.changes] == [(6, [0, 2], [1])]
    ref = _sparseloco_reference(mc, tc, data, 1, 3, leaves={1: 4})
    assert close(ref, crash.step_losses()) <= 1e-5


def test_a_sparseloco_run_resumed_from_its_checkpoint_trains_on_exactly(data):
    """A checkpoint at the outer step after step 6 holds each replica's own error feedback
    beside its AdamW state; a run resumed from it computes steps 7-12 of the simulation of the
    uninterrupted run (to 1e-5); resumed without the feedback, steps 10-12 (after the outer
    step that would have sent it) are not."""
    from swarm_core.pipeline.optim import ERROR_FIELD

    mc = ModelConfig(**MODEL)
    tc = attrs.evolve(_training(density=0.1), steps=12, shard_push_interval_steps=4)
    ref = _sparseloco_reference(mc, tc, data, 1, 2)
    with_state, without = resumed_runs(mc, tc, data, 6, ERROR_FIELD)
    assert close(ref[6:], with_state) <= 1e-5
    assert close(ref[9:], without[3:]) > 1e-4


# --- the message -------------------------------------------------------------------------------

def test_a_message_is_its_codes_positions_and_lookups_to_the_byte():
    """Per tensor: the kept values' codes (value_bits each), their positions in their tiles
    (ceil(log2 tile size) bits each), a shift and 2^bits float32 lookups; R-1 forwards of the
    whole message per outer step, each piece in a frame, plus the confirmation."""
    shapes = [(64, 96), (96,), (7, 5)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    tc = _training()  # density 0.02, chunk 4096, 2 bits
    # (64, 96): tiles of 64 x 48 (the largest divisor of 96 up to 4096/64), two of them,
    # round(0.02 x 3072) = 61 kept each, positions in 12 bits.
    # (96,): one run of 96, round(1.92) = 2 kept, 7 bits. (7, 5): h = 7, w = 5, one tile of
    # 35, round(0.7) = 1 kept, 6 bits.
    def tensor(kept: int, index_bits: int) -> int:
        return 4 * (1 + 4) + math.ceil(kept * 2 / 8) + math.ceil(kept * index_bits / 8)

    message = tensor(122, 12) + tensor(2, 7) + tensor(1, 6)
    for replicas in (1, 2, 4):
        sync = make_sync(tc, params, None, None, 0, replicas, torch.device("cpu"))
        confirm = (replicas - 1) * (HEADER_SIZE + 4)
        assert sync.expected_bytes() == (replicas - 1) * (HEADER_SIZE + message) + confirm
        assert sync.max_payload == message


def test_one_member_keeps_in_its_feedback_exactly_what_it_did_not_send():
    """A group of one: after an outer step, the weights moved by what was sent, and the error
    feedback holds the rest of the change, so sent + kept is the change itself."""
    tc = _training(density=0.25, value_bits=32)
    params = [torch.nn.Parameter(torch.zeros(8, 8))]
    sync = make_sync(tc, params, None, None, 0, 1, torch.device("cpu"))
    change = torch.randn(8, 8)
    with torch.no_grad():
        params[0].sub_(change)
    sync.after_step(2, False, 1.0)
    sent = -params[0].detach()  # (the anchor was zeros: it moved by -sent)
    kept = torch.from_numpy(sync.checkpoint_state(["w"])["w.error_feedback"])
    assert int((sent != 0).sum()) == 16  # (8 x 8 is one tile; a quarter of it)
    assert torch.equal(sent + kept, change)
    assert float(sent[sent != 0].abs().min()) >= float(kept.abs().max())


@pytest.mark.parametrize("width", [1, 2, 3, 7, 12, 20])
def test_codes_of_any_width_pack_into_as_few_bytes_and_back(width):
    codes = torch.randint(0, 2 ** width, (37,))
    raw = pack_bits(codes, width)
    assert raw.numel() == math.ceil(37 * width / 8)
    assert torch.equal(unpack_bits(raw, width, 37), codes)


def test_a_message_that_names_a_position_beyond_its_tile_is_a_frame_error():
    from swarm_core.pipeline.syncs.sparse import SparseCode, Tiling

    code = SparseCode(Tiling.of((5, 5), 4096, 0.2), 32)  # (one tile of 25, 5 kept, 5 bits)
    pos = torch.tensor([[0, 3, 9, 17, 24]])
    raw, _ = code.encode(pos, torch.ones(1, 5))
    got, values = code.decode(memoryview(raw), torch.device("cpu"))
    assert torch.equal(got, pos) and torch.equal(values, torch.ones(1, 5))
    bad, _ = code.encode(torch.tensor([[0, 3, 9, 17, 30]]), torch.ones(1, 5))
    with pytest.raises(FrameError, match="position 30 of a tile of 25"):
        code.decode(memoryview(bad), torch.device("cpu"))


# --- the configuration -------------------------------------------------------------------------

@pytest.mark.parametrize("sync, message", [
    ({"compression": "int8"}, r"compression: must be none under sparseloco"),
    ({"value_bits": 3}, r"value_bits: must be one of 1, 2, 4, 8, 32, got 3"),
    ({"density": 0}, r"density: must be > 0"),
    ({"density": 1.5}, r"density: must be <= 1"),
    ({"error_decay": 1.5}, r"error_decay: must be <= 1"),
])
def test_a_sparseloco_field_out_of_its_range_is_refused_by_name(sync, message):
    with pytest.raises(SchemaError, match=rf"^\$\.training\.sync\.{message}"):
        structure({"sync": {"mode": "sparseloco", **sync}}, TrainingConfig, "$.training")


def test_the_outer_step_defaults_to_each_papers():
    assert SyncConfig(mode="diloco").outer_step == (0.7, 0.9)
    assert SyncConfig(mode="sparseloco").outer_step == (1.0, 0.0)
    assert SyncConfig(mode="diloco", outer_lr=0.5).outer_step == (0.5, 0.9)
    assert SyncConfig(mode="sparseloco", inner_steps=10).label == \
        "sparseloco H=10 d=0.02 2-bit"
