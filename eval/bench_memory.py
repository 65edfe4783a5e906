"""Memory benchmark: does `compress run` stay within a bounded memory whatever the model's depth?

    python -m slimserve.eval.bench_memory [--shape demo|8b] [--layers 8 32] [--quick]
        [--device cpu|cuda] [--threads N] [--json-out FILE] [--work-dir DIR]

A GPTQ recipe holds one decoder layer at a time (compress/layer_store.py): decoder layers are
read from the safetensors files when their turn comes, upcast to float32 for the layer's math,
written to a spill file and dropped; the artifact is written layer by layer. This checks it end
to end on random-init Llama checkpoints with N decoder layers written to disk in bf16:

- `--shape demo`: the demo model's width (hidden 384, intermediate 1024, 6 query / 2 KV heads x
  64, vocab = the tokenizer's), calibration `stdlib` train 64 x 512 tokens (`--quick`: 16 x 256,
  layers 2 and 8), 4 evaluation windows of 512;
- `--shape 8b`: Llama-3-8B's shape (hidden 4096, intermediate 14336, 32 query / 8 KV heads x 128,
  vocab 128256, untied lm_head; 32 layers = 8.03B parameters, 16.06 GB in bf16), written tensor
  by tensor so the parent never holds the model either; calibration 16 x 256 tokens, 2
  evaluation windows of 256 (one per forward: the logits of 128256 tokens are large). On a CPU
  the layer replays run in float32 (`calibration.dtype: float32`): CPUs without native bf16
  multiply bf16 several times slower than float32; on CUDA they run in bf16 (`auto`).

Each checkpoint goes through a GPTQ W4A16 g128 recipe (the gate is wide open: the weights are
random) in its own child process (`--threads`: demo 1, 8b every core), so its wall time and
peak RSS (`os.wait4`) are its alone; with `--device cuda` the child also reports the GPU's peak
allocated memory. The verdict: the deepest run's peak RSS within `--tolerance` (default 10%)
of the shallowest's, and below the size of its bf16 checkpoint. Exit code 1 when
memory grows or a peak exceeds the checkpoint, 2 when a run failed or fewer than two depths ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from slimserve.eval.bench_common import fmt_cell, run_child
from slimserve.runtime.bench.sysinfo import hardware_info, hardware_line

DEMO_MODEL = Path(__file__).resolve().parents[1] / "recipes" / "demo-model"
SHAPES = ("demo", "8b")
DEFAULT_LAYERS = {"demo": (8, 32), "8b": (8, 32)}
QUICK_LAYERS = {"demo": (2, 8), "8b": (1, 2)}
TOLERANCE = 0.10  # deep/shallow peak RSS may exceed 1 by this fraction and still be "flat"
BF16_BYTES = 2  # the checkpoints' dtype
TOKENIZER_FILES = 40  # stdlib train files the fallback tokenizer is trained on
TOKENIZER_VOCAB = 4096  # the demo model's vocabulary size (eval/demo_model.py --vocab-size)
LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
INIT_STD = 0.02  # random weights ~ N(0, 0.02^2), norms 1 (LlamaConfig's initializer_range)


@dataclass(frozen=True, slots=True)
class Workload:
    num_samples: int = 64  # calibration windows (stdlib train)
    calib_seq_len: int = 512  # tokens per calibration window
    seed: int = 0  # seed of the calibration window sampler
    eval_seq_len: int = 512  # tokens per perplexity window (stdlib validation)
    max_windows: int = 4  # perplexity windows per measurement (baseline + after gptq)
    eval_batch: int = 8  # windows per evaluation forward
    group_size: int = 128  # GPTQ W4A16 weight group size
    calibration_dtype: str = "auto"  # dtype of the layer replays (recipe calibration.dtype)
    device: str = "cpu"  # the recipe's device


def workload(quick: bool, shape: str = "demo", device: str = "cpu") -> Workload:
    if shape == "8b":
        return Workload(
            num_samples=16,
            calib_seq_len=256,
            eval_seq_len=256,
            max_windows=2,
            eval_batch=1,
            calibration_dtype="float32" if device == "cpu" else "auto",
            device=device,
        )
    wl = Workload(num_samples=16, calib_seq_len=256, max_windows=2) if quick else Workload()
    return replace(wl, device=device)


@dataclass(slots=True)
class Row:
    layers: int  # decoder layers of the checkpoint
    params: int  # parameters of the checkpoint
    status: str = "ok"  # ok | failed
    peak_rss_mb: float | None = (
        None  # peak resident set of the `compress run` child, MB (1e6 bytes)
    )
    wall_s: float | None = None  # seconds of the whole child (load, 2 ppl evals, GPTQ, export)
    gptq_s: float | None = None  # seconds of the gptq stage alone (from report.json)
    gpu_peak_mb: float | None = None  # torch.cuda.max_memory_allocated of the child (device cuda)
    note: str = ""  # why it failed

    @property
    def weight_mb(self) -> float:
        """The bf16 checkpoint's weights, MB."""
        return self.params * BF16_BYTES / 1e6

    @property
    def rss_ratio(self) -> float | None:
        """Peak RSS over the bf16 checkpoint's size."""
        return None if self.peak_rss_mb is None else self.peak_rss_mb / self.weight_mb

    @property
    def layer_s(self) -> float | None:
        """GPTQ seconds per decoder layer."""
        return None if self.gptq_s is None else self.gptq_s / self.layers


@dataclass(frozen=True, slots=True)
class Verdict:
    shallow: int | None  # layers of the reference run
    deep: int | None  # layers of the compared run
    ratio: float | None  # peak RSS deep / shallow
    grows: bool | None  # ratio > 1 + tolerance; None when undecidable
    above_checkpoint: list[
        int
    ]  # [deep] when the deepest run's peak RSS is not below its bf16 checkpoint
    text: str  # the sentence printed under the table


def model_config(num_layers: int, vocab_size: int, eos_id: int, shape: str = "demo"):
    """The LlamaConfig of `shape` with `num_layers` layers: the demo model's (vocab `vocab_size`)
    or Llama-3-8B's widths (its own vocab; `vocab_size` is ignored)."""
    from transformers import LlamaConfig

    from slimserve.eval.demo_model import model_config as demo_config

    if shape == "8b":
        return LlamaConfig(
            num_hidden_layers=num_layers, bos_token_id=eos_id, eos_token_id=eos_id, **LLAMA3_8B
        )
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
        "device": wl.device,
        "calibration": {
            "dataset": "stdlib",
            "num_samples": wl.num_samples,
            "seq_len": wl.calib_seq_len,
            "seed": wl.seed,
            "dtype": wl.calibration_dtype,
        },
        # Random weights: perplexity is meaningless, so the gate only has to let the run finish.
        "eval": {
            "dataset": "stdlib",
            "seq_len": wl.eval_seq_len,
            "max_windows": wl.max_windows,
            "batch_size": wl.eval_batch,
            "max_ppl_increase": 1.0e6,
        },
        "stages": [{"gptq": {"scheme": "W4A16", "group_size": wl.group_size}}],
        "export": {"format": "compressed-tensors"},
    }


def verdict(rows: list[Row], tolerance: float = TOLERANCE) -> Verdict:
    """Compare the peak RSS of the deepest ok run with the shallowest's, and the deepest with its
    checkpoint. Only the deepest run is held to its checkpoint's size: a shallow model's bf16 weights
    can be smaller than the fixed cost (embeddings, lm_head, one layer's float32 math; 8.1 GB
    against 2.5 GB at one Llama-3-8B-shaped layer), which is what a flat peak means."""
    ok = sorted(
        (r for r in rows if r.status == "ok" and r.peak_rss_mb is not None), key=lambda r: r.layers
    )
    if len(ok) < 2 or ok[0].layers == ok[-1].layers:
        return Verdict(None, None, None, None, [], "undecided: fewer than two depths ran")
    lo, hi = ok[0], ok[-1]
    above = [hi.layers] if hi.peak_rss_mb >= hi.weight_mb else []
    ratio = hi.peak_rss_mb / lo.peak_rss_mb
    grows = ratio > 1 + tolerance
    below = (
        f"the {hi.layers}-layer peak is {'NOT ' if above else ''}below its bf16 checkpoint "
        f"({hi.peak_rss_mb:.0f} vs {hi.weight_mb:.0f} MB)"
    )
    text = (
        f"peak RSS {'GROWS' if grows else 'is flat'} with depth: {hi.layers} vs {lo.layers} layers = "
        f"{ratio:.2f}x ({hi.peak_rss_mb:.0f} vs {lo.peak_rss_mb:.0f} MB; limit {1 + tolerance:.2f}x) while "
        f"the weights grow {hi.params / lo.params:.2f}x; {below}"
    )
    return Verdict(lo.layers, hi.layers, ratio, grows, above, text)


def format_table(meta: dict, rows: list[Row], v: Verdict) -> str:
    """The benchmark's one table: hardware, model, workload, a row per depth, the verdict."""
    hw, m, wl = meta["hardware"], meta["model"], meta["workload"]
    width = "Llama-3-8B shape" if m.get("shape") == "8b" else "demo-model width"
    replay = {"auto": "bf16", "float32": "fp32"}.get(
        wl["calibration_dtype"], wl["calibration_dtype"]
    )
    lines = [
        hardware_line(hw),
        f"model: random-init LlamaForCausalLM, {width} (hidden {m['hidden_size']}, intermediate "
        f"{m['intermediate_size']}, {m['heads']} heads / {m['kv_heads']} KV heads x {m['head_dim']}, "
        f"vocab {m['vocab_size']}), bf16 checkpoint on disk; one decoder layer at a time in fp32 (GPTQ "
        f"replays in {replay}); tokenizer: {m['tokenizer']}",
        f"workload: compress run on {wl['device']}, gptq W4A16 g{wl['group_size']}; calibration stdlib train "
        f"{wl['num_samples']} x {wl['calib_seq_len']} tokens, seed {wl['seed']}; eval stdlib validation "
        f"{wl['max_windows']} windows x {wl['eval_seq_len']} (baseline + after gptq); export compressed-tensors; "
        f"{wl['threads']} torch thread(s) per child",
    ]
    head = (
        "layers",
        "params M",
        "bf16 ckpt MB",
        "peak RSS MB",
        "RSS / ckpt",
        "GPU peak MB",
        "gptq s",
        "s / layer",
        "wall s",
        "note",
    )
    body = [head] + [
        (
            str(r.layers),
            f"{r.params / 1e6:.2f}",
            f"{r.weight_mb:.0f}",
            fmt_cell(r.peak_rss_mb, ".0f"),
            fmt_cell(r.rss_ratio, ".2f"),
            fmt_cell(r.gpu_peak_mb, ".0f"),
            fmt_cell(r.gptq_s, ".1f"),
            fmt_cell(r.layer_s, ".1f"),
            fmt_cell(r.wall_s, ".1f"),
            "" if r.status == "ok" else f"{r.status}: {r.note}",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in body) for i in range(len(head) - 1)]

    def line(cells) -> str:
        return ("  ".join(c.rjust(w) for c, w in zip(cells, widths)) + "  " + cells[-1]).rstrip()

    lines += ["", line(head), "  ".join("-" * w for w in widths) + "  " + "-" * 4]
    lines += [line(cells) for cells in body[1:]]
    lines += [
        "",
        "MB = 1e6 bytes; peak RSS / wall s: the whole child process (os.wait4); "
        "s / layer: the gptq stage's seconds over the layer count",
        v.text,
    ]
    return "\n".join(lines)


def make_tokenizer(work: Path):
    """(HF tokenizer, description): the demo model's when present, else one trained on stdlib files."""
    from transformers import AutoTokenizer

    if (DEMO_MODEL / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(DEMO_MODEL)), f"copied from {DEMO_MODEL}"
    from slimserve.eval.demo_model import train_tokenizer, wrap_tokenizer
    from slimserve.runtime.corpus import read_texts

    tok = wrap_tokenizer(train_tokenizer(read_texts("train")[:TOKENIZER_FILES], TOKENIZER_VOCAB))
    return (
        tok,
        f"byte-level BPE trained on {TOKENIZER_FILES} stdlib train files (no {DEMO_MODEL.name})",
    )


def write_checkpoint(out: Path, cfg, tok, seed: int = 0) -> int:
    """Write a seeded random bf16 Llama of `cfg` and `tok` at `out`, one safetensors file per
    decoder layer (plus one for the rest) and an index, generating one layer at a time so the
    writer never holds the model. Weights ~ N(0, INIT_STD^2), norms 1. Returns its parameters."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {k: (tuple(t.shape)) for k, t in LlamaForCausalLM(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    n = cfg.num_hidden_layers
    groups = [[k for k in shapes if k.startswith(f"model.layers.{i}.")] for i in range(n)]
    groups.append([k for k in shapes if not k.startswith("model.layers.")])
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for j, keys in enumerate(groups):
        name = f"model-{j + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for k in keys:
            if k.endswith("norm.weight"):
                tensors[k] = torch.ones(shapes[k], dtype=torch.bfloat16)
            else:
                tensors[k] = (torch.randn(shapes[k], generator=gen) * INIT_STD).to(torch.bfloat16)
            weight_map[k] = name
            total += tensors[k].numel()
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        del tensors
    index = {
        "metadata": {"total_size": total * BF16_BYTES},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    cfg.dtype = torch.bfloat16
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    assert total == param_count(cfg), (total, param_count(cfg))
    return total


def run_depth(num_layers: int, tok, wl: Workload, work: Path, shape: str = "demo") -> Row:
    """Write the checkpoint, run the recipe in a child process; a Row."""
    import yaml

    ckpt = work / f"llama-{shape}-{num_layers}l"
    params = write_checkpoint(
        ckpt, model_config(num_layers, len(tok), tok.eos_token_id, shape), tok
    )
    row = Row(num_layers, params)
    out, recipe = work / f"art-{shape}-{num_layers}l", work / f"gptq-{shape}-{num_layers}l.yaml"
    recipe.write_text(
        f"# bench_memory: {shape}, {num_layers} layers\n"
        + yaml.safe_dump(recipe_dict(ckpt, wl, out), sort_keys=False),
        encoding="utf-8",
    )
    child = run_child(
        [sys.executable, "-m", "slimserve.eval.bench_memory", "--child", str(recipe)],
        work / f"run-{shape}-{num_layers}l",
    )
    row.wall_s, row.peak_rss_mb = child.seconds, child.max_rss_bytes / 1e6
    report = out / "report.json"
    try:
        if child.returncode not in (0, 3) or not report.is_file():  # 3: gate failed, report written
            row.status, row.note = "failed", f"exit {child.returncode}: {child.stderr_tail}"
            return row
        rep = json.loads(report.read_text())
        row.gptq_s = sum(s["seconds"] for s in rep["stages"])
        tail = child.stdout.strip().splitlines()[-1:] or ["{}"]
        gpu = json.loads(tail[0]).get("cuda_peak_bytes") if tail[0].startswith("{") else None
        row.gpu_peak_mb = None if gpu is None else gpu / 1e6
        return row
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)  # a 32-layer 8B-shaped checkpoint is 16 GB
        shutil.rmtree(out, ignore_errors=True)


def child_main(recipe_path: Path) -> int:
    """The measured child: `compress run` of one recipe (no progress bars), then one JSON line with
    the GPU's peak allocated bytes when the recipe ran on CUDA. Exit 0, or 3 when the gate failed."""
    import torch

    from slimserve.compress.pipeline import run_recipe
    from slimserve.compress.recipe import load_recipe

    result = run_recipe(
        load_recipe(recipe_path),
        log=lambda m: print(m, file=sys.stderr, flush=True),
        progress=False,
    )
    peak = (
        torch.cuda.max_memory_allocated()
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else None
    )
    print(json.dumps({"cuda_peak_bytes": peak}))
    return 0 if result.passed else 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shape", choices=SHAPES, default="demo", help="model width (default demo; 8b: Llama-3-8B)"
    )
    p.add_argument(
        "--layers",
        type=int,
        nargs="+",
        help="decoder layer counts (default 8 32; --quick: "
        f"demo {QUICK_LAYERS['demo']}, 8b {QUICK_LAYERS['8b']})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="demo: 16 x 256 calibration tokens, 2 eval windows; "
        "both shapes: shallower default depths",
    )
    p.add_argument("--device", default="cpu", help="the recipes' device: cpu or cuda[:N]")
    p.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads of each child (OMP_NUM_THREADS; default: demo 1, since GPTQ's "
        "column loop runs tiny ops there that extra threads only slow down; 8b every core, "
        "where the factorizations and products are large)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        help="allowed growth of peak RSS, deepest vs shallowest (fraction)",
    )
    p.add_argument("--json-out", type=Path, help="also write the table's data as JSON here")
    p.add_argument(
        "--work-dir",
        type=Path,
        help="checkpoints, recipes and logs go here (default: a temp "
        "folder; a 32-layer 8b checkpoint needs 16 GB, its spill files as much again)",
    )
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: the measured child
    args = p.parse_args(argv)
    if args.threads is None:
        args.threads = (os.cpu_count() or 1) if args.shape == "8b" else 1
    if args.threads < 1:
        p.error(f"--threads {args.threads}: must be at least 1")
    if args.layers and min(args.layers) < 1:
        p.error(f"--layers {args.layers}: every layer count must be at least 1")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        p.error(f"--device {args.device}: use cpu or cuda[:N]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    wl = workload(args.quick, args.shape, args.device)
    layers = sorted(
        set(args.layers or (QUICK_LAYERS if args.quick else DEFAULT_LAYERS)[args.shape])
    )
    rows: list[Row] = []
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by each child's torch at start-up
    if args.work_dir:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_memory-", dir=args.work_dir) as tmp:
        work = Path(tmp)
        os.environ["SLIMSERVE_SPILL_DIR"] = str(
            work
        )  # the children's layer spills: beside the checkpoint
        tok, tok_note = make_tokenizer(work)
        for i, n in enumerate(layers, 1):
            print(f"[{i}/{len(layers)}] {n} layers ...", file=sys.stderr, flush=True)
            rows.append(run_depth(n, tok, wl, work, args.shape))
            if args.work_dir:  # keep the logs
                for log in work.glob(f"run-{args.shape}-{n}l.*"):
                    shutil.copy(log, args.work_dir / log.name)
    cfg = model_config(1, len(tok), tok.eos_token_id, args.shape)
    meta = {
        "hardware": hardware_info(),
        "model": {
            "shape": args.shape,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "tokenizer": tok_note,
        },
        "workload": {**asdict(wl), "threads": args.threads},
    }
    v = verdict(rows, args.tolerance)
    print(format_table(meta, rows, v))
    if args.json_out:
        data = {
            "meta": meta,
            "tolerance": args.tolerance,
            "verdict": asdict(v),
            "rows": [
                {
                    **asdict(r),
                    "weight_mb": r.weight_mb,
                    "rss_ratio": r.rss_ratio,
                    "layer_s": r.layer_s,
                }
                for r in rows
            ],
        }
        args.json_out.write_text(json.dumps(data, indent=2) + "\n")
    if any(r.status != "ok" for r in rows) or v.grows is None:
        return 2
    return 1 if v.grows or v.above_checkpoint else 0


if __name__ == "__main__":
    sys.exit(main())
