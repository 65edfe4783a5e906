"""Prompt logprobs on /v1/completions (`echo` with `logprobs`, max_tokens 0, vLLM's
`prompt_logprobs` field, several prompts in one request): the layout vLLM's OpenAI server
answers, which `lm_eval --model local-completions` reads, and values equal to one full forward of
the model. A real engine over the tests' tiny checkpoint (tests/helpers/tiny_model.py)."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.engine.async_engine import AsyncEngine
from slimserve.runtime.engine.llm_engine import LLMEngine
from slimserve.runtime.server.app import build_app

pytestmark = pytest.mark.timeout(120)

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b"]


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_checkpoint),
            device="cpu",
            dtype="float32",
            kv_cache_memory=4 << 20,
            max_num_batched_tokens=16,  # longer prompts are prefilled in several chunks
        )
    )
    with TestClient(build_app(AsyncEngine(engine))) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(client):
    return client.app.state.serving.engine.tokenizer


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """log_softmax of one full forward of the checkpoint through transformers (no paged cache,
    no chunks, not our model code): row i scores token i + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.float(), -1)

    return logprobs


def _complete(client, body: dict, status: int = 200) -> dict:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    return r.json()


def test_echo_logprobs_layout_and_values(client, tokenizer, reference):
    ids = tokenizer.encode(TEXTS[0])
    body = _complete(
        client,
        {"prompt": TEXTS[0], "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 3},
    )
    choice = body["choices"][0]
    lp = choice["logprobs"]
    gen = len(lp["tokens"]) - len(ids)
    assert gen == body["usage"]["completion_tokens"] == 2
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(len(lp[k]) == len(ids) + 2 for k in lp)
    # the text: the prompt, then the generated text; the tokens: the prompt's, then the new ones
    assert choice["text"].startswith(TEXTS[0])
    assert lp["tokens"][: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert "".join(lp["tokens"]) == choice["text"]
    # the first prompt token has nothing before it: null, as vLLM
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # offsets: where each token starts in the text
    assert lp["text_offset"][0] == 0
    for k in range(1, len(lp["tokens"])):
        assert lp["text_offset"][k] == lp["text_offset"][k - 1] + len(lp["tokens"][k - 1])
    # the prompt tokens' logprobs are those of one full forward
    want = reference(ids)
    got = lp["token_logprobs"][1 : len(ids)]
    assert got == pytest.approx([want[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)
    # top_logprobs: the 3 best (and the token itself, as OpenAI), best first, equal to the forward's
    for i in range(1, len(ids)):
        top = lp["top_logprobs"][i]
        best = torch.topk(want[i - 1], 3)
        names = [tokenizer.decode([t]) for t in best.indices.tolist()]
        chosen_elsewhere = lp["tokens"][i] in names and ids[i] not in best.indices.tolist()
        if len(set(names)) < 3 or chosen_elsewhere:
            continue  # two ids decode to one string (a byte of a character): keys collide
        assert 3 <= len(top) <= 4 and list(top)[:3] == names
        for name, v in zip(names, best.values.tolist()):
            assert top[name] == pytest.approx(v, abs=1e-4)
        assert top[lp["tokens"][i]] == pytest.approx(got[i - 1], abs=1e-6)
    # the generated tokens: greedy, so each is its step's best
    for i in range(len(ids), len(ids) + 2):
        assert lp["token_logprobs"][i] == pytest.approx(max(lp["top_logprobs"][i].values()))


def test_lm_eval_request_token_prompts_batched(client, tokenizer, reference):
    """What lm-eval's local-completions sends for loglikelihood (lm_eval/models/
    openai_completions.py `_create_payload`): token-id prompts, a batch of them, max_tokens 1,
    logprobs 1, echo; it reads token_logprobs[ctxlen:-1] and top_logprobs for is_greedy."""
    prompts = [tokenizer.encode(t) for t in TEXTS] + [tokenizer.encode(TEXTS[0])[:5]]
    body = _complete(
        client,
        {
            "prompt": prompts,
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        },
    )
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert body["usage"]["completion_tokens"] == 3
    for ids, choice in zip(prompts, choices):
        lp = choice["logprobs"]
        assert choice["text"].startswith(tokenizer.decode(ids))
        assert len(lp["token_logprobs"]) == len(ids) + 1
        want = reference(ids)
        ctxlen = 2
        cont = lp["token_logprobs"][ctxlen:-1]
        assert cont == pytest.approx(
            [want[i - 1, ids[i]].item() for i in range(ctxlen, len(ids))], abs=1e-4
        )
        for i in range(ctxlen, len(ids)):
            top = lp["top_logprobs"][i]
            assert 1 <= len(top) <= 2  # logprobs 1: the best and the token itself
            is_greedy = lp["token_logprobs"][i] == max(top.values())
            assert is_greedy == (int(want[i - 1].argmax()) == ids[i])


def test_max_tokens_zero_echo_is_the_prompt_alone(client, tokenizer, reference):
    ids = tokenizer.encode(TEXTS[1])
    body = _complete(client, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "n": 2})
    assert body["usage"]["completion_tokens"] == 0
    for choice in body["choices"]:
        assert choice["text"] == tokenizer.decode(ids)
        assert choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
        # logprobs 0: only the token itself
        assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
    want = reference(ids)
    got = body["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert got == pytest.approx([want[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)
    # without echo, 0 tokens is no request
    err = _complete(client, {"prompt": ids, "max_tokens": 0}, 400)["error"]
    assert err["param"] == "max_tokens" and "echo" in err["message"]


def test_stream_echo_logprobs_first_chunk_carries_the_prompt(client, tokenizer):
    ids = tokenizer.encode(TEXTS[0])
    req = {"prompt": TEXTS[0], "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    whole = _complete(client, req)["choices"][0]
    with client.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[0]["text"].startswith(TEXTS[0])
    assert len(chunks[0]["logprobs"]["tokens"]) == len(ids) + 1
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    merged = {
        k: sum((c["logprobs"][k] for c in chunks if c["logprobs"]), []) for k in whole["logprobs"]
    }
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert merged["tokens"] == whole["logprobs"]["tokens"]
    assert merged["text_offset"] == whole["logprobs"]["text_offset"]
    assert merged["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:])


def test_vllm_prompt_logprobs_field(client, tokenizer, reference):
    ids = tokenizer.encode(TEXTS[1])
    body = _complete(client, {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
    choice = body["choices"][0]
    assert choice["logprobs"] is None and choice["text"]  # no echo: the generated text alone
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    want = reference(ids)
    for i in range(1, len(ids)):
        entry = plp[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-4)
        assert entry["decoded_token"] == tokenizer.decode([ids[i]])
        best = torch.topk(want[i - 1], 2).indices.tolist()
        assert {str(t) for t in best} <= set(plp[i])
        assert plp[i][str(best[0])]["rank"] == 1
        assert entry["rank"] == (best.index(ids[i]) + 1 if ids[i] in best else None)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
        ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "echo": True, "logprobs": -1}, "logprobs"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "hi", "prompt_logprobs": True}, "prompt_logprobs"),
        ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": [[1, 2], "hi"]}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [[1, 2], [3, "x"]]}, "prompt"),
        ({"prompt": [[1, 2]] * 257}, "prompt"),
        ({"prompt": [[1, 2]] * 20, "n": 16}, "n"),
        ({"prompt": [[1, 2], [10**9]], "echo": True, "logprobs": 1}, "prompt"),
    ],
)
def test_bad_combinations_are_one_line_400s(client, body, param):
    err = _complete(client, body, 400)["error"]
    assert err["param"] == param and "\n" not in err["message"]
    assert err["message"].startswith(param) or param in err["message"]
    # the server goes on
    assert client.get("/health").status_code == 200


def test_a_refused_prompt_among_several_ends_the_others(client):
    # the second prompt is longer than the context: refused by the engine, the first aborted
    max_len = client.app.state.serving.engine.max_model_len
    body = {"prompt": [[1, 2, 3], [5] * (max_len - 1)], "max_tokens": 4, "echo": True}
    err = _complete(client, body, 400)["error"]
    assert err["param"] == "max_tokens"
    assert client.app.state.serving.active == set()
    ok = _complete(client, {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "echo": True})
    assert len(ok["choices"]) == 2
