"""Tokenizers: ``byte`` (vocab 256) and ``bpe`` (byte-level BPE trained offline, cached)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from swarm_core.paths import atomic_write, swarm_home


class TokenizerError(ValueError):
    pass


class ByteTokenizer:
    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: list[int] | np.ndarray) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")

    def spec(self) -> dict[str, object]:
        return {"name": "byte", "vocab_size": 256}


class BpeTokenizer:
    name = "bpe"

    def __init__(self, tok: object, path: Path) -> None:
        self._tok = tok
        self.path = path
        self.vocab_size = tok.get_vocab_size()  # type: ignore[attr-defined]
        # Names this exact tokenizer (merges and vocabulary): a model records it, so a later
        # tokenizer rebuilt from a changed corpus is told apart from the one it learned.
        self.digest = hashlib.sha256(tok.to_str().encode()).hexdigest()  # type: ignore[attr-defined]

    @classmethod
    def load(cls, path: Path) -> BpeTokenizer:
        """A tokenizer file written by :meth:`train`."""
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(str(path)), path)
        except Exception as exc:  # the tokenizers library raises bare Exceptions
            raise TokenizerError(f"{path}: not a tokenizer file: "
                                 f"{str(exc).splitlines()[0] if str(exc) else exc}") from None

    @classmethod
    def train(cls, text: str, vocab_size: int, cache_dir: Path | None = None) -> BpeTokenizer:
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        except ImportError:
            raise TokenizerError(
                "tokenizer 'bpe' needs the 'tokenizers' package: pip install tokenizers"
            ) from None
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
        cache = (cache_dir or swarm_home() / "cache" / "bpe") / f"bpe-{vocab_size}-{digest}.json"
        if cache.exists():
            try:
                return cls.load(cache)
            except TokenizerError:
                pass  # a damaged cache entry (an interrupted disk, a hand edit): train anew
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(_chunks(text), trainer=trainer)
        atomic_write(cache, tok.to_str().encode())
        return cls(tok, cache)

    def encode(self, text: str) -> np.ndarray:
        ids = [i for chunk in _chunks(text) for i in self._tok.encode(chunk).ids]  # type: ignore[attr-defined]
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: list[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids])  # type: ignore[attr-defined]

    def spec(self) -> dict[str, object]:
        return {"name": "bpe", "vocab_size": self.vocab_size, "file": str(self.path),
                "sha256": self.digest}


def _chunks(text: str, size: int = 1 << 16) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]
