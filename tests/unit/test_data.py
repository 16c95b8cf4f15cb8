from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm_core.config.schemas import TrainingConfig
from swarm_core.data import DataError, load_token_data
from swarm_core.data.datasets import load_text, shakespeare_text, textfiles_paths


def test_shakespeare_is_real_text_and_splits_deterministically():
    text = shakespeare_text()
    assert len(text) > 4_000_000 and "HAMLET" in text and "Exeunt" in text
    a = load_token_data(TrainingConfig(), 32)
    b = load_token_data(TrainingConfig(), 32)
    assert a.vocab_size == 256
    assert torch.equal(a.train[:1000], b.train[:1000]) and len(a.val) == len(b.val)
    total = len(a.train) + len(a.val)
    assert abs(len(a.val) / total - 0.05) < 0.01


def test_batches_depend_on_seed_and_step_only():
    d = load_token_data(TrainingConfig(), 32)
    x1, y1 = d.batch(3, 4, 32, seed=1)
    x2, y2 = d.batch(3, 4, 32, seed=1)
    x3, _ = d.batch(4, 4, 32, seed=1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next tokens


def test_eval_batches_are_fixed_windows_spread_over_the_validation_split():
    d = load_token_data(TrainingConfig(), 32)
    ev = d.eval_batches(3, 4, 32)
    assert len(ev) == 3 and all(x.shape == y.shape == (4, 32) for x, y in ev)
    x = torch.cat([b[0] for b in ev])
    y = torch.cat([b[1] for b in ev])
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Each window is the validation split at a multiple of seq_len: none overlaps another,
    # and they reach from the split's start to its far end.
    fit = (len(d.val) - 1) // 32
    starts = [k * fit // 12 * 32 for k in range(12)]
    assert starts[0] == 0 and starts[-1] >= len(d.val) - 32 * (fit // 12 + 2)
    assert len(set(starts)) == 12
    for row, start in zip(x, starts, strict=True):
        assert torch.equal(row, d.val[start:start + 32].long())
    # No seed or step in them: every evaluation of every run scores the same text.
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ev, d.eval_batches(3, 4, 32),
                                                        strict=True))
    # More windows than the split holds: the split's windows, some twice, all in range.
    many = torch.cat([b[0] for b in d.eval_batches(fit // 4 + 1, 8, 32)])
    assert len(many) > fit and len({tuple(r.tolist()) for r in many}) <= fit


def test_real_min_tokens_is_enforced_not_padded():
    with pytest.raises(DataError, match="fewer than real_min_tokens=100000000"):
        load_token_data(TrainingConfig(real_min_tokens=100_000_000), 32)


def test_textfiles_and_missing_paths(tmp_path):
    (tmp_path / "a.txt").write_text("to be or not to be, that is the question. " * 200)
    d = load_token_data(TrainingConfig(dataset="textfiles",
                                       dataset_paths=[str(tmp_path / "*.txt")]), 16)
    assert d.tokenizer.decode(d.train[:9].tolist()) == "to be or "
    with pytest.raises(DataError, match="matches no file"):
        load_token_data(TrainingConfig(dataset="textfiles",
                                       dataset_paths=[str(tmp_path / "nope*.md")]), 16)


@pytest.fixture
def data_root(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("to be or not to be " * 100)
    (root / "sub" / "b.txt").write_text("that is the question " * 100)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key.txt").write_text("SWARM_TOKEN=hunter2")
    return root


OUTSIDE = "is outside this fellow's data roots"


@pytest.mark.parametrize("pattern", [
    "/proc/self/environ", "/etc/pass*", "~/.bash*", "/**", "/etc/no-such-file-here",
    "{root}/../secret/key.txt", "{root}/../secret/*", "{root}/../**/*.txt", "relative/*.txt",
])
def test_a_fellow_reads_nothing_outside_its_data_roots(data_root, pattern):
    """Outside the roots is refused whether or not the file exists, with a message that names
    only the pattern: it tells nothing about the files out there."""
    pat = pattern.format(root=data_root)
    with pytest.raises(DataError) as err:
        textfiles_paths([pat], roots=(str(data_root.resolve()),))
    assert str(err.value) == (f"dataset_paths: {pat!r} {OUTSIDE} (its operator names them: "
                              "swarm fellow --data-root DIR)")


def test_a_symlink_in_a_data_root_does_not_lead_out_of_it(data_root):
    (data_root / "link.txt").symlink_to(data_root.parent / "secret" / "key.txt")
    (data_root / "linked-dir").symlink_to(data_root.parent / "secret")
    roots = (str(data_root.resolve()),)
    for pat in (data_root / "link.txt", data_root / "*.txt", data_root / "**" / "*.txt",
                data_root / "linked-dir" / "key.txt"):
        with pytest.raises(DataError, match=OUTSIDE):
            textfiles_paths([str(pat)], roots=roots)


def test_files_under_a_data_root_are_read(data_root):
    roots = (str(data_root.resolve()),)
    got = textfiles_paths([str(data_root / "**" / "*.txt")], roots=roots)
    assert sorted(Path(f).name for f in got) == ["a.txt", "b.txt"]
    d = load_token_data(TrainingConfig(dataset="textfiles",
                                       dataset_paths=[str(data_root / "a.txt")]), 16,
                        roots=roots)
    assert d.tokenizer.decode(d.train[:6].tolist()) == "to be "
    with pytest.raises(DataError, match="matches no file"):
        textfiles_paths([str(data_root / "nope*.md")], roots=roots)
    with pytest.raises(DataError, match=OUTSIDE):  # no roots at all: nothing may be read
        textfiles_paths([str(data_root / "a.txt")], roots=())


def test_overlapping_patterns_read_each_file_once(tmp_path):
    """A file named by two patterns is read once: a second copy would put training text in
    the validation split. A pattern that matches only directories matches no file."""
    (tmp_path / "a.txt").write_text("alpha " * 300)
    (tmp_path / "b.txt").write_text("beta " * 300)
    (tmp_path / "sub.txt").mkdir()
    once = load_text(TrainingConfig(dataset="textfiles", dataset_paths=[str(tmp_path / "*.txt")]))
    both = load_text(TrainingConfig(dataset="textfiles", dataset_paths=[
        str(tmp_path / "a.txt"), str(tmp_path / "*.txt")]))
    assert both == once and once.count("alpha") == 300 and once.count("beta") == 300
    with pytest.raises(DataError, match=r"sub\.txt' matches no file"):
        load_text(TrainingConfig(dataset="textfiles", dataset_paths=[str(tmp_path / "sub.txt")]))


def test_too_small_corpus_is_a_clear_error(tmp_path):
    (tmp_path / "tiny.txt").write_text("short")
    with pytest.raises(DataError, match="fewer than seq_len"):
        load_token_data(TrainingConfig(dataset="textfiles",
                                       dataset_paths=[str(tmp_path / "tiny.txt")]), 64)


def test_wikitext_without_datasets_says_how_to_get_it():
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="pip install datasets"):
            load_token_data(TrainingConfig(dataset="wikitext103"), 32)
    else:
        with pytest.raises(DataError, match="wikitext"):
            load_token_data(TrainingConfig(dataset="wikitext103"), 32)


def test_bpe_trains_offline_and_caches(tmp_path, swarm_home):
    words = " ".join(f"word{i % 50} thing{i % 7}" for i in range(4000))
    (tmp_path / "c.txt").write_text(words)
    cfg = TrainingConfig(dataset="textfiles", dataset_paths=[str(tmp_path / "c.txt")],
                         tokenizer="bpe", bpe_vocab_size=300)
    d = load_token_data(cfg, 16)
    assert 256 < d.vocab_size <= 300
    assert len(d.train) < len(words) * 0.95 * 0.6  # merges compress the text
    assert d.tokenizer.decode(d.train[:20].tolist()) in words
    cached = list((swarm_home / "cache" / "bpe").glob("bpe-300-*"))
    assert any(p.suffix == ".json" for p in cached) and any(p.suffix == ".npy" for p in cached)
    again = load_token_data(cfg, 16)
    assert torch.equal(again.train, d.train)
    # A damaged cache entry is trained anew, to the same tokenizer.
    (json_file,) = [p for p in cached if p.suffix == ".json"]
    json_file.write_text(json_file.read_text()[:100])
    healed = load_token_data(cfg, 16)
    assert healed.tokenizer.spec()["sha256"] == d.tokenizer.spec()["sha256"]
    assert torch.equal(healed.train, d.train)


def test_wikitext_uses_its_own_splits_offline(tmp_path, monkeypatch):
    """A stand-in ``datasets`` package (the real one is not installed here) records what the
    loader does: offline mode is on before the package is imported, and the validation text
    is the corpus's own validation split, not a cut of its training split."""
    import sys

    (tmp_path / "datasets.py").write_text(
        "import os\n"
        "OFFLINE_AT_IMPORT = os.environ.get('HF_DATASETS_OFFLINE')\n"
        "CALLS = []\n"
        "def load_dataset(name, config, split):\n"
        "    CALLS.append((name, config, split))\n"
        "    line = {'train': 'the train split. ', 'validation': 'held out words. '}[split]\n"
        "    return {'text': [line] * 400}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "datasets", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    d = load_token_data(TrainingConfig(dataset="wikitext103"), 16)
    fake = sys.modules["datasets"]
    assert fake.OFFLINE_AT_IMPORT == "1"
    assert fake.CALLS == [("wikitext", "wikitext-103-raw-v1", "train"),
                          ("wikitext", "wikitext-103-raw-v1", "validation")]
    assert d.tokenizer.decode(d.val[:16].tolist()) == "held out words. "
    assert len(d.val) == 400 * 16 and "held" not in d.tokenizer.decode(d.train.tolist())
    # Ids are held narrow; batches come out as int64 for the embedding and the loss.
    assert d.train.dtype == torch.uint8
    x, y = d.batch(0, 2, 16, seed=0)
    assert x.dtype == y.dtype == torch.int64


def test_a_stage_that_reads_no_tokens_loads_only_the_tokenizer(tmp_path):
    """tokens=False: the byte tokenizer needs no text (a missing file is not even read); BPE
    reads the text for its tokenizer but holds no token ids."""
    gone = TrainingConfig(dataset="textfiles", dataset_paths=[str(tmp_path / "gone*.txt")])
    d = load_token_data(gone, 16, tokens=False)
    assert (len(d.train), len(d.val), d.vocab_size) == (0, 0, 256)
    (tmp_path / "a.txt").write_text("to be or not to be, that is the question. " * 200)
    bpe = TrainingConfig(dataset="textfiles", dataset_paths=[str(tmp_path / "a.txt")],
                         tokenizer="bpe", bpe_vocab_size=300)
    full, bare = load_token_data(bpe, 16), load_token_data(bpe, 16, tokens=False)
    assert len(bare.train) == len(bare.val) == 0 and len(full.train) > 0
    assert bare.vocab_size == full.vocab_size and bare.tokenizer.spec() == full.tokenizer.spec()


def test_stages_of_one_process_share_one_loaded_corpus():
    """A fellow's stages running at once share one copy of the corpus; a stage that reads no
    tokens takes it too; once no stage holds it, the next job loads afresh."""
    import gc

    from swarm_core.fellow.corpus import shared_token_data

    tc = TrainingConfig()
    a = shared_token_data(tc, 32, tokens=True)
    assert shared_token_data(tc, 32, tokens=True) is a
    assert shared_token_data(tc, 32, tokens=False) is a
    other = shared_token_data(TrainingConfig(validation_fraction=0.1), 32, tokens=True)
    assert other is not a and len(other.val) > len(a.val)
    del a, other
    gc.collect()
    again = shared_token_data(tc, 32, tokens=False)
    assert len(again.train) == 0, "nothing held it: the middle stage loaded only the tokenizer"


def test_an_edited_corpus_is_not_served_from_the_shared_copy(tmp_path):
    """Even while an old copy is still held, a changed file is a new corpus."""
    from swarm_core.fellow.corpus import shared_token_data

    (tmp_path / "a.txt").write_text("alpha beta gamma. " * 200)
    tc = TrainingConfig(dataset="textfiles", dataset_paths=[str(tmp_path / "*.txt")])
    old = shared_token_data(tc, 16, tokens=True)
    (tmp_path / "a.txt").write_text("delta epsilon zeta eta. " * 200)
    new = shared_token_data(tc, 16, tokens=True)
    assert new is not old
    assert new.tokenizer.decode(new.train[:6].tolist()) == "delta "

