"""`slimserve.json`: the manifest written beside `config.json` in every exported artifact.

It records how the artifact was made (tool version, base model and its hash, the recipe
verbatim, stage reports, eval results) and the sha256 of every weight file, which the loader
checks before it trusts the tensors.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path

from slimserve.runtime.errors import ArtifactError

MANIFEST_NAME = "slimserve.json"
FORMAT_VERSION = 1
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
    files: dict[str, str] = field(default_factory=dict)  # weight file name -> sha256 hex digest
    tool_version: str = field(default_factory=tool_version)  # slimserve version that wrote it
    format_version: int = FORMAT_VERSION  # version of this manifest's schema

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "ArtifactManifest":
        """Parse a manifest; a newer schema or a missing field raises ArtifactError."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{MANIFEST_NAME} is not valid JSON ({e}); re-export the artifact") from None
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
    """sha256 over a local checkpoint's weight files (name and digest of each, sorted).

    Returns None when `path` is not a local folder (e.g. a hub id) or holds no weight files.
    """
    folder = Path(path)
    if not folder.is_dir():
        return None
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


def read_manifest(directory: str | Path) -> ArtifactManifest | None:
    """The artifact's manifest, or None when the folder has no slimserve.json."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return None
    return ArtifactManifest.from_json(path.read_text())


def verify_files(directory: str | Path, manifest: ArtifactManifest) -> None:
    """Check every weight file against the manifest's sha256.

    Raises ArtifactError naming a file that is missing, modified, or a *.safetensors file that
    the manifest does not list.
    """
    folder = Path(directory)
    for name, expected in sorted(manifest.files.items()):
        path = folder / name
        if not path.is_file():
            raise ArtifactError(
                f"{path} is listed in {MANIFEST_NAME} but missing; the artifact is incomplete, "
                "re-export or re-download it"
            )
        actual = sha256_file(path)
        if actual != expected:
            raise ArtifactError(
                f"checksum mismatch for {path}: {MANIFEST_NAME} expects sha256 {expected}, the "
                f"file has {actual}; it is corrupt or was modified, re-export or re-download it"
            )
    extra = sorted(p.name for p in folder.glob("*.safetensors") if p.name not in manifest.files)
    if extra:
        raise ArtifactError(
            f"weight file(s) {', '.join(extra)} in {folder} are not listed in {MANIFEST_NAME}; "
            "remove them or re-export the artifact"
        )
