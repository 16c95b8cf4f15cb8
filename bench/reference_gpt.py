"""An independent reference for the project's training figures (not a test): a single-file
GPT trainer in plain PyTorch, written from the standard recipe (GPT-2 / nanoGPT: every Linear
N(0, 0.02) with zero biases, the residual output projections N(0, 0.02/sqrt(2 n_layers)),
embeddings N(0, 0.02); AdamW with decay on matrices only; linear warm-up then cosine; global
norm clipping), beside the project's 2-stage pipeline run through a real local leader and two
fellow processes on the same setting.

It takes only the data from the project (``swarm_core.data``: the same training windows per
step and the same held-out evaluation windows), never its model, optimiser or schedule
(``swarm_core.pipeline`` is not imported here), so a figure both agree on does not rest on the
code under test. The two start from different random draws of the same init, so they agree to
seed noise, not bit for bit; the target is a validation loss within 1 % at 400 steps.

Usage::

    .venv/bin/python bench/reference_gpt.py                      # 400 steps, none + fixed_int8
    .venv/bin/python bench/reference_gpt.py --steps 200 --compression none
    .venv/bin/python bench/reference_gpt.py --quick              # 6 steps, tiny: a smoke run
    .venv/bin/python bench/reference_gpt.py --seeds 0,1,2,3 --compression none
        # the reference over four init seeds: the pipeline against their mean and range

Prints one row per compression spec: the reference's and the pipeline's final validation loss,
their ratio and whether it is within the target. Exits 0 when every row ran (whether or not
the target is met), 1 when one failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

TARGET = 0.01  # |pipeline / reference - 1| at the full setting

# The setting: a d=128, 4-layer, 4-head byte-level model on shakespeare.
MODEL = {"name": "ref", "d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128,
         "dropout": 0.0, "mlp_ratio": 4, "tie_weights": False, "wire_dtype": "fp32"}
TRAINING = {"name": "ref", "dataset": "shakespeare", "tokenizer": "byte", "seed": 0,
            "steps": 400, "batch_size": 16, "micro_batches": 4, "lr": 3e-3, "min_lr": 3e-4,
            "warmup_steps": 20, "weight_decay": 0.1, "betas": [0.9, 0.95], "grad_clip": 1.0,
            "eval_batches": 16, "schedule": "1f1b", "threads": 1}
QUICK = {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32}


# --- the reference: one file of plain PyTorch -------------------------------------------------

class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ratio: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads)
        self.c_fc = nn.Linear(d, ratio * d)
        self.c_proj = nn.Linear(ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq_len: int,
                 ratio: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.h = nn.ModuleList(Block(d, heads, ratio) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # GPT-2: the projections that write into the residual stream, scaled by its depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lr_schedule(step: int, t: dict) -> float:
    if step < t["warmup_steps"]:
        return t["lr"] * (step + 1) / t["warmup_steps"]
    frac = min(1.0, (step - t["warmup_steps"]) / max(1, t["steps"] - t["warmup_steps"]))
    return t["min_lr"] + 0.5 * (t["lr"] - t["min_lr"]) * (1.0 + math.cos(math.pi * frac))


def train_reference_gpt(model_cfg: dict, training: dict, data, seed: int) -> tuple[float, float]:
    """(mean training loss of the last tenth of the steps, final validation loss)."""
    torch.manual_seed(seed)
    m, t = model_cfg, training
    gpt = GPT(data.vocab_size, m["d_model"], m["n_layers"], m["n_heads"], m["seq_len"],
              m["mlp_ratio"])
    opt = adamw(gpt, t)
    losses = []
    for step in range(t["steps"]):
        for group in opt.param_groups:
            group["lr"] = lr_schedule(step, t)
        x, y = data.batch(step, t["batch_size"], m["seq_len"], t["seed"])
        logits = gpt(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(gpt.parameters(), t["grad_clip"])
        opt.step()
        losses.append(float(loss.detach()))
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail), evaluate(gpt, data, m, t)


def adamw(gpt: nn.Module, t: dict) -> torch.optim.AdamW:
    """AdamW as nanoGPT sets it: weight decay on the matrices only."""
    ps = list(gpt.parameters())
    return torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2],
                               "weight_decay": t["weight_decay"]},
                              {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
                             lr=t["lr"], betas=tuple(t["betas"]), eps=1e-8)


def evaluate(gpt: nn.Module, data, m: dict, t: dict) -> float:
    """The mean loss over the held-out windows the project evaluates on."""
    gpt.eval()
    micro = t["batch_size"] // t["micro_batches"]  # the project evaluates per micro-batch
    with torch.no_grad():
        evals = [float(F.cross_entropy(gpt(x).reshape(-1, data.vocab_size), y.reshape(-1)))
                 for x, y in data.eval_batches(t["eval_batches"], micro, m["seq_len"])]
    return sum(evals) / len(evals)


# --- the project: a 2-stage pipeline through a real local leader -----------------------------

def pipeline_runs(model_cfg: dict, training: dict, specs: list[str]
                  ) -> dict[str, tuple[float, float, str] | str]:
    """Per compression spec, one job on one local cluster (a leader and two fellows): (mean
    training loss of the last tenth, final validation loss, the init it recorded), or why it
    failed."""
    from swarm_core.client import ClientError, SwarmClient
    from swarm_core.config.schemas import ModelConfig, TrainingConfig
    from swarm_core.contract import JobSubmit, Topology
    from swarm_core.local_cluster import ClusterSpec, start_cluster, stop_cluster, token_for
    from swarm_core.schema import structure

    record = start_cluster(ClusterSpec(fellows=2, timeout_s=120))

    async def body() -> dict[str, tuple[float, float, str] | str]:
        out: dict[str, tuple[float, float, str] | str] = {}
        async with SwarmClient(record.leader_url, token_for(record)) as c:
            for spec in specs:
                try:
                    job = await c.submit(JobSubmit(
                        name=f"reference-{spec}", kind="train",
                        model=structure({**model_cfg, "compression": spec}, ModelConfig),
                        training=structure(training, TrainingConfig),
                        topology=Topology(fellows=2)))
                    job = await c.wait_job(job.job_id, 1.0)
                except (ClientError, ValueError) as exc:
                    out[spec] = f"{type(exc).__name__}: {exc}"
                    continue
                if job.state != "COMPLETED" or job.metrics.eval_loss is None:
                    out[spec] = f"job {job.job_id} {job.state}: {job.reason}"
                    continue
                losses = [loss for _step, loss in job.loss_history]
                tail = losses[-max(1, len(losses) // 10):]
                out[spec] = (sum(tail) / len(tail), job.metrics.eval_loss, job.model.init)
        return out

    try:
        return asyncio.run(body())
    finally:
        stop_cluster()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=TRAINING["steps"])
    ap.add_argument("--compression", default="none,fixed_int8",
                    help="comma-separated compression specs (default: none,fixed_int8)")
    ap.add_argument("--seed", type=int, default=0, help="the reference's init seed")
    ap.add_argument("--seeds", default=None,
                    help="comma-separated init seeds of the reference (its spread over them is "
                         "the seed noise a gap is read against); overrides --seed")
    ap.add_argument("--no-pipeline", action="store_true",
                    help="the reference's rows only (with --seeds: the seed noise alone)")
    ap.add_argument("--init", choices=("gpt2", "torch"), default="gpt2",
                    help="the pipeline's model init (torch: the seed's, to see what it cost)")
    ap.add_argument("--quick", action="store_true", help="6 steps of a tiny model: smoke run")
    args = ap.parse_args(argv)
    if args.steps < 1:
        print("reference_gpt: --steps must be at least 1", file=sys.stderr)
        return 2
    model_cfg, training = {**MODEL, "init": args.init}, {**TRAINING, "steps": args.steps}
    if args.quick:
        model_cfg.update(QUICK)
        training.update(steps=6, warmup_steps=2, batch_size=4, micro_batches=2, eval_batches=2)
    specs = [s.strip() for s in args.compression.split(",") if s.strip()]
    try:
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    except ValueError:
        print(f"reference_gpt: --seeds must be integers separated by commas: {args.seeds!r}",
              file=sys.stderr)
        return 2

    from swarm_core.config.schemas import TrainingConfig
    from swarm_core.data import load_token_data
    from swarm_core.schema import structure

    torch.set_num_threads(1)
    data = load_token_data(structure(training, TrainingConfig), model_cfg["seq_len"])
    print(f"d={model_cfg['d_model']} layers={model_cfg['n_layers']} "
          f"seq={model_cfg['seq_len']} batch={training['batch_size']} steps={training['steps']} "
          f"lr {training['lr']}->{training['min_lr']} cosine, warm-up "
          f"{training['warmup_steps']}, wd {training['weight_decay']}, clip "
          f"{training['grad_clip']}")
    vals = []
    for seed in seeds:
        t0 = time.perf_counter()
        ref_train, ref_val = train_reference_gpt(model_cfg, training, data, seed)
        vals.append(ref_val)
        print(f"reference (plain PyTorch, GPT-2 init, seed {seed}): train {ref_train:.4f} val "
              f"{ref_val:.4f} ({time.perf_counter() - t0:.0f} s)")
    ref_val = sum(vals) / len(vals)
    if len(vals) > 1:
        spread = (max(vals) - min(vals)) / ref_val
        print(f"reference over seeds {','.join(map(str, seeds))}: val mean {ref_val:.4f}, "
              f"min {min(vals):.4f}, max {max(vals):.4f} (spread {spread:.2%} of the mean)")
    if args.no_pipeline:
        return 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="reference-gpt-") as home:
        os.environ["SWARM_HOME"] = home  # its own local cluster, not the user's
        results = pipeline_runs(model_cfg, training, specs)
    print(f"pipeline (2 stages, real leader and fellows): {time.perf_counter() - t0:.0f} s")
    rows, failed = [], False
    for spec, got in results.items():
        if isinstance(got, str):  # a row that fails is reported; the others still show
            print(f"reference_gpt: {spec}: {got}", file=sys.stderr)
            failed = True
        else:
            rows.append((spec, *got))
    print(f"{'compression':<14}{'init':<8}{'train':>9}{'val':>9}{'ref val':>9}"
          f"{'val/ref':>9}  within {TARGET:.0%}" + ("  within the seeds'" if len(vals) > 1
                                                    else ""))
    for spec, train, val, init in rows:
        ratio = val / ref_val
        seeds_say = ("  " + ("yes" if min(vals) <= val <= max(vals) else "no")) \
            if len(vals) > 1 else ""
        print(f"{spec:<14}{init:<8}{train:>9.4f}{val:>9.4f}{ref_val:>9.4f}{ratio:>9.4f}  "
              + ("yes" if abs(ratio - 1) <= TARGET else "no") + seeds_say)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
