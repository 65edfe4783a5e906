"""The communicator of one tensor-parallel model: N ranks, gloo on CPU, NCCL on CUDA.

Each engine gets its own process group built from a TCPStore (`ProcessGroupGloo` /
`ProcessGroupNCCL` directly, not `init_process_group`), so a process can hold several engines,
and nothing global in `torch.distributed` is touched. Every collective runs with a timeout
(`SLIMSERVE_TP_TIMEOUT`, seconds): a peer that dies closes its sockets and the collective fails
at once; one that hangs fails it after the timeout, never forever.

Every socket the group listens on is bound to one address, `bind` (127.0.0.1 for ranks on one
host, runtime/worker/executor.py): torch's TCPStore server would listen on every interface
(its `host_name` is only what clients connect to), so `create_store` binds the listening socket
itself and hands it over (`master_listen_fd`); gloo's pairs listen on the address its device is
created with. The store has no authentication, so on one host nothing but local processes can
reach it.

The group times its all-reduces and gathers (`comm_seconds`, `comm_calls`; on CPU the whole
collective including the wait for the slowest rank, on CUDA only the host's enqueue time, since
synchronizing to measure would stall the stream), which `ModelRunner.comm_stats()` reports.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0  # a collective (or the start-up rendezvous) longer than this fails


def timeout_s() -> float:
    return float(os.environ.get("SLIMSERVE_TP_TIMEOUT", DEFAULT_TIMEOUT_S))


def create_store(world: int, bind: str = "127.0.0.1") -> dist.TCPStore:
    """Rank 0's store on a free port of address `bind` only (`store.port` is what the workers
    are given): the listening socket is ours, bound there, and handed to torch."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((bind, 0))
        sock.listen(max(128, world))
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()  # torch's server owns it from here (and closes it)
    try:
        return dist.TCPStore(
            bind,
            port,
            world,
            True,
            timeout=datetime.timedelta(seconds=timeout_s()),
            wait_for_workers=False,
            master_listen_fd=fd,
            use_libuv=True,
        )
    except BaseException:
        os.close(fd)
        raise


class TPGroup:
    """Rank `rank` of `world`; `device` is where its tensors and collectives live. host: where
    rank 0's store listens (workers); bind: the address this rank's gloo sockets listen on."""

    def __init__(
        self,
        rank: int,
        world: int,
        device: torch.device,
        store: dist.TCPStore | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        bind: str = "127.0.0.1",
    ):
        self.rank, self.world, self.device = rank, world, device
        timeout = datetime.timedelta(seconds=timeout_s())
        if store is None:
            store = dist.TCPStore(host, port, world, False, timeout=timeout)
        self.store = store
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
            self.pg = dist.ProcessGroupGloo(store, rank, world, opts)
        self.comm_seconds = 0.0  # time spent in all-reduces and gathers, cumulative
        self.comm_calls = 0

    def _timed(self, work) -> None:
        t0 = time.perf_counter()
        work.wait()  # gloo: done; NCCL: queued on the stream (host time only, no sync added)
        self.comm_seconds += time.perf_counter() - t0
        self.comm_calls += 1

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place over the ranks; returns x."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._timed(self.pg.allreduce([x], opts))
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (same shape) on rank 0, in rank order; None on the others."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        outs = [[torch.empty_like(x) for _ in range(self.world)]] if self.rank == 0 else []
        self._timed(self.pg.gather(outs, [x.contiguous()], opts))
        return outs[0] if self.rank == 0 else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype), in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([x], opts).wait()
        return x

    def isend(self, x: torch.Tensor, dst: int, tag: int = 0):
        """Start sending `x` to rank `dst`; pass the result to `wait` (pipeline stages)."""
        return self.pg.send([x], dst, tag), x  # keep x alive until the send is done

    def wait(self, handle) -> None:
        self._timed(handle[0])

    def recv(self, x: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive into `x` from rank `src`; returns x."""
        self._timed(self.pg.recv([x], src, tag))
        return x

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, dist.ReduceOp.MIN).item())
