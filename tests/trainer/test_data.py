from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch

from trainer.data import Corpus, TokenStream, evaluate, resolve_files, stdlib_dir
from trainer.models import build_model


def test_stdlib_corpus_is_sorted_and_split(stdlib_corpus):
    files = resolve_files("stdlib")
    rel = [f.relative_to(stdlib_dir()).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 500
    assert not any("site-packages" in r or "__pycache__" in r for r in rel)
    assert stdlib_corpus.vocab_size == 256 and stdlib_corpus.train.dtype == np.uint8
    assert stdlib_corpus.files == len(files)
    total = len(stdlib_corpus.train) + len(stdlib_corpus.val)
    assert 0.03 < len(stdlib_corpus.val) / total < 0.07
    assert isinstance(stdlib_corpus.train, np.memmap)


def test_cache_is_keyed_by_fingerprint(tmp_path):
    src = tmp_path / "docs"
    src.mkdir()
    (src / "a.txt").write_text("hello world\n" * 500)
    (src / "b.md").write_text("second file " * 300)
    (src / "blob.bin").write_bytes(b"\x00\x01binary" * 10)
    cache = tmp_path / "cache"
    c1 = Corpus.load(str(src), cache_dir=cache)
    c2 = Corpus.load(str(src), cache_dir=cache)
    assert c1.fingerprint == c2.fingerprint and c1.files == 2  # the binary file is skipped
    assert len(list(cache.glob("tokens-*.json"))) == 1
    time.sleep(0.01)
    (src / "a.txt").write_text("changed\n" * 500)
    os.utime(src / "a.txt")
    c3 = Corpus.load(str(src), cache_dir=cache)
    assert c3.fingerprint != c1.fingerprint
    assert b"changed" in bytes(np.concatenate([c3.train, c3.val]))


def test_jsonl_glob_and_errors(tmp_path):
    (tmp_path / "d1.jsonl").write_text("\n".join(json.dumps({"text": f"doc {i} " * 20}) for i in range(30)))
    (tmp_path / "d2.jsonl").write_text(json.dumps("a bare string document " * 10) + "\n")
    c = Corpus.load(str(tmp_path / "*.jsonl"), cache_dir=tmp_path / "c")
    data = bytes(np.concatenate([c.train, c.val]))
    assert b"doc 7 doc 7" in data and b'"text"' not in data and b"bare string" in data
    (tmp_path / "bad.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        Corpus.load(str(tmp_path / "bad.jsonl"), cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="does not exist"):
        Corpus.load(str(tmp_path / "nope"), cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="matches no files"):
        Corpus.load(str(tmp_path / "*.xyz"), cache_dir=tmp_path / "c")


def test_tokenizer_json_needs_optional_package(tmp_path):
    (tmp_path / "t.txt").write_text("x" * 1000)
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="tokenizers"):
            Corpus.load(str(tmp_path / "t.txt"), cache_dir=tmp_path, tokenizer=str(tmp_path / "tok.json"))


def _windows(stream, n):
    starts = []
    for _ in range(n):
        starts.append(stream._window_index(stream.cursor))
        stream.cursor += 1
    return starts


def test_streams_are_deterministic_and_disjoint(stdlib_corpus):
    a = [TokenStream(stdlib_corpus, i, 3, 4, 32, seed=1) for i in range(3)]
    seen = [set(_windows(s, 200)) for s in a]
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2])
    b = TokenStream(stdlib_corpus, 0, 3, 4, 32, seed=1)
    x1, y1 = b.next_batch()
    c = TokenStream(stdlib_corpus, 0, 3, 4, 32, seed=1)
    x2, y2 = c.next_batch()
    assert torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])
    assert x1.dtype == torch.long and x1.shape == (4, 32)


def test_restore_continues_exactly(stdlib_corpus):
    s = TokenStream(stdlib_corpus, 1, 2, 3, 16, seed=5)
    for _ in range(5):
        s.next_batch()
    state = s.state_dict()
    expected = [s.next_batch()[0] for _ in range(4)]
    moved = TokenStream(stdlib_corpus, 1, 2, 3, 16, seed=5)  # "on another node"
    moved.load_state_dict(state)
    got = [moved.next_batch()[0] for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    with pytest.raises(ValueError, match="learner_index"):
        TokenStream(stdlib_corpus, 0, 2, 3, 16, seed=5).load_state_dict(state)


def test_no_window_read_twice_within_an_epoch_across_restore(tmp_path):
    (tmp_path / "t.txt").write_bytes(bytes(range(256)) * 40)
    corpus = Corpus.load(str(tmp_path / "t.txt"), cache_dir=tmp_path / "c")
    s = TokenStream(corpus, 0, 2, 1, 8, seed=0)
    per = s.per_learner
    first = _windows(s, per // 2)
    restored = TokenStream(corpus, 0, 2, 1, 8, seed=0)
    restored.load_state_dict(s.state_dict())
    rest = _windows(restored, per - per // 2)
    epoch = first + rest
    assert len(set(epoch)) == per  # every window once, none skipped
    nxt = _windows(restored, per)  # the next epoch: a fresh shuffle
    assert len(set(nxt)) == per and nxt != epoch


def test_evaluate_is_deterministic(stdlib_corpus):
    m = build_model("tiny", seq_len=16)
    a = evaluate(m, stdlib_corpus, 4, 16, batches=2)
    b = evaluate(m, stdlib_corpus, 4, 16, batches=2)
    assert a == b and 5.0 < a < 6.0
    assert m.training
