"""The `mp` executor: ranks 1..N-1 as worker processes (multiprocessing spawn) on one machine.

The driver (the engine's process) is rank 0: its `ModelRunner` holds shard 0 and runs its
forward too, as vLLM's driver worker does. Each step it sends the batch once:

- a 10-int64 header over each worker's pipe (command, T, B, block-table width, S, max_q_len,
  max_context_len, decode_only, num_decodes, payload length). Idle workers wait on the pipe, not in a
  collective, so an idle server never runs into the collectives' timeout, and a worker sees
  the driver's death as the pipe's end-of-file;
- one broadcast of a flat int64 tensor holding every field of `BatchInputs` (runtime/batch.py).

Liveness: before each step the driver checks that every worker is alive; a collective that
fails (a dead peer closes its sockets, a hung one runs into `SLIMSERVE_TP_TIMEOUT`) is turned
into a `WorkerDiedError` naming the rank, logged, and the remaining workers are stopped. The
engine then dies the ordinary way (AsyncEngine fails every open request; /health answers 503).

CPU: every rank gets cores // N threads (torch.set_num_threads), the driver included. CUDA: rank r
runs on cuda:r with NCCL.

Per-rank numbers for /metrics (`worker_stats`, runtime/stats/rank_stats.py): each
worker's weight and KV bytes from its "ready" message, its collective counters (and, on CUDA,
its allocated memory) from what it publishes in the store, its RSS on CPU read here from
/proc/<pid>/statm. A worker that has exited has no row. Called from the server's thread at
scrape time: it never talks to the workers and never waits.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import time
import weakref

import torch

from slimserve.runtime.batch import BatchInputs
from slimserve.runtime.distributed.group import TPGroup, create_store, timeout_s
from slimserve.runtime.distributed.signed_store import SignedStore, new_secret
from slimserve.runtime.stats.rank_stats import RankStats, read_published, rss_bytes, worker_row
from slimserve.runtime.worker.rank_process import HEADER, STOP, pack_batch, worker_main

log = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process died or stopped answering; the engine cannot go on."""


def cpu_threads(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


class MultiprocExecutor:
    """Starts ranks 1..N-1, is rank 0's end of their pipes, and sends them each step.

    The transport-specific parts (`_start_workers`, `_post`, `_messages`, `_exit_status`,
    `_stop_workers`) are what the `ray` executor (runtime/worker/ray_executor.py) replaces;
    the rest is shared."""

    name = "mp"

    def __init__(self, config, device: torch.device):
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        self.world, self.device = world, device
        self.threads = cpu_threads(world) if device.type == "cpu" else None
        self.bind = bind = self._bind_address()
        store = create_store(world, bind)
        self.secret = new_secret()  # signs what the ranks say through the store (signed_store.py)
        self.signed = SignedStore(store, self.secret)
        self._closed = False
        self.ready_info: dict[int, dict] = {}  # rank -> its "ready" message (weight/KV bytes, pid)
        self._start_workers(config, store)
        atexit.register(_shutdown_ref, weakref.ref(self))
        self._threads_before = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            self.group = TPGroup(0, world, device, store=store, bind=bind)
        except RuntimeError as e:  # the rendezvous timed out (DistStoreError) or a worker died
            raise self.failure(e) from None

    # -- transport (multiprocessing: spawned processes and pipes) -------------------------------

    def _bind_address(self) -> str:
        """Where rank 0's store and gloo sockets listen: loopback, every rank is on this host."""
        return "127.0.0.1"

    def _start_workers(self, config, store) -> None:
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=worker_main,
                name=f"slimserve-tp-rank{rank}",
                daemon=True,
                args=(rank, self.world, store.port, config, child, self.threads),
                kwargs={"secret": self.secret},
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def _post(self, header: bytes) -> None:
        for c in self.conns:
            c.send_bytes(header)

    def _messages(self, rank: int, wait_s: float = 0.0) -> list[tuple[str, object]]:
        """What rank `rank` reported since the last call: ("ready", {blocks, weight_bytes,
        kv_cache_bytes, pid}) or ("error", text)."""
        c, out = self.conns[rank - 1], []
        try:
            if c.poll(wait_s):
                while True:
                    out.append(c.recv())
                    if not c.poll():
                        break
        except (EOFError, OSError):
            pass
        return out

    def _exit_status(self, rank: int) -> tuple[bool, str]:
        """(exited, how: pid and exit code) of rank `rank`'s process."""
        p = self.procs[rank - 1]
        return (not p.is_alive(), f"pid {p.pid}, exit code {p.exitcode}")

    def _worker_memory(self, rank: int, published: dict) -> int | None:
        """A live worker's process memory: on CPU its RSS, read here (a local process), on
        CUDA the allocated memory it published (only the worker can ask its GPU)."""
        if self.device.type == "cpu":
            return rss_bytes(self.procs[rank - 1].pid)
        return None  # worker_row falls back to the published value

    def _stop_workers(self, stop: bytes) -> None:
        for c in self.conns:
            try:
                c.send_bytes(stop)
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self.conns:
            c.close()

    # -- liveness -------------------------------------------------------------------------------

    def dead_rank(self, wait_s: float = 0.0) -> tuple[int, str] | None:
        """(rank, how it ended) of a worker that has exited, waiting up to `wait_s` for one."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank in range(1, self.world):
                exited, how = self._exit_status(rank)
                if exited:
                    return rank, how
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _worker_error(self) -> str | None:
        """The first error a worker reported (a failed load), if any."""
        for rank in range(1, self.world):
            for kind, msg in self._messages(rank):
                if kind == "error":
                    return f"rank {rank}: {msg}"
        return None

    def failure(self, cause: BaseException) -> BaseException:
        """The error to raise after a collective or a send failed: a WorkerDiedError naming the
        rank when a worker died (the others are stopped), else the worker's reported error."""
        dead = self.dead_rank(wait_s=2.0)
        reported = self._worker_error()
        if dead is None and reported is None:
            return cause
        if reported is not None and dead is None:
            self.shutdown()
            return RuntimeError(f"tensor-parallel worker {reported}")
        rank, how = dead
        msg = f"tensor-parallel worker rank {rank} ({how}) died; the engine cannot continue"
        if reported:
            msg += f" ({reported})"
        log.error(msg)
        self.shutdown()
        return WorkerDiedError(msg)

    def wait_ready(self) -> None:
        """Every worker's 'ready' after its model and KV cache are built (or its error)."""
        deadline = time.monotonic() + timeout_s()
        for rank in range(1, self.world):
            while not (got := self._messages(rank, wait_s=0.05)):
                if self._exit_status(rank)[0] or time.monotonic() > deadline:
                    raise self.failure(
                        RuntimeError(f"tensor-parallel worker rank {rank} did not start")
                    )
            kind, msg = got[0]
            if kind != "ready":
                self.shutdown()
                raise RuntimeError(f"tensor-parallel worker rank {rank}: {msg}")
            self.ready_info[rank] = msg if isinstance(msg, dict) else {}

    def worker_stats(self) -> list[RankStats]:
        """The rows of the workers that are alive (rank order); cheap, never raises."""
        rows = []
        for rank in range(1, self.world):
            try:
                if self._closed or self._exit_status(rank)[0]:
                    continue  # a dead worker: no row
                published = read_published(self.signed, rank)
                row = worker_row(
                    rank,
                    self.ready_info.get(rank, {}),
                    published,
                    self._worker_memory(rank, published),
                )
            except Exception:  # noqa: BLE001 (a scrape must not fail: the row is left out)
                log.debug("stats of tensor-parallel rank %d unavailable", rank, exc_info=True)
                continue
            if row is not None:
                rows.append(row)
        return rows

    # -- steps ----------------------------------------------------------------------------------

    def send(self, batch: BatchInputs) -> None:
        """Hand one step's batch to every worker (call before rank 0's own forward)."""
        dead = self.dead_rank()
        if dead is not None:
            raise self.failure(RuntimeError("worker exited"))
        header, payload = pack_batch(batch)
        try:
            self._post(header)
            self.group.broadcast(payload.to(self.group.device))
        except (OSError, RuntimeError) as e:
            raise self.failure(e) from None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_workers(HEADER.pack(STOP, *([0] * (HEADER.size // 8 - 1))))  # int64 fields
        if self.threads is not None:  # the process may go on without tensor parallelism
            torch.set_num_threads(self._threads_before)


def _shutdown_ref(ref) -> None:
    ex = ref()
    if ex is not None:
        ex.shutdown()
