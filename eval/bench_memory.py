"""Memory benchmark: does `compress run` need working memory that grows with model depth?

    python -m slimserve.eval.bench_memory [--layers 8 32] [--quick] [--json-out FILE] [--work-dir DIR]

The calibration engine (compress/calibration.py) promises that, beside the model itself, peak
memory is one decoder layer plus the cached activations of one layer, whatever the depth. This
checks that claim end to end: random-init `LlamaForCausalLM` checkpoints with the demo model's
width (hidden 384, intermediate 1024, 6 query heads over 2 KV heads, head_dim 64, vocab = the
tokenizer's) and N decoder layers each (bf16, saved with the demo model's tokenizer, or one
trained on a few stdlib files when recipes/demo-model is absent) go through a GPTQ W4A16 g128
recipe (calibration `stdlib` train, 64 x 512 tokens; evaluation on a few windows so it does not
dominate; the gate is wide open since the weights are random), each as its own
`python -m slimserve.compress.cli run` child (one torch thread unless `--threads`), so its wall
time and peak RSS (`os.wait4`) are its alone. `--quick`: 16 x 256 calibration tokens, 2 evaluation windows, layers 2 and 8.

The pipeline holds the model in float32, so "working MB" = peak RSS - 4 bytes x params: the
interpreter, torch, the cached activations, Hessians, quantized codes and export buffers. The
verdict compares the deepest run with the shallowest: working memory "does not grow" with depth
when deep / shallow <= 1 + tolerance (default 25%) while the weights grow with the layer count.
Exit code 1 when it grows, 2 when a run failed or fewer than two depths ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from slimserve.eval.bench_common import fmt_cell, run_child
from slimserve.runtime.bench.sysinfo import hardware_info, hardware_line

DEMO_MODEL = Path(__file__).resolve().parents[1] / "recipes" / "demo-model"
DEFAULT_LAYERS = (8, 32)
QUICK_LAYERS = (2, 8)
TOLERANCE = 0.25  # deep/shallow working memory may exceed 1 by this fraction and still be "flat"
FP32_BYTES = 4  # the pipeline's compute dtype (compress/pipeline.py COMPUTE_DTYPE)
BF16_BYTES = 2  # the checkpoint's storage dtype
TOKENIZER_FILES = 40  # stdlib train files the fallback tokenizer is trained on
TOKENIZER_VOCAB = 4096  # the demo model's vocabulary size (eval/demo_model.py --vocab-size)


@dataclass(frozen=True, slots=True)
class Workload:
    num_samples: int = 64  # calibration windows (stdlib train)
    calib_seq_len: int = 512  # tokens per calibration window
    seed: int = 0  # seed of the calibration window sampler
    eval_seq_len: int = 512  # tokens per perplexity window (stdlib validation)
    max_windows: int = 4  # perplexity windows per measurement (baseline + after gptq)
    group_size: int = 128  # GPTQ W4A16 weight group size


def workload(quick: bool) -> Workload:
    return Workload(num_samples=16, calib_seq_len=256, max_windows=2) if quick else Workload()


@dataclass(slots=True)
class Row:
    layers: int  # decoder layers of the checkpoint
    params: int  # parameters of the checkpoint
    status: str = "ok"  # ok | failed
    peak_rss_mb: float | None = None  # peak resident set of the `compress run` child, MB (1e6 bytes)
    wall_s: float | None = None  # seconds of the whole child (load, 2 ppl evals, GPTQ, export)
    gptq_s: float | None = None  # seconds of the gptq stage alone (from report.json)
    note: str = ""  # why it failed

    @property
    def weight_mb(self) -> float:
        """The bf16 checkpoint's weights, MB."""
        return self.params * BF16_BYTES / 1e6

    @property
    def fp32_mb(self) -> float:
        """The model as the pipeline holds it (float32), MB."""
        return self.params * FP32_BYTES / 1e6

    @property
    def working_mb(self) -> float | None:
        """Peak RSS minus the fp32 model: activations, Hessians, codes, buffers, the runtime itself."""
        return None if self.peak_rss_mb is None else self.peak_rss_mb - self.fp32_mb


@dataclass(frozen=True, slots=True)
class Verdict:
    shallow: int | None  # layers of the reference run
    deep: int | None  # layers of the compared run
    ratio: float | None  # working MB deep / working MB shallow
    grows: bool | None  # ratio > 1 + tolerance; None when undecidable
    bytes_per_param: float | None  # working memory added per added parameter (deep - shallow), bytes
    text: str  # the sentence printed under the table


def model_config(num_layers: int, vocab_size: int, eos_id: int):
    """The demo model's LlamaConfig (same widths, same everything) with `num_layers` layers."""
    from slimserve.eval.demo_model import model_config as demo_config

    cfg = demo_config(vocab_size, eos_id)
    cfg.num_hidden_layers = num_layers
    return cfg


def param_count(cfg) -> int:
    """Parameters of a bias-free Llama: embeddings, per layer 7 Linears + 2 RMSNorms, final norm, lm_head."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q = cfg.num_attention_heads * cfg.head_dim  # width of the query projection
    kv = cfg.num_key_value_heads * cfg.head_dim  # width of each of the key and value projections
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    lm_head = 0 if cfg.tie_word_embeddings else v * h
    return v * h + cfg.num_hidden_layers * per_layer + h + lm_head


def recipe_dict(model: str | Path, wl: Workload, output: str | Path) -> dict:
    """The GPTQ W4A16 recipe each checkpoint runs (a dict, ready for YAML)."""
    return {
        "model": str(model),
        "output": str(output),
        "calibration": {"dataset": "stdlib", "num_samples": wl.num_samples,
                        "seq_len": wl.calib_seq_len, "seed": wl.seed},
        # Random weights: perplexity is meaningless, so the gate only has to let the run finish.
        "eval": {"dataset": "stdlib", "seq_len": wl.eval_seq_len, "max_windows": wl.max_windows,
                 "max_ppl_increase": 1.0e6},
        "stages": [{"gptq": {"scheme": "W4A16", "group_size": wl.group_size}}],
        "export": {"format": "compressed-tensors"},
    }


def verdict(rows: list[Row], tolerance: float = TOLERANCE) -> Verdict:
    """Compare the working memory of the deepest ok run with that of the shallowest."""
    ok = sorted((r for r in rows if r.status == "ok" and r.working_mb is not None), key=lambda r: r.layers)
    if len(ok) < 2 or ok[0].layers == ok[-1].layers:
        return Verdict(None, None, None, None, None, "undecided: fewer than two depths ran")
    lo, hi = ok[0], ok[-1]
    if lo.working_mb <= 0:
        return Verdict(lo.layers, hi.layers, None, None, None,
                       f"undecided: working memory of the {lo.layers}-layer run is not positive")
    ratio = hi.working_mb / lo.working_mb
    grows = ratio > 1 + tolerance
    weights = hi.params / lo.params
    per_param = (hi.working_mb - lo.working_mb) * 1e6 / (hi.params - lo.params)
    text = (f"working memory (peak RSS - fp32 weights) {'GROWS' if grows else 'does not grow'} with depth: "
            f"{hi.layers} vs {lo.layers} layers = {ratio:.2f}x ({hi.working_mb:.0f} vs {lo.working_mb:.0f} MB; "
            f"limit {1 + tolerance:.2f}x) while the weights grow {weights:.2f}x; "
            f"{per_param:+.2f} bytes of working memory per added parameter (fp32 weights: 4)")
    return Verdict(lo.layers, hi.layers, ratio, grows, per_param, text)


def format_table(meta: dict, rows: list[Row], v: Verdict) -> str:
    """The benchmark's one table: hardware, model, workload, a row per depth, the verdict."""
    hw, m, wl = meta["hardware"], meta["model"], meta["workload"]
    lines = [
        hardware_line(hw),
        f"model: random-init LlamaForCausalLM, demo-model width (hidden {m['hidden_size']}, intermediate "
        f"{m['intermediate_size']}, {m['heads']} heads / {m['kv_heads']} KV heads x {m['head_dim']}, "
        f"vocab {m['vocab_size']}), bf16 checkpoint, compressed in fp32 (GPTQ replays in bf16); "
        f"tokenizer: {m['tokenizer']}",
        f"workload: compress run, gptq W4A16 g{wl['group_size']}; calibration stdlib train "
        f"{wl['num_samples']} x {wl['calib_seq_len']} tokens, seed {wl['seed']}; eval stdlib validation "
        f"{wl['max_windows']} windows x {wl['eval_seq_len']} (baseline + after gptq); export compressed-tensors; "
        f"{wl['threads']} torch thread(s) per child",
    ]
    head = ("layers", "params M", "weight MB bf16", "fp32 MB", "peak RSS MB", "RSS - fp32 MB", "gptq s", "wall s", "note")
    body = [head] + [(
        str(r.layers), f"{r.params / 1e6:.2f}", f"{r.weight_mb:.0f}", f"{r.fp32_mb:.0f}",
        fmt_cell(r.peak_rss_mb, ".0f"), fmt_cell(r.working_mb, ".0f"), fmt_cell(r.gptq_s, ".1f"),
        fmt_cell(r.wall_s, ".1f"),
        "" if r.status == "ok" else f"{r.status}: {r.note}",
    ) for r in rows]
    widths = [max(len(row[i]) for row in body) for i in range(len(head) - 1)]

    def line(cells) -> str:
        return ("  ".join(c.rjust(w) for c, w in zip(cells, widths)) + "  " + cells[-1]).rstrip()

    lines += ["", line(head), "  ".join("-" * w for w in widths) + "  " + "-" * 4]
    lines += [line(cells) for cells in body[1:]]
    lines += ["", "MB = 1e6 bytes; peak RSS / wall s: the whole child process (os.wait4); "
              "RSS - fp32 = peak RSS - 4 bytes x params", v.text]
    return "\n".join(lines)


def make_tokenizer(work: Path):
    """(HF tokenizer, description): the demo model's when present, else one trained on stdlib files."""
    from transformers import AutoTokenizer

    if (DEMO_MODEL / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(DEMO_MODEL)), f"copied from {DEMO_MODEL}"
    from slimserve.eval.demo_model import train_tokenizer, wrap_tokenizer
    from slimserve.runtime.corpus import read_texts

    tok = wrap_tokenizer(train_tokenizer(read_texts("train")[:TOKENIZER_FILES], TOKENIZER_VOCAB))
    return tok, f"byte-level BPE trained on {TOKENIZER_FILES} stdlib train files (no {DEMO_MODEL.name})"


def build_checkpoint(out: Path, num_layers: int, tok) -> int:
    """Save a seeded random-init bf16 Llama with `num_layers` layers and `tok` at `out`; its params."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = model_config(num_layers, len(tok), tok.eos_token_id)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    assert params == param_count(cfg), (params, param_count(cfg))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return params


def run_depth(num_layers: int, tok, wl: Workload, work: Path) -> Row:
    """Build the checkpoint, run the recipe as a child `compress run`; a Row."""
    import yaml

    ckpt = work / f"llama-{num_layers}l"
    params = build_checkpoint(ckpt, num_layers, tok)
    row = Row(num_layers, params)
    out, recipe = work / f"art-{num_layers}l", work / f"gptq-{num_layers}l.yaml"
    recipe.write_text(f"# bench_memory: {num_layers} layers\n"
                      + yaml.safe_dump(recipe_dict(ckpt, wl, out), sort_keys=False), encoding="utf-8")
    child = run_child([sys.executable, "-m", "slimserve.compress.cli", "run", str(recipe),
                       "--output", str(out), "--no-progress"], work / f"run-{num_layers}l")
    row.wall_s, row.peak_rss_mb = child.seconds, child.max_rss_bytes / 1e6
    report = out / "report.json"
    if child.returncode not in (0, 3) or not report.is_file():  # 3: gate failed, report written
        row.status, row.note = "failed", f"exit {child.returncode}: {child.stderr_tail}"
        return row
    rep = json.loads(report.read_text())
    row.gptq_s = sum(s["seconds"] for s in rep["stages"])
    shutil.rmtree(ckpt, ignore_errors=True)  # keep the temp folder small between depths
    shutil.rmtree(out, ignore_errors=True)
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", help=f"decoder layer counts (default {DEFAULT_LAYERS}; "
                   f"--quick: {QUICK_LAYERS})")
    p.add_argument("--quick", action="store_true", help="16 x 256 calibration tokens, 2 eval windows")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads of each child (OMP_NUM_THREADS); GPTQ's column loop runs "
                        "tiny ops that extra threads only slow down")
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help="allowed growth of working memory, deepest vs shallowest (fraction)")
    p.add_argument("--json-out", type=Path, help="also write the table's data as JSON here")
    p.add_argument("--work-dir", type=Path, help="keep recipes and logs here (default: a temp folder)")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads {args.threads}: must be at least 1")
    if args.layers and min(args.layers) < 1:
        p.error(f"--layers {args.layers}: every layer count must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wl = workload(args.quick)
    layers = sorted(set(args.layers or (QUICK_LAYERS if args.quick else DEFAULT_LAYERS)))
    rows: list[Row] = []
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by each child's torch at start-up
    with tempfile.TemporaryDirectory(prefix="bench_memory-") as tmp:
        work = args.work_dir.resolve() if args.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        tok, tok_note = make_tokenizer(work)
        for i, n in enumerate(layers, 1):
            print(f"[{i}/{len(layers)}] {n} layers ...", file=sys.stderr, flush=True)
            rows.append(run_depth(n, tok, wl, work))
    cfg = model_config(1, len(tok), tok.eos_token_id)
    meta = {
        "hardware": hardware_info(),
        "model": {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                  "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                  "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "tokenizer": tok_note},
        "workload": {**asdict(wl), "threads": args.threads},
    }
    v = verdict(rows, args.tolerance)
    print(format_table(meta, rows, v))
    if args.json_out:
        data = {"meta": meta, "tolerance": args.tolerance, "verdict": asdict(v),
                "rows": [{**asdict(r), "weight_mb": r.weight_mb, "fp32_mb": r.fp32_mb,
                          "working_mb": r.working_mb} for r in rows]}
        args.json_out.write_text(json.dumps(data, indent=2) + "\n")
    if any(r.status != "ok" for r in rows) or v.grows is None:
        return 2
    return 1 if v.grows else 0


if __name__ == "__main__":
    sys.exit(main())
