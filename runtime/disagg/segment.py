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

Between hosts the same bytes travel over HTTP (runtime/router/app.py relays them): the prefill
server hands a segment out once (`open_segment`: opened, then unlinked) and the decode server
stores what it receives as a segment of its own (`receive_segment`: size-capped, atomic, and
registered to expire like one it wrote), which it then imports as usual. What a server holds is
bounded: `receive_segment` refuses (KVStoreFull, a 503) an upload that would take the
registry's segments past a count or their bytes past a total, counting uploads in progress
byte by byte as they arrive. Whether two servers
share a segment folder is what `host_id` tells: the boot and the folder's filesystem, so two
containers with their own /dev/shm differ even on one machine.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import secrets
import socket
import struct
import tempfile
import threading
import time
from collections.abc import AsyncIterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch

from slimserve.runtime.disagg.errors import KVHandleError, KVSegmentMissing, KVStoreFull

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
        raise KVHandleError(
            f"KV handle: segment {str(name)[:80]!r} is not a slimserve KV segment "
            "name; send the handle a slimserve prefill replica returned"
        )
    return name


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor."""
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.reshape(-1).view(torch.uint8)


def write_segment(
    name: str,
    header: dict[str, Any],
    tensors: list[tuple[str, torch.Tensor]],
    directory: Path | None = None,
) -> int:
    """Write a segment (atomically: `.part`, then rename); returns its size in bytes."""
    directory = directory or segment_dir()
    entries, offset = [], 0
    raws = []
    for tname, t in tensors:
        raw = _raw(t)
        entries.append(
            {
                "name": tname,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": raw.numel(),
            }
        )
        raws.append(raw)
        offset = _pad(offset + raw.numel())
    head = json.dumps({**header, "tensors": entries}).encode()
    start = _pad(len(MAGIC) + 8 + len(head))
    size = start + offset
    with _atomic_file(directory, name) as f:
        f.write(MAGIC + struct.pack("<Q", len(head)) + head)
        f.write(b"\0" * (start - len(MAGIC) - 8 - len(head)))
        for entry, raw in zip(entries, raws):
            f.seek(start + entry["offset"])
            f.write(raw.numpy().data)
        f.truncate(size)
    return size


@contextmanager
def _atomic_file(directory: Path, name: str) -> Iterator[BinaryIO]:
    """A new file (mode 0600) that appears as `name` only once written whole: written as
    `<name>.part`, renamed at the end, unlinked if anything fails."""
    part = directory / f"{name}.part"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            yield f
        os.rename(part, directory / name)
    except BaseException:
        try:
            os.unlink(part)
        except FileNotFoundError:
            pass
        raise


def open_segment(name: str, directory: Path | None = None) -> tuple[BinaryIO, int]:
    """(the open file, its size) of a segment, unlinked already: whoever opens it owns it, nobody
    else may import it, and its memory goes when the file is closed."""
    path = (directory or segment_dir()) / check_name(name)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise KVSegmentMissing(
            f"KV segment {name} does not exist: it was imported already, "
            f"expired (segments live {SEGMENT_TTL_S:g} s), or was written on "
            "another host (shared memory needs both replicas on one host; "
            "through the router, replicas on other hosts get it over HTTP)"
        ) from None
    try:
        os.unlink(path)
        return os.fdopen(fd, "rb", buffering=0), os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        raise


def read_segment(
    name: str, directory: Path | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(header, tensors by name) of a segment, which is unlinked once read (whatever follows)."""
    f, size = open_segment(name, directory)
    with f:
        data = torch.empty(size, dtype=torch.uint8)
        got = f.readinto(data.numpy().data)
    if got != size or size < len(MAGIC) + 8 or bytes(data[: len(MAGIC)].tolist()) != MAGIC:
        raise KVHandleError(
            f"KV segment {name} is not a slimserve KV segment (bad magic or "
            "truncated); was it written by another version?"
        )
    (hlen,) = struct.unpack("<Q", bytes(data[len(MAGIC) : len(MAGIC) + 8].tolist()))
    start = _pad(len(MAGIC) + 8 + hlen)
    if hlen > MAX_HEADER_BYTES or start > size:
        raise KVHandleError(f"KV segment {name}: header of {hlen} bytes does not fit the segment")
    try:
        header = json.loads(bytes(data[len(MAGIC) + 8 : len(MAGIC) + 8 + hlen].numpy()))
        tensors = {}
        for e in header["tensors"]:
            lo, n = start + int(e["offset"]), int(e["nbytes"])
            if lo + n > size:
                raise ValueError(f"tensor {e['name']} runs past the end")
            dtype = getattr(torch, e["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {e['dtype']}")
            tensors[e["name"]] = data[lo : lo + n].view(dtype).reshape(e["shape"])
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise KVHandleError(f"KV segment {name} is malformed: {e}") from None
    return header, tensors


async def receive_segment(
    chunks: AsyncIterable[bytes],
    limit: int,
    registry: SegmentRegistry | None = None,
    directory: Path | None = None,
    max_count: int | None = None,
    max_bytes: int | None = None,
) -> str:
    """Store a segment sent over HTTP under a new name of ours (`.part`, then renamed); refused
    (KVHandleError) past `limit` bytes or without the segment magic. Registered in `registry`, it
    expires like one this process wrote; with a registry, KVStoreFull when the registry already
    holds `max_count` segments (uploads in progress count) or would hold more than `max_bytes`
    (checked as each chunk arrives; the partial file is removed). The caller imports it by the
    returned name."""
    directory = directory or segment_dir()
    name = new_name()
    size, head = 0, b""
    if registry is not None:
        upload = registry.begin_upload(max_count)
    stored = False
    try:
        with _atomic_file(directory, name) as f:
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise KVHandleError(
                        f"KV segment upload: more than {limit} bytes, the most a "
                        "prompt of this server's context can hold"
                    )
                if registry is not None:
                    registry.grow_upload(upload, len(chunk), max_bytes)
                if len(head) < len(MAGIC):
                    head += chunk[: len(MAGIC)]
                    if head[: len(MAGIC)] != MAGIC[: len(head)]:
                        raise KVHandleError(
                            "KV segment upload: not a slimserve KV segment (bad "
                            "magic); send what GET /kv_segments/NAME returned"
                        )
                f.write(chunk)
            if len(head) < len(MAGIC):
                raise KVHandleError("KV segment upload: empty or truncated body")
        stored = True
    finally:
        if registry is not None:
            registry.end_upload(upload, name if stored else None)
    return name


def host_id(directory: Path | None = None) -> str:
    """Equal for two servers exactly when they share the segment folder: this boot of this
    machine and the folder's filesystem and inode."""
    directory = directory or segment_dir()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    st = os.stat(directory)
    return hashlib.sha256(f"{boot}:{st.st_dev}:{st.st_ino}".encode()).hexdigest()[:16]


def unlink_quietly(name: str, directory: Path | None = None) -> bool:
    try:
        os.unlink((directory or segment_dir()) / name)
        return True
    except FileNotFoundError:
        return False


class SegmentRegistry:
    """The segments this process wrote or received and nobody has imported yet (any thread),
    with their sizes, and the uploads being received (their bytes so far)."""

    def __init__(self, ttl_s: float = SEGMENT_TTL_S, directory: Path | None = None) -> None:
        self.ttl_s = ttl_s
        self.directory = directory
        self._lock = threading.Lock()
        self._written: dict[str, float] = {}  # name -> monotonic s written
        self._sizes: dict[str, int] = {}  # name -> bytes
        self._incoming: dict[int, int] = {}  # upload in progress (ticket) -> bytes received so far
        self._tickets = itertools.count()
        self.expired = 0  # segments unlinked by expiry (never imported), cumulative

    def add(self, name: str, nbytes: int = 0) -> None:
        with self._lock:
            self._written[name] = time.monotonic()
            self._sizes[name] = nbytes

    def discard(self, name: str) -> None:
        """Forget a segment that was imported or handed out (its reader unlinked it)."""
        with self._lock:
            self._written.pop(name, None)
            self._sizes.pop(name, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._written)

    def begin_upload(self, max_count: int | None) -> int:
        """Count one more upload in progress (returns its ticket); KVStoreFull when `max_count`
        segments are held already."""
        with self._lock:
            held = len(self._written) + len(self._incoming)
            if max_count is not None and held >= max_count:
                raise KVStoreFull(
                    f"KV segment upload: this server holds {held} KV segments, its "
                    f"limit (--kv-segments-max {max_count}); retry shortly"
                )
            ticket = next(self._tickets)
            self._incoming[ticket] = 0
            return ticket

    def grow_upload(self, ticket: int, nbytes: int, max_bytes: int | None) -> None:
        """Upload `ticket` received `nbytes` more; KVStoreFull past `max_bytes` in all."""
        with self._lock:
            total = sum(self._sizes.values()) + sum(self._incoming.values()) + nbytes
            if max_bytes is not None and total > max_bytes:
                raise KVStoreFull(
                    f"KV segment upload: this server's KV segments would exceed "
                    f"{max_bytes} bytes (--kv-segments-max-bytes); retry shortly"
                )
            self._incoming[ticket] += nbytes

    def end_upload(self, ticket: int, name: str | None) -> None:
        """Upload `ticket` ended: stored as `name` (registered with its bytes), or failed."""
        with self._lock:
            nbytes = self._incoming.pop(ticket)
            if name is not None:
                self._written[name] = time.monotonic()
                self._sizes[name] = nbytes

    def expire(self, now: float | None = None) -> int:
        """Unlink the segments older than the TTL (a reader that unlinked one already is fine);
        returns how many were still there."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [n for n, t in self._written.items() if now - t > self.ttl_s]
            for n in old:
                del self._written[n]
                self._sizes.pop(n, None)
        gone = sum(unlink_quietly(n, self.directory) for n in old)
        self.expired += gone
        return gone

    def close(self) -> None:
        """Unlink every segment still registered (server shutdown)."""
        with self._lock:
            names, self._written, self._sizes = list(self._written), {}, {}
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
