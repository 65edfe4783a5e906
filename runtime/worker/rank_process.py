"""A tensor-parallel worker process (ranks 1..N-1): build the rank's runner, then run steps.

The loop waits on its pipe for the driver's step header (runtime/worker/executor.py),
receives the batch with one broadcast, runs the rank's forward (its share of the all-reduces and
of the logits gather happen inside it, runtime/distributed/layers.py) and waits again. It ends on
the driver's stop command, on the pipe's end-of-file (the driver died), or on a failed collective
(another rank died); it never samples, schedules or detokenizes.

For /metrics the worker reports its own numbers (runtime/stats/rank_stats.py): the bytes
of its weights and KV cache in its "ready" message, and its process memory and collective
counters in the group's store, at most every second while it steps and once when it goes idle.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import struct
import time

import torch
from torch.distributed import DistError, DistStoreError

from slimserve.runtime.batch import BatchInputs
from slimserve.runtime.devices import resolve_device
from slimserve.runtime.distributed.group import TPGroup
from slimserve.runtime.distributed.signed_store import ForgedMessage, SignedStore
from slimserve.runtime.stats.rank_stats import (
    IDLE_PUBLISH_S,
    PUBLISH_EVERY_S,
    process_memory_bytes,
    publish_stats,
)
from slimserve.runtime.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)
STEP, STOP = 1, 0
# command, T, B, table width, S, max_q_len, max_context_len, decode_only, num_decodes, payload
HEADER = struct.Struct("<10q")


def pack_batch(batch: BatchInputs) -> tuple[bytes, torch.Tensor]:
    """(header, int64 payload) of one step's batch."""
    b, w = batch.block_tables.shape
    parts = [
        batch.input_ids,
        batch.positions,
        batch.slot_mapping,
        batch.logits_indices,
        batch.block_tables.reshape(-1),
        batch.cu_seqlens_q,
        batch.context_lens,
    ]
    payload = torch.cat([p.to(torch.int64) for p in parts])
    header = HEADER.pack(
        STEP,
        batch.input_ids.numel(),
        b,
        w,
        batch.logits_indices.numel(),
        batch.max_q_len,
        batch.max_context_len,
        int(batch.decode_only),
        batch.num_decodes,
        payload.numel(),
    )
    return header, payload


def unpack_batch(header: tuple, payload: torch.Tensor) -> BatchInputs:
    _, t, b, w, s, max_q, max_ctx, decode_only, num_decodes, _ = header
    ids, pos, slots, logits, tables, cu, ctx = payload.split([t, t, t, s, b * w, b + 1, b])
    return BatchInputs(
        ids,
        pos,
        slots,
        tables.to(torch.int32).reshape(b, w),
        cu.to(torch.int32),
        ctx.to(torch.int32),
        logits,
        max_q,
        max_ctx,
        bool(decode_only),
        num_decodes,
    )


class StoreChannel:
    """The pipe's interface over the group's TCPStore, for workers on other machines (the `ray`
    executor, runtime/worker/ray_executor.py): the driver posts step n's header under
    `step/<n>`, a worker posts its messages under `msg/<rank>/<i>`, both signed (`store` is a
    SignedStore: a forged step header raises ForgedMessage)."""

    def __init__(self, store: SignedStore, rank: int):
        self.store, self.rank, self.steps, self.sent = store, rank, 0, 0

    def recv_bytes(self) -> bytes:
        key = f"step/{self.steps}"
        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=1))
                break
            except DistStoreError:  # nothing yet: an idle server
                continue
            except DistError as e:  # the driver's store is gone
                raise EOFError(str(e)) from None
        self.steps += 1
        return self.store.get(key)

    def poll(self, timeout: float) -> bool:
        """Whether the next step header is there (or the store is gone), waiting up to `timeout` s."""
        try:
            self.store.wait([f"step/{self.steps}"], datetime.timedelta(seconds=timeout))
        except DistStoreError:  # not yet
            return False
        except DistError:  # gone: recv_bytes will say so
            return True
        return True

    def send(self, message: tuple[str, object]) -> None:
        # JSON, never pickle: the store's port is reachable from other hosts under Ray
        self.store.set(f"msg/{self.rank}/{self.sent}", json.dumps(list(message)))
        self.sent += 1


def worker_main(
    rank: int,
    world: int,
    port: int,
    config,
    conn,
    threads: int | None,
    host: str = "127.0.0.1",
    cuda_index: int | None = None,
    bind: str = "127.0.0.1",
    *,
    secret: bytes,
) -> None:
    """Process entry (multiprocessing spawn, or a Ray actor); errors go back over `conn` as
    ("error", text). conn None: a `StoreChannel` over the group's store. host: where rank 0's
    store listens; cuda_index: this rank's GPU (default: cuda:rank); bind: the address this
    rank's gloo sockets listen on (runtime/distributed/group.py); secret: the run's key for
    what goes through the store (runtime/distributed/signed_store.py)."""
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        device = resolve_device(config.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank if cuda_index is None else cuda_index)
            torch.cuda.set_device(device)
        group = TPGroup(rank, world, device, port=port, host=host, bind=bind)
        signed = SignedStore(group.store, secret)
        if conn is None:
            conn = StoreChannel(signed, rank)
        runner = ModelRunner(config, group=group)
        _publish(runner, signed, rank)
        conn.send(
            (
                "ready",
                {
                    "blocks": runner.num_blocks,
                    "weight_bytes": runner.weight_bytes,
                    "kv_cache_bytes": runner.kv_cache_bytes,
                    "pid": os.getpid(),
                },
            )
        )
    except BaseException as e:  # noqa: BLE001 (any failure is reported to the driver, which names this rank)
        try:
            conn.send(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        except OSError:
            pass
        return
    published, unpublished = time.monotonic(), False  # steps run since the last publish
    while True:
        try:
            if unpublished and not conn.poll(IDLE_PUBLISH_S):  # idle now: complete counters
                _publish(runner, signed, rank)
                published, unpublished = time.monotonic(), False
            header = HEADER.unpack(conn.recv_bytes())
        except ForgedMessage as e:  # someone else wrote our step key: stop, say so
            log.error("tensor-parallel rank %d: %s", rank, e)
            return
        except (EOFError, OSError, RuntimeError):  # RuntimeError: the store (DistError)
            return  # the driver is gone
        if header[0] == STOP:
            return
        payload = torch.empty(header[-1], dtype=torch.int64, device=group.device)  # its length
        try:
            group.broadcast(payload)
            runner.execute(unpack_batch(header, payload))
            unpublished = True
            if time.monotonic() - published >= PUBLISH_EVERY_S:
                _publish(runner, signed, rank)
                published, unpublished = time.monotonic(), False
        except RuntimeError as e:  # a peer died or hung (or the store is gone): nothing left to do
            log.error("tensor-parallel rank %d: %s", rank, str(e).splitlines()[0] if str(e) else e)
            return


def _publish(runner: ModelRunner, store: SignedStore, rank: int) -> None:
    """This rank's process memory and collective counters into the store, for the driver's
    /metrics (runtime/stats/rank_stats.py)."""
    comm = runner.comm_stats()
    publish_stats(
        store, rank, process_memory_bytes(runner.device), comm["comm_s"], comm["comm_calls"]
    )
