"""``swarm glue``, ``swarm generate`` and ``swarm eval``: the exported model, on one device."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm_core.contract import perplexity
from swarm_tui.commands.argtypes import (
    positive_int,
    sampling_seed,
    temperature,
    thread_count,
    token_count,
    utf8_text,
)
from swarm_tui.commands.base import (
    CommandError,
    ExitCode,
    add_format,
    emit_json,
    print_line,
)

if TYPE_CHECKING:  # (imported where used: torch and the data stack are slow to load)
    from swarm_core.config.schemas import TrainingConfig
    from swarm_core.data import TokenData
    from swarm_core.data.tokenizers import BpeTokenizer, ByteTokenizer
    from swarm_core.pipeline.whole import ExperimentModel


def cmd_glue(args: argparse.Namespace) -> int:
    from swarm_core.artifacts.glue import GlueError, glue

    try:
        out = glue(Path(args.export_dir))
    except GlueError as exc:
        raise CommandError(f"glue: {exc}") from None
    if args.format == "json":
        emit_json({"full_model": str(out)})
    else:
        print_line(f"wrote {out}")
    return 0


def _full_model(path: str) -> Path:
    """The full_model directory ``path`` names: itself, or a run's model_export's."""
    from swarm_core.artifacts.glue import GlueError, full_model_dir

    try:
        return full_model_dir(Path(path))
    except GlueError as exc:
        raise CommandError(str(exc)) from None


def _load(model_dir: Path) -> tuple[ExperimentModel, dict[str, Any]]:
    from swarm_core.artifacts.glue import GlueError, load_full_model

    try:
        return load_full_model(model_dir)
    except GlueError as exc:
        raise CommandError(str(exc)) from None


def _same_tokenizer(recorded: dict, now: dict) -> bool:
    keys = ("name", "vocab_size", "sha256")
    return all(recorded.get(k) == now.get(k) for k in keys if k in recorded)


def _data(manifest: dict, seq_len: int) -> tuple[TrainingConfig, TokenData]:
    """The run's training config and its dataset, tokenized as the model learned it."""
    from swarm_core.config.schemas import TrainingConfig
    from swarm_core.data import DataError, load_token_data
    from swarm_core.schema import SchemaError, structure

    try:
        training = structure(manifest.get("training") or {}, TrainingConfig)
    except SchemaError as exc:
        raise CommandError(f"the model's training config is invalid: {exc}") from None
    try:
        data = load_token_data(training, seq_len)
    except DataError as exc:
        raise CommandError(str(exc)) from None
    recorded = manifest.get("tokenizer") or {}
    if not _same_tokenizer(recorded, data.tokenizer.spec()):
        raise CommandError(f"the dataset's {training.dataset} tokenizer is not the one the "
                           "model was trained with (the corpus changed since?): its token ids "
                           "would mean other text")
    return training, data


def _tokenizer(manifest: dict, seq_len: int) -> ByteTokenizer | BpeTokenizer:
    """The tokenizer the model was trained with: bytes need no corpus; a BPE tokenizer is read
    from the file the run recorded, else rebuilt from the dataset if that gives the same one."""
    from swarm_core.data.tokenizers import BpeTokenizer, ByteTokenizer, TokenizerError

    recorded = manifest.get("tokenizer") or {}
    if recorded.get("name") == "byte":
        return ByteTokenizer()
    path = recorded.get("file")
    if isinstance(path, str) and Path(path).is_file():
        try:
            tok = BpeTokenizer.load(Path(path))
        except TokenizerError:
            tok = None
        if tok is not None and _same_tokenizer(recorded, tok.spec()):
            return tok
    return _data(manifest, seq_len)[1].tokenizer


def _check_vocab(tokens: int, manifest: dict, model_dir: Path) -> None:
    """A token id past the model's embedding would fail inside torch."""
    from swarm_core.artifacts.glue import INFERENCE_MANIFEST

    if tokens > manifest["vocab_size"]:
        raise CommandError(f"{model_dir / INFERENCE_MANIFEST}: vocab_size "
                           f"{manifest['vocab_size']} is smaller than its tokenizer's {tokens} "
                           "tokens")


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from swarm_core.pipeline.model import lm_loss

    model_dir = _full_model(args.model)
    model, manifest = _load(model_dir)
    seq_len = model.cfg.seq_len  # (the manifest may leave it to the default)
    training, data = _data(manifest, seq_len)
    _check_vocab(data.vocab_size, manifest, model_dir)
    mb = training.batch_size // training.micro_batches
    # Distinct windows, as TokenData.eval_batches counts them: more batches only repeat them,
    # and every batch asked for is allocated before the first is scored.
    held = max(1, data.eval_windows(seq_len) // mb)
    if args.batches is not None and args.batches > held:
        raise CommandError(f"--batches {args.batches}: the validation split of "
                           f"{training.dataset} holds {held} batch(es) of {mb} windows of "
                           f"{seq_len} tokens", ExitCode.USAGE)
    n = args.batches or training.eval_batches or 1
    batches = data.eval_batches(n, mb, seq_len)
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        losses = [float(lm_loss(model(x), y)) for x, y in batches]
    loss = sum(losses) / len(losses)
    result = {"model": args.model, "step": manifest["step"], "eval_loss": loss,
              "perplexity": perplexity(loss), "batches": n,
              "dataset": training.dataset}
    if args.format == "json":
        emit_json(result)
    else:
        print_line(f"validation loss {loss:.6f} (perplexity {result['perplexity']:.2f}) on "
                   f"{n} batch(es) of {training.dataset}, model at step {manifest['step']}")
    return 0


def _generate_model_dir(args: argparse.Namespace) -> Path:
    """EXPORT_DIR, or --model as before it: one of them, as its full_model directory."""
    if args.export_dir is not None and args.model is not None:
        raise CommandError("give EXPORT_DIR or --model, not both", ExitCode.USAGE)
    if args.export_dir is None and args.model is None:
        raise CommandError("generate needs EXPORT_DIR: a run's model_export directory",
                           ExitCode.USAGE)
    return _full_model(args.export_dir if args.export_dir is not None else args.model)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from swarm_core.artifacts.generate import sample_tokens

    model_dir = _generate_model_dir(args)
    model, manifest = _load(model_dir)
    tok = _tokenizer(manifest, model.cfg.seq_len)
    _check_vocab(tok.vocab_size, manifest, model_dir)
    ids = [int(i) for i in tok.encode(args.prompt)]
    if not ids:
        raise CommandError("--prompt must not be empty", ExitCode.USAGE)
    torch.set_num_threads(args.threads)
    new = sample_tokens(model, ids, args.tokens, seq_len=model.cfg.seq_len,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    text = tok.decode(ids + new)
    if args.format == "json":
        emit_json({"prompt": args.prompt, "text": text, "tokens": len(new)})
    else:
        print_line(text)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("glue", help="glue a run's stage shards into one model "
                                    "(model_export/full_model)")
    p.add_argument("export_dir", help="a run's model_export directory")
    add_format(p)
    p.set_defaults(func=cmd_glue)

    p = sub.add_parser("eval", help="validation loss of a glued model on its dataset")
    p.add_argument("--model", required=True, help="model_export/full_model directory")
    p.add_argument("--batches", type=positive_int, default=None,
                   help="held-out batches (default: the run's eval_batches)")
    p.add_argument("--threads", type=thread_count, default=1, help="torch threads")
    add_format(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="sample text from a glued model on CPU")
    p.add_argument("export_dir", nargs="?", default=None, metavar="EXPORT_DIR",
                   help="a run's model_export directory (glued), or its full_model")
    p.add_argument("--model", default=None,
                   help="model_export/full_model directory (instead of EXPORT_DIR)")
    p.add_argument("--prompt", type=utf8_text, required=True, help="text to continue")
    p.add_argument("--tokens", type=token_count, default=200, help="tokens to sample")
    p.add_argument("--temperature", type=temperature, default=0.8, help="sampling temperature")
    p.add_argument("--top-k", type=positive_int, default=None, help="sample from the top k")
    p.add_argument("--seed", type=sampling_seed, default=0, help="sampling seed")
    p.add_argument("--threads", type=thread_count, default=1, help="torch threads")
    add_format(p)
    p.set_defaults(func=cmd_generate)
