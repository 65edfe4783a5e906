"""Scheduler: FCFS admission, limits, chunked prefill, prefix hits, preemption, abort.

A fake engine drives the loop. It also keeps a fake KV cache: the "K/V" written to a slot is an
id of the whole prefix up to that token, and every scheduled sequence checks that each of its
cached positions still holds its own prefix's id — so a wrong prefix hit, a write into a shared
block or a stale slot after preemption all fail the test.
"""

import random
import zlib

import pytest

from slimserve.runtime.engine.block_manager import BlockManager
from slimserve.runtime.engine.scheduler import Scheduler, SchedulerConfig
from slimserve.runtime.engine.sequence import SamplingParams, Sequence, SequenceStatus

_clock = iter(range(10**9))


def _seq(rid: str, prompt: list[int], max_tokens: int = 4) -> Sequence:
    # Explicit, strictly increasing arrival times: the preemption victim is the newest arrival.
    return Sequence(
        rid, list(prompt), SamplingParams(max_tokens=max_tokens), arrival_time=float(next(_clock))
    )


def _token(rid: str, i: int) -> int:
    """The fake model's i-th output token for a request (deterministic, so recompute agrees)."""
    return (zlib.crc32(rid.encode()) + 7919 * i) % 1000


def _prefix_ids(tokens: list[int]) -> list[int]:
    ids, h = [], 0
    for t in tokens:
        h = hash((h, t))
        ids.append(h)
    return ids


class FakeEngine:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.bm = sched.block_manager
        self.kv: dict[int, int] = {}  # slot -> prefix id of the token whose K/V it holds
        self.finished: list[Sequence] = []

    def step(self):
        sched, bm, cfg = self.sched, self.bm, self.sched.config
        out = sched.schedule()
        seqs = [s.seq for s in out.scheduled]
        assert len(set(map(id, seqs))) == len(seqs)
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert sched.num_running <= cfg.max_num_seqs
        for s in out.scheduled:  # every write of the step happens before any read
            prefix = _prefix_ids(s.seq.token_ids[: s.start + s.num_new_tokens])
            for p in range(s.start, s.start + s.num_new_tokens):
                self.kv[bm.slot(s.seq, p)] = prefix[p]
        for s in out.scheduled:
            prefix = _prefix_ids(s.seq.token_ids[: s.start + s.num_new_tokens])
            assert [self.kv.get(bm.slot(s.seq, p)) for p in range(len(prefix))] == prefix
        self._check_refcounts()
        sampled = [
            _token(s.seq.request_id, len(s.seq.output_token_ids)) if s.sample else None
            for s in out.scheduled
        ]
        sched.update(out, sampled)
        for s in out.scheduled:
            if s.sample and len(s.seq.output_token_ids) == s.seq.params.max_tokens:
                sched.finish(s.seq, "length")
                self.finished.append(s.seq)
        return out

    def _check_refcounts(self):
        holders = [0] * self.bm.num_blocks
        for seq in self.sched.running:
            for b in seq.block_table:
                holders[b] += 1
        assert all(not seq.block_table for seq in self.sched.waiting)
        assert holders == [self.bm.ref_count(b) for b in range(self.bm.num_blocks)]

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        return steps


def _make(num_blocks=64, block_size=4, prefix_caching=True, **cfg) -> Scheduler:
    cfg.setdefault("max_model_len", 4096)
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, prefix_caching))


def _check_done(seqs: list[Sequence]) -> None:
    for seq in seqs:
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
        assert seq.output_token_ids == [
            _token(seq.request_id, i) for i in range(seq.params.max_tokens)
        ]


def test_fcfs_and_max_num_seqs():
    sched = _make(max_num_seqs=2)
    seqs = [_seq(f"r{i}", [i] * 5, max_tokens=2 + i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    eng = FakeEngine(sched)
    out = eng.step()
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 2
    eng.run()
    assert [s.request_id for s in eng.finished] == ["r0", "r1", "r2", "r3"]
    _check_done(seqs)
    assert sched.block_manager.usage == 0


def test_chunked_prefill_does_not_stall_decodes():
    sched = _make(max_num_batched_tokens=32)
    a = _seq("a", [1, 2, 3, 4], max_tokens=20)
    sched.add(a)
    eng = FakeEngine(sched)
    eng.step()  # a's prefill
    b = _seq("b", list(range(100, 200)), max_tokens=3)
    sched.add(b)
    chunks = []
    for _ in range(4):
        out = eng.step()
        first, second = out.scheduled
        assert first.seq is a and first.num_new_tokens == 1 and first.sample  # a decodes every step
        assert second.seq is b
        chunks.append((second.start, second.num_new_tokens, second.sample))
        assert out.num_batched_tokens == first.num_new_tokens + second.num_new_tokens <= 32
    assert chunks == [(0, 31, False), (31, 31, False), (62, 31, False), (93, 7, True)]
    assert len(a.output_token_ids) == 5 and len(b.output_token_ids) == 1
    eng.run()
    _check_done([a, b])


def test_long_prefill_token_threshold_caps_chunks():
    sched = _make(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    a = _seq("a", list(range(20)), max_tokens=2)
    sched.add(a)
    eng = FakeEngine(sched)
    assert [eng.step().scheduled[0].num_new_tokens for _ in range(3)] == [8, 8, 4]
    eng.run()
    _check_done([a])


def test_prefix_hit_second_request_computes_fewer_tokens():
    sched = _make(block_size=16, num_blocks=16)
    prompt = list(range(1000, 1040))  # 40 tokens: 2 full blocks
    a = _seq("a", prompt, max_tokens=3)
    sched.add(a)
    eng = FakeEngine(sched)
    eng.run()
    b = _seq("b", prompt[:36] + [7, 7, 7, 7], max_tokens=3)  # shares 2 full blocks + 4 tokens
    sched.add(b)
    first = eng.step().scheduled[0]
    assert (first.start, first.num_new_tokens, first.sample) == (32, 8, True)
    assert b.num_cached_tokens == 32 and a.num_cached_tokens == 0
    eng.run()
    _check_done([a, b])
    assert sched.stats().prefix_cache_hit_rate == pytest.approx(32 / 80)


def test_preempts_newest_arrival_and_it_resumes_with_its_outputs():
    sched = _make(num_blocks=4, block_size=4)
    a, b = _seq("a", list(range(7)), max_tokens=5), _seq("b", list(range(50, 57)), max_tokens=5)
    sched.add(a)
    sched.add(b)
    eng = FakeEngine(sched)
    eng.step()  # both prefill 7 tokens into 2 blocks each: the cache is full
    c = _seq("c", [9, 9], max_tokens=1)
    sched.add(c)
    eng.step()  # token 8 of a and b still fits; c waits for blocks
    out = eng.step()  # both need a third block: a (older) is served, b preempted
    assert out.preempted == [b] and [s.seq for s in out.scheduled] == [a]
    assert b.status is SequenceStatus.WAITING and b.num_preemptions == 1 and b.block_table == []
    assert b.num_computed_tokens == 0 and len(b.output_token_ids) == 2
    assert list(sched.waiting) == [b, c] and sched.stats().num_preemptions == 1
    eng.run()
    _check_done([a, b, c])
    assert sched.block_manager.usage == 0


def test_sequence_can_preempt_itself():
    sched = _make(num_blocks=4, block_size=4)
    a, b = _seq("a", list(range(6)), max_tokens=2), _seq("b", list(range(50, 58)), max_tokens=4)
    sched.add(a)
    sched.add(b)
    eng = FakeEngine(sched)
    eng.step()
    out = eng.step()  # a's 7th token fits its blocks; b's 9th needs a block and b is the newest
    assert [s.seq for s in out.scheduled] == [a] and out.preempted == [b]
    eng.run()
    _check_done([a, b])


def test_tiny_cache_forces_preemption_and_every_request_finishes():
    sched = _make(num_blocks=6, block_size=4, max_num_batched_tokens=16)
    seqs = [_seq(f"r{i}", [i] * (3 + i), max_tokens=8) for i in range(6)]
    for s in seqs:
        sched.add(s)
    eng = FakeEngine(sched)
    eng.run()
    assert sched.num_preemptions > 0
    _check_done(seqs)
    assert sched.block_manager.usage == 0 and not sched.has_unfinished()


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_with_shared_prefixes(seed):
    rng = random.Random(seed)
    sched = _make(
        num_blocks=rng.randint(8, 12),
        block_size=4,
        max_num_batched_tokens=rng.randint(6, 40),
        max_num_seqs=rng.randint(1, 5),
        long_prefill_token_threshold=rng.choice([0, 5]),
        prefix_caching=seed % 4 != 3,
    )
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    seqs = []
    for i in range(10):
        prompt = rng.choice(stems)[: rng.randint(0, 12)] + [
            rng.randrange(50) for _ in range(rng.randint(1, 8))
        ]
        seqs.append(_seq(f"s{seed}-{i}", prompt, max_tokens=rng.randint(1, 12)))
    eng = FakeEngine(sched)
    pending = list(seqs)
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 2)):  # requests keep arriving while others run
            if pending:
                sched.add(pending.pop(0))
        if sched.has_unfinished():
            eng.step()
    _check_done(seqs)
    assert sched.block_manager.usage == 0


def test_abort_from_waiting_and_running_frees_blocks():
    sched = _make(max_num_seqs=1)
    a, b = _seq("a", list(range(10)), max_tokens=8), _seq("b", list(range(10)), max_tokens=8)
    sched.add(a)
    sched.add(b)
    eng = FakeEngine(sched)
    eng.step()
    assert sched.block_manager.usage > 0
    assert sched.abort("b") is b and b.finish_reason == "abort" and b.is_finished
    out = sched.schedule()
    assert sched.abort("a") is a and a.finish_reason == "abort" and a.block_table == []
    sched.update(out, [5])  # a step in flight when a was aborted is ignored for it
    assert a.output_token_ids == [_token("a", 0)]
    assert sched.block_manager.usage == 0 and not sched.has_unfinished()
    assert sched.abort("a") is None and sched.abort("nope") is None


def test_add_rejects_requests_that_can_never_run():
    sched = _make(num_blocks=4, block_size=4, max_model_len=32)
    sched.add(_seq("ok", [1] * 8, max_tokens=8))
    with pytest.raises(ValueError, match="already in flight"):
        sched.add(_seq("ok", [1], max_tokens=1))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(_seq("empty", [], max_tokens=1))
    with pytest.raises(ValueError, match="max_model_len=32"):
        sched.add(_seq("long", [1] * 33, max_tokens=1))
    with pytest.raises(ValueError, match="KV cache holds 16"):
        sched.add(_seq("big", [1] * 8, max_tokens=9))


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)
