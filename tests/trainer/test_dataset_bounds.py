"""Issue 35, High 1: a dataset's file selection is bounded (`**` per pattern, files, directory
entries, time, cancel), and a normal glob still selects what glob.glob selected."""
from __future__ import annotations

import glob
import os
import time
from pathlib import Path

import pytest

from trainer.data import (
    MAX_DATASET_FILES,
    MAX_GLOB_STARS,
    Corpus,
    SelectionLimit,
    folder_files,
    glob_files,
    resolve_files,
)
from trainer.spec import JobSpec, source_problem


def _tree(root: Path) -> Path:
    """A corpus tree with nesting, hidden names, character-class names and non-matching files."""
    files = [
        "top.txt", "top.md", ".hidden.txt", "a/x1.txt", "a/x2.txt", "a/y.jsonl", "a/b/c/deep.txt",
        "a/b/c/d/deeper.txt", "a/.dot/in_hidden.txt", ".hid/inside.txt", "b/x1.txt", "b/sub/s.txt",
        "c/sub/s.txt", "c/sub/t.md", "[x]/lit.txt", "space dir/f.txt",
    ]
    for rel in files:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"text of {rel}\n" * 20)
    (root / "emptydir").mkdir()
    (root / "a" / "folder.txt").mkdir()  # a folder whose name matches *.txt: not a file
    return root


def _glob(pattern: str) -> list[Path]:
    """What the engine selected before: glob.glob, files only, sorted, duplicates dropped."""
    return sorted({Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)})


PATTERNS = [
    "**/*.txt", "*.txt", "**", "*", "a/**/*.txt", "a/*.txt", "*/sub/*.txt", "*/sub/*", "a/x?.txt",
    "[ab]/*.txt", "**/.*", ".*", ".hid/*", "**/c/**", "**/**/*.txt", "a/**/**", "**/x1.txt",
    "*/b/*/*.txt", "nothere/**/*.txt", "**/*.nothing", "a/b/", "space dir/*", "[[]x]/*.txt",
    "a/**/d/*.txt", "a/*/c/**/*.txt",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_bounded_walk_selects_what_glob_selected(tmp_path, pattern):
    root = _tree(tmp_path / "corpus")
    assert glob_files(f"{root}/{pattern}") == _glob(f"{root}/{pattern}"), pattern


def test_relative_patterns_select_what_glob_selected(tmp_path, monkeypatch):
    _tree(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)
    for pattern in ("corpus/**/*.txt", "corpus/*.md", "*/a/*.txt", "./corpus/**/x1.txt"):
        assert glob_files(pattern) == _glob(pattern), pattern
        assert glob_files(pattern)


def test_normal_dataset_glob_reads_the_same_files(tmp_path):
    root = _tree(tmp_path / "corpus")
    (root / "a" / "blob.txt").write_bytes(b"\x00binary")
    pattern = f"{root}/**/*.txt"
    files = resolve_files(pattern, roots=[root])
    expected = [p for p in _glob(pattern) if b"\x00" not in p.read_bytes()[:8192]]
    assert files == expected and len(files) == 10
    corpus = Corpus.load(pattern, cache_dir=tmp_path / "cache", roots=[root])
    assert corpus.files == 10


def test_symlinked_folders_are_followed_once_and_loops_end(tmp_path):
    root = _tree(tmp_path / "corpus")
    pattern = f"{root}/**/*.txt"
    before = _glob(pattern)  # glob.glob before the links (through a loop it would not end)
    (root / "link").symlink_to(root / "a", target_is_directory=True)
    (root / "a" / "b" / "loop").symlink_to(root, target_is_directory=True)
    start = time.monotonic()
    files = resolve_files(pattern, roots=[root])
    assert time.monotonic() - start < 5
    # the same files, each once (glob.glob would list them again through every link)
    assert files == before


def test_symlink_escapes_are_still_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret " * 50)
    root = _tree(tmp_path / "corpus")
    (root / "a" / "escape.txt").symlink_to(outside / "secret.txt")
    (root / "esc").symlink_to(outside, target_is_directory=True)
    for source in (f"{root}/**/*.txt", f"{root}/a", f"{root}/esc/*.txt"):
        with pytest.raises(ValueError, match="outside the data roots"):
            resolve_files(source, roots=[root])


def test_folder_source_selects_what_rglob_selected(tmp_path):
    root = _tree(tmp_path / "corpus")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.txt").write_text("cache")
    (root / "a" / ".git").write_text("gitdir: elsewhere")
    (root / "linked").symlink_to(root / "b", target_is_directory=True)
    (root / "lf.txt").symlink_to(root / "top.txt")
    skip = {"site-packages", "dist-packages", "__pycache__", ".git"}
    old = sorted((p for p in root.rglob("*")
                  if p.is_file() and not skip.intersection(p.relative_to(root).parts)),
                 key=lambda p: p.relative_to(root).as_posix())
    assert folder_files(root) == old


def test_pathological_glob_is_refused_by_the_engine_at_once(tmp_path):
    root = _tree(tmp_path / "corpus")
    pattern = f"{root}/" + "**/" * 30 + "*.txt"
    start = time.monotonic()
    with pytest.raises(SelectionLimit, match=rf"at most {MAX_GLOB_STARS} '\*\*' per pattern"):
        resolve_files(pattern)
    with pytest.raises(ValueError, match="per pattern"):
        Corpus.load(pattern, cache_dir=tmp_path / "cache")
    assert time.monotonic() - start < 1


def test_pathological_glob_is_refused_by_the_spec():
    spec = {"dataset": "/data/" + "**/" * 30 + "*.txt"}
    with pytest.raises(ValueError, match=r"at most 2 '\*\*' per pattern"):
        JobSpec.model_validate(spec)
    assert source_problem("/data/**/x/**/*.txt") is None
    assert "at most 64 sources" in source_problem(",".join(f"/data/{i}.txt" for i in range(65)))
    with pytest.raises(ValueError, match="at most 64 sources"):
        JobSpec.model_validate({"dataset": ",".join(f"/data/{i}.txt" for i in range(65))})


def _deep(root: Path, depth: int, width: int) -> Path:
    """A chain `depth` folders deep with `width` sibling folders and a file at each level."""
    here = root
    for level in range(depth):
        for w in range(width):
            (here / f"w{w}").mkdir(parents=True, exist_ok=True)
        (here / f"f{level}.txt").parent.mkdir(parents=True, exist_ok=True)
        (here / f"f{level}.txt").write_text("x " * 40)
        here = here / "w0"
    return root


def test_two_stars_on_a_deep_tree_stay_cheap(tmp_path):
    root = _deep(tmp_path / "deep", depth=40, width=4)  # ~160 folders, like the tree
    start = time.monotonic()
    files = glob_files(f"{root}/**/**/*.txt")
    assert time.monotonic() - start < 2
    assert len(files) == 40 and files == _glob(f"{root}/**/*.txt")


def test_walk_stops_at_the_entry_cap(tmp_path):
    root = _deep(tmp_path / "deep", depth=30, width=5)
    start = time.monotonic()
    with pytest.raises(SelectionLimit, match="more than 50 directory entries"):
        resolve_files(f"{root}/**/*.txt", max_entries=50)
    with pytest.raises(SelectionLimit, match="more than 50 directory entries"):
        resolve_files(str(root), max_entries=50)
    assert time.monotonic() - start < 1


def test_walk_stops_at_the_file_cap(tmp_path):
    root = tmp_path / "many"
    root.mkdir()
    for i in range(30):
        (root / f"{i:03}.txt").write_text("y " * 40)
    with pytest.raises(SelectionLimit, match="selects more than 20 files"):
        resolve_files(f"{root}/*.txt", max_files=20)
    with pytest.raises(SelectionLimit, match="selects more than 20 files"):
        resolve_files(str(root), max_files=20)
    with pytest.raises(SelectionLimit, match="selects more than 20 files"):
        resolve_files(",".join(str(root / f"{i:03}.txt") for i in range(21)), max_files=20)
    assert len(resolve_files(f"{root}/*.txt", max_files=30)) == 30
    assert MAX_DATASET_FILES == 10_000


def test_walk_stops_at_the_deadline_and_on_cancel(tmp_path):
    root = _deep(tmp_path / "deep", depth=30, width=3)
    with pytest.raises(SelectionLimit, match="longer than 0 s"):
        resolve_files(f"{root}/**/*.txt", deadline_s=0)
    start = time.monotonic()
    with pytest.raises(SelectionLimit, match="cancelled"):
        Corpus.load(f"{root}/**/*.txt", cache_dir=tmp_path / "cache", should_stop=lambda: True)
    assert time.monotonic() - start < 1
    calls = []

    def slow(answer: bool):
        def should_stop() -> bool:  # a cancel check that costs (a query): it is asked sparingly
            calls.append(1)
            time.sleep(0.3)
            return answer and len(calls) > 2
        return should_stop

    with pytest.raises(SelectionLimit, match="cancelled"):
        resolve_files(f"{root}/**/*.txt", should_stop=slow(True))  # the cancel comes mid-walk
    assert len(calls) == 3
    calls.clear()
    cheap = []
    assert len(resolve_files(f"{root}/**/*.txt", should_stop=lambda: cheap.append(1))) == 30
    assert len(cheap) < 5  # 90 folders, asked at most every 0.25 s
