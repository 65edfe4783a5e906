"""Train the embedded demo model: a small Llama on the Python standard library's source.

Offline machines (CI, the quickstart) have no hub model to compress, so slimserve trains and
ships its own: a byte-level BPE tokenizer and a grouped-query-attention `LlamaForCausalLM`
trained on the `stdlib` corpus's train split. The result lives in `recipes/demo-model/` and is
trained once (about an hour on 2 CPU cores); this module is how it was made and how to remake it:

    python -m slimserve.eval.demo_model --out recipes/demo-model --steps 2400
    python -m slimserve.eval.demo_model --out recipes/demo-model --check   # acceptance numbers

A mixture-of-experts demo model, `recipes/demo-moe` (a Qwen3-MoE of 8 experts, top-2, 9.2M
parameters), reuses the demo model's tokenizer and trains the same way, in fp32, with the
router's load-balancing loss added (900 steps, 25.6 minutes on 2 cores; whole-split validation
ppl 19.55, RTN W4 g128 +0.33%, W3 g128 +1.88%: accepted, ratio 5.7):

    python -m slimserve.eval.demo_model --arch moe --out recipes/demo-moe --steps 900 \
        --batch 16 --seq-len 256 --tokenizer recipes/demo-model

Training is seeded and deterministic for a given Python version, torch version and thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from slimserve.compress.datasets import encode_documents as encode_split
from slimserve.runtime.corpus import read_texts

EOS = "<|endoftext|>"
# A minimal ChatML-style template so `/v1/chat/completions` has something to render.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (every byte representable, no unknown token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def wrap_tokenizer(tok):
    """The HF fast-tokenizer wrapper that `AutoTokenizer.from_pretrained` will load back."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    hf.chat_template = CHAT_TEMPLATE
    hf.model_max_length = 1024
    return hf


def model_config(vocab_size: int, eos_id: int):
    """~9M-parameter Llama: hidden 384, 4 layers, 6 query heads over 2 KV heads (3:1), head_dim 64."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=384,
        intermediate_size=1024,  # a multiple of 128 so group size 128 divides every K
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attention_bias=False,
        mlp_bias=False,
    )


def moe_config(vocab_size: int, eos_id: int):
    """~6M-parameter Qwen3-MoE (~2.5M active per token): hidden 256, 4 layers, 4 query heads over
    2 KV heads, head_dim 64, 8 experts of width 256 per layer, top-2, renormalized."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,  # unused: every layer is sparse
        moe_intermediate_size=256,  # a multiple of 128 so group size 128 divides every K
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        output_router_logits=True,  # the load-balancing loss, added in `train`
        router_aux_loss_coef=0.01,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then cosine decay to 10% of it at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def quick_val_ppl(model, val_ids: torch.Tensor, seq_len: int, max_windows: int) -> float:
    """Perplexity over the first `max_windows` non-overlapping windows (a training-time probe)."""
    model.eval()
    n = min(max_windows, val_ids.numel() // seq_len)
    total, count = 0.0, 0
    for i in range(0, n, 8):
        batch = val_ids[i * seq_len : min(n, i + 8) * seq_len].view(-1, seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.size(-1)),
            batch[:, 1:].reshape(-1),
            reduction="sum",
        )
        total += loss.item()
        count += batch[:, 1:].numel()
    model.train()
    return math.exp(total / count)


def train(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    train_texts, val_texts = read_texts("train"), read_texts("validation")
    if args.tokenizer:
        hf_tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        hf_tok = wrap_tokenizer(train_tokenizer(train_texts, args.vocab_size))
    train_ids, val_ids = encode_split(hf_tok, train_texts), encode_split(hf_tok, val_texts)
    log = open(out / "train_log.jsonl", "a")
    print(
        f"tokenizer trained in {time.time() - t0:.0f}s; train {train_ids.numel()} tok, val {val_ids.numel()} tok"
    )

    eos_id = hf_tok.convert_tokens_to_ids(EOS)
    config = (moe_config if args.arch == "moe" else model_config)(len(hf_tok), eos_id)
    model = AutoModelForCausalLM.from_config(config)
    print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    step_fn = torch.compile(model) if args.compile else model
    gen = torch.Generator().manual_seed(args.seed)
    tokens_seen, t_train = 0, time.time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        starts = torch.randint(
            0, train_ids.numel() - args.seq_len - 1, (args.batch,), generator=gen
        )
        batch = torch.stack([train_ids[s : s + args.seq_len] for s in starts.tolist()])
        # MoE in fp32: transformers' grouped expert GEMMs under bf16 autocast take ~15x longer
        # backward on CPU (measured 20.6 s vs 1.4 s for 16 x 256 tokens on one thread)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.arch != "moe"):
            result = step_fn(batch)
        logits = result.logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)
        )
        aux = getattr(result, "aux_loss", None)  # MoE: the router's load-balancing loss
        if aux is not None:
            loss = loss + config.router_aux_loss_coef * aux.float()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens_seen += batch.numel()
        if step % args.eval_every == 0 or step == args.steps - 1:
            ppl = quick_val_ppl(model, val_ids, args.seq_len, args.eval_windows)
            rec = {
                "step": step,
                "loss": round(loss.item(), 4),
                "val_ppl": round(ppl, 3),
                "tokens": tokens_seen,
                "minutes": round((time.time() - t_train) / 60, 2),
            }
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
    save(
        model,
        hf_tok,
        out,
        {
            "steps": args.steps,
            "tokens_seen": tokens_seen,
            "train_minutes": round((time.time() - t_train) / 60, 1),
            "seq_len": args.seq_len,
            "batch": args.batch,
            "lr": args.lr,
            "seed": args.seed,
            "arch": args.arch,
            "torch": torch.__version__,
        },
    )


def save(model, hf_tok, out: Path, meta: dict) -> None:
    """Write config.json + bf16 model.safetensors + tokenizer files + training facts."""
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    if getattr(model.config, "output_router_logits", False):
        model.config.output_router_logits = False  # a training-time loss, not for inference
    model.save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def acceptance(
    model_dir: Path, seq_len: int = 512, prompt: str = "def read_config(path):\n"
) -> dict:
    """The demo model's acceptance numbers on the whole stdlib validation split.

    Accept only if RTN W3 g128 drift >= 2x RTN W4 g128 drift: a model whose quantization drifts
    are tiny and unordered makes every later quality comparison noise.
    """
    from slimserve.compress.datasets import load_token_documents
    from slimserve.compress.perplexity import evaluate_perplexity
    from slimserve.compress.quant.stages import RtnOptions, RtnStage
    from slimserve.compress.stage import CompressionState
    from slimserve.runtime.loading.loader import load_model

    loaded = load_model(model_dir, dtype=torch.float32)
    ids = load_token_documents("stdlib", loaded.tokenizer)
    base = evaluate_perplexity(loaded.model, ids, seq_len, progress=False)
    facts = {"val_ppl": base.ppl, "val_tokens": base.tokens}
    for scheme in ("W4A16", "W3A16"):
        model = load_model(model_dir, dtype=torch.float32).model
        stage = RtnStage(RtnOptions(scheme=scheme, group_size=128))
        stage.apply(
            CompressionState(model=model, tokenizer=loaded.tokenizer, storage_dtype=torch.bfloat16)
        )
        ppl = evaluate_perplexity(model, ids, seq_len, progress=False).ppl
        facts[f"rtn_{scheme}_g128_ppl"] = ppl
        facts[f"rtn_{scheme}_g128_drift"] = ppl / base.ppl - 1
    facts["drift_ratio_w3_over_w4"] = facts["rtn_W3A16_g128_drift"] / facts["rtn_W4A16_g128_drift"]
    facts["accepted"] = facts["drift_ratio_w3_over_w4"] >= 2.0
    enc = loaded.tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = loaded.model.generate(
        enc, max_new_tokens=48, do_sample=False, pad_token_id=loaded.tokenizer.eos_token_id
    )
    facts["greedy_prompt"] = prompt
    facts["greedy_continuation"] = loaded.tokenizer.decode(out[0, enc.shape[1] :])
    return facts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--check",
        action="store_true",
        help="print the acceptance numbers of --out instead of training",
    )
    p.add_argument("--out", default="recipes/demo-model")
    p.add_argument(
        "--arch", choices=("dense", "moe"), default="dense", help="Llama or Qwen3-MoE (8 x top-2)"
    )
    p.add_argument(
        "--tokenizer", default="", help="a folder whose tokenizer to reuse instead of training one"
    )
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-windows", type=int, default=48)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    if args.check:
        print(json.dumps(acceptance(Path(args.out)), indent=2))
    else:
        train(args)


if __name__ == "__main__":
    main()
