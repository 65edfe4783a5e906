"""Make the tiny Llama that tests/fixtures/peers/ checkpoints are quantized from, and pack fixtures.

Run with any python that has torch + transformers (our venv, or a peer venv):

    python eval/peers/tiny_llama.py model /tmp/tiny-llama      # model + calib.json beside it
    # quantize /tmp/tiny-llama with eval/peers/autoawq_quant.py / gptqmodel_quant.py --dequant-out
    python eval/peers/tiny_llama.py pack CHECKPOINT DEQUANT tests/fixtures/peers/NAME

`model`: a random-init LlamaForCausalLM, 2 layers, hidden 128, 4 query / 2 KV heads (GQA, so
AWQ skips v_proj -> o_proj), MLP 256 (down_proj has two groups of 128), vocab 512, tied
embeddings, bf16, seed 0, with the demo model's tokenizer files (the peers insist on one; ids
stay below 512), and `calib.json`: 16 random windows x 128 token ids.
`pack`: copies the checkpoint's config files and weights (no tokenizer: our loader does not need
one) and writes `DEST.reference.safetensors` beside DEST = the peer's own dequantized weights of the LAST
decoder layer's Linears (fp16 [N, K]) + `logits` [1, 16, 512] + `probe_ids` [1, 16] (the first 16
positions of the peer's probe), keeping each fixture near 0.6 MB.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo-model"
# The demo model's tokenizer files, copied beside the tiny model (and by tests beside fixtures).
# Not runtime.loader.TOKENIZER_FILES: this script runs in peer venvs without slimserve.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CONFIG_FILES = (
    "config.json",
    "quantize_config.json",
    "quant_config.json",
    "generation_config.json",
    "model.safetensors.index.json",
)
VOCAB, LAYERS, PROBE = 512, 2, 16


def make_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        shutil.copy(DEMO / f, out / f)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (16, 128), generator=g).tolist()
    (out.parent / f"{out.name}-calib.json").write_text(json.dumps(ids))


def pack(checkpoint: Path, dequant: Path, dest: Path) -> None:
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for f in CONFIG_FILES:
        if (checkpoint / f).is_file():
            shutil.copy(checkpoint / f, dest / f)
    for f in checkpoint.glob("*.safetensors"):
        shutil.copy(f, dest / f.name)
    ref = load_file(str(dequant))
    last = f"model.layers.{LAYERS - 1}."
    keep = {k: v for k, v in ref.items() if k.startswith(last)}
    # The model is causal: the first PROBE positions' logits depend on the first PROBE ids only.
    keep["logits"] = ref["logits"][:, :PROBE].contiguous()
    keep["probe_ids"] = ref["probe_ids"][:, :PROBE].contiguous()
    # beside the folder, not in it: a loader reads every *.safetensors of a folder without an index
    save_file(keep, str(dest.parent / f"{dest.name}.reference.safetensors"))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "model":
        make_model(Path(sys.argv[2]))
    elif len(sys.argv) == 5 and sys.argv[1] == "pack":
        pack(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    else:
        raise SystemExit(__doc__)
