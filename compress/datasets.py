"""Datasets for calibration and perplexity: one spec string names where the text comes from.

Forms of a spec (recipes, `--dataset`):

    stdlib              the running Python's standard library source (offline; see corpus.py):
                        validation split for evaluation, train split for calibration
    stdlib:train        an explicit split (train | validation)
    wikitext2           WikiText-2 raw through the `datasets` library (network or HF cache):
                        test split for evaluation, train split for calibration
    wikitext2:SPLIT     an explicit split (train | validation | test)
    text:PATH           one UTF-8 file, one document
    jsonl:PATH:FIELD    one JSON object per line; each line's FIELD string is a document

Relative paths resolve against `base_dir` (recipes pass their own folder). Token streams follow
one convention everywhere (training, calibration, perplexity): each document's ids without
special tokens, then EOS, concatenated.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlparse

import torch

from slimserve.runtime import corpus

FORMS = "stdlib, stdlib:train, wikitext2, wikitext2:SPLIT, text:PATH, jsonl:PATH:FIELD"
# Default split per named corpus: (for evaluation, for calibration). Calibration never uses
# the evaluation split, or the perplexity gate would score the data the quantizer fitted.
DEFAULT_SPLITS = {"stdlib": ("validation", "train"), "wikitext2": ("test", "train")}
VALID_SPLITS = {"stdlib": corpus.SPLITS, "wikitext2": ("train", "validation", "test")}
# Seconds to wait for the hub before declaring it unreachable (DNS + TCP connect).
HUB_PROBE_TIMEOUT_S = 3.0


class DatasetError(ValueError):
    """A dataset spec that cannot be used: bad form, missing file, bad line, no network."""


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    kind: str  # 'stdlib' | 'wikitext2' | 'text' | 'jsonl'
    split: str | None = None  # named corpora: the split; None = the default for the purpose
    path: Path | None = None  # text/jsonl: absolute path of the file
    field: str | None = None  # jsonl: key of the document string in each object

    def __str__(self) -> str:
        if self.kind in DEFAULT_SPLITS:
            return self.kind if self.split is None else f"{self.kind}:{self.split}"
        if self.kind == "text":
            return f"text:{self.path}"
        return f"jsonl:{self.path}:{self.field}"

    @property
    def eval_split(self) -> str | None:
        """The split read for evaluation (None for file datasets)."""
        if self.kind not in DEFAULT_SPLITS:
            return None
        return self.split or DEFAULT_SPLITS[self.kind][0]

    def for_calibration(self) -> DatasetSpec:
        """The spec to calibrate on: named corpora switch to their train split."""
        if self.kind not in DEFAULT_SPLITS:
            return self
        eval_default, calib_default = DEFAULT_SPLITS[self.kind]
        if self.split == eval_default:
            raise DatasetError(
                f"calibration dataset {self} is the evaluation split; calibrating on it would make "
                f"the perplexity gate meaningless; use {self.kind} or {self.kind}:{calib_default}"
            )
        return replace(self, split=self.split or calib_default)


def parse_dataset(spec: str, base_dir: Path | None = None) -> DatasetSpec:
    """Parse a dataset spec string; relative file paths resolve against `base_dir` (default cwd)."""
    if not isinstance(spec, str) or not spec.strip():
        raise DatasetError(f"empty dataset spec {spec!r}; use one of: {FORMS}")
    spec = spec.strip()
    kind, _, rest = spec.partition(":")
    if kind in DEFAULT_SPLITS:
        if rest and rest not in VALID_SPLITS[kind]:
            raise DatasetError(
                f"unknown split {rest!r} in dataset {spec!r}; {kind} splits: {', '.join(VALID_SPLITS[kind])}"
            )
        return DatasetSpec(kind, split=rest or None)
    if kind == "text":
        if not rest:
            raise DatasetError(f"dataset {spec!r} has no path; write text:PATH")
        return DatasetSpec("text", path=_existing_file(rest, base_dir, spec))
    if kind == "jsonl":
        path, sep, field = rest.rpartition(":")
        if not sep or not path or not field:
            raise DatasetError(f"dataset {spec!r} needs a path and a field; write jsonl:PATH:FIELD")
        return DatasetSpec("jsonl", path=_existing_file(path, base_dir, spec), field=field)
    raise DatasetError(f"unknown dataset {spec!r}; use one of: {FORMS}")


def _existing_file(path: str, base_dir: Path | None, spec: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = (base_dir or Path.cwd()) / p
    p = p.resolve()
    if not p.is_file():
        raise DatasetError(
            f"dataset file not found: {p} (from {spec!r}); fix the path (relative paths "
            f"resolve against the recipe's folder)"
        )
    return p


def load_texts(spec: DatasetSpec | str) -> list[str]:
    """The documents of a dataset, in a deterministic order (named corpora: the eval split)."""
    spec = parse_dataset(spec) if isinstance(spec, str) else spec
    if spec.kind == "stdlib":
        return corpus.read_texts(spec.eval_split)
    if spec.kind == "wikitext2":
        return _load_wikitext2(spec.eval_split)
    if spec.kind == "text":
        return [_read_utf8(spec.path)]
    if spec.kind == "jsonl":
        return _read_jsonl(spec.path, spec.field)
    raise DatasetError(f"unknown dataset kind {spec.kind!r}; use one of: {FORMS}")


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DatasetError(f"dataset file not found: {path}; fix the path") from None
    except UnicodeDecodeError as e:
        raise DatasetError(
            f"{path}: not UTF-8 at byte {e.start}; convert the file to UTF-8"
        ) from None


def _read_jsonl(path: Path, field: str) -> list[str]:
    docs: list[str] = []
    for lineno, line in enumerate(_read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(
                f"{path} line {lineno}: not valid JSON ({e.msg}); "
                f"each line must be one JSON object with a {field!r} string"
            ) from None
        value = obj.get(field) if isinstance(obj, dict) else None
        if not isinstance(value, str):
            what = (
                "is missing" if not isinstance(obj, dict) or field not in obj else "is not a string"
            )
            keys = f" (keys: {', '.join(map(str, obj))})" if isinstance(obj, dict) else ""
            raise DatasetError(
                f"{path} line {lineno}: field {field!r} {what}{keys}; "
                f"fix the line or name another field in jsonl:PATH:FIELD"
            )
        docs.append(value)
    if not docs:
        raise DatasetError(
            f"{path}: no documents (empty file); give a file with one JSON object per line"
        )
    return docs


def _hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """True if a TCP connection to the HF endpoint opens within `timeout_s` (DNS included)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            ok.append(True)
        except OSError:
            pass

    # getaddrinfo ignores socket timeouts, so the probe runs in a daemon thread we stop waiting on.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(ok)


def _offline_mode() -> bool:
    flags = (os.environ.get(k, "").upper() for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(f in {"1", "ON", "YES", "TRUE"} for f in flags)


def _load_wikitext2(split: str) -> list[str]:
    """WikiText-2 raw as one document: its lines joined by blank lines (the usual ppl convention)."""
    offline = _offline_mode()
    fix = "use --dataset stdlib or text:PATH offline"
    if not offline:
        fix += " (or set HF_HUB_OFFLINE=1 to use a cached copy)"
    if not offline and not _hub_reachable():
        raise DatasetError(
            f"could not load wikitext2 (no network?): the Hugging Face hub did not answer "
            f"within {HUB_PROBE_TIMEOUT_S:.0f} s; {fix}"
        )
    # Low hub timeouts, read when huggingface_hub is first imported; a no-op if it already is.
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "15")
    try:
        import datasets

        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=split)["text"]
    except Exception as e:  # any failure (network, cache, format) is the same user problem
        reason = " ".join(str(e).split()) or type(e).__name__
        raise DatasetError(f"could not load wikitext2 (no network?): {reason}; {fix}") from None
    return ["\n\n".join(rows)]


def encode_documents(tokenizer, texts: list[str]) -> torch.Tensor:
    """Each document's ids (no special tokens), then EOS if the tokenizer has one. [num_tokens] int64."""
    eos_id = tokenizer.eos_token_id
    ids: list[int] = []
    if not texts:
        return torch.zeros(0, dtype=torch.long)
    for enc in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        if eos_id is not None:
            ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def load_token_documents(
    spec: DatasetSpec | str, tokenizer, base_dir: Path | None = None
) -> torch.Tensor:
    """A dataset's token stream: its documents (named corpora: the split `spec` names, else the
    eval split) encoded by `encode_documents`. A spec string is parsed against `base_dir`.
    [num_tokens] int64."""
    spec = parse_dataset(spec, base_dir) if isinstance(spec, str) else spec
    return encode_documents(tokenizer, load_texts(spec))


def calibration_batches(
    tokenizer, spec: DatasetSpec | str, num_samples: int, seq_len: int, seed: int = 0
) -> torch.Tensor:
    """`num_samples` seeded random windows of the calibration stream. [num_samples, seq_len] int64.

    Named corpora use their train split (see `DatasetSpec.for_calibration`).
    """
    if num_samples < 1 or seq_len < 1:
        raise DatasetError(
            f"calibration needs num_samples >= 1 and seq_len >= 1 "
            f"(got num_samples={num_samples}, seq_len={seq_len})"
        )
    spec = (parse_dataset(spec) if isinstance(spec, str) else spec).for_calibration()
    stream = load_token_documents(spec, tokenizer)  # [num_tokens]
    if stream.numel() < seq_len + 1:
        raise DatasetError(
            f"calibration dataset {spec} has {stream.numel()} tokens, fewer than "
            f"seq_len + 1 = {seq_len + 1}; use a larger dataset or a smaller seq_len"
        )
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seq_len, (num_samples,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])
