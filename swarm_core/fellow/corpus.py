"""The corpus a fellow's stages train on, loaded once per process.

Stages that run in one fellow at the same time (its device slots) share one copy of the
corpus, freed with the last of them.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

_loaded: dict[tuple, weakref.ref] = {}
_loads: dict[tuple, threading.Lock] = {}  # one per corpus: a second stage waits for the first
_lookup = threading.Lock()


def _corpus_key(training: Any, seq_len: int, roots: tuple[str, ...] | None) -> tuple:
    """What the loaded data depends on, the files' sizes and times included: an edited or added
    file is a new corpus."""
    from swarm_core.data.datasets import DataError, textfiles_paths

    files: tuple = ()
    if training.dataset == "textfiles":
        try:
            files = tuple((f, (st := os.stat(f)).st_mtime_ns, st.st_size)
                          for f in textfiles_paths(training.dataset_paths, roots))
        except (DataError, OSError):
            files = ()  # the load says what is wrong
    return (training.dataset, tuple(training.dataset_paths), files, training.tokenizer,
            training.bpe_vocab_size, training.validation_fraction, training.real_min_tokens,
            seq_len, roots)


def shared_token_data(training: Any, seq_len: int, tokens: bool,
                      roots: tuple[str, ...] | None = None) -> Any:
    """``load_token_data``, once per process for the stages that run in it at the same time
    (a fellow's device slots): they share one copy of the corpus, freed with the last of them.
    A stage that reads no tokens takes a loaded copy if there is one. ``roots``: the fellow's
    data roots (see ``textfiles_paths``)."""
    from swarm_core.data import load_token_data

    key = _corpus_key(training, seq_len, roots)

    def cached() -> Any:
        for want in ((True, False) if not tokens else (True,)):
            ref = _loaded.get((*key, want))
            if ref is not None and (data := ref()) is not None:
                return data
        return None

    with _lookup:
        data = cached()
        if data is not None:
            return data
        if not tokens and training.tokenizer == "byte":
            return load_token_data(training, seq_len, tokens=False)  # nothing to read
        lock = _loads.setdefault((*key, tokens), threading.Lock())
    with lock:
        with _lookup:
            data = cached()
        if data is None:
            data = load_token_data(training, seq_len, tokens=tokens, roots=roots)
            with _lookup:
                for k in [k for k, r in _loaded.items() if r() is None]:
                    del _loaded[k]
                    _loads.pop(k, None)
                _loaded[(*key, tokens)] = weakref.ref(data)
        return data
