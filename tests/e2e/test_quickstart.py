"""The README's promise: the quickstart recipe passes its gate offline on the demo model, and
the artifact it writes gives the same perplexity in plain transformers as in our loader."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "demo-model"


def test_demo_model_is_plain_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    size = sum(p.stat().st_size for p in DEMO.iterdir() if p.is_file())
    assert size < 25e6
    model = AutoModelForCausalLM.from_pretrained(DEMO)
    tok = AutoTokenizer.from_pretrained(DEMO)
    params = sum(p.numel() for p in model.parameters())
    assert 5e6 <= params <= 10e6
    cfg = model.config
    assert (
        cfg.num_attention_heads % cfg.num_key_value_heads == 0
        and cfg.num_key_value_heads < cfg.num_attention_heads
    )
    assert not cfg.tie_word_embeddings and cfg.intermediate_size % 128 == 0
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "hi" in chat and chat.endswith("assistant\n")


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    out = tmp_path_factory.mktemp("qs") / "artifact"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimserve.compress.cli",
            "run",
            str(REPO / "recipes" / "quickstart.yaml"),
            "--output",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
    )
    return r, out


def test_quickstart_passes_gate(quickstart):
    r, out = quickstart
    assert r.returncode == 0, r.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["gate"]["passed"] and 0 < rep["gate"]["ppl_increase"] <= 0.02
    # Decoder Linears shrink ~3.8x (int4 + bf16 scales per 128); embeddings and lm_head (6.3 of
    # the 18.9 MB) stay bf16, so the whole file lands near half the baseline.
    assert rep["final"]["size_bytes"] < 0.55 * rep["baseline"]["size_bytes"]


def test_transformers_matches_our_loader_on_artifact(quickstart):
    from transformers import AutoModelForCausalLM

    from slimserve.compress.datasets import load_token_documents
    from slimserve.compress.perplexity import evaluate_perplexity
    from slimserve.runtime.loading.loader import load_model

    _, out = quickstart
    ours = load_model(out, dtype=torch.float32)
    ids = load_token_documents("stdlib", ours.tokenizer)
    ppl_ours = evaluate_perplexity(ours.model, ids, 512, max_windows=16, progress=False).ppl
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ppl_hf = evaluate_perplexity(hf, ids, 512, max_windows=16, progress=False).ppl
    assert ppl_hf == pytest.approx(ppl_ours, rel=1e-3)


def test_runtime_serves_the_quickstart_artifact_to_the_openai_client(quickstart):
    """`runtime serve` on the quickstart artifact (W4A16 weights, our engine) answers the
    official openai client, plain and streaming, with the same greedy text both ways."""
    import socket
    import threading
    import time

    import openai
    import uvicorn

    from slimserve.runtime.config import EngineConfig
    from slimserve.runtime.engine.async_engine import AsyncEngine
    from slimserve.runtime.server.app import build_app

    r, out = quickstart
    assert r.returncode == 0, r.stderr
    engine = AsyncEngine.from_config(EngineConfig(model=str(out), kv_cache_memory="64MiB"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, api_key="sk-qs"), log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not srv.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="sk-qs"
        )
        assert [m.id for m in client.models.list().data] == [out.name]
        plain = client.completions.create(
            model=out.name, prompt="def fibonacci(n):\n", max_tokens=24, temperature=0
        )
        assert plain.usage.completion_tokens == 24 or plain.choices[0].finish_reason == "stop"
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model=out.name,
                prompt="def fibonacci(n):\n",
                max_tokens=24,
                temperature=0,
                stream=True,
            )
            if c.choices
        )
        assert streamed == plain.choices[0].text and len(streamed) > 10
        chat = client.chat.completions.create(
            model=out.name, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
        assert chat.choices[0].message.role == "assistant"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=client.base_url, api_key="wrong").models.list()
    finally:
        srv.should_exit = True
        thread.join(30)
