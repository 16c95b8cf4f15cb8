"""A GPT-style decoder, as the stage slices of it that fellows train (the whole of it in one
process: :mod:`swarm_core.pipeline.whole`). Plain torch modules: what a schedule needs of them
(split backward's deferred weight passes) the stage swaps in, and the wire is the stage's.

Every part (embedding, block i, head, bottleneck halves at boundary j) is initialised under its
own seed derived from the run seed and the part's name, so a stage that builds only its layers
holds exactly the weights the whole model would: the pipeline and a single process start equal.
Parameter names use global layer indices (``blocks.7.attn.qkv.weight``), so stage shards glue
back into one state dict by union.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from swarm_core.config.schemas import ModelConfig
from swarm_core.pipeline.boundary import Frame, make_boundary


def compute_precision(cfg: ModelConfig, device_type: str) -> contextlib.AbstractContextManager:
    """The model profile's ``dtype``: ``bfloat16`` is mixed precision (autocast), with float32
    weights, gradients and optimiser state; ``float32`` computes in float32."""
    if cfg.dtype == "bfloat16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def part_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# torch's generators are process-wide, and a fellow may run several stages in threads: whatever
# seeds one and then draws from it (building a part, a forward pass with dropout) takes turns.
_RNG_LOCK = threading.Lock()


M = TypeVar("M", bound=nn.Module | None)


def seeded(seed: int, name: str, build: Callable[[], M]) -> M:
    # Only the CPU generator (modules are built on the CPU): torch.manual_seed would also reseed
    # every GPU's generator, under a stage already training there.
    with _RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(part_seed(seed, name))
        return build()


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


@contextlib.contextmanager
def dropout_rng(module: StageModule, step: int | None,
                micro_batch: int | None) -> Iterator[None]:
    """Dropout masks that depend on (run seed, stage, step, micro-batch) alone: the generator
    of the stage's device is seeded with them for the forward pass inside (backward draws
    nothing: the masks are saved). So a pipeline with dropout equals the single process (which
    seeds each stage's forward the same way), a resumed run continues exactly with no generator
    state in its checkpoint, and a fellow's earlier jobs do not change a run. A no-op without
    dropout, outside training or without a step (``None``: the generator as it stands); with
    it, forwards of stages sharing a process take turns."""
    if not (module.training and module.cfg.dropout > 0) or step is None or micro_batch is None:
        yield
        return
    with _RNG_LOCK:
        _generator(next(module.parameters()).device).manual_seed(
            part_seed(module.seed, f"dropout/{module.stage}/{step}/{micro_batch}"))
        yield


GPT2_STD = 0.02


def gpt2_init(module: nn.Module, cfg: ModelConfig, residual: tuple[nn.Linear, ...] = ()) -> None:
    """GPT-2's init on a freshly built part, under its seed: every Linear N(0, 0.02) with zero
    biases, and the ``residual`` projections (those that write into the residual stream)
    N(0, 0.02/sqrt(2 n_layers)), so the stream's variance does not grow with depth. Norms keep
    (1, 0). Nothing under ``init: torch``."""
    if cfg.init != "gpt2":
        return
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=GPT2_STD)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    for proj in residual:
        nn.init.normal_(proj.weight, mean=0.0, std=GPT2_STD / (2 * cfg.n_layers) ** 0.5)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, cfg.mlp_ratio * d), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * d, d))
        self.drop = nn.Dropout(cfg.dropout)
        gpt2_init(self, cfg, residual=(self.attn.proj, cast(nn.Linear, self.mlp[2])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, vocab, bias=False)
        gpt2_init(self, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class BottleneckDown(nn.Module):
    """Sender half of a learned bottleneck: Linear(d→k) → LayerNorm(k)."""

    def __init__(self, cfg: ModelConfig, k: int) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.d_model, k)
        self.norm = nn.LayerNorm(k)
        gpt2_init(self, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # LayerNorm in float32 under autocast on every device (CUDA's autocast does this
        # itself, the CPU's does not), so the residual stream after it stays float32.
        return self.norm(self.proj(x).float())


class BottleneckUp(nn.Module):
    """Receiver half: Linear(k→d) → LayerNorm(d)."""

    def __init__(self, cfg: ModelConfig, k: int) -> None:
        super().__init__()
        self.proj = nn.Linear(k, cfg.d_model)
        self.norm = nn.LayerNorm(cfg.d_model)
        gpt2_init(self, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x).float())  # float32, as in BottleneckDown


class StageModule(nn.Module):
    """Global layers ``[start, stop)`` of the model, plus what this stage owns at its edges:
    the embedding (first), the head (last), the bottleneck up-projection of the boundary before
    it and the down-projection of the boundary after it."""

    def __init__(self, cfg: ModelConfig, vocab: int, seed: int, start: int, stop: int,
                 stage: int, num_stages: int) -> None:
        super().__init__()
        self.cfg, self.stage, self.num_stages, self.seed = cfg, stage, num_stages, seed
        self.start, self.stop = start, stop
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.embed = seeded(seed, "embed", lambda: Embedding(cfg, vocab)) if self.first else None
        # What the spec puts either side of a boundary (a learned bottleneck's halves), built
        # under the part seeds as every other part, and keyed by boundary index, so names stay
        # unique when stages are glued together.
        boundary = make_boundary(cfg)
        up = seeded(seed, f"up{stage - 1}", boundary.receiver_module) if not self.first \
            else None
        self.up = nn.ModuleDict({str(stage - 1): up}) if up is not None else None
        self.blocks = nn.ModuleDict({
            str(i): seeded(seed, f"block{i}", lambda: Block(cfg)) for i in range(start, stop)
        })
        down = seeded(seed, f"down{stage}", boundary.sender_module) if not self.last else None
        self.down = nn.ModuleDict({str(stage): down}) if down is not None else None
        self.head = seeded(seed, "head", lambda: Head(cfg, vocab)) if self.last else None
        if self.tied:
            self.head.lm_head.weight = self.embed.tok.weight  # type: ignore[union-attr]
        # A fixed frame every stage holds alike (a subspace boundary's basis and embedding),
        # under a part seed of its own; its constraint holds from the start.
        self.frame = cast(Frame | None, seeded(
            seed, "subspace", lambda: cast(nn.Module | None, boundary.frame_module(vocab))))
        self.constrain_()

    @property
    def tied(self) -> bool:
        """``tie_weights`` takes effect where one stage holds both the embedding and the head:
        split, tying would cost the shared gradient's round trip over the link every step."""
        return self.cfg.tie_weights and self.first and self.last

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: token ids (the first stage) or what crossed; ``tokens``: the micro-batch's
        ids, which a stage with a frame needs (ignored without one)."""
        with compute_precision(self.cfg, x.device.type):
            x = self._layers(x, tokens)
        # What leaves a stage for the next is float32 whatever the compute dtype: the wire
        # codec alone decides the bytes, and the gradient that comes back has the same dtype.
        return x if self.last else x.float()

    def _layers(self, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        idx = x if self.first else tokens
        if self.embed is not None:
            x = self.embed(x)
        if self.frame is not None:
            assert idx is not None, "a stage with a frame needs the step's token ids"
            x = self.frame.enter(x, idx, self.first)
        if self.up is not None:
            for up in self.up.values():
                x = up(x)
        for block in self.blocks.values():
            x = block(x)
        if self.down is not None:
            for down in self.down.values():
                x = down(x)
        if self.frame is not None and not self.last:
            assert idx is not None
            x = self.frame.leave(x, idx)
        if self.head is not None:
            x = self.head(x)
        return x

    def residual_writers(self) -> Iterator[tuple[torch.Tensor, int]]:
        """The parameters that write into the residual stream, each with its d-wide axis:
        the trainable embedding's tables (rows), each block's attention and MLP output
        projections (output rows) and their biases."""
        if self.embed is not None:
            yield self.embed.tok.weight, -1
            yield self.embed.pos.weight, -1
        for block in cast(Iterator[Block], self.blocks.values()):
            for proj in (block.attn.proj, cast(nn.Linear, block.mlp[2])):
                yield proj.weight, 0
                if proj.bias is not None:
                    yield proj.bias, 0

    @torch.no_grad()
    def constrain_(self, grads: bool = False) -> None:
        """Keep the residual writers where the frame can carry them (its ``project_``): their
        values, or with ``grads`` their gradients. Called at build, on the gradients before
        the optimiser step (clipping included) and on the values after every change of the
        weights. Nothing without a frame."""
        if self.frame is None:
            return
        for p, axis in self.residual_writers():
            t = p.grad if grads else p
            if t is not None:
                self.frame.project_(t, axis)


def stage_state_names(cfg: ModelConfig, start: int, stop: int, stage: int,
                      num_stages: int) -> frozenset[str]:
    """The state names of a stage's module (as :class:`StageModule` builds it): built on the
    meta device, so no weights are made, only the names."""
    with torch.device("meta"):
        module = StageModule(cfg, cfg.vocab_size or 256, 0, start, stop, stage, num_stages)
    return frozenset(module.state_dict())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, in float32 whatever dtype the logits were computed in."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
