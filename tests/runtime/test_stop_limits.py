"""Hostile stop lists and prefix-cache hashes: bounded stop lists, linear stop matching (engine
and stream hold-back), stop token ids as a set, sha256 block hashes.

Complexity is checked by counting the characters the code looks at, never by timing.
"""

from __future__ import annotations

import hashlib
import random
import struct

import pytest
from fastapi.testclient import TestClient

from slimserve.runtime.engine import llm_engine as engine_mod
from slimserve.runtime.engine.block_manager import ROOT_HASH, BlockManager, block_hash, hash_blocks
from slimserve.runtime.engine.detokenizer import DetokenizerState
from slimserve.runtime.engine.llm_engine import LLMEngine, _Request
from slimserve.runtime.engine.sequence import SamplingError, SamplingParams, Sequence
from slimserve.runtime.engine.stops import StopHoldBack, StopPrefixMatcher, find_stop, partial_stop
from slimserve.runtime.server.app import build_app
from slimserve.runtime.server.protocol import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tests.helpers.server_fakes import FakeEngine, events

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def client():
    with TestClient(build_app(FakeEngine())) as c:
        yield c


def _brute_partial(text: str, stops: list[str]) -> int:
    """The definition: longest suffix of text that is a proper prefix of some stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class CountingStr(str):
    """A str that counts the characters the code under test reads from it."""

    touched = 0

    def __getitem__(self, key):
        out = str.__getitem__(self, key)
        CountingStr.touched += len(out)
        return out

    def _whole(name):
        def method(self, *a, **kw):
            CountingStr.touched += len(self)
            return getattr(str, name)(self, *a, **kw)

        return method

    for _name in (
        "endswith",
        "startswith",
        "find",
        "rfind",
        "index",
        "rindex",
        "count",
        "__contains__",
        "__iter__",
        "__eq__",
        "__hash__",
        "split",
        "partition",
    ):
        locals()[_name] = _whole(_name)
    del _name, _whole


# -- limits ----------------------------------------------------------------------------------------


def test_limits_are_generous_but_bounded():
    assert 4 <= MAX_STOP_STRINGS <= 256 and 64 <= MAX_STOP_STRING_CHARS <= 4096
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)  # at the limits: fine
    with pytest.raises(SamplingError, match=f"at most {MAX_STOP_STRINGS} stop strings"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(SamplingError, match=f"at most {MAX_STOP_STRING_CHARS} characters"):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])


@pytest.mark.parametrize(
    "endpoint,extra",
    [
        ("completions", {"prompt": "hi"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_too_many_or_too_long_stop_strings_get_a_400_naming_the_limit(client, endpoint, extra):
    for stop, limit in [
        ([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], MAX_STOP_STRINGS),
        (["y" * (MAX_STOP_STRING_CHARS + 1)], MAX_STOP_STRING_CHARS),
    ]:
        r = client.post(f"/v1/{endpoint}", json={**extra, "max_tokens": 3, "stop": stop})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "stop" and str(limit) in err["message"], err
    r = client.post(
        f"/v1/{endpoint}",
        json={**extra, "max_tokens": 3, "stop": ["z" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS},
    )
    assert r.status_code == 200, r.text


def test_stop_token_ids_are_a_set(client):
    p = SamplingParams(stop_token_ids=[5, 7, 5])
    assert isinstance(p.stop_token_ids, frozenset) and p.stop_token_ids == {5, 7}
    r = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 8, "stop_token_ids": [99, 99]}
    )
    assert r.json()["choices"][0]["stop_reason"] == 99


# -- the stream's held-back text ----------------------------------------------------------------


def test_held_back_text_matches_the_definition_across_random_chunkings():
    rng = random.Random(0)
    for _ in range(300):
        stops = [
            "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
            for _ in range(rng.randint(1, 4))
        ]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        m, fed = StopPrefixMatcher(stops), 0
        while fed < len(text):
            step = rng.randint(1, 9)
            held = m.feed(text[fed : fed + step])
            fed = min(len(text), fed + step)
            assert held == _brute_partial(text[:fed], stops), (stops, text[:fed])
        assert partial_stop(text, stops) == _brute_partial(text, stops)


def test_stop_string_straddling_chunks_is_held_back_then_cut(client):
    # The fake engine emits one letter per token: 'de' | 'f' | 'gh' arrive in separate chunks.
    r = client.post(
        "/v1/completions",
        json={
            "prompt": "hi",
            "max_tokens": 12,
            "stream": True,
            "stop": ["xyz", "defgh", "q" * 500],
        },
    )
    chunks = events(r.text)[:-1]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "abc"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == "defgh"
    # A false start ('de' then something else) is released once it cannot be a stop any more.
    hold = StopHoldBack(["dex"])
    assert [hold.take(t, False) for t in ["ab", "abd", "abde", "abdef"]] == ["ab", "", "", "def"]


def test_held_back_text_reads_only_the_new_text_per_chunk():
    """100-char chunks, 64 stop strings of 1024 characters: each chunk reads ~its new text."""
    stops = [
        ("ab" * 600)[: MAX_STOP_STRING_CHARS - 1] + str(i % 10) for i in range(MAX_STOP_STRINGS)
    ]
    hold = StopHoldBack(stops)
    text, chunk = "", "ab" * 50
    for _ in range(60):
        text += chunk
        CountingStr.touched = 0
        hold.take(CountingStr(text), False)
        # the new text once for the matcher, once (at most) for the emitted delta
        assert CountingStr.touched <= 2 * len(chunk) + 2 * MAX_STOP_STRING_CHARS, (
            CountingStr.touched
        )
        assert len(text) - hold.sent == _brute_partial(text[-MAX_STOP_STRING_CHARS:], stops[:1])
    # Automaton work: amortized O(new characters x stops), not O(stop length^2) per chunk.
    assert hold._matcher.steps <= 2 * len(text) * MAX_STOP_STRINGS


# -- the engine's stop search ----------------------------------------------------------------------


def test_find_stop_searches_only_the_new_text_and_the_longest_stops_tail():
    stops = ["q" * 1000, "hello world"]
    text = "x" * 5000 + "hello wor"
    assert find_stop(text, 0, stops, 1000) is None
    text2 = text + "ld!"
    CountingStr.touched = 0
    hit = find_stop(CountingStr(text2), len(text), stops, 1000)
    assert hit == (5000, "hello world")  # straddles the previous text and the new one
    assert CountingStr.touched <= 3 + 999  # new text + max_stop_len - 1 characters
    # earliest start wins; ties broken as before (by the stop string)
    assert find_stop("..abcd", 2, ["cd", "bc", "abcd"], 4) == (2, "abcd")


def test_engine_stop_check_uses_the_bounded_window(monkeypatch):
    """LLMEngine._check_stop on multi-character tokens: a stop straddling tokens is cut exactly,
    and each call searches no more than the new text plus the longest stop's tail."""
    vocab = {i: w for i, w in enumerate(["<p>", "foo", "ba", "r b", "az", "STOP", "x"])}
    eng = object.__new__(LLMEngine)
    eng.tokenizer, eng._decode = object(), (lambda ids: "".join(vocab[i] for i in ids))
    eng.eos_token_ids, eng.max_model_len = set(), 10**6
    params = SamplingParams(max_tokens=400, stop=["bar baz", "zz" * 300], stop_token_ids=[6])
    seq = Sequence("r", [0], params)
    req = _Request(seq, None, DetokenizerState.for_prompt(1), max_stop_len=600)
    windows = []

    def spy(text, prev, stops, max_stop_len):
        windows.append(len(text) - max(0, prev - (max_stop_len - 1)))
        return find_stop(text, prev, stops, max_stop_len)

    monkeypatch.setattr(engine_mod, "find_stop", spy)
    for tok in [1] * 300 + [2, 3, 4, 1]:
        seq.output_token_ids.append(tok)
        eng._check_stop(req)
        if seq.finish_reason:
            break
    assert (seq.finish_reason, seq.stop_reason) == ("stop", "bar baz")
    assert req.text == "foo" * 300 and len(seq.output_token_ids) == 303
    assert max(windows) <= 599 + 3
    # stop token ids: the set is what the engine checks
    seq2 = Sequence("s", [0], params)
    req2 = _Request(seq2, None, DetokenizerState.for_prompt(1), max_stop_len=600)
    seq2.output_token_ids.append(6)
    eng._check_stop(req2)
    assert (seq2.finish_reason, seq2.stop_reason) == ("stop", 6)


# -- prefix-cache hashes ---------------------------------------------------------------------------


def test_block_hashes_are_chained_sha256_digests():
    tokens = (1, 2, 3, 50_000)
    h = block_hash(None, tokens)
    assert isinstance(h, bytes) and len(h) == 32
    assert h == hashlib.sha256(ROOT_HASH + struct.pack("<4q", *tokens)).digest()
    assert block_hash(None, list(tokens)) == h  # same tokens, same parent -> same digest
    child = block_hash(h, (7, 7, 7, 7))
    assert child == hashlib.sha256(h + struct.pack("<4q", 7, 7, 7, 7)).digest()
    assert child != block_hash(block_hash(None, (1, 2, 3, 4)), (7, 7, 7, 7))  # other parent
    assert hash_blocks([1, 2, 3, 50_000, 7, 7, 7, 7, 9], 4) == [h, child]
    with pytest.raises(ValueError):
        block_hash(b"short", tokens)


def test_prefix_cache_is_keyed_by_the_digests():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    a = Sequence("a", prompt, SamplingParams(max_tokens=2))
    bm.allocate_prefix(a)
    bm.append_slots(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    bm.commit(a)
    assert set(bm._cached) == set(hash_blocks(prompt, 4))
    assert bm.allocate_prefix(Sequence("b", prompt + [99], SamplingParams(max_tokens=2))) == 8
