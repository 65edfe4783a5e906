"""CI: the built wheel holds every module of the four layers, and each imports from it.

Run by .ci/run with the python of a fresh venv that has only the slimserve wheel installed
(its dependencies come from PYTHONPATH, where .pth files, and so any editable install of
slimserve, are not processed). Usage: python wheel_check.py WHEEL REPO
"""

from __future__ import annotations

import importlib
import sys
import zipfile
from pathlib import Path

LAYERS = ("kernels", "runtime", "compress", "eval")


def main(wheel: str, repo: str) -> int:
    root = Path(repo)
    in_repo = {
        f"slimserve/{p.relative_to(root).as_posix()}"
        for layer in LAYERS
        for p in (root / layer).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    names = set(zipfile.ZipFile(wheel).namelist())
    in_wheel = {n for n in names if n.endswith(".py")}
    missing = sorted(in_repo - in_wheel)
    for name in missing:
        print(
            f"wheel check: {name} is in the repository but not in the wheel "
            "(a folder without __init__.py?)"
        )
    # C sources the package compiles at run time (kernels/cpu_build.py): package_data in setup.py
    sources = {
        f"slimserve/{p.relative_to(root).as_posix()}"
        for layer in LAYERS
        for pattern in ("*.c", "*.h")
        for p in (root / layer).rglob(pattern)
    }
    for name in sorted(sources - names):
        missing.append(name)
        print(
            f"wheel check: {name} is in the repository but not in the wheel (setup.py package_data)"
        )
    failed = []
    for name in sorted(in_wheel):
        module = name[:-3].replace("/", ".").removesuffix(".__init__")
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - every failure is reported by name
            failed.append(module)
            print(f"wheel check: importing {module} from the wheel failed: {type(e).__name__}: {e}")
            continue
        here = Path(mod.__file__).resolve()
        if any(here.is_relative_to((root / layer).resolve()) for layer in LAYERS):
            failed.append(module)
            print(
                f"wheel check: {module} was imported from the repository ({mod.__file__}), not the wheel"
            )
    print(
        f"wheel check: {len(in_wheel)} modules in the wheel, {len(missing)} missing, "
        f"{len(failed)} failed to import"
    )
    return 1 if missing or failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
