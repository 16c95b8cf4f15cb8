"""An independent one-process reference for ``subspace_kK``: a GPT in plain PyTorch whose
residual stream is confined to E(tokens) + span(U), written from the published recipes and
the project's documented seeding, never from its model code (``swarm_core.pipeline`` is not
imported here; only the data comes from the project, as in ``bench/reference_gpt.py``).

The recipes it follows:

* part seeds: torch's CPU generator seeded with the first 8 bytes (little-endian, top bit
  cleared) of blake2b("{seed}/{part}"), one part each: "embed", "block{i}", "head", and
  "subspace" (U and E);
* GPT-2 init: modules built in the order of a pre-LN block (ln1, qkv, out projection, ln2,
  MLP up, MLP down; PyTorch's default draws as they are built), then every Linear N(0, 0.02)
  with zero biases, then the two residual projections N(0, 0.02/sqrt(2 n_layers));
  the trainable embedding's token then position tables N(0, 0.02);
* the subspace: U the reduced QR factor of a d x K standard normal draw, then E's token and
  position tables N(0, 0.02) each; every residual writer projected onto span(U) at init, its
  gradient before the optimiser step and its value after it;
* AdamW (decay on matrices only, eps 1e-8), linear warm-up then cosine to ``min_lr``, the
  global gradient norm clipped to ``grad_clip`` (scale max_norm / (norm + 1e-6)).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


def part_generator_seed(seed: int, part: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{part}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def drawing(seed: int, part: str) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(part_generator_seed(seed, part))
        yield


class RefBlock(nn.Module):
    def __init__(self, d: int, heads: int, ratio: int, layers: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, ratio * d)
        self.down = nn.Linear(ratio * d, d)
        for lin in (self.qkv, self.out, self.up, self.down):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        for lin in (self.out, self.down):
            nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class SubspaceGPT(nn.Module):
    """The constrained model. ``project_grads=False`` leaves the writers' gradients whole
    (a different model's steps: for the test that shows the projection matters)."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int, k: int,
                 seed: int, ratio: int = 4, project_grads: bool = True) -> None:
        super().__init__()
        self.project_grads = project_grads
        with drawing(seed, "embed"):
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)
            nn.init.normal_(self.tok.weight, std=0.02)
            nn.init.normal_(self.pos.weight, std=0.02)
        self.blocks = nn.ModuleList()
        for i in range(layers):
            with drawing(seed, f"block{i}"):
                self.blocks.append(RefBlock(d, heads, ratio, layers))
        with drawing(seed, "head"):
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)
            nn.init.normal_(self.lm_head.weight, std=0.02)
        with drawing(seed, "subspace"):
            self.u = torch.linalg.qr(torch.randn(d, k))[0]
            self.fixed_tok = torch.randn(vocab, d) * 0.02
            self.fixed_pos = torch.randn(seq, d) * 0.02
        self.project()

    def writers(self) -> Iterator[tuple[torch.Tensor, bool]]:
        """(tensor, whether its rows are d-vectors) of every residual writer."""
        yield self.tok.weight, True
        yield self.pos.weight, True
        for block in self.blocks:
            assert isinstance(block, RefBlock)
            for lin in (block.out, block.down):
                yield lin.weight, False
                yield lin.bias, False

    @torch.no_grad()
    def project(self, grads: bool = False) -> None:
        p = self.u @ self.u.T
        for w, rows in self.writers():
            t = w.grad if grads else w
            if t is not None:
                t.copy_(t @ p if rows else p @ t)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = (self.tok(idx) + self.pos.weight[:t]) + (self.fixed_tok[idx] + self.fixed_pos[:t])
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lr_at(step: int, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def train(model: SubspaceGPT, batches, steps: int, micro_batches: int, lr: float,
          min_lr: float, warmup: int, weight_decay: float, betas: tuple[float, float],
          grad_clip: float) -> list[float]:
    """Per-step losses (the mean over the step's micro-batches); ``batches(step)`` gives the
    step's (inputs, targets)."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=lr, betas=betas, eps=1e-8)
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr, min_lr, warmup, steps)
        x, y = batches(step)
        total = 0.0
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
            logits = model(xs)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1))
            (loss / micro_batches).backward()
            total += float(loss.detach()) / micro_batches
        if model.project_grads:
            model.project(grads=True)
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params
                             if p.grad is not None))
        scale = grad_clip / (norm + 1e-6)
        if grad_clip > 0 and scale < 1:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.project()
        losses.append(total)
    return losses
