"""The calibration windows the peer scripts share (they run as scripts in their own venvs, so
they import this sibling file by name, not through the slimserve package)."""

from __future__ import annotations

import json
from pathlib import Path


def load_ids(path: Path) -> list[list[int]]:
    """The calibration windows as a list of equal-length int lists (.json, or a safetensors file
    with an `input_ids` tensor)."""
    if path.suffix == ".json":
        ids = json.loads(path.read_text())
    else:
        from safetensors.torch import load_file

        ids = load_file(str(path))["input_ids"].tolist()
    if not ids or len({len(row) for row in ids}) != 1:
        raise SystemExit(f"{path}: expected a non-empty [num_samples, seq_len] array of token ids")
    return ids
