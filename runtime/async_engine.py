"""AsyncEngine: the LLMEngine on its own thread, fed and drained from asyncio.

The engine thread owns every scheduler and KV-cache structure; the event loop only tokenizes and
validates (LLMEngine.make_sequence), then hands sequences and aborts over a thread-safe queue.
Outputs come back through per-request asyncio queues (loop.call_soon_threadsafe). A request whose
consumer stops iterating (client disconnect, task cancelled) is aborted and its blocks freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.engine import EngineStats, LLMEngine
from slimserve.runtime.errors import EngineDeadError, RequestError
from slimserve.runtime.sequence import RequestOutput, SamplingParams

log = logging.getLogger(__name__)
_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.config = engine.config
        self.model_name = engine.config.served_model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._stats = engine.stats()
        self._queued = 0  # adds handed to the engine thread and not yet applied (for num_waiting)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine(config))

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="slimserve-engine", daemon=True)
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

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        seq = self.engine.make_sequence(request_id, prompt, params)  # RequestError before any yield
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[request_id] = (asyncio.get_running_loop(), q)
            self._queued += 1
        self._commands.put(("add", seq))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, RequestError):
                    finished = True  # never reached the scheduler: nothing to abort
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item}")
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    # -- engine thread -------------------------------------------------------------------------

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _apply(self, cmd) -> bool:
        if cmd is _STOP:
            return False
        kind, arg = cmd
        if kind == "add":
            with self._lock:
                self._queued -= 1
            try:
                self.engine.add_sequence(arg)
            except (RequestError, ValueError) as e:  # fails this request only, not the loop
                err = e if isinstance(e, RequestError) else RequestError("prompt", str(e))
                self._deliver(err, arg.request_id)
        else:
            out = self.engine.abort_request(arg)
            if out is not None:
                self._deliver(out, arg)
        return True

    def _loop(self) -> None:
        try:
            running = True
            while running:
                block = not self.engine.has_unfinished()
                try:
                    cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
                    running = self._apply(cmd)
                    while running:
                        running = self._apply(self._commands.get_nowait())
                except queue.Empty:
                    pass
                if running and self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._deliver(out, out.request_id)
                self._stats = self.engine.stats()
        except BaseException as e:  # a bug or device failure: fail every open request loudly
            log.exception("engine loop died")
            self._dead = e
        finally:
            for rid in list(self.engine.requests):
                out = self.engine.abort_request(rid)
                self._deliver(self._dead or out, rid)
            self._stats = self.engine.stats()
