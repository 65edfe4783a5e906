"""Shared fixtures: a tiny random Llama checkpoint with a real (tiny) BPE tokenizer."""

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)
# Triton kernels run through the interpreter on machines without a GPU; the switch is read
# when a @triton.jit function is defined, so it is set before any test imports a kernel module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "recipes" / "demo-model"


@pytest.fixture
def one_thread():
    """GPTQ's column loop is thousands of ops on tensors of a few kB: intra-op threads only add
    synchronization. On the shared 2-core test box one thread measured 43 ms per 256x256 GPTQ
    against 1.7 s with two (oversubscribed cores stall every parallel region)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A 2-layer GQA Llama (bf16, vocab 512) saved as a plain HF checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimserve.eval.corpus import read_texts
    from slimserve.eval.demo_model import train_tokenizer, wrap_tokenizer

    out = tmp_path_factory.mktemp("tiny-llama")
    tok = wrap_tokenizer(train_tokenizer(read_texts("validation")[:6], vocab_size=512))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
