"""The built-in `stdlib` corpus: the running Python's standard library source.

Offline machines have no dataset to calibrate or evaluate on, so the project uses the `*.py`
files of the interpreter's own standard library. The split into train and validation is a
deterministic function of each file's path relative to the stdlib root, so every machine with
the same Python version sees the same split.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Folders skipped anywhere in the tree: third-party code, the test suites (huge, repetitive)
# and IDLE (GUI code that is mostly Tk boilerplate).
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
)
# Per-mille of files that go to validation (about 5%).
VALIDATION_PER_MILLE = 50
SPLITS = ("train", "validation")


@dataclass(frozen=True, slots=True)
class CorpusFile:
    rel_path: str  # path relative to the stdlib root, with '/' separators
    path: Path  # absolute path on this machine


def stdlib_root() -> Path:
    """The folder holding the running interpreter's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(rel_path: str) -> str:
    """'validation' for about 5% of files, chosen by a hash of the relative path; else 'train'."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:4], "big") % 1000
    return "validation" if bucket < VALIDATION_PER_MILLE else "train"


def list_files(split: str, root: Path | None = None) -> list[CorpusFile]:
    """All corpus files of one split, sorted by relative path (deterministic order)."""
    if split not in SPLITS:
        raise ValueError(f"unknown stdlib split {split!r}; use one of {', '.join(SPLITS)}")
    root = root or stdlib_root()
    found: list[CorpusFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if split_of(rel) == split:
                found.append(CorpusFile(rel, path))
    found.sort(key=lambda f: f.rel_path)
    return found


def read_texts(split: str, root: Path | None = None) -> list[str]:
    """The UTF-8 text of every file of a split (undecodable bytes replaced), in sorted order."""
    return [f.path.read_text(encoding="utf-8", errors="replace") for f in list_files(split, root)]
