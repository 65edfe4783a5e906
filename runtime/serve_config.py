"""`runtime serve --config FILE`: the YAML file of serve options, read and written in one place.

The file is a mapping from `runtime serve`'s option names to values, e.g.

    model: /models/llama-w4a16        # the positional MODEL (also accepted as `artifact`)
    max_num_seqs: 32                  # `max-num-seqs` and `--max-num-seqs` are the same key
    max_num_batched_tokens: 512
    enable_prefix_caching: false

The keys are checked against a schema of the serve options (`OptionSpec`: names, types and
ranges): runtime/cli.py passes `file_options()` of runtime/serve_options.py, where every serve
option is defined and marked as a file key or not (`--config` itself is not one), so a new
option needs no change here. Values must have the option's type (an int for an int option,
true/false for a flag; a string option also takes a number, e.g. a byte count for
`kv_cache_memory`) and lie in its range; `null` means the option's default. A relative `model`
path is resolved against the file's folder when it exists there. The CLI puts the values into
click's `default_map`, so flags on the command line override the file. Every problem is one
`ServeConfigError` line naming the file, the key and the fix.

`runtime tune` (runtime/tune/) writes its chosen setting with `write_serve_config` (checked
against the same schema before anything is written) and starts every server it measures through
`runtime serve --config`, so the writer and the reader are exercised together.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

MODEL_KEYS = ("model", "artifact")  # file keys of serve's positional argument; `model` is written


class ServeConfigError(ValueError):
    """A --config file that cannot be used; the message is one line naming the file and the fix."""


def normalize_key(key: str) -> str:
    """`--max-num-seqs`, `max-num-seqs` and `max_num_seqs` are one key."""
    return key.strip().lstrip("-").replace("-", "_")


def read_serve_config(path: str | Path) -> dict[str, Any]:
    """The file's mapping with normalized keys and `null` values dropped (nothing checked against
    the command yet); a relative model path is resolved against the file's folder when it
    exists there."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ServeConfigError(
            f"--config {path}: cannot read it ({why}); give a readable YAML file of serve options"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "syntax error"
        raise ServeConfigError(
            f"--config {path}: not valid YAML{where} ({problem}); write one "
            "`option_name: value` per line"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ServeConfigError(
            f"--config {path}: holds a {type(data).__name__}, not a mapping; "
            "write one `option_name: value` per line"
        )
    out: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ServeConfigError(
                f"--config {path}: key {key!r} is not an option name; keys are "
                "serve's option names such as max_num_seqs"
            )
        name = normalize_key(key)
        if name in out:
            raise ServeConfigError(
                f"--config {path}: {key!r} repeats another spelling of {name!r}; keep one"
            )
        if value is not None:
            out[name] = value
    for key in MODEL_KEYS:
        if isinstance(out.get(key), str) and not Path(out[key]).is_absolute():
            beside = path.parent / out[key]
            if beside.exists():
                out[key] = str(beside.resolve())
    return out


@dataclass(frozen=True, slots=True)
class OptionSpec:
    """One parameter of the serve command as the file may set it."""

    name: str  # the Python parameter name (the file key, dashes as underscores)
    kind: type  # bool, int, float or str
    low: float | None = None  # typer.Option(min=...)
    high: float | None = None  # typer.Option(max=...)
    argument: bool = False  # the positional MODEL


_WANT = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_value(spec: OptionSpec, key: str, value: Any, path: str | Path) -> Any:
    ok = {bool: (bool,), int: (int,), float: (int, float), str: (str, int, float)}[spec.kind]
    if (isinstance(value, bool) and spec.kind is not bool) or not isinstance(value, ok):
        raise ServeConfigError(
            f"--config {path}: {key} must be {_WANT[spec.kind]}, got "
            f"{value!r}; fix the value or remove the key"
        )
    if spec.kind is str:
        return str(value)  # a string option given a number (a byte count, a name)
    if spec.kind is float:
        value = float(value)
    for bound, bad, word in (
        (spec.low, lambda b: value < b, ">="),
        (spec.high, lambda b: value > b, "<="),
    ):
        if bound is not None and bad(bound):
            raise ServeConfigError(
                f"--config {path}: {key} {value!r} must be {word} {bound:g}; "
                "fix the value or remove the key"
            )
    return value


def check_serve_config(
    values: Mapping[str, Any], options: Mapping[str, OptionSpec], path: str | Path
) -> dict[str, Any]:
    """`values` (from read_serve_config) keyed by the command's parameter names, type- and
    range-checked against `options` (the file options of runtime/serve_options.py)."""
    argument = next((o.name for o in options.values() if o.argument), None)
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = argument if key in MODEL_KEYS and argument else key
        spec = options.get(name)
        if spec is None:
            known = [n for n in options if n != argument] + ([MODEL_KEYS[0]] if argument else [])
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]}?" if close else "see `runtime serve --help`"
            raise ServeConfigError(
                f"--config {path}: unknown key {key!r}; {hint} (keys are "
                "serve's option names, e.g. max_num_seqs)"
            )
        out[name] = _check_value(spec, key, value, path)
    return out


def load_serve_config(path: str | Path, options: Mapping[str, OptionSpec]) -> dict[str, Any]:
    """read_serve_config + check_serve_config: what `runtime serve --config` puts in default_map."""
    return check_serve_config(read_serve_config(path), options, path)


def write_serve_config(
    path: str | Path,
    values: Mapping[str, Any],
    comment: str | None = None,
    *,
    options: Mapping[str, OptionSpec],
) -> Path:
    """Write `values` (serve parameter names -> plain values; `model` for the positional
    argument, first) as a file `runtime serve --config` reads; `comment` lines go on top.
    `options`: the schema the reader will check (ServeConfigError before anything is written)."""
    path = Path(path)
    body = {normalize_key(k): v for k, v in values.items() if v is not None}
    models = [body.pop(k) for k in MODEL_KEYS if k in body]
    if len(models) > 1:
        raise ValueError(f"{path}: give the model once (as `model`)")
    file = {**({"model": models[0]} if models else {}), **body}
    check_serve_config(file, options, path)
    head = "".join(f"# {line}\n" for line in (comment or "").splitlines())
    text = yaml.safe_dump(
        file,
        sort_keys=False,
        default_flow_style=False,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + text, encoding="utf-8")
    return path
