"""The real engine (demo model, CPU) when things go wrong: delta outputs add up to the cumulative
ones, a request with non-finite logits fails alone, a stalled consumer holds one merged output
instead of one copy per step, a dead loop fails every open request at once, a stuck step makes
health_problem() report it, prompts are tokenized off the event loop (and oversized ones not at
all)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.engine.async_engine import AsyncEngine
from slimserve.runtime.engine.llm_engine import LLMEngine
from slimserve.runtime.engine.sequence import OutputAccumulator, SamplingParams
from slimserve.runtime.errors import EngineDeadError, RequestError
from slimserve.runtime.stats.step_cost import MIN_STEPS
from tests.helpers import DEMO_MODEL

pytestmark = pytest.mark.timeout(120)
PROMPT = "def main(argv):\n    parser = argparse.ArgumentParser()\n"


@pytest.fixture(scope="module")
def engine_config():
    return EngineConfig(model=str(DEMO_MODEL), device="cpu", dtype="float32", max_num_seqs=8)


def _drain(engine: LLMEngine) -> dict:
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def test_delta_outputs_add_up_to_the_cumulative_output(engine_config):
    engine = LLMEngine(engine_config)
    # "self" appears in the demo model's greedy continuation: a stop string that ends the text
    params = [
        SamplingParams(max_tokens=40, temperature=0, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0, logprobs=2, stop=["self", "zzzz"]),
    ]
    cumulative = {}
    for i, p in enumerate(params):
        engine.add_request(f"c{i}", PROMPT, p)
    for rid, outs in _drain(engine).items():
        cumulative[rid] = outs[-1]
    engine.output_deltas = True
    for i, p in enumerate(params):
        engine.add_request(f"d{i}", PROMPT, p)
    for rid, outs in _drain(engine).items():
        acc = OutputAccumulator()
        for out in outs:
            acc.add(out)
        whole, ref = acc.take(), cumulative["c" + rid[1:]]
        assert whole.outputs[0].text == ref.outputs[0].text
        assert whole.outputs[0].token_ids == ref.outputs[0].token_ids
        assert whole.outputs[0].logprobs == ref.outputs[0].logprobs
        assert whole.outputs[0].finish_reason == ref.outputs[0].finish_reason
        # each delta is new tokens only: no output repeats what an earlier one carried
        assert sum(len(o.outputs[0].token_ids) for o in outs) == len(ref.outputs[0].token_ids)
        if ref.outputs[0].stop_reason == "self":  # text is cut, and never streamed past the cut
            assert not any("self" in o.outputs[0].text for o in outs)


def test_a_request_with_non_finite_logits_fails_alone(engine_config, monkeypatch):
    engine = LLMEngine(engine_config)
    engine.add_request(
        "alone", PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    alone = _drain(engine)["alone"][-1].outputs[0].token_ids

    execute, schedule = engine.runner.execute, engine.scheduler.schedule
    state = {"sampled": [], "poison": False}

    def schedule_spy():
        out = schedule()
        state["sampled"] = [s.seq.request_id for s in out.scheduled if s.sample]
        return out

    def execute_with_nan(batch):
        logits = execute(batch)  # one row per sampled sequence, in schedule order
        if state["poison"] and "bad" in state["sampled"]:
            logits = logits.clone()
            logits[state["sampled"].index("bad")] = float("nan")
        return logits

    monkeypatch.setattr(engine.scheduler, "schedule", schedule_spy)
    monkeypatch.setattr(engine.runner, "execute", execute_with_nan)
    engine.add_request(
        "good", PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    engine.add_request(
        "bad", PROMPT, SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)
    )
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        state["poison"] = len(outs.get("good", [])) >= 3  # a few tokens in, then NaN
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    bad = outs["bad"][-1]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert "not finite" in bad.error
    assert outs["good"][-1].outputs[0].token_ids == alone
    assert outs["good"][-1].error is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_stalled_consumer_holds_one_merged_output(engine_config):
    async def run():
        engine = AsyncEngine.from_config(engine_config)
        await engine.start()
        gen = engine.generate(
            PROMPT, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), "r"
        )
        first = await gen.__anext__()
        while "r" in engine.engine.requests:  # the consumer reads nothing while it all runs
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        rest = await gen.__anext__()  # everything since the first output, merged into one
        await engine.shutdown()
        return first, rest

    first, rest = asyncio.run(run())
    assert rest.finished
    assert len(first.outputs[0].token_ids) + len(rest.outputs[0].token_ids) == 60


def test_a_dead_loop_fails_every_open_request_at_once(engine_config, monkeypatch):
    async def run():
        engine = AsyncEngine.from_config(engine_config)
        calls = []

        def failing_step():
            calls.append(1)
            time.sleep(0.3)  # let every request register first, some still queued as commands
            raise RuntimeError("device lost")

        monkeypatch.setattr(engine.engine, "step", failing_step)
        await engine.start()

        async def one(i):
            try:
                async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=5), f"r{i}"):
                    pass
            except EngineDeadError as e:
                return str(e)
            return "finished"

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4))), 20)
        problem = engine.health_problem()
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=5), "late"):
                pass
        return results, problem

    results, problem = asyncio.run(run())
    assert all("device lost" in r for r in results), results
    assert problem is not None and "device lost" in problem


def test_a_step_past_the_watchdog_makes_the_engine_unhealthy(engine_config, monkeypatch):
    async def run():
        engine = AsyncEngine.from_config(engine_config, step_watchdog_s=0.2)
        step = engine.engine.step

        def slow_step():
            time.sleep(0.8)
            return step()

        monkeypatch.setattr(engine.engine, "step", slow_step)
        await engine.start()
        seen = []

        async def consume():
            async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=2), "r"):
                pass

        task = asyncio.ensure_future(consume())
        while not task.done():
            seen.append(engine.health_problem())
            await asyncio.sleep(0.05)
        await engine.shutdown()
        return seen

    seen = asyncio.run(run())
    assert any(p is not None and "(watchdog 0.2 s)" in p for p in seen), seen
    assert seen[0] is None  # healthy before the step had run long


def test_prompts_are_tokenized_off_the_event_loop_and_oversized_ones_not_at_all(
    engine_config, monkeypatch
):
    async def run():
        engine = AsyncEngine.from_config(engine_config)
        await engine.start()
        loop_thread = threading.current_thread()
        threads = []
        tok = engine.engine.tokenizer
        real_call = type(tok).__call__

        def spy(self, *a, **k):
            threads.append(threading.current_thread())
            return real_call(self, *a, **k)

        monkeypatch.setattr(type(tok), "__call__", spy)
        async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=1), "r"):
            pass
        assert threads and all(t is not loop_thread for t in threads)
        threads.clear()
        huge = "x" * (engine.max_prompt_chars + 1)
        with pytest.raises(RequestError, match="characters"):
            async for _ in engine.generate(huge, SamplingParams(max_tokens=1), "huge"):
                pass
        assert threads == []  # refused on its length alone
        await engine.shutdown()

    asyncio.run(run())
    max_chars = LLMEngine(engine_config).max_prompt_chars
    assert 1024 <= max_chars <= 1024 * 64  # the demo model's context times its longest token


def test_load_reports_queued_prefill_and_measured_step_times(engine_config):
    """AsyncEngine.load(), what GET /state serves to the router (runtime/router/policy.py)."""

    async def run():
        engine = AsyncEngine.from_config(engine_config)
        fresh = engine.load()
        await engine.start()
        try:
            params = SamplingParams(max_tokens=MIN_STEPS + 2, temperature=0, ignore_eos=True)
            gen = engine.generate(PROMPT * 4, params, "r0")
            task = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0)
            while not task.done() and engine.load().queued_prefill_tokens == 0:
                await asyncio.sleep(0.001)  # tokenizing in a worker thread
            queued = engine.load().queued_prefill_tokens
            await task
            async for _ in gen:
                pass
            return fresh, queued, engine.load(), len(engine.tokenizer(PROMPT * 4).input_ids)
        finally:
            await engine.shutdown()

    fresh, queued, after, n_tokens = asyncio.run(run())
    assert fresh.steps == 0 and fresh.step_time_s is None and fresh.prefill_s_per_token is None
    assert fresh.max_num_batched_tokens == engine_config.max_num_batched_tokens
    assert queued > 32  # the prompt, until its first output
    assert fresh.step_cost is None and fresh.chars_per_token is None
    assert after.queued_prefill_tokens == 0 and after.steps == MIN_STEPS + 2  # 1 prefill + decodes
    assert after.num_decoding == 0 and after.decoding_context_tokens == 0  # finished
    cost = after.step_cost
    assert cost is not None and cost.per_prefill_token_s > 0
    assert (
        after.step_time_s == cost.base_s and after.prefill_s_per_token == cost.per_prefill_token_s
    )
    assert after.chars_per_token == pytest.approx(len(PROMPT * 4) / n_tokens)
