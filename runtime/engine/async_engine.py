"""AsyncEngine: the LLMEngine on its own thread, fed and drained from asyncio.

The engine thread owns every scheduler and KV-cache structure; the event loop only validates and
hands sequences and aborts over a thread-safe queue. Tokenizing a prompt runs in a worker thread
(`make_sequence` in the default executor), never on the event loop, after a character-count
bound that refuses an oversized prompt without tokenizing it.

Outputs are deltas (`LLMEngine.output_deltas`): each step hands a request only its new tokens and
text. They reach the request's `_Mailbox` through `loop.call_soon_threadsafe`; a mailbox merges
the deltas its consumer has not taken yet into one, so a consumer that stops reading (a stalled
HTTP client) costs memory in proportion to its output, never one copy per step. A request whose
consumer stops iterating (client disconnect, task cancelled) is aborted and its blocks freed.

Failure handling: a request the engine fails alone (non-finite logits, a decode error) ends with
an output whose `error` is set; if the loop itself dies, every registered request is failed at
once with EngineDeadError and `health_problem()` says so (the server's /health answers 503); a
step running longer than `step_watchdog_s` also makes `health_problem()` report the engine stuck.

Load (`load()`, for the router's least-latency policy through the server's GET /state): the prompt
tokens that requests without a first output still have to compute (queued prefill work: less
what chunked prefill has computed already and what the prefix cache serves, so a replica
holding a shared prefix does not look busier than it is); the sequences decoding and their
context tokens; the engine's step cost fit online on the engine thread (runtime/stats/step_cost.py:
fixed, per prefill token, per decoding sequence, per context token), and the characters per
prompt token of its tokenizer (a router without a tokenizer estimates prompts with it).

Step timing and profiling: `step_timing()` is a copy of the engine's per-phase histograms
(runtime/stats/step_timing.py) for /metrics. With a `profile_dir`, `start_profile()` and
`stop_profile()` run a `StepProfiler` (runtime/stats/profiler.py) on the engine thread: they travel
over the command queue like adds and aborts, so the profiler starts and stops between steps
and sees each step whole; writing the trace pauses the steps while it lasts.

Prefill/decode disaggregation (runtime/disagg/): `generate(..., kv_export=NAME)` runs a
prefill-only request (validated with the request's own parameters, then one token, no stops)
whose prompt KV and first token end up in shared-memory segment NAME; `generate(...,
kv_import=NAME)` reads and checks that segment in a worker thread (a `KVTransferError` before
the first output for a bad one) and continues the request from its first token. The engine
thread unlinks segments nobody imported after their TTL, and all of its own at shutdown.

Ranks (`rank_stats()`, for /metrics): each rank's weight, KV-cache and process memory and its
time in collectives (runtime/stats/rank_stats.py), read without touching the engine thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from slimserve.runtime.config import DEFAULT_STEP_WATCHDOG_S, EngineConfig
from slimserve.runtime.disagg.segment import SegmentRegistry, sweep_orphans
from slimserve.runtime.disagg.transfer import load_import
from slimserve.runtime.engine.llm_engine import EngineStats, LLMEngine
from slimserve.runtime.engine.sequence import (
    OutputAccumulator,
    RequestOutput,
    SamplingParams,
    SequenceStatus,
)
from slimserve.runtime.errors import EngineDeadError, RequestError
from slimserve.runtime.stats.profiler import (
    PROFILE_MAX_STEPS,
    ProfileError,
    ProfileResult,
    ProfilingDisabled,
    StepProfiler,
    prepare_profile_dir,
)
from slimserve.runtime.stats.rank_stats import RankStats
from slimserve.runtime.stats.step_cost import StepCost, StepCostFit
from slimserve.runtime.stats.step_timing import StepTimingSnapshot
from slimserve.runtime.worker.model_runner import startup_line

log = logging.getLogger(__name__)
_STOP = object()
CHARS_EWMA_ALPHA = 0.05  # weight of the newest text prompt in load().chars_per_token
SEGMENT_EXPIRY_EVERY_S = 1.0  # how often the engine thread unlinks expired KV segments


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """What a router needs to predict this engine's time to first token (runtime/router/)."""

    queued_prefill_tokens: int  # prompt tokens requests without a first output still compute
    max_num_batched_tokens: int  # tokens one step computes at most
    steps: int  # steps run so far
    num_decoding: int = 0  # sequences past their prefill (each decodes a token per step)
    decoding_context_tokens: int = 0  # their tokens so far (what their attention reads)
    step_cost: StepCost | None = None  # fit of the steps so far; None before MIN_STEPS of them
    # the cost's decode-only step for the sequences decoding now, and its cost per prefill token
    # (what an older router reads); None with step_cost
    step_time_s: float | None = None
    prefill_s_per_token: float | None = None
    chars_per_token: float | None = None  # of the text prompts so far (moving average); None: none


class _HomeThread:
    """The engine's one thread: it builds the engine, then runs its loop.

    torch's CPU ops run on the OpenMP team of the thread that calls them, and a team's workers
    stay behind (spinning a while, then asleep) when that thread moves on. Loading the weights
    on the event loop's thread and stepping on another left two teams on the same cores; the
    demo serving workload ran 5-20% slower than with one thread doing both (measured).
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="slimserve-engine", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, box = job
            try:
                result = (True, fn())
            except BaseException as e:  # handed to the caller
                result = (False, e)
            if box is not None:
                box.put(result)

    def call(self, fn: Callable[[], Any]) -> Any:
        """fn() on this thread; its result, or its exception raised here."""
        box: queue.Queue = queue.Queue(1)
        self._jobs.put((fn, box))
        ok, value = box.get()
        if not ok:
            raise value
        return value

    def finish_with(self, fn: Callable[[], Any]) -> None:
        """Run fn as this thread's last job (it ends when fn returns); does not wait."""
        self._jobs.put((fn, None))
        self._jobs.put(None)


def _put_all(items: list[tuple[_Mailbox, Any]]) -> None:
    for box, out in items:
        box.put(out)


class _Mailbox:
    """One request's undelivered outputs, merged into one; touched only on the event loop."""

    def __init__(self) -> None:
        self._ready = asyncio.Event()
        self._pending = OutputAccumulator()
        self._error: BaseException | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = self._error or item
        else:
            self._pending.add(item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        """The merged outputs since the previous get (outputs before an error come first)."""
        await self._ready.wait()
        merged = self._pending.take()
        if merged is None:
            return self._error  # type: ignore[return-value]
        if self._error is None:
            self._ready.clear()
        return merged


class AsyncEngine:
    """profile_dir: where POST /start_profile ... /stop_profile write traces (created if missing;
    None: profiling off); profile_max_steps: the default cap of one profile."""

    def __init__(
        self,
        engine: LLMEngine,
        step_watchdog_s: float = DEFAULT_STEP_WATCHDOG_S,
        profile_dir: str | Path | None = None,
        profile_max_steps: int = PROFILE_MAX_STEPS,
    ):
        self.engine = engine
        engine.output_deltas = True
        self.config = engine.config
        self.model_name = engine.config.served_model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_prompt_chars = engine.max_prompt_chars  # longer prompts cannot fit (see engine)
        self.step_watchdog_s = step_watchdog_s
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Mailbox]] = {}
        self._lock = threading.Lock()  # guards _streams, _queued and the _dead transition
        self._thread: threading.Thread | None = None
        self._home: _HomeThread | None = None  # the thread that built the engine (from_config)
        self._dead: BaseException | None = None
        self._step_started: float | None = None  # monotonic s, while a step runs
        self._stats = engine.stats()
        self._queued = 0  # adds handed to the engine thread and not yet applied (for num_waiting)
        self._prefill: dict[str, int] = {}  # request id -> prompt tokens, until its first output
        self._left: dict[
            str, int
        ] = {}  # engine thread's snapshot: of those, tokens still to compute
        self._cost = StepCostFit()  # load(): written by the engine thread only
        self._decoding = (0, 0)  # engine thread's snapshot: sequences decoding, their tokens
        self._chars_per_token: float | None = None
        self.profile_dir = None if profile_dir is None else prepare_profile_dir(profile_dir)
        self._profiler = (
            None
            if self.profile_dir is None
            else StepProfiler(
                self.profile_dir,
                engine.step_timing,
                cuda=engine.step_timing.cuda,
                max_steps=profile_max_steps,
            )
        )

    @classmethod
    def from_config(cls, config: EngineConfig, **kw) -> AsyncEngine:
        """Build the engine on the thread that will step it (`_HomeThread`)."""
        home = _HomeThread()
        try:
            engine = home.call(lambda: LLMEngine(config))
        except BaseException:
            home.finish_with(lambda: None)
            raise
        made = cls(engine, **kw)
        made._home = home
        return made

    async def start(self) -> None:
        if self._thread is None:
            try:
                sweep_orphans()  # KV segments of prefill servers that died before expiring them
            except OSError:
                log.warning("could not sweep orphaned KV segments", exc_info=True)
            if self._home is not None:
                self._thread = self._home.thread
                self._home.finish_with(self._loop)
                self._home = None  # a restart after shutdown gets a new thread
            else:
                self._thread = threading.Thread(
                    target=self._loop, name="slimserve-engine", daemon=True
                )
                self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is not None:
            self._commands.put(_STOP)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)
            self._thread = None

    def stats(self) -> EngineStats:
        """Refreshed by the engine thread after every step; requests handed over since count as
        waiting, so a burst within one step sees an exact queue length."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        s = self._stats
        return dataclasses.replace(s, num_waiting=s.num_waiting + self._queued)

    def load(self) -> EngineLoad:
        """Queued prefill work, the decoding batch and the step-cost fit (see EngineLoad); cheap,
        event loop only."""
        left = self._left  # replaced whole by the engine thread, never changed in place
        queued = sum(left.get(rid, n) for rid, n in self._prefill.items())
        decoding, context = self._decoding
        cost = self._cost.estimate()
        return EngineLoad(
            queued,
            self.config.max_num_batched_tokens,
            self._cost.steps,
            decoding,
            context,
            cost,
            step_time_s=None if cost is None else cost.step_s(0, decoding, context),
            prefill_s_per_token=None if cost is None else cost.per_prefill_token_s,
            chars_per_token=self._chars_per_token,
        )

    @property
    def kv_segments(self) -> SegmentRegistry:
        """The KV segments this engine wrote or received and nobody has imported yet."""
        return self.engine.kv_segments

    def kv_segment_max_bytes(self) -> int:
        """The largest KV segment a prompt of this engine's context fills: blocks of every layer
        for max_model_len tokens, the prompt's ids in the header, and room for FP8 scales."""
        layout = self.engine.kv_layout
        per_token = (
            2 * layout.num_kv_heads * sum(layout.row_bytes(i) for i in range(layout.num_layers))
        )
        return (
            per_token * (self.max_model_len + layout.block_size) + 64 * self.max_model_len + 2**20
        )

    def health_problem(self) -> str | None:
        """Why the engine cannot serve (dead loop, or a step past the watchdog); None if healthy."""
        if self._dead is not None:
            return f"the engine stopped: {self._dead}"
        started = self._step_started
        if started is not None and time.monotonic() - started > self.step_watchdog_s:
            return (
                f"an engine step has run for {time.monotonic() - started:.1f} s "
                f"(watchdog {self.step_watchdog_s:g} s)"
            )
        return None

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def step_timing(self) -> StepTimingSnapshot:
        """The engine's per-phase and batch histograms so far (any thread; a consistent copy)."""
        return self.engine.step_timing.snapshot()

    def startup_line(self) -> str:
        """How long each part of the start-up took (runtime/worker/model_runner.py, the start-up log)."""
        runner = self.engine.runner
        return startup_line(runner.startup, runner.activation_bytes)

    def kv_capacity_line(self) -> str:
        """The KV cache's blocks and what the same memory holds in bf16 / fp8 / int8 / int4
        (runtime/worker/model_runner.py `capacity_line`): `runtime serve` prints it."""
        return self.engine.runner.capacity_line()

    def rank_stats(self) -> list[RankStats]:
        """Per rank (rank 0 only without tensor/pipeline parallelism): weight, KV-cache and
        process memory, collective time. Any thread; cheap (no worker is asked, nothing waits
        for a step); a worker that has died has no row."""
        return self.engine.runner.rank_stats()

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (runtime/engine/block_manager.py), between steps: what a
        benchmark calls before each measured run so that prompts it sent before are not served
        from the cache (vLLM's POST /reset_prefix_cache)."""
        await self._on_engine_thread(self.engine.block_manager.reset_prefix_cache)

    async def start_profile(self, record_shapes: bool = False, max_steps: int | None = None) -> int:
        """Profile the steps from now on (runtime/stats/profiler.py); returns the step cap in force.
        ProfilingDisabled without a profile_dir, ProfileStateError while one runs."""
        profiler = self._require_profiler()
        return await self._on_engine_thread(lambda: profiler.start(record_shapes, max_steps))

    async def stop_profile(self) -> ProfileResult:
        """Stop profiling and write the trace (or return the one written at the cap)."""
        profiler = self._require_profiler()
        return await self._on_engine_thread(profiler.stop)

    def _require_profiler(self) -> StepProfiler:
        if self._profiler is None:
            raise ProfilingDisabled("profiling is off: start the server with --profile-dir DIR")
        return self._profiler

    async def _on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """fn() run by the engine thread between steps; its result or exception comes back."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:  # as in generate: a dead loop's finally fails whatever is queued
            if self._dead is not None:
                raise EngineDeadError(f"the engine stopped: {self._dead}")
            self._commands.put(("call", (fn, loop, fut)))
        return await fut

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        kv_export: str | None = None,
        kv_import: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Delta outputs of one request; RequestError before the first one for a bad request.
        kv_export / kv_import: a prefill-only request whose KV goes to this segment / a request
        continuing from the KV in this segment (KVTransferError before the first output)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        loop = asyncio.get_running_loop()
        if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
            seq = self.engine.make_sequence(request_id, prompt, params)  # raises, no tokenizing
        else:
            seq = await loop.run_in_executor(
                None, self.engine.make_sequence, request_id, prompt, params
            )
            if isinstance(prompt, str):
                ratio = len(prompt) / len(seq.prompt_token_ids)
                old = self._chars_per_token
                self._chars_per_token = (
                    ratio if old is None else old + CHARS_EWMA_ALPHA * (ratio - old)
                )
        imported = None
        if kv_export is not None:  # validated with the real parameters; now prefill only
            seq.params = dataclasses.replace(
                params, max_tokens=1, stop=[], stop_token_ids=frozenset(), ignore_eos=True
            )
            seq.eos_token_id = None
        elif kv_import is not None:
            layout = self.engine.kv_layout
            try:
                imported = await loop.run_in_executor(
                    None, load_import, kv_import, layout, seq.prompt_token_ids
                )
            finally:  # read (and unlinked) or unusable: no longer counts toward the store's limits
                self.engine.kv_segments.discard(kv_import)
        box = _Mailbox()
        with self._lock:
            if self._dead is not None:  # died while we tokenized: nobody would answer
                raise EngineDeadError(f"the engine stopped: {self._dead}")
            self._streams[request_id] = (asyncio.get_running_loop(), box)
            self._queued += 1
        self._prefill[request_id] = 1 if imported is not None else len(seq.prompt_token_ids)
        self._commands.put(("add", (seq, kv_export, imported)))
        finished = False
        try:
            while True:
                item = await box.get()
                self._prefill.pop(request_id, None)
                if isinstance(item, RequestError):
                    finished = True  # never reached the scheduler: nothing to abort
                    raise item
                if isinstance(item, BaseException):
                    finished = True
                    raise EngineDeadError(f"the engine stopped: {item}")
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._prefill.pop(request_id, None)
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    # -- engine thread -------------------------------------------------------------------------

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            self._post(target, out)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, one event-loop callback per loop rather than one per request: each
        `call_soon_threadsafe` wakes the loop through its self-pipe, and the loop's thread then
        holds the GIL that this thread needs between its torch ops."""
        with self._lock:
            targets = [(self._streams.get(out.request_id), out) for out in outputs]
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Mailbox, RequestOutput]]] = {}
        for target, out in targets:
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            self._post_all(loop, items)

    @staticmethod
    def _settle(
        loop: asyncio.AbstractEventLoop,
        fut: asyncio.Future,
        result: Any,
        error: BaseException | None,
    ) -> None:
        def settle() -> None:
            if not fut.done():  # the caller may have given up (request cancelled)
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(error)

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed
            pass

    @staticmethod
    def _post_all(loop: asyncio.AbstractEventLoop, items: list[tuple[_Mailbox, Any]]) -> None:
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    @classmethod
    def _post(cls, target: tuple[asyncio.AbstractEventLoop, _Mailbox], out) -> None:
        cls._post_all(target[0], [(target[1], out)])

    def _apply(self, cmd) -> bool:
        if cmd is _STOP:
            return False
        kind, arg = cmd
        if kind == "add":
            seq, kv_export, imported = arg
            with self._lock:
                self._queued -= 1
            try:
                self.engine.add_sequence(seq, kv_export=kv_export, kv_import=imported)
            except (RequestError, ValueError) as e:  # fails this request only, not the loop
                err = e if isinstance(e, RequestError) else RequestError("prompt", str(e))
                self._deliver(err, seq.request_id)
        elif kind == "call":
            fn, loop, fut = arg
            try:
                result, error = fn(), None
            except ProfileError as e:
                result, error = None, e
            except Exception as e:  # a bug: the caller gets it, the loop goes on
                log.exception("engine-thread call failed")
                result, error = None, e
            self._settle(loop, fut, result, error)
        else:
            out = self.engine.abort_request(arg)
            if out is not None:
                self._deliver(out, arg)
        return True

    def _measure(self, seconds: float, seqs: list) -> None:
        """Fold one step into the step-cost fit. Per sequence, tokens computed = growth of its
        computed tokens (a finished one has freed its blocks: all its tokens but the sampled last
        one were computed; a preempted one shrinks: counted as 0; one admitted in this step did
        not compute its prefix-cache hit); one that had finished its prompt before the step
        decoded, with its tokens so far as context, the others prefilled."""
        prefill = decode = context = 0
        for seq, before in seqs:
            if before == 0 and seq.num_preemptions == 0:  # admitted now: its prefix-cache hit
                before = seq.num_cached_tokens  # came free, not computed
            done = (
                seq.num_tokens - 1
                if seq.status is SequenceStatus.FINISHED
                else seq.num_computed_tokens
            )
            grown = max(0, done - before)
            if grown and before >= seq.num_prompt_tokens:
                decode, context = decode + 1, context + before + 1
            else:
                prefill += grown
        if prefill or decode:
            self._cost.add(seconds, prefill, decode, context)

    def _snapshot_load(self) -> None:
        """Engine thread, one pass over the requests: per request without a first token, the
        prompt tokens it still has to compute (less those computed and, while it waits, those its
        prefix-cache hit serves); the sequences past their prompt that the next step decodes and
        their tokens. Each snapshot is replaced whole (load() reads them from the event loop)."""
        bm, left = self.engine.block_manager, {}
        decoding = context = 0
        for rid, req in self.engine.requests.items():
            seq = req.seq
            if seq.output_token_ids:
                if (
                    seq.status is SequenceStatus.RUNNING
                    and seq.num_computed_tokens >= seq.num_prompt_tokens
                ):
                    decoding, context = decoding + 1, context + seq.num_computed_tokens + 1
                continue
            if self.engine.is_importing(rid):  # copied in, never computed here
                left[rid] = 0
                continue
            done = seq.num_computed_tokens
            if seq.status is SequenceStatus.WAITING and not seq.block_table:
                done = bm.lookup_prefix(seq)
            left[rid] = max(0, seq.num_prompt_tokens - done)
        self._left, self._decoding = left, (decoding, context)

    def _after_profiled_step(self) -> None:
        try:
            self._profiler.after_step()  # type: ignore[union-attr]
        except Exception:  # writing the capped trace failed: serving goes on
            log.exception("stopping the profile at its cap failed")

    def _fail_queued_calls(self) -> None:
        """The loop has ended: engine-thread calls still queued get EngineDeadError."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd is not _STOP and cmd[0] == "call":
                _, loop, fut = cmd[1]
                self._settle(loop, fut, None, EngineDeadError(f"the engine stopped: {self._dead}"))

    def _loop(self) -> None:
        expired_at = time.monotonic()
        try:
            running = True
            while running:
                if time.monotonic() - expired_at > SEGMENT_EXPIRY_EVERY_S:
                    expired_at = time.monotonic()
                    self.engine.kv_segments.expire()
                block = not self.engine.has_unfinished()
                try:
                    cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
                    running = self._apply(cmd)
                    while running:
                        running = self._apply(self._commands.get_nowait())
                except queue.Empty:
                    pass
                if running and self.engine.has_unfinished():
                    seqs = [
                        (r.seq, r.seq.num_computed_tokens)
                        for rid, r in self.engine.requests.items()
                        if not self.engine.is_importing(rid)
                    ]  # copied in, not computed
                    self._step_started = started = time.monotonic()
                    outputs = self.engine.step()
                    self._step_started = None
                    self._measure(time.monotonic() - started, seqs)
                    if self._profiler is not None:
                        self._after_profiled_step()
                    # the load snapshots first: whoever holds a request's final output
                    # already sees the load without it
                    self._snapshot_load()
                    self._deliver_all(outputs)
                self._stats = self.engine.stats()
        except BaseException as e:  # a bug or device failure: fail every open request loudly
            log.exception("engine loop died")
            with self._lock:
                self._dead = e
        finally:
            self._step_started = None
            self.engine.kv_segments.close()  # exported segments nobody imported: gone with us
            if self._profiler is not None:
                try:
                    self._profiler.close()  # a running profile's trace is written
                except Exception:
                    log.exception("writing the profile at shutdown failed")
            with self._lock:  # from here on generate() refuses, so nobody registers unseen
                clean = self._dead is None
                if clean:
                    self._dead = EngineDeadError("the engine was shut down")
                streams = dict(self._streams)
            self._fail_queued_calls()
            for rid in list(self.engine.requests):
                try:
                    out = self.engine.abort_request(rid)
                except Exception:  # the engine's state may be what broke
                    out = None
                if clean and out is not None and rid in streams:
                    self._post(streams.pop(rid), out)  # shutdown: finish_reason "abort"
            for target in streams.values():  # every other registered request, queued ones too
                self._post(target, self._dead)
            try:
                self._stats = self.engine.stats()
            except Exception:
                pass
