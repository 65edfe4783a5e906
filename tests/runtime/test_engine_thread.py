"""`AsyncEngine.from_config` builds the engine on the thread that later steps it, so torch's CPU
work runs on one OpenMP team (runtime/engine/async_engine.py, `_HomeThread`)."""

import asyncio
import threading

import pytest

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.engine.async_engine import AsyncEngine
from slimserve.runtime.engine.llm_engine import LLMEngine
from slimserve.runtime.engine.sequence import SamplingParams


def test_engine_is_built_and_stepped_on_one_thread(tiny_checkpoint, monkeypatch):
    threads: dict[str, set[threading.Thread]] = {"built": set(), "stepped": set()}
    init, step = LLMEngine.__init__, LLMEngine.step

    def recording_init(self, *a, **k):
        threads["built"].add(threading.current_thread())
        init(self, *a, **k)

    def recording_step(self):
        threads["stepped"].add(threading.current_thread())
        return step(self)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_checkpoint), device="cpu"))

    async def run():
        await engine.start()
        outs = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=4), "r0")]
        await engine.shutdown()
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished
    assert len(threads["built"]) == 1 and threads["built"] == threads["stepped"]
    assert threading.main_thread() not in threads["built"]
    assert not any(t.is_alive() for t in threads["built"])  # ended with the loop


def test_a_failed_build_raises_in_the_caller_and_leaves_no_thread(tmp_path):
    before = set(threading.enumerate())
    with pytest.raises(Exception) as err:  # an empty folder: no config.json
        AsyncEngine.from_config(EngineConfig(model=str(tmp_path), device="cpu"))
    assert "config" in str(err.value).lower()
    for t in set(threading.enumerate()) - before:
        t.join(5)
        assert not t.is_alive(), t.name
