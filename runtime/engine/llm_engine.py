"""LLMEngine: the synchronous step loop (schedule -> prepare batch -> forward -> sample -> update).

Not thread-safe: the offline `LLM` calls it directly; `AsyncEngine` drives it from one thread.

Outputs are cumulative (everything so far, what the offline `LLM` returns) or, with
`output_deltas`, only what is new since the request's previous output (what the server streams):
a delta holds back the tail of the text that could still begin a stop string, so text once handed
out is never taken back, and a consumer that keeps deltas holds O(output) memory, not O(output^2).

One request cannot take the others down: logits that are NaN or +inf in a row (or all -inf) fail
that request alone with finish_reason "error", and so does an exception while its text is
decoded or its stop strings are matched. An exception in the forward pass itself cannot be
pinned on one request and propagates (AsyncEngine then fails every open request).

Prefill/decode disaggregation (runtime/disagg/): a request added with `kv_export` (a segment name)
writes its prompt's KV blocks and its first token into that shared-memory segment when it
finishes (its parameters are prefill-only: one token); one added with `kv_import` (blocks read
from such a segment) waits for free blocks, gets the blocks copied into the cache and its first
token appended (stop conditions checked on it), and then decodes like any running sequence.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

import torch

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.disagg.layout import KVLayout, layout_of
from slimserve.runtime.disagg.segment import SegmentRegistry
from slimserve.runtime.disagg.transfer import ImportedKV, export_blocks, scatter
from slimserve.runtime.engine.block_manager import BlockManager
from slimserve.runtime.engine.detokenizer import DetokenizerState, make_decoder
from slimserve.runtime.engine.sampler import sample, token_logprobs
from slimserve.runtime.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from slimserve.runtime.engine.sequence import (
    CompletionOutput,
    RequestOutput,
    SamplingParams,
    Sequence,
    SequenceStatus,
)
from slimserve.runtime.engine.stops import StopHoldBack, find_stop
from slimserve.runtime.errors import RequestError
from slimserve.runtime.stats.step_timing import StepTimings, batch_composition
from slimserve.runtime.worker.launch import make_runner
from slimserve.runtime.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1 of KV blocks held by live sequences
    prefix_cache_hit_rate: float  # 0..1, cumulative over prompt tokens looked up
    num_preemptions: int  # cumulative
    num_blocks: int
    block_size: int
    capacity_tokens: int  # num_blocks * block_size
    # CPU compute threads now and how often they changed (runtime/worker/threads.py); 0, 0 for
    # an engine whose threads nobody governs (CUDA, -tp/-pp ranks)
    cpu_threads: int = 0
    cpu_thread_changes: int = 0


@dataclass(eq=False)
class _Request:
    seq: Sequence
    generator: torch.Generator | None
    detok: DetokenizerState  # incremental detokenization of the output
    text: str = ""  # detokenized output, stop string removed once found
    max_stop_len: int = field(default=0)
    error: str | None = None  # why the request failed alone (finish_reason "error")
    # delta outputs: tokens handed out so far; the text handed out, less a stop-string start
    sent_tokens: int = 0
    holdback: StopHoldBack | None = None  # built with the request's first delta
    kv_export: str | None = None  # prefill side: the segment its prompt's KV goes to when done
    kv_import: ImportedKV | None = None  # decode side: blocks waiting to enter the cache


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None):
        self.config = config
        self.runner = runner or make_runner(config)
        self.tokenizer = self.runner.built.tokenizer
        self._decode = make_decoder(self.tokenizer) if self.tokenizer is not None else None
        self.eos_token_ids = set(self.runner.built.eos_token_ids)
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
            ),
            self.block_manager,
        )
        self.requests: dict[str, _Request] = {}
        self._counter = itertools.count()
        self.output_deltas = False  # step() returns what is new per request, not everything
        self.step_timing = StepTimings.for_device(self.runner.device)  # phase histograms
        # A token spans at most this many characters of text, so a prompt longer than
        # max_model_len * it cannot fit and is refused before the tokenizer sees it.
        self.max_prompt_chars = self.max_model_len * _max_token_chars(self.tokenizer)
        self.kv_segments = SegmentRegistry()  # segments exported and not imported yet
        self._imports: deque[_Request] = deque()  # imported requests waiting for blocks, FCFS

    @cached_property
    def kv_layout(self) -> KVLayout:
        """This engine's KV block layout (runtime/disagg/layout.py), for exports and imports."""
        if self.runner.tensor_parallel_size > 1 or self.config.pipeline_parallel_size > 1:
            raise ValueError(
                "prefill/decode disaggregation: a model split with -tp/-pp cannot "
                "hand over KV blocks yet; serve each role on one rank"
            )
        return layout_of(self.runner)

    # -- requests ------------------------------------------------------------------------------

    def make_sequence(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> Sequence:
        """Tokenize and validate a request (any thread); raises RequestError naming the field."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt", "this model folder has no tokenizer; send token ids")
            if len(prompt) > self.max_prompt_chars:
                raise RequestError(
                    "prompt",
                    f"has {len(prompt)} characters, more than "
                    f"{self.max_model_len} tokens of this tokenizer can "
                    f"hold ({self.max_prompt_chars}); this model's maximum "
                    f"context length is {self.max_model_len}",
                )
            ids = self.tokenizer(prompt).input_ids if prompt else []
        else:
            if len(prompt) >= self.max_model_len:  # before looking at every id
                raise RequestError(
                    "prompt",
                    f"has {len(prompt)} tokens; this model's maximum "
                    f"context length is {self.max_model_len} "
                    f"(prompt + max_tokens)",
                )
            ids = list(prompt)
            vocab = self.runner.spec.vocab_size
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(
                    "prompt", f"token id {bad!r} is outside the vocabulary [0, {vocab})"
                )
        if not ids:
            raise RequestError("prompt", "is empty; send at least one token")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                "prompt",
                f"has {len(ids)} tokens; this model's maximum context "
                f"length is {self.max_model_len} (prompt + max_tokens)",
            )
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                "max_tokens",
                f"{params.max_tokens} + {len(ids)} prompt tokens exceed "
                f"the maximum context length {self.max_model_len}; "
                f"ask for at most {self.max_model_len - len(ids)}",
            )
        eos = None if params.ignore_eos else min(self.eos_token_ids, default=None)
        return Sequence(
            request_id=request_id, prompt_token_ids=ids, params=params, eos_token_id=eos
        )

    def add_sequence(
        self, seq: Sequence, kv_export: str | None = None, kv_import: ImportedKV | None = None
    ) -> None:
        """Queue a validated sequence. kv_export: write its prompt's KV into this segment when it
        finishes (the caller gave it prefill-only parameters); kv_import: its prompt's KV and
        first token, received from a prefill replica (runtime/disagg/)."""
        if seq.request_id in self.requests:
            raise RequestError("request_id", f"{seq.request_id!r} is already running")
        if kv_import is not None:
            bs, cap = self.block_manager.block_size, self.block_manager.num_blocks
            longest = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
            if -(-longest // bs) > cap:
                raise RequestError(
                    "max_tokens",
                    f"the request may reach {longest} tokens but the "
                    f"KV cache holds {cap * bs}; lower max_tokens",
                )
        gen = None
        if not seq.params.greedy:
            seed = (
                seq.params.seed
                if seq.params.seed is not None
                else hash((self.config.seed, next(self._counter))) & 0x7FFFFFFF
            )
            gen = torch.Generator().manual_seed(seed)
            if kv_import is not None:  # the prefill side drew the first token's number
                torch.rand((), dtype=torch.float64, generator=gen)
        req = _Request(
            seq,
            gen,
            DetokenizerState.for_prompt(seq.num_prompt_tokens),
            max_stop_len=max((len(s) for s in seq.params.stop), default=0),
            kv_export=kv_export,
            kv_import=kv_import,
        )
        self.requests[seq.request_id] = req
        if kv_import is not None:
            self._imports.append(req)  # enters the batch once blocks are free (_admit_imports)
        else:
            self.scheduler.add(seq)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> Sequence:
        seq = self.make_sequence(request_id, prompt, params)
        self.add_sequence(seq)
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.kv_import is not None:  # still waiting for blocks: never reached the scheduler
            self._imports.remove(req)
            req.kv_import = None
            req.seq.status = SequenceStatus.FINISHED
        self.scheduler.abort(request_id)
        req.seq.finish_reason = "abort"
        req.seq.finish_time = time.monotonic()
        return self._output(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._imports)

    def is_importing(self, request_id: str) -> bool:
        """Whether the request waits for blocks to import its prefilled prompt into."""
        req = self.requests.get(request_id)
        return req is not None and req.kv_import is not None

    def stats(self) -> EngineStats:
        bm, s = self.block_manager, self.scheduler.stats()
        return EngineStats(
            s.num_running,
            s.num_waiting + len(self._imports),
            s.kv_cache_usage,
            s.prefix_cache_hit_rate,
            s.num_preemptions,
            bm.num_blocks,
            bm.block_size,
            bm.num_blocks * bm.block_size,
            gov.threads if (gov := self.runner.threads) else 0,
            gov.changes if gov else 0,
        )

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an update for every request that produced a token. Each
        phase is timed into `self.step_timing` (runtime/stats/step_timing.py)."""
        imported = self._admit_imports() if self._imports else []
        clock = self.step_timing.begin()
        out = self.scheduler.schedule()
        if not out.scheduled:
            clock.cancel()
            return imported
        # one-token sequences first (stable): on a GPU a mixed step's attention runs them on the
        # decode kernel and only the prompt chunks on the prefill kernel (BatchInputs.num_decodes)
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        items = out.scheduled
        composition = batch_composition(items)
        clock.next("prepare")
        # positions whose logits give prompt logprobs (empty unless a request asked for them)
        extra = [s.seq.prompt_logprob_rows(s.start, s.num_new_tokens) for s in items]
        batch = self.runner.prepare(
            [s.seq.token_ids[s.start : s.start + s.num_new_tokens] for s in items],
            [s.start for s in items],
            [s.seq.block_table for s in items],
            [s.sample for s in items],
            [range(r.start - s.start, r.stop - s.start) for r, s in zip(extra, items)],
        )
        clock.next("forward")
        logits = self.runner.execute(batch)
        clock.next("sample")
        if any(extra):
            logits = self._prompt_logprobs(logits, items, extra)
        sampled = [s for s in items if s.sample]
        reqs = [self.requests[s.seq.request_id] for s in sampled]
        result = sample(logits, [r.seq.params for r in reqs], [r.generator for r in reqs])
        # A row without a finite maximum (NaN, +inf, or nothing but -inf) has no meaningful
        # token: that request fails alone (the sampler reports it in its one host copy).
        for j, ok in enumerate(result.finite):
            if not ok:
                reqs[j].error = "the model's logits are not finite (NaN or inf) for this request"
        it = iter(range(len(sampled)))
        tokens = [result.token_ids[next(it)] if s.sample else None for s in items]
        self.scheduler.update(out, tokens)
        clock.next("detokenize")
        now = time.monotonic()
        for j, req in enumerate(reqs):
            seq = req.seq
            if result.logprobs[j] is not None:
                seq.output_logprobs.append(result.logprobs[j])
            seq.first_token_time = seq.first_token_time or now
            seq.last_token_time = now
            if req.error is None:
                self._check_stop_or_fail(req)
        clock.next("output")
        outputs = imported
        for req in reqs:
            seq = req.seq
            if req.kv_export is not None and seq.finish_reason is not None and req.error is None:
                self._export(req)
            if req.error is not None:
                seq.finish_reason, seq.stop_reason = "error", None
            if seq.finish_reason is not None:
                seq.finish_time = now
                self.scheduler.finish(seq, seq.finish_reason)
                self.requests.pop(seq.request_id, None)
            outputs.append(self._output(req))
        clock.finish(*composition)
        return outputs

    def _prompt_logprobs(
        self, logits: torch.Tensor, items: list[ScheduledSeq], extra: list[range]
    ) -> torch.Tensor:
        """Store the prompt logprobs of this step's extra logits rows in their sequences and
        return the sampled rows alone. Rows go item by item: its extra rows, then its sampled row
        (runtime/batch.py `prepare_batch`)."""
        rows, targets, keep, top_n, at = [], [], [], 0, 0
        for item, positions in zip(items, extra):
            seq = item.seq
            if positions:
                rows.extend(range(at, at + len(positions)))
                targets.extend(seq.prompt_token_ids[p + 1] for p in positions)
                top_n = max(top_n, seq.params.prompt_logprobs)
                at += len(positions)
            if item.sample:
                keep.append(at)
                at += 1
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        values = token_logprobs(logits.index_select(0, index), targets, top_n)
        it = iter(values)
        for item, positions in zip(items, extra):
            seq = item.seq
            if not positions:
                continue
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None] * seq.num_prompt_tokens
            n = seq.params.prompt_logprobs
            for p in positions:
                lp, tops = next(it)
                seq.prompt_logprobs[p + 1] = (lp, tops if n == top_n else _first(tops, n))
        return logits.index_select(0, torch.tensor(keep, dtype=torch.long, device=logits.device))

    def _export(self, req: _Request) -> None:
        """Write a finished prefill's prompt KV and first token into its segment; a failure
        fails this request alone."""
        seq = req.seq
        try:
            export_blocks(
                self.runner.kv_caches,
                self.kv_layout,
                seq.block_table,
                seq.num_prompt_tokens,
                seq.prompt_token_ids,
                seq.output_token_ids[0],
                seq.output_logprobs[0] if seq.output_logprobs else None,
                req.kv_export,
                self.kv_segments,
            )
        except Exception as e:
            log.exception("exporting the KV of %s failed", seq.request_id)
            req.error = f"exporting the prompt's KV blocks failed: {type(e).__name__}: {e}"

    def _admit_imports(self) -> list[RequestOutput]:
        """Move imported requests into the running batch, oldest first, while sequence slots and
        free blocks allow: blocks copied in, first token appended and checked for a stop."""
        outputs: list[RequestOutput] = []
        bm = self.block_manager
        while self._imports:
            req = self._imports[0]
            seq, imp = req.seq, req.kv_import
            assert imp is not None
            if len(
                self.scheduler.running
            ) >= self.config.max_num_seqs or not bm.can_allocate_blocks(imp.num_blocks):
                break
            self._imports.popleft()
            req.kv_import = None
            seq.output_token_ids.append(imp.first_token)
            if seq.params.logprobs is not None and imp.first_logprob is not None:
                seq.output_logprobs.append(imp.first_logprob)
            seq.first_token_time = seq.last_token_time = time.monotonic()
            self._check_stop_or_fail(req)
            if req.error is not None:
                seq.finish_reason, seq.stop_reason = "error", None
            if seq.finish_reason is None:
                scatter(self.runner.kv_caches, imp, bm.allocate_imported(seq, imp.num_tokens))
                self.scheduler.add_running(seq)
            else:  # done at its first token: it never needs a block
                seq.status, seq.finish_time = SequenceStatus.FINISHED, seq.last_token_time
                self.requests.pop(seq.request_id, None)
            outputs.append(self._output(req))
        return outputs

    def _check_stop_or_fail(self, req: _Request) -> None:
        """_check_stop; a tokenizer/decoder failure there fails this request alone."""
        try:
            self._check_stop(req)
        except Exception as e:
            log.exception("request %s failed while decoding its output", req.seq.request_id)
            req.error = f"decoding the output failed: {type(e).__name__}"

    def _check_stop(self, req: _Request) -> None:
        seq, p = req.seq, req.seq.params
        last = seq.output_token_ids[-1]
        if self.tokenizer is not None:
            prev = len(req.text)
            req.detok.update(self._decode, seq.token_ids)
            req.text = req.detok.text
            if p.stop:
                # Only the new text and the max_stop_len - 1 characters before it are searched.
                hit = find_stop(req.text, prev, p.stop, req.max_stop_len)
                if hit is not None:
                    i, s = hit
                    req.text = req.text[:i]
                    seq.finish_reason, seq.stop_reason = "stop", s
                    return
        if last in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", last
        elif not p.ignore_eos and last in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None and self._decode is not None:
            req.detok.flush(self._decode, seq.token_ids)
            req.text = req.detok.text

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        metrics = {
            k: v
            for k, v in (
                ("arrival", seq.arrival_time),
                ("first_token", seq.first_token_time),
                ("last_token", seq.last_token_time),
                ("finish", seq.finish_time),
            )
            if v is not None
        }
        want_lps = seq.params.logprobs is not None
        if self.output_deltas:
            if req.holdback is None:
                req.holdback = StopHoldBack(seq.params.stop)
            text, start = (
                req.holdback.take(req.text, seq.finish_reason is not None),
                req.sent_tokens,
            )
            ids, lps = (
                seq.output_token_ids[start:],
                seq.output_logprobs[start:] if want_lps else None,
            )
            req.sent_tokens = len(seq.output_token_ids)
        else:
            text, ids = req.text, list(seq.output_token_ids)
            lps = list(seq.output_logprobs) if want_lps else None
        comp = CompletionOutput(0, text, ids, lps, seq.finish_reason, seq.stop_reason)
        return RequestOutput(
            seq.request_id,
            seq.prompt_token_ids,
            [comp],
            seq.finish_reason is not None,
            seq.num_cached_tokens,
            metrics,
            error=req.error,
            prompt_logprobs=seq.prompt_logprobs,
        )


def _first(tops: dict[int, float], n: int) -> dict[int, float]:
    """The n best of a top-n dict (insertion order is best first)."""
    return dict(list(tops.items())[:n])


def _max_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry;
    byte-level entries are one character per byte), at least 1; 1 without a tokenizer."""
    if tokenizer is None:
        return 1
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary listing: bound by bytes per token
        return 64
    return max((len(t) for t in vocab), default=1)
