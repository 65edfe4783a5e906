"""Shared-memory segments: how KV blocks travel from a prefill to a decode replica on one host.

A segment is one file in /dev/shm (tmpfs: memory, never disk; elsewhere the temporary folder),
named `slimserve-kv-<writer pid>-<32 hex>`, mode 0600 (only the same user's processes read it):

    b"SLIMKV1\\n" | header length (u64, little-endian) | header (JSON) | padding to 64 bytes
    | each tensor's raw bytes, at the 64-byte-aligned offset the header gives

The header holds the writer's KV layout, the request's prompt token ids and first token, and the
list of tensors (name, dtype, shape, offset, nbytes). The writer creates `<name>.part` and renames
it, so a reader never sees half a segment. The reader unlinks the segment as soon as it has read
it (the memory is freed once the copy is made). A segment nobody reads (the decode side failed, the
router gave up) is unlinked by its writer after `SEGMENT_TTL_S` (`SegmentRegistry.expire`), and at
start a server removes the segments of writers that no longer run (`sweep_orphans`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from slimserve.runtime.disagg.errors import KVHandleError, KVSegmentMissing

MAGIC = b"SLIMKV1\n"
ALIGN = 64
SEGMENT_TTL_S = 60.0  # a segment not imported within this is unlinked by its writer
PREFIX = "slimserve-kv-"
NAME_RE = re.compile(r"^slimserve-kv-(\d+)-[0-9a-f]{32}$")
MAX_HEADER_BYTES = 64 * 2**20


def segment_dir() -> Path:
    """/dev/shm where it exists (Linux), else a folder in the temporary directory;
    SLIMSERVE_KV_DIR overrides (both sides must use the same)."""
    override = os.environ.get("SLIMSERVE_KV_DIR")
    if override:
        path = Path(override)
    elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        path = Path("/dev/shm")
    else:
        path = Path(tempfile.gettempdir()) / "slimserve-kv"
    path.mkdir(parents=True, exist_ok=True)
    return path


def new_name() -> str:
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise KVHandleError(f"KV handle: segment {str(name)[:80]!r} is not a slimserve KV segment "
                            "name; send the handle a slimserve prefill replica returned")
    return name


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor."""
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.reshape(-1).view(torch.uint8)


def write_segment(name: str, header: dict[str, Any], tensors: list[tuple[str, torch.Tensor]],
                  directory: Path | None = None) -> int:
    """Write a segment (atomically: `.part`, then rename); returns its size in bytes."""
    directory = directory or segment_dir()
    entries, offset = [], 0
    raws = []
    for tname, t in tensors:
        raw = _raw(t)
        entries.append({"name": tname, "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape), "offset": offset, "nbytes": raw.numel()})
        raws.append(raw)
        offset = _pad(offset + raw.numel())
    head = json.dumps({**header, "tensors": entries}).encode()
    start = _pad(len(MAGIC) + 8 + len(head))
    size = start + offset
    part = directory / f"{name}.part"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            f.write(MAGIC + struct.pack("<Q", len(head)) + head)
            f.write(b"\0" * (start - len(MAGIC) - 8 - len(head)))
            for entry, raw in zip(entries, raws):
                f.seek(start + entry["offset"])
                f.write(raw.numpy().data)
            f.truncate(size)
        os.rename(part, directory / name)
    except BaseException:
        try:
            os.unlink(part)
        except FileNotFoundError:
            pass
        raise
    return size


def read_segment(name: str, directory: Path | None = None
                 ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(header, tensors by name) of a segment, which is unlinked once read (whatever follows)."""
    path = (directory or segment_dir()) / check_name(name)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise KVSegmentMissing(f"KV segment {name} does not exist: it was imported already, "
                               f"expired (segments live {SEGMENT_TTL_S:g} s), or was written on "
                               "another host (shared memory needs both replicas on one host)"
                               ) from None
    try:
        os.unlink(path)  # ours now: nobody else may import it, and it goes once read
        size = os.fstat(fd).st_size
        data = torch.empty(size, dtype=torch.uint8)
        with os.fdopen(fd, "rb", buffering=0) as f:
            fd = -1
            got = f.readinto(data.numpy().data)
    finally:
        if fd >= 0:
            os.close(fd)
    if got != size or size < len(MAGIC) + 8 or bytes(data[:len(MAGIC)].tolist()) != MAGIC:
        raise KVHandleError(f"KV segment {name} is not a slimserve KV segment (bad magic or "
                            "truncated); was it written by another version?")
    (hlen,) = struct.unpack("<Q", bytes(data[len(MAGIC):len(MAGIC) + 8].tolist()))
    start = _pad(len(MAGIC) + 8 + hlen)
    if hlen > MAX_HEADER_BYTES or start > size:
        raise KVHandleError(f"KV segment {name}: header of {hlen} bytes does not fit the segment")
    try:
        header = json.loads(bytes(data[len(MAGIC) + 8:len(MAGIC) + 8 + hlen].numpy()))
        tensors = {}
        for e in header["tensors"]:
            lo, n = start + int(e["offset"]), int(e["nbytes"])
            if lo + n > size:
                raise ValueError(f"tensor {e['name']} runs past the end")
            dtype = getattr(torch, e["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {e['dtype']}")
            tensors[e["name"]] = data[lo:lo + n].view(dtype).reshape(e["shape"])
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise KVHandleError(f"KV segment {name} is malformed: {e}") from None
    return header, tensors


def unlink_quietly(name: str, directory: Path | None = None) -> bool:
    try:
        os.unlink((directory or segment_dir()) / name)
        return True
    except FileNotFoundError:
        return False


class SegmentRegistry:
    """The segments this process wrote and nobody has imported yet (any thread)."""

    def __init__(self, ttl_s: float = SEGMENT_TTL_S, directory: Path | None = None) -> None:
        self.ttl_s = ttl_s
        self.directory = directory
        self._lock = threading.Lock()
        self._written: dict[str, float] = {}  # name -> monotonic s written
        self.expired = 0  # segments unlinked by expiry (never imported), cumulative

    def add(self, name: str) -> None:
        with self._lock:
            self._written[name] = time.monotonic()

    def __len__(self) -> int:
        with self._lock:
            return len(self._written)

    def expire(self, now: float | None = None) -> int:
        """Unlink the segments older than the TTL (a reader that unlinked one already is fine);
        returns how many were still there."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [n for n, t in self._written.items() if now - t > self.ttl_s]
            for n in old:
                del self._written[n]
        gone = sum(unlink_quietly(n, self.directory) for n in old)
        self.expired += gone
        return gone

    def close(self) -> None:
        """Unlink every segment still registered (server shutdown)."""
        with self._lock:
            names, self._written = list(self._written), {}
        for n in names:
            unlink_quietly(n, self.directory)


def sweep_orphans(directory: Path | None = None) -> int:
    """Unlink segments (and half-written `.part` files) whose writer process is gone."""
    directory = directory or segment_dir()
    removed = 0
    for path in directory.glob(PREFIX + "*"):
        m = NAME_RE.match(path.name.removesuffix(".part"))
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # the writer runs: it expires its own
        except ProcessLookupError:
            pass
        except PermissionError:  # another user's process: not ours to judge
            continue
        removed += unlink_quietly(path.name, directory)
    return removed
