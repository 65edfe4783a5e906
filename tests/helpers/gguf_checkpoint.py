"""Write a Llama Hugging Face checkpoint as a GGUF file with the `gguf` package, as llama.cpp's
convert_hf_to_gguf.py lays it out: llama.* metadata, the byte-level BPE tokenizer as
tokenizer.ggml.* (tokens, types, merges, special ids, chat template), tensors under llama.cpp's
names with q/k rows permuted into its rotary layout, 2-D weights in `weight_type` (F32, F16, BF16
or a block type such as Q8_0), 1-D norms in F32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
CONTROL, NORMAL = 3, 1  # gguf TokenType values


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary row order for q (n_head heads) or k (n_kv_head heads)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _gguf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    _, _, i, rest = name.split(".", 3)  # model.layers.<i>.<rest>
    return f"blk.{i}.{_LAYER[rest.removesuffix('.weight')]}.weight"


def write_gguf(
    checkpoint: Path,
    out: Path,
    weight_type: str = "F32",
    architecture: str = "llama",
    tokenizer: bool = True,
) -> Path:
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(checkpoint)
    w = gguf.GGUFWriter(str(out), architecture)
    w.add_name(checkpoint.name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        tok = AutoTokenizer.from_pretrained(checkpoint)
        by_id = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
        assert [i for _, i in by_id] == list(range(cfg.vocab_size))
        special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
        merges = json.loads((checkpoint / "tokenizer.json").read_text())["model"]["merges"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list([t for t, _ in by_id])
        w.add_token_types([CONTROL if i in special else NORMAL for _, i in by_id])
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
        w.add_bos_token_id(tok.bos_token_id)
        w.add_eos_token_id(tok.eos_token_id)
        w.add_pad_token_id(tok.pad_token_id)
        w.add_chat_template(tok.chat_template)
    qtype = gguf.GGMLQuantizationType[weight_type]
    for name, t in load_file(checkpoint / "model.safetensors").items():
        a = t.float().numpy()
        if name.endswith("q_proj.weight"):
            a = _permute(a, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = _permute(a, cfg.num_key_value_heads)
        if a.ndim == 1 or weight_type == "F32":
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(a, dtype=np.float32))
        elif weight_type == "F16":
            w.add_tensor(_gguf_name(name), a.astype(np.float16))
        else:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
