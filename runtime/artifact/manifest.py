"""`slimserve.json`: the manifest written beside `config.json` in every exported artifact.

It records how the artifact was made (tool version, base model and its hash, the recipe
verbatim, stage reports, eval results) and the sha256 of every file of the artifact (config,
tokenizer files, chat template, index, generation config, weights; format_version 2; version 1
listed weight files only), which the loaders check before they trust anything in the folder.

An exported config.json also carries `"slimserve": {"manifest": "slimserve.json"}` (MARKER_KEY),
so a folder whose manifest was deleted is still known to be a slimserve artifact and refused under
`verify="strict"` (the default). Folders with neither marker nor manifest (plain HF checkpoints,
other tools' output) load without a manifest check.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path

from slimserve.runtime.errors import ArtifactError

MANIFEST_NAME = "slimserve.json"
FORMAT_VERSION = 2  # 2: `files` covers every file of the artifact; 1: weight files only
MARKER_KEY = "slimserve"  # config.json key the exporter writes: {"manifest": MANIFEST_NAME}
# The run report (compress/report.py: report.json/.md/.png, report-<stage>.png), written after the
# manifest: not part of the artifact contract, so neither hashed nor refused when present.
_REPORT_FILE = re.compile(r"report(-[a-z0-9_]+)?\.(json|md|png)")
_IGNORED_NAMES = frozenset({".gitattributes", ".DS_Store"})  # hub/OS clutter, never read
VERIFY_MODES = ("strict", "none")  # strict: slimserve artifacts need a matching manifest
_CHUNK = 1 << 20  # bytes read per hashing step
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth")  # what counts as a base weight file


def tool_version() -> str:
    """The installed slimserve version, or "0+unknown" when running from an uninstalled tree."""
    try:
        return metadata.version("slimserve")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(slots=True)
class ArtifactManifest:
    """Provenance and integrity record of one exported artifact."""

    base_model: str  # hub id or local path of the checkpoint that was compressed
    recipe: str = ""  # the recipe YAML, verbatim
    base_model_sha256: str | None = None  # hash over the base weight files; None if not local
    stages: list[dict] = field(default_factory=list)  # one StageReport dict per stage, in order
    eval: dict = field(default_factory=dict)  # perplexity before/after and gate results
    files: dict[str, str] = field(default_factory=dict)  # artifact file (relative path) -> sha256
    # Linears whose last input group is partial (group_size does not divide in_features): only with
    # the recipe's export.allow_partial_groups; vLLM and transformers refuse such an artifact
    partial_groups: list[str] = field(default_factory=list)
    # Decoder layers whose KV cache stays in the model dtype although the artifact has fp8 K/V
    # scales (the kv_cache stage's skip_layers / skip_sensitive): every loader here honours it;
    # vLLM takes it as `--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 1 16`
    kv_cache_skip_layers: list[int] = field(default_factory=list)
    # The KV-cache dtype the artifact asks `--kv-cache-dtype auto` for when it is not fp8 (whose
    # scales are tensors of the checkpoint): "int8" or "int4" (per token and head, computed as
    # the cache is written: kernels/kv_quant.py; no calibration); "": none recorded
    kv_cache_dtype: str = ""
    tool_version: str = field(default_factory=tool_version)  # slimserve version that wrote it
    format_version: int = FORMAT_VERSION  # version of this manifest's schema

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ArtifactManifest:
        """Parse a manifest; a newer schema or a missing field raises ArtifactError."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ArtifactError(
                f"{MANIFEST_NAME} is not valid JSON ({e}); re-export the artifact"
            ) from None
        version = data.get("format_version") if isinstance(data, dict) else None
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ArtifactError(
                f"{MANIFEST_NAME} has format_version={version!r}; this slimserve reads versions "
                f"up to {FORMAT_VERSION}, upgrade slimserve or re-export the artifact"
            )
        known = {f.name for f in fields(cls)}
        if "base_model" not in data:
            raise ArtifactError(f"{MANIFEST_NAME} lacks 'base_model'; re-export the artifact")
        return cls(**{k: v for k, v in data.items() if k in known})


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_checkpoint(path: str | Path) -> str | None:
    """sha256 over a local checkpoint's weight files (name and digest of each, sorted), or over
    the one file `path` names (a GGUF checkpoint).

    Returns None when `path` is not local (e.g. a hub id) or a folder without weight files.
    """
    folder = Path(path)
    if folder.is_file():
        files = [folder]
    elif not folder.is_dir():
        return None
    else:
        files = sorted({p for g in _WEIGHT_GLOBS for p in folder.glob(g)})
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\t{sha256_file(p)}\n".encode())
    return h.hexdigest()


def write_manifest(directory: str | Path, manifest: ArtifactManifest) -> Path:
    path = Path(directory) / MANIFEST_NAME
    path.write_text(manifest.to_json())
    return path


def artifact_file_hashes(directory: str | Path) -> dict[str, str]:
    """Relative path -> sha256 of every file of an artifact folder: all regular files except
    the run report (report*.json/md/png), .gitattributes and whatever sits in a hidden folder. A symlink or other non-regular entry is refused."""
    folder = Path(directory)
    out: dict[str, str] = {}
    for name in _listed_entries(folder):
        p = folder / name
        if p.is_symlink() or not p.is_file():
            raise ArtifactError(f"{p} is not a regular file; an artifact holds regular files only")
        out[name] = sha256_file(p)
    return out


def _uncovered(rel: str) -> bool:
    """The manifest itself and the run report: present in an artifact folder, never hashed."""
    return rel == MANIFEST_NAME or _REPORT_FILE.fullmatch(rel) is not None


def _listed_entries(folder: Path) -> list[str]:
    """Relative posix paths of the files a manifest covers (not dirs, hidden or uncovered entries)."""
    names = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts[:-1]) or _uncovered(rel.as_posix()):
            continue  # inside a hidden folder (e.g. huggingface_hub's .cache/), or a report file
        if rel.name in _IGNORED_NAMES:
            continue
        if p.is_dir() and not p.is_symlink():
            continue
        names.append(rel.as_posix())
    return names


def confined_file(directory: str | Path, name: str, source: str) -> Path:
    """`directory / name` when it is a regular file inside `directory`, else ArtifactError naming
    `name` and `source` (the file or rule that named it).

    Refused: absolute paths, `..` components, and symlinks whose target leaves the folder; the
    one exception is the Hugging Face hub cache layout (`snapshots/<rev>/f -> ../../blobs/<sha>`).
    """
    folder = Path(directory)
    rel = Path(name)
    if not name or rel.is_absolute() or rel.drive or ".." in rel.parts or "\\" in name:
        raise ArtifactError(
            f"{source} names {name!r}, which is not a plain file name inside "
            f"{folder}; refusing to read outside the artifact folder"
        )
    path = folder / rel
    root = folder.resolve()
    target = path.resolve()
    if not (target.is_relative_to(root) or _hub_blob(folder, target)):
        raise ArtifactError(
            f"{source} names {name!r}, a symlink to {target} outside {folder}; "
            "refusing to read outside the artifact folder"
        )
    if not target.is_file():
        what = "missing" if not os.path.lexists(path) else "not a regular file"
        named = " is" if source == "the artifact" else f" is listed in {source} but"
        raise ArtifactError(
            f"{path}{named} {what}; the artifact is incomplete, re-export or re-download it"
        )
    return path


def _hub_blob(folder: Path, target: Path) -> bool:
    """huggingface_hub's cache: <repo>/snapshots/<rev>/<file> links to <repo>/blobs/<sha>."""
    folder = folder.absolute()
    if folder.parent.name != "snapshots":
        return False
    return target.parent == (folder.parent.parent / "blobs").resolve()


def read_config_json(directory: str | Path) -> dict:
    """config.json as a dict (confined, must be a JSON object)."""
    path = confined_file(directory, "config.json", "the artifact")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path} is not a JSON object")
    return data


def is_slimserve_artifact(directory: str | Path, config: dict | None = None) -> bool:
    """A folder exported by slimserve: it has slimserve.json or config.json carries MARKER_KEY."""
    folder = Path(directory)
    if os.path.lexists(folder / MANIFEST_NAME):
        return True
    if config is None:
        try:
            config = read_config_json(folder)
        except ArtifactError:
            return False
    return isinstance(config.get(MARKER_KEY), dict)


def check_artifact(
    directory: str | Path, verify: str = "strict", config: dict | None = None
) -> ArtifactManifest | None:
    """The loaders' manifest policy; returns the verified manifest, or None.

    verify="strict": a slimserve artifact (is_slimserve_artifact) must have a slimserve.json
    that matches every file; a folder without marker or manifest (plain HF checkpoint, another
    tool's output) passes unchecked. verify="none": no manifest check at all.
    """
    if verify not in VERIFY_MODES:
        raise ArtifactError(f"verify={verify!r} is not one of {', '.join(VERIFY_MODES)}")
    if verify == "none":
        return None
    folder = Path(directory)
    manifest = read_manifest(folder)
    if manifest is None:
        if is_slimserve_artifact(folder, config):
            raise ArtifactError(
                f"{folder / MANIFEST_NAME} is missing, but config.json marks {folder} as a slimserve "
                f"artifact ('{MARKER_KEY}' key); its files cannot be verified. Re-export or "
                "re-download it, or pass --verify none (verify='none') to load it anyway"
            )
        return None
    verify_files(folder, manifest)
    return manifest


def read_manifest(directory: str | Path) -> ArtifactManifest | None:
    """The artifact's manifest, or None when the folder has no slimserve.json."""
    folder = Path(directory)
    path = folder / MANIFEST_NAME
    if not os.path.lexists(path):
        return None
    path = confined_file(folder, MANIFEST_NAME, "the artifact")
    return ArtifactManifest.from_json(path.read_text())


def unverified_manifest(directory: str | Path) -> ArtifactManifest | None:
    """The manifest as it is, unchecked (under verify="none": to read its gate and KV skip
    layers); None when missing or unreadable."""
    try:
        return read_manifest(directory)
    except (ArtifactError, OSError):
        return None


def verify_files(directory: str | Path, manifest: ArtifactManifest) -> None:
    """Check the artifact's files against the manifest's sha256.

    format_version 2 lists every file of the artifact: a listed file that is missing, not a
    regular file inside the folder, or modified, and any file not listed (except
    the run report and hidden entries) is an ArtifactError naming it. format_version 1 listed
    weight files only: those are checked, plus no unlisted *.safetensors file.
    """
    folder = Path(directory)
    fix = "re-export or re-download it, or pass --verify none to load it anyway"
    for name, expected in sorted(manifest.files.items()):
        path = confined_file(folder, name, MANIFEST_NAME)
        actual = sha256_file(path)
        if actual != expected:
            raise ArtifactError(
                f"checksum mismatch for {path}: {MANIFEST_NAME} expects sha256 {expected}, the "
                f"file has {actual}; it is corrupt or was modified, {fix}"
            )
    if manifest.format_version >= 2:
        extra = [n for n in _listed_entries(folder) if n not in manifest.files]
    else:
        extra = sorted(p.name for p in folder.glob("*.safetensors") if p.name not in manifest.files)
    if extra:
        raise ArtifactError(
            f"file(s) {', '.join(extra)} in {folder} are not listed in {MANIFEST_NAME}; remove "
            f"them, or {fix}"
        )


def check_gate(
    directory: str | Path, manifest: ArtifactManifest | None, allow_failed_gate: bool = False
) -> None:
    """Refuse (ArtifactError) an artifact whose manifest says its perplexity gate failed
    (`eval.gate.passed` is false) or its task gate did (`eval.task_gate.passed`), unless
    `allow_failed_gate`; anything else passes."""
    ev = manifest.eval if manifest is not None and isinstance(manifest.eval, dict) else {}
    gate, tasks = ev.get("gate"), ev.get("task_gate")
    if allow_failed_gate:
        return
    if isinstance(tasks, dict) and tasks.get("passed") is False:
        failed = ", ".join(sorted(tasks.get("failed") or [])) or "passed: false"
        raise ArtifactError(
            f"{directory}: its task gate FAILED ({failed}; {MANIFEST_NAME} eval.task_gate); "
            "pass --allow-failed-gate (LLM: allow_failed_gate=True) to load it anyway"
        )
    if not isinstance(gate, dict) or gate.get("passed") is not False:
        return
    inc, limit = gate.get("ppl_increase"), gate.get("max_ppl_increase")
    result = (
        f"ppl {inc * 100:+.2f}% over a limit of {limit * 100:.2f}%"
        if isinstance(inc, (int, float)) and isinstance(limit, (int, float))
        else "passed: false"
    )
    raise ArtifactError(
        f"{directory}: its perplexity gate FAILED ({result}, {MANIFEST_NAME} "
        "eval.gate); pass --allow-failed-gate (LLM: allow_failed_gate=True) to load it anyway"
    )
