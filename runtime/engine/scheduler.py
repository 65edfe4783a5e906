"""Iteration-level continuous batching with chunked prefill and preemption by recompute (vLLM V1).

Every engine step `schedule()` spends a token budget (`max_num_batched_tokens`) on one flat
batch: first the RUNNING sequences, oldest arrival first (a decode takes 1 token, a prompt still
being prefilled takes the next chunk), then WAITING sequences FCFS (prefix-cache hits skip their
cached blocks; the rest is chunked to fit). A long prompt is thus spread over several steps and
never stalls running decodes.

When KV blocks run out for a running sequence, the most recently arrived running sequence is
preempted by recompute: its blocks are freed, it keeps its output tokens and goes to the front of
the waiting queue, to be recomputed over prompt + outputs later (the prefix cache may serve part
of it). The oldest sequence therefore always progresses, and no request is ever dropped.

Stopping (EOS, stop strings, max_tokens, max_model_len) is decided by the engine, which calls
`finish(seq, reason)`; `update()` only advances the KV state and appends sampled tokens.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from slimserve.runtime.engine.block_manager import BlockManager
from slimserve.runtime.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    """Batch-shape limits of one engine step (vLLM names)."""

    max_num_seqs: int = 256  # sequences held RUNNING at most (the batch's sequence count cap)
    max_num_batched_tokens: int = (
        2048  # tokens (decodes + prefill chunks) computed per step at most
    )
    max_model_len: int = 2048  # prompt + generated tokens of one sequence at most
    long_prefill_token_threshold: int = 0  # cap on one prompt's chunk per step; 0 = off

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        threshold = self.long_prefill_token_threshold
        if not isinstance(threshold, int) or threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be an integer >= 0 (0 = off), got {threshold!r}"
            )


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step."""

    seq: Sequence
    num_new_tokens: int  # tokens whose K/V this step computes: token_ids[start : start + n]
    start: int  # seq.num_computed_tokens when scheduled (position of the first new token)
    sample: bool  # start + num_new_tokens == seq.num_tokens: this step samples the next token


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)  # running ones first, then new
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting this step
    num_batched_tokens: int = 0  # sum of num_new_tokens (<= max_num_batched_tokens)


@dataclass(slots=True)
class SchedulerStats:
    num_running: int  # sequences holding KV blocks
    num_waiting: int  # queued or preempted sequences
    kv_cache_usage: float  # 0..1 of KV blocks held by live sequences
    prefix_cache_hit_rate: float  # 0..1 of looked-up prompt tokens, cumulative
    num_preemptions: int  # preemptions since start, cumulative


class Scheduler:
    """Decides, step by step, which tokens of which sequences the model computes."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()  # FCFS; preempted sequences go to the front
        self.running: list[Sequence] = []  # sorted by arrival_time, oldest first
        self._requests: dict[str, Sequence] = {}  # request_id -> unfinished sequence
        self.num_preemptions = 0  # cumulative, all sequences

    # ---- queue management -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request (FCFS). Raises ValueError for one that could never run."""
        if seq.request_id in self._requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in flight; use a unique id")
        if seq.num_prompt_tokens < 1:
            raise ValueError(
                f"request {seq.request_id!r} has an empty prompt; give at least one token"
            )
        max_len = self.config.max_model_len
        if seq.num_prompt_tokens > max_len:
            raise ValueError(
                f"request {seq.request_id!r}: prompt of {seq.num_prompt_tokens} tokens exceeds "
                f"max_model_len={max_len}; shorten the prompt"
            )
        bm = self.block_manager
        longest = min(seq.num_prompt_tokens + seq.params.max_tokens, max_len)
        if -(-longest // bm.block_size) > bm.num_blocks:
            raise ValueError(
                f"request {seq.request_id!r} may reach {longest} tokens but the KV cache holds "
                f"{bm.num_blocks * bm.block_size}; lower max_tokens or give the KV cache more memory"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._requests[seq.request_id] = seq

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose prompt K/V already fill its blocks (imported from a prefill
        replica by the engine, runtime/disagg/): it runs from the next step on."""
        if seq.request_id in self._requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in flight; use a unique id")
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival_time)
        self._requests[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        """Finish an unfinished request with reason "abort" and free its blocks; None if unknown."""
        seq = self._requests.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of the queues, free its blocks, mark it FINISHED with `reason`."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return  # already finished
        self.block_manager.free(seq)
        self._requests.pop(seq.request_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=bm.usage,
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
            num_preemptions=self.num_preemptions,
        )

    # ---- one step ---------------------------------------------------------------------------

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens to compute this step out of `remaining`, within the budget and the threshold."""
        n = min(remaining, budget)
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _preempt(self, seq: Sequence) -> None:
        """Drop seq's KV for recompute and put it at the front of the waiting queue."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give each running sequence its next tokens, preempting the newest ones when blocks run out."""
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            assert n > 0, seq.request_id  # the last sampled token always lacks K/V
            while not bm.can_append(seq, n):
                # running is arrival-sorted and processed in order, so the victim (last) is never
                # one already scheduled this step; it may be seq itself, then the loop ends.
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(
                    ScheduledSeq(seq, n, seq.num_computed_tokens, self._samples(seq, n))
                )
                bm.append_slots(seq, n)
                budget -= n
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting sequences FCFS while budget, max_num_seqs and free blocks allow."""
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = self._chunk(seq.num_tokens - bm.lookup_prefix(seq), budget)
            if not bm.can_allocate(seq, n):
                break  # head-of-line waits for blocks: admission never preempts
            self.waiting.popleft()
            bm.allocate_prefix(seq)
            out.scheduled.append(
                ScheduledSeq(seq, n, seq.num_computed_tokens, self._samples(seq, n))
            )
            bm.append_slots(seq, n)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival_time)
            budget -= n
        return budget

    @staticmethod
    def _samples(seq: Sequence, n: int) -> bool:
        return seq.num_computed_tokens + n == seq.num_tokens

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running sequences first, then new ones, within all limits."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        # After a preemption memory is tight: admitting now would only preempt again (as vLLM V1).
        if not out.preempted:
            budget = self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def update(self, output: SchedulerOutput, sampled: list[int | None]) -> None:
        """Apply a computed step: advance KV state, cache full blocks, append sampled tokens.

        `sampled[k]` is the token sampled for output.scheduled[k] when its `sample` is set, else
        None. Sequences finished (e.g. aborted) since `schedule()` are skipped.
        """
        assert len(sampled) == len(output.scheduled), (len(sampled), len(output.scheduled))
        for item, token in zip(output.scheduled, sampled):
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            assert seq.num_computed_tokens == item.start, (
                seq.request_id,
                seq.num_computed_tokens,
                item.start,
            )
            assert (token is not None) == item.sample, (seq.request_id, token, item.sample)
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.commit(seq)
            if token is not None:
                seq.output_token_ids.append(token)
