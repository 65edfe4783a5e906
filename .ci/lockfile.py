"""The tested environment: `constraints.txt` at the repository root pins every package of the
README's install to the versions CI passed with.

    python .ci/lockfile.py write constraints.txt   # from the active venv (.ci/lock runs it)
    python .ci/lockfile.py check constraints.txt   # the active venv is exactly the lock (.ci/run)

`write` records `pip list` of the active virtualenv, less slimserve itself and the installer's
own tools (pip, setuptools, wheel); a local version label (`torch 2.13.0+cpu`) is dropped so the
same line matches the CPU wheel and PyPI's build of that release. `check` fails, naming each
package, when an installed version differs from its pin or a package is installed that the lock
does not name, so a lock that no longer describes what CI tests cannot pass silently.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SKIP = {"slimserve", "pip", "setuptools", "wheel"}
HEADER = """\
# The tested environment: exact versions of every package the README's install brings in,
# as `.ci/run` passed with them (CPU torch; Linux x86-64; Python 3.11). Used as `pip install -c`.
# Refresh deliberately with `.ci/lock` (a fresh venv at the newest versions pyproject.toml's
# ranges allow, the README's test command, then this file); never edit by hand.
# pyproject.toml keeps ranges for people who embed the library.
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {
        _norm(p["name"]): p["version"].split("+")[0]
        for p in json.loads(out)
        if _norm(p["name"]) not in SKIP
    }


def read(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_norm(name)] = version.strip()
    return pins


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("write", "check"):
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        print("usage: python .ci/lockfile.py write|check constraints.txt", file=sys.stderr)
        return 2
    verb, path = argv[0], Path(argv[1])
    have = installed()
    if verb == "write":
        path.write_text(HEADER + "".join(f"{n}=={v}\n" for n, v in sorted(have.items())))
        print(f"lockfile: wrote {len(have)} pins to {path}")
        return 0
    pins = read(path)
    bad = [
        f"{n} {v} installed, {pins[n]} locked"
        for n, v in sorted(have.items())
        if n in pins and pins[n] != v
    ]
    bad += [
        f"{n} {v} installed but not in {path.name} (refresh it with .ci/lock)"
        for n, v in sorted(have.items())
        if n not in pins
    ]
    bad += [f"{n} {pins[n]} locked but not installed" for n in sorted(pins) if n not in have]
    for line in bad:
        print(f"lockfile: {line}")
    print(f"lockfile: {len(have)} packages installed, {len(pins)} locked, {len(bad)} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
