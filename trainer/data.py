"""Data: corpora, the token cache, per-learner token streams and validation.

Sources
  `stdlib`            the `.py` files of this Python's standard library (sorted by relative
                      path; site-packages, dist-packages and __pycache__ are skipped)
  a file              text, or `.jsonl` (one JSON object per line, its `text` field is used;
                      a bare JSON string line is used as is)
  a directory         every file below it, recursively, sorted; files whose first 8 KiB hold
                      a NUL byte are treated as binary and skipped
  a glob              `data/*.txt`, `corpus/**/*.jsonl` (glob.glob's rules: `**` is any number
                      of folders, wildcards skip hidden names unless the segment starts with `.`)
  several, joined with `,` (or a list)

File selection is bounded, not glob.glob (whose cost grows like k^4 with k `**`): a glob holds
at most MAX_GLOB_STARS `**` segments; one dataset selects at most MAX_DATASET_FILES files,
visits at most MAX_WALK_ENTRIES directory entries and takes at most `deadline_s` seconds
(WALK_DEADLINE_S), and a `should_stop` callable (asked at most every 0.25 s) cancels it; past any a
`SelectionLimit` (a ValueError) names the limit. Each folder is listed at most once per
pattern segment, symlinked folders included (a link loop ends there).

Tokens are bytes (vocabulary 256) unless a local `tokenizer.json` is given, which needs the
optional `tokenizers` package. Documents are joined with a blank line. The token arrays are
cached as memory-mapped files under the cache dir (`$DILOCO_CACHE_DIR`, else `var/cache`),
keyed by a fingerprint of the tokenizer and of every input file's path, size and mtime.

Validation split: the token array is cut into chunks of 8192 tokens; every k-th chunk
(k = round(1 / val_fraction)) is held out. Corpora smaller than two chunks hold out their
last `val_fraction` instead.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# split_source and the `**` bound are the spec's (trainer.spec stays free of numpy and torch)
from trainer.spec import GLOB_CHARS, MAX_GLOB_STARS, glob_stars, short, split_source

CHUNK = 8192
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}
CACHE_VERSION = 1
# Bounds of one dataset's file selection (`stdlib` excepted): see the module's docstring.
MAX_DATASET_FILES = 10_000
MAX_WALK_ENTRIES = 500_000
WALK_DEADLINE_S = 30.0
_CHECK_EVERY = 256  # directory entries between two deadline / cancel checks
_STOP_EVERY_S = 0.25  # should_stop (a host's cancel check, maybe a query) at most this often


def stdlib_dir() -> Path:
    path = sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__)
    if not os.path.isdir(path):
        path = os.path.dirname(os.__file__)
    return Path(path)


def default_cache_dir() -> Path:
    return Path(os.environ.get("DILOCO_CACHE_DIR") or Path("var") / "cache")


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as fh:
        return b"\x00" in fh.read(8192)


def inside_roots(path: Path, roots: Iterable[Path]) -> bool:
    """Whether `path`, with every symlink resolved, lies inside one of `roots`."""
    try:
        real = path.resolve()
    except (OSError, RuntimeError, ValueError):
        return False
    return any(real == root or root in real.parents for root in roots)


class SelectionLimit(ValueError):
    """A dataset's file selection went past one of its bounds, or was cancelled."""


class _Budget:
    """What one dataset's selection may still spend: files, directory entries, time."""

    def __init__(self, max_files: int, max_entries: int, deadline_s: float | None,
                 should_stop: Callable[[], bool] | None) -> None:
        self.max_files, self.max_entries = max_files, max_entries
        self.deadline_s = deadline_s
        self.deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self.should_stop = should_stop
        self.asked = -math.inf  # when should_stop was last called
        self.files = self.entries = 0

    def check(self, part: str) -> None:
        now = time.monotonic()
        if self.deadline is not None and now > self.deadline:
            raise SelectionLimit(f"data source {short(part)}: selecting its files took longer than "
                                 f"{self.deadline_s:g} s")
        if self.should_stop is not None and now - self.asked >= _STOP_EVERY_S:
            self.asked = now
            if self.should_stop():
                raise SelectionLimit(f"data source {short(part)}: file selection cancelled")

    def entry(self, part: str) -> None:
        self.entries += 1
        if self.entries > self.max_entries:
            raise SelectionLimit(f"data source {short(part)}: visits more than {self.max_entries:,} "
                                 "directory entries")
        if self.entries % _CHECK_EVERY == 0:
            self.check(part)

    def file(self, part: str) -> None:
        self.files += 1
        if self.files > self.max_files:
            raise SelectionLimit(f"data source {short(part)}: the dataset selects more than "
                                 f"{self.max_files:,} files")


def _scan(folder: str, part: str, budget: _Budget) -> list[os.DirEntry]:
    """The entries of `folder`, sorted by name, each counted; [] when it cannot be listed."""
    budget.check(part)
    try:
        with os.scandir(folder or ".") as it:
            entries = []
            for entry in it:
                budget.entry(part)
                entries.append(entry)
    except OSError:
        return []
    return sorted(entries, key=lambda e: e.name)


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _is_file(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file()
    except OSError:
        return False


def _folder_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path or ".")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _join(folder: str, name: str) -> str:
    return os.path.join(folder, name) if folder else name


def glob_files(pattern: str, budget: _Budget | None = None) -> list[Path]:
    """The files `pattern` matches under glob.glob(pattern, recursive=True)'s rules, sorted,
    found by a bounded walk: each (folder, segment) pair is visited once, symlinks followed."""
    budget = budget or _Budget(MAX_DATASET_FILES, MAX_WALK_ENTRIES, WALK_DEADLINE_S, None)
    stars = glob_stars(pattern)
    if stars > MAX_GLOB_STARS:
        raise SelectionLimit(f"data source {short(pattern)}: at most {MAX_GLOB_STARS} '**' per pattern "
                             f"({stars} given)")
    if pattern.endswith("/"):
        return []  # glob: folders only, and a dataset reads files
    segs = [seg for seg in pattern.split("/") if seg not in ("", ".")]
    fixed = 0
    while fixed < len(segs) and not any(ch in segs[fixed] for ch in GLOB_CHARS):
        fixed += 1
    base = ("/" if pattern.startswith("/") else "") + "/".join(segs[:fixed])
    segs = segs[fixed:]
    if not segs:
        return [Path(base)] if os.path.isfile(base) else []
    found: dict[str, None] = {}
    seen: set[tuple[tuple[int, int], int]] = set()
    stack = [(base, 0)]
    while stack:
        folder, i = stack.pop()
        key = _folder_key(folder)
        if key is None or (key, i) in seen:
            continue
        seen.add((key, i))
        for item in _step(folder, i, segs, pattern, budget):
            if isinstance(item, str):
                if item not in found:
                    budget.file(pattern)
                    found[item] = None
            else:
                stack.append(item)
    return sorted(Path(p) for p in found)


def _step(folder: str, i: int, segs: list[str], part: str, budget: _Budget):
    """From `folder` at segment `i`: matched files (str) and the (folder, segment) pairs to visit."""
    seg, last = segs[i], i == len(segs) - 1
    if not any(ch in seg for ch in GLOB_CHARS):  # a literal segment after a wildcard one
        path = _join(folder, seg)
        if last:
            return [path] if os.path.isfile(path) else []
        return [(path, i + 1)] if os.path.isdir(path) else []
    out: list = []
    if seg == "**":
        if not last:
            out.append((folder, i + 1))  # `**` as no folder at all
        for entry in _scan(folder, part, budget):
            if entry.name.startswith("."):
                continue
            path = _join(folder, entry.name)
            if _is_dir(entry):
                out.append((path, i))
            elif last and _is_file(entry):
                out.append(path)
        return out[::-1]
    hidden_ok = seg.startswith(".")
    for entry in _scan(folder, part, budget):
        if (entry.name.startswith(".") and not hidden_ok) or not fnmatch.fnmatchcase(entry.name, seg):
            continue
        path = _join(folder, entry.name)
        if last:
            if _is_file(entry):
                out.append(path)
        elif _is_dir(entry):
            out.append((path, i + 1))
    return out[::-1]


def folder_files(root: Path, budget: _Budget | None = None) -> list[Path]:
    """Every file below `root` (hidden ones too), sorted by relative path, skipping _SKIP_DIRS;
    symlinked folders are not entered (as Path.rglob), symlinked files are listed. Bounded."""
    budget = budget or _Budget(MAX_DATASET_FILES, MAX_WALK_ENTRIES, WALK_DEADLINE_S, None)
    part = str(root)
    found: list[tuple[str, Path]] = []
    stack = [(str(root), "")]
    while stack:
        folder, rel = stack.pop()
        for entry in _scan(folder, part, budget):
            if entry.name in _SKIP_DIRS:
                continue
            sub = f"{rel}/{entry.name}" if rel else entry.name
            if _is_dir(entry) and not entry.is_symlink():
                stack.append((entry.path, sub))
            elif _is_file(entry):
                budget.file(part)
                found.append((sub, root / sub))
    return [p for _, p in sorted(found)]


def resolve_files(source: str | Iterable[str], roots: Iterable[Path] | None = None, *,
                  should_stop: Callable[[], bool] | None = None,
                  deadline_s: float | None = WALK_DEADLINE_S,
                  max_files: int = MAX_DATASET_FILES, max_entries: int = MAX_WALK_ENTRIES) -> list[Path]:
    """The input files of a source spec, deterministic order, no duplicates.

    With `roots` (the platform's data roots), every file found, after symlinks, must lie
    inside one of them (`stdlib` excepted): a link in a data folder cannot reach elsewhere.
    Globs and folders are walked within the bounds (`SelectionLimit` past one of them):
    `max_files` files, `max_entries` directory entries, `deadline_s` seconds, `should_stop`.
    """
    parts = split_source(source)
    if not parts:
        raise ValueError("empty data source")
    budget = _Budget(max_files, max_entries, deadline_s, should_stop)
    files: list[Path] = []
    for part in parts:
        if part == "stdlib":
            root = stdlib_dir()
            found = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)]
            files.extend(sorted(found, key=lambda p: p.relative_to(root).as_posix()))
        elif any(ch in part for ch in GLOB_CHARS):
            matched = glob_files(part, budget)
            if not matched:
                raise ValueError(f"data source {short(part)} matches no files")
            files.extend(p for p in matched if not _is_binary(p))
        else:
            path = Path(part)
            if path.is_file():
                budget.file(part)
                files.append(path)
            elif path.is_dir():
                files.extend(p for p in folder_files(path, budget) if not _is_binary(p))
            else:
                raise ValueError(f"data source {short(part)} does not exist")
    if roots is not None:
        allowed = [Path(r).resolve() for r in roots]
        std = stdlib_dir().resolve()
        outside = [f for f in files if not inside_roots(f, [*allowed, std])]
        if outside:
            raise ValueError(f"data source file {str(outside[0])!r} lies outside the data roots")
    seen: set[str] = set()
    unique = []
    for f in files:
        key = str(f.resolve())
        if key not in seen:
            seen.add(key)
            unique.append(f)
    if not unique:
        raise ValueError(f"data source {short(str(source))} holds no text files")
    return unique


def _documents(path: Path) -> Iterable[bytes]:
    raw = path.read_bytes()
    if path.suffix == ".jsonl":
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
            text = obj if isinstance(obj, str) else obj.get("text") if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: expected a string or an object with a 'text' string")
            yield text.encode("utf-8")
    else:
        yield raw


class ByteTokenizer:
    name = "bytes"
    vocab_size = 256

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, tokens: Iterable[int]) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class FileTokenizer:
    """A local Hugging Face `tokenizer.json` (optional dependency `tokenizers`)."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer  # noqa: PLC0415 - optional dependency
        except ImportError as exc:
            raise ValueError("a tokenizer.json needs the optional 'tokenizers' package") from exc
        self._tok = Tokenizer.from_file(str(path))
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
        self.name = f"tokenizer-{digest}"
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, data: bytes) -> np.ndarray:
        return np.asarray(self._tok.encode(data.decode("utf-8", errors="replace")).ids, dtype=np.int64)

    def decode(self, tokens: Iterable[int]) -> str:
        return self._tok.decode([int(t) for t in tokens])


def _token_dtype(vocab: int) -> np.dtype:
    if vocab <= 256:
        return np.dtype(np.uint8)
    if vocab <= 65536:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)




@dataclass
class Corpus:
    train: np.ndarray
    val: np.ndarray
    fingerprint: str
    vocab_size: int
    files: int
    tokenizer_name: str

    @classmethod
    def load(cls, source: str | Iterable[str] = "stdlib", cache_dir: str | os.PathLike | None = None,
             tokenizer: str | None = None, val_fraction: float = 0.05,
             roots: Iterable[Path] | None = None, should_stop: Callable[[], bool] | None = None,
             deadline_s: float | None = WALK_DEADLINE_S) -> Corpus:
        """The corpus of `source`: its files selected within the bounds of `resolve_files`
        (`should_stop`, `deadline_s`), tokenized once into the cache."""
        tok = FileTokenizer(tokenizer) if tokenizer else ByteTokenizer()
        files = resolve_files(source, roots, should_stop=should_stop, deadline_s=deadline_s)
        h = hashlib.sha256(f"v{CACHE_VERSION}|{tok.name}|{val_fraction}".encode())
        for f in files:
            st = f.stat()
            h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
        fp = h.hexdigest()[:24]
        dtype = _token_dtype(tok.vocab_size)
        cache = Path(cache_dir) if cache_dir else default_cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        meta_path = cache / f"tokens-{fp}.json"
        if not meta_path.exists():
            cls._build(files, tok, dtype, cache, fp, val_fraction)
        meta = json.loads(meta_path.read_text())
        train = _open_memmap(cache / f"tokens-{fp}.train.bin", dtype, meta["train"])
        val = _open_memmap(cache / f"tokens-{fp}.val.bin", dtype, meta["val"])
        return cls(train=train, val=val, fingerprint=fp, vocab_size=tok.vocab_size, files=meta["files"],
                   tokenizer_name=tok.name)

    @staticmethod
    def _build(files, tok, dtype, cache: Path, fp: str, val_fraction: float) -> None:
        pieces = []
        for f in files:
            for doc in _documents(f):
                pieces.append(tok.encode(doc).astype(dtype, copy=False))
                pieces.append(tok.encode(b"\n\n").astype(dtype, copy=False))
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
        n = len(tokens)
        if n < 64:
            raise ValueError(f"corpus too small: {n} tokens")
        nchunks = n // CHUNK
        if nchunks >= 2:
            k = max(2, round(1 / val_fraction))
            idx = np.arange(n) // CHUNK
            is_val = (idx % k == k - 1) & (idx < nchunks)
            train, val = tokens[~is_val], tokens[is_val]
        else:
            cut = n - max(32, int(n * val_fraction))
            train, val = tokens[:cut], tokens[cut:]
        for name, arr in (("train", train), ("val", val)):
            _atomic_write(cache / f"tokens-{fp}.{name}.bin", arr.tobytes())
        meta = {"train": int(len(train)), "val": int(len(val)), "files": len(files),
                "dtype": dtype.name, "tokenizer": tok.name, "vocab_size": tok.vocab_size}
        _atomic_write(cache / f"tokens-{fp}.json", json.dumps(meta).encode())


def _open_memmap(path: Path, dtype: np.dtype, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,))


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class TokenStream:
    """The deterministic token stream of one learner.

    The train array is cut into windows of `seq_len + 1` tokens at stride `seq_len`. Epoch e
    visits the windows in a permutation seeded by (seed, e); learner i of M takes the
    permuted windows i, i + M, i + 2M, ... `cursor` counts the windows this learner has
    consumed, so (seed, learner, M, cursor) pins the position exactly: a restored stream
    never skips a window nor reads one twice within an epoch.
    """

    def __init__(self, corpus: Corpus, learner_index: int, num_learners: int, batch_size: int,
                 seq_len: int, seed: int = 0) -> None:
        if not 0 <= learner_index < num_learners:
            raise ValueError(f"learner_index {learner_index} outside 0..{num_learners - 1}")
        self.corpus = corpus
        self.learner_index = learner_index
        self.num_learners = num_learners
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.windows = (len(corpus.train) - 1) // seq_len
        self.per_learner = self.windows // num_learners
        if self.per_learner < 1:
            raise ValueError(f"corpus too small: {self.windows} windows of {seq_len} tokens for "
                             f"{num_learners} learners")
        self.cursor = 0
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def _window_index(self, n: int) -> int:
        epoch, pos = divmod(n, self.per_learner)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch, 0x5EED])
            self._perm = rng.permutation(self.windows)
            self._epoch = epoch
        return int(self._perm[pos * self.num_learners + self.learner_index])

    @property
    def epoch(self) -> int:
        return self.cursor // self.per_learner

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for _ in range(self.batch_size):
            start = self._window_index(self.cursor) * self.seq_len
            rows.append(np.asarray(self.corpus.train[start:start + self.seq_len + 1], dtype=np.int64))
            self.cursor += 1
        arr = torch.from_numpy(np.stack(rows))
        return arr[:, :-1], arr[:, 1:]

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "learner_index": self.learner_index, "num_learners": self.num_learners,
                "seq_len": self.seq_len, "seed": self.seed, "fingerprint": self.corpus.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        for key in ("learner_index", "num_learners", "seq_len", "seed", "fingerprint"):
            mine = self.corpus.fingerprint if key == "fingerprint" else getattr(self, key)
            if state.get(key) != mine:
                raise ValueError(f"stream state is for {key}={state.get(key)!r}, this stream has {mine!r}")
        cursor = int(state["cursor"])
        if cursor < 0:
            raise ValueError("negative cursor")
        self.cursor = cursor


def val_windows(corpus: Corpus, seq_len: int, count: int) -> np.ndarray:
    """Start offsets of `count` evenly spaced validation windows (deterministic)."""
    available = (len(corpus.val) - 1) // seq_len
    if available < 1:
        raise ValueError("validation split is shorter than one sequence")
    count = min(count, available)
    return (np.linspace(0, available - 1, count).round().astype(np.int64)) * seq_len


@torch.no_grad()
def evaluate(model: torch.nn.Module, corpus: Corpus, batch_size: int, seq_len: int, batches: int = 8,
             seed: int = 0, device: torch.device | str | None = None) -> float:
    """Mean validation loss (nats per token) over fixed, evenly spaced windows."""
    del seed  # windows are evenly spaced, not sampled: the result does not depend on a seed
    starts = val_windows(corpus, seq_len, batches * batch_size)
    was_training = model.training
    model.eval()
    if device is None:
        device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for i in range(0, len(starts), batch_size):
            rows = [np.asarray(corpus.val[s:s + seq_len + 1], dtype=np.int64)
                    for s in starts[i:i + batch_size]]
            arr = torch.from_numpy(np.stack(rows)).to(device)
            loss = model.loss(arr[:, :-1], arr[:, 1:])
            total += float(loss) * len(rows)
            count += len(rows)
    finally:
        model.train(was_training)
    return total / count
