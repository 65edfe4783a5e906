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
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0 and cfg.num_key_value_heads < cfg.num_attention_heads
    assert not cfg.tie_word_embeddings and cfg.intermediate_size % 128 == 0
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "hi" in chat and chat.endswith("assistant\n")


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    out = tmp_path_factory.mktemp("qs") / "artifact"
    r = subprocess.run(
        [sys.executable, "-m", "slimserve.compress.cli", "run", str(REPO / "recipes" / "quickstart.yaml"),
         "--output", str(out), "--no-progress"],
        capture_output=True, text=True,
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

    from slimserve.eval.datasets import encode_documents, load_texts
    from slimserve.eval.perplexity import evaluate_perplexity
    from slimserve.runtime.loader import load_model

    _, out = quickstart
    ours = load_model(out, dtype=torch.float32)
    ids = encode_documents(ours.tokenizer, load_texts("stdlib"))
    ppl_ours = evaluate_perplexity(ours.model, ids, 512, max_windows=16, progress=False).ppl
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ppl_hf = evaluate_perplexity(hf, ids, 512, max_windows=16, progress=False).ppl
    assert ppl_hf == pytest.approx(ppl_ours, rel=1e-3)
