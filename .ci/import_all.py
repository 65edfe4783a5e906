"""Import every module of the four layers from the active environment (.ci/oldest): a module
that needs a newer torch/transformers than the lower bounds fails here by name."""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path

LAYERS = ("kernels", "runtime", "compress", "eval")
REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    names = sorted(
        "slimserve." + ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for layer in LAYERS
        for p in (REPO / layer).rglob("*.py")
        if "__pycache__" not in p.parts
    )
    failed = 0
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - every failure is reported by name
            failed += 1
            print(f"import_all: {name} failed:\n{traceback.format_exc(limit=3)}")
    print(f"import_all: {len(names)} modules, {failed} failed to import")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
