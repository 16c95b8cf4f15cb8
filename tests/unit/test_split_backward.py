"""Split backward: input gradients first, weight gradients deferred, same numbers."""

from __future__ import annotations

import attrs
import pytest
import torch

from swarm_core.config.schemas import ModelConfig
from swarm_core.pipeline.model import StageModule, lm_loss
from swarm_core.pipeline.wgrad import SplitLinear, WeightGradQueue, attach

CFG = ModelConfig(d_model=32, n_layers=4, n_heads=4, seq_len=16)


def _grads(split: bool, cfg: ModelConfig = CFG,
           ) -> tuple[dict[str, torch.Tensor], torch.Tensor, WeightGradQueue | None]:
    torch.manual_seed(1)
    stage = StageModule(cfg, 64, 0, 2, 4, 1, 2)  # the last stage: blocks 2-3 and the head
    queue = WeightGradQueue() if split else None
    attach(stage, queue)
    x = torch.randn(2, 3, 16, 32)
    y = torch.randint(0, 64, (2, 3, 16))
    inputs = []
    for i in range(2):  # two micro-batches, gradients accumulated
        inp = x[i].clone().requires_grad_(True)
        loss = lm_loss(stage(inp), y[i]) / 2
        with queue.capture() if queue is not None else torch.enable_grad():
            loss.backward()
        inputs.append(inp.grad)
        if queue is not None:
            # The input gradient is there before any weight gradient of a Linear, except the
            # LM head's, which is never deferred (its output gradient is tokens x vocab).
            assert stage.blocks["2"].mlp[0].weight.grad is None
            assert stage.head.lm_head.weight.grad is not None
            assert len(queue) == i + 1
    if queue is not None:
        # One layer per run_one, oldest micro-batch first.
        layers = 8  # 2 blocks x (qkv, proj, fc1, fc2)
        for _ in range(layers - 1):
            assert queue.run_one()
        assert len(queue) == 2  # the first micro-batch still has one layer to go
        assert queue.run_one() and len(queue) == 1
        queue.drain()
        assert len(queue) == 0 and not queue.run_one()
    return ({n: p.grad.clone() for n, p in stage.named_parameters()}, torch.stack(inputs), queue)


def test_split_backward_gives_the_fused_gradients() -> None:
    plain, plain_in, _ = _grads(split=False)
    split, split_in, _ = _grads(split=True)
    assert plain.keys() == split.keys()
    assert torch.equal(plain_in, split_in)
    for name in plain:
        torch.testing.assert_close(split[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)


def test_split_linear_is_a_plain_linear_without_a_queue() -> None:
    layer = SplitLinear(8, 4)
    ref = torch.nn.Linear(8, 4)
    ref.load_state_dict(layer.state_dict())  # same names, same shapes
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), ref(x))
    assert attach(layer, WeightGradQueue()) == 1 and layer.wgrad is not None
    with torch.no_grad():  # evaluation never builds W passes
        assert torch.equal(layer(x), ref(x))
    assert attach(layer, None) == 1 and layer.wgrad is None


def test_a_micro_batch_that_does_not_split_trains_as_plain_linears() -> None:
    """With ``splitting`` off for a micro-batch (a backward nobody waits behind), the forward
    keeps the weight in the graph: autograd's fused backward, no hook, nothing queued."""
    layer = SplitLinear(8, 4)
    queue = WeightGradQueue()
    attach(layer, queue)
    x = torch.randn(3, 8, requires_grad=True)
    queue.splitting = False
    out = layer(x)
    assert not out._backward_hooks
    with queue.capture():
        out.sum().backward()
    assert len(queue) == 0 and layer.weight.grad is not None
    plain = layer.weight.grad.clone()
    layer.weight.grad = None
    queue.splitting = True
    out = layer(x)
    assert out._backward_hooks  # the hook that queues the W pass
    with queue.capture():
        out.sum().backward()
    assert len(queue) == 1 and layer.weight.grad is None
    queue.drain()
    torch.testing.assert_close(layer.weight.grad, plain)


def test_split_backward_under_bfloat16_gives_the_fused_gradients() -> None:
    """dtype bfloat16 (autocast): a deferred weight pass uses the same bfloat16 products as
    autocast's linear, and every gradient lands in the float32 parameters."""
    bf16 = attrs.evolve(CFG, dtype="bfloat16")
    plain, plain_in, _ = _grads(split=False, cfg=bf16)
    split, split_in, _ = _grads(split=True, cfg=bf16)
    assert torch.equal(plain_in, split_in)
    for name in plain:
        assert split[name].dtype == torch.float32, name
        torch.testing.assert_close(split[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)
    # and bfloat16 really was the compute dtype: the float32 gradients differ from these
    fp32, _, _ = _grads(split=False)
    assert max(float((fp32[n] - plain[n]).abs().max()) for n in plain) > 1e-4


@pytest.mark.parametrize("compression", ["none", "learned_dim8"])
def test_bfloat16_computes_in_bfloat16_and_hands_on_float32(compression: str) -> None:
    bf16 = attrs.evolve(CFG, dtype="bfloat16", compression=compression)
    first = StageModule(bf16, 64, 0, 0, 2, 0, 2)
    last = StageModule(bf16, 64, 0, 2, 4, 1, 2)
    seen: list[torch.dtype] = []
    first.blocks["0"].mlp[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    # The residual stream stays float32 on every device, also after a bottleneck's norm
    # (the CPU's autocast would leave a LayerNorm of bfloat16 in bfloat16).
    streams: list[torch.dtype] = []
    last.blocks["2"].register_forward_pre_hook(lambda _m, args: streams.append(args[0].dtype))
    attach(first, WeightGradQueue())
    ids = torch.randint(0, 64, (2, 16))
    act = first(ids)
    assert seen == [torch.bfloat16]
    # What crosses the boundary is float32 (the wire codec decides the bytes); the logits come
    # out in the compute dtype and the loss is taken in float32.
    assert act.dtype == torch.float32
    logits = last(act.detach())
    assert logits.dtype == torch.bfloat16
    assert lm_loss(logits, torch.randint(0, 64, (2, 16))).dtype == torch.float32
    assert streams == [torch.float32]
    assert all(p.dtype == torch.float32 for p in first.parameters())


def test_the_meter_counts_what_pending_weight_passes_hold() -> None:
    """A deferred weight pass keeps its layer's input and output gradient: counted while it
    waits, released when it has run."""
    from swarm_core.pipeline.memory import ActivationMeter

    stage = StageModule(CFG, 64, 0, 2, 4, 1, 2)
    meter = ActivationMeter(stage.parameters())
    queue = WeightGradQueue(meter)
    attach(stage, queue)
    x = torch.randn(3, 16, 32, requires_grad=True)
    with meter.saving():
        loss = lm_loss(stage(x), torch.randint(0, 64, (3, 16)))
    saved = meter.live
    with queue.capture():
        loss.backward()
    del loss
    pending = meter.live
    assert pending > 0, "the queue's inputs and gradients are counted"
    assert pending != saved
    queue.drain()
    assert meter.live == 0


def test_split_linear_keeps_what_autograd_guarantees() -> None:
    """A frozen bias gets no gradient, and an input changed in place after the forward is an
    error, as with a plain Linear (whose saved input autograd checks)."""
    torch.manual_seed(0)
    layer, ref = SplitLinear(4, 3), torch.nn.Linear(4, 3)
    ref.load_state_dict(layer.state_dict())
    for lin in (layer, ref):
        lin.bias.requires_grad_(False)
    queue = WeightGradQueue()
    attach(layer, queue)
    x = torch.randn(2, 4, requires_grad=True)
    for lin in (layer, ref):
        with queue.capture():
            lin(x * 1.0).sum().backward()
    queue.drain()
    assert layer.bias.grad is None and ref.bias.grad is None
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    for lin in (layer, ref):
        h = x * 1.0
        out = lin(h)
        h.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"), \
                queue.capture():
            out.sum().backward()
    queue.clear()


def test_the_model_is_plain_linears_until_a_stage_splits_its_backward() -> None:
    """The model knows nothing of schedules: its layers are plain Linears. A stage that
    splits its backward swaps in SplitLinears (same parameters), all but the LM head."""
    stage = StageModule(CFG, 64, 0, 2, 4, 1, 2)  # blocks 2-3 and the head
    assert not any(isinstance(m, SplitLinear) for m in stage.modules())
    weights = {n: p for n, p in stage.named_parameters()}
    touched = attach(stage, WeightGradQueue())
    split = [n for n, m in stage.named_modules() if isinstance(m, SplitLinear)]
    assert touched == len(split) == 2 * 4  # qkv, proj and the MLP's two, in each block
    assert type(stage.head.lm_head) is torch.nn.Linear
    assert all(p is weights[n] for n, p in stage.named_parameters())
