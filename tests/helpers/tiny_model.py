"""The tests' own tiny checkpoint: a random 2-layer GQA Llama with a small byte-level BPE
tokenizer trained here (not by the demo-model trainer, so retraining the demo model never
changes a test's model)."""

from __future__ import annotations

from pathlib import Path

import torch

EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(texts: list[str], vocab_size: int = 512):
    """An HF fast tokenizer: byte-level BPE (no unknown token) with EOS and ChatML markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=[EOS, "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    hf.chat_template = CHAT_TEMPLATE
    hf.model_max_length = 1024
    return hf


def save_tiny_llama(out: Path) -> Path:
    """Write the tiny Llama (bf16, hidden 128, 4 query / 2 KV heads, vocab 512) to `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimserve.runtime.corpus import read_texts

    tok = tiny_tokenizer(read_texts("validation")[:6])
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def save_tiny_moe(out: Path, model_type: str, experts: int = 4, top_k: int = 2) -> Path:
    """Write a tiny random mixture-of-experts model of `model_type` (qwen3_moe, qwen2_moe with
    its shared expert, mixtral or olmoe: 2 layers, hidden 64, by default 4 experts and top-2, bf16) with the
    tiny tokenizer to `out` (`experts` and `top_k` change the expert count and the experts each
    token is routed to). transformers 5 holds each layer's experts as stacked 3-D tensors
    (`mlp.experts.gate_up_proj` [E, 2I, H]); `save_pretrained` writes them per expert."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slimserve.runtime.corpus import read_texts

    tok = tiny_tokenizer(read_texts("validation")[:6])
    moe = {
        "qwen3_moe": {"num_experts": experts, "moe_intermediate_size": 32, "head_dim": 16},
        "qwen2_moe": {
            "num_experts": experts,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 96,
        },
        "mixtral": {"num_local_experts": experts},
        "olmoe": {"num_experts": experts},
    }[model_type]
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=top_k,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        **moe,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def tiny_llama():
    """A 1-layer bf16 Llama (vocab 64, hidden 32, GQA 2/1) in memory, seeded: export tests."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def save_wide_random(path: Path, model_type: str, **config):
    """A random fp32 transformers model of `model_type` built from `config`, its weights drawn
    wide (std 0.15; 1-D ones, the norms' among them, std 0.3 so they are not all ones) so that
    greedy margins are far above fp32 rounding; saved to `path`. Returns the model (eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.15 if p.dim() >= 2 else 0.3)
    model.save_pretrained(path)
    return model
