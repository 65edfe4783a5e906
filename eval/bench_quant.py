"""Quantization quality benchmark: RTN / GPTQ / AWQ / SmoothQuant / FP8 KV and llm-compressor, one table.

    python -m slimserve.eval.bench_quant [--model recipes/demo-model] [--quick] [--json-out FILE]
        [--llmcompressor-python /work/peers/llmcompressor-venv/bin/python] [--work-dir DIR]

Every configuration runs on the same model, the same calibration windows (`stdlib` train split,
64 x 512 tokens, seed 0) and the same evaluation (the whole `stdlib` validation split, windows of
512 tokens); `--quick`: 40 windows, 16 calibration samples. Each is a generated recipe run as its
own `python -m slimserve.compress.cli run` process, so its wall time and peak RSS (`os.wait4`) are
its alone; the rest comes from its report.json. A stage missing from STAGES skips the row.

Drift = final ppl / baseline ppl - 1; "x RTN" = drift / drift of the same scheme's `rtn` row (AWQ
paper, Llama-2-7B g128, 4 bits: GPTQ about 0.85x, AWQ 0.5x). "wall s" / "peak RSS": the whole
child (ours: load, baseline ppl, stages with ppl after each, export; the peer: load, oneshot,
save; its evaluation is a separate `compress eval`). "quant s": the algorithm alone.

Peer: llm-compressor's GPTQ on the same calibration windows (eval/peers/llmcompressor_gptq.py),
evaluated by our loader and perplexity. It lives in its own venv, never a slimserve dependency
(llm-compressor pins its own transformers):

    python3 -m venv /work/peers/llmcompressor-venv
    /work/peers/llmcompressor-venv/bin/pip install torch==2.13.0
    /work/peers/llmcompressor-venv/bin/pip install "llmcompressor==0.14.*"

Without `--llmcompressor-python`, or when the peer fails, its rows say why.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from slimserve.eval.bench_common import fmt_cell, json_tail, last_line, run_child
from slimserve.runtime.bench.sysinfo import hardware_info, hardware_line, model_info

PEER_METHOD = "llm-compressor gptq"
PEER_SCRIPT = Path(__file__).resolve().parent / "peers" / "llmcompressor_gptq.py"
GROUP = 128  # weight group size of every grouped scheme here
_W4 = {"scheme": "W4A16", "group_size": GROUP}
_W3 = {"scheme": "W3A16", "group_size": GROUP}
_W8A8 = {"scheme": "W8A8"}


@dataclass(frozen=True, slots=True)
class BenchConfig:
    scheme: str  # weights/activations label; "x RTN" compares rows of one scheme
    method: str  # what produced the row ("rtn", "awq + rtn", PEER_METHOD, ...)
    stages: tuple[dict, ...] = ()  # our recipe's stage entries in order; empty for the peer
    peer_bits: int | None = None  # llm-compressor rows: weight bits (group size GROUP)


CONFIGS: tuple[BenchConfig, ...] = (
    BenchConfig("W4A16 g128", "rtn", ({"rtn": _W4},)),
    BenchConfig("W4A16 g128", "gptq", ({"gptq": _W4},)),
    BenchConfig("W4A16 g128", PEER_METHOD, peer_bits=4),
    BenchConfig("W4A16 g128", "awq + rtn", ({"awq": _W4}, {"rtn": _W4})),
    BenchConfig("W4A16 g128", "gptq + kv_cache fp8", ({"gptq": _W4}, {"kv_cache": {}})),
    BenchConfig("W3A16 g128", "rtn", ({"rtn": _W3},)),
    BenchConfig("W3A16 g128", "gptq", ({"gptq": _W3},)),
    BenchConfig("W3A16 g128", PEER_METHOD, peer_bits=3),
    BenchConfig("W3A16 g128", "awq + rtn", ({"awq": _W3}, {"rtn": _W3})),
    BenchConfig("W8A8", "rtn", ({"rtn": _W8A8},)),
    BenchConfig("W8A8", "smoothquant + rtn", ({"smoothquant": {}}, {"rtn": _W8A8})),
)


@dataclass(frozen=True, slots=True)
class Workload:
    dataset: str = "stdlib"  # calibration uses its train split, evaluation its validation split
    num_samples: int = 64  # calibration windows
    calib_seq_len: int = 512  # tokens per calibration window
    seed: int = 0  # seed of the calibration window sampler
    eval_seq_len: int = 512  # tokens per perplexity window
    max_windows: int | None = None  # None: every window of the validation split


def workload(quick: bool) -> Workload:
    return Workload(num_samples=16, max_windows=40) if quick else Workload()


@dataclass(slots=True)
class Row:
    scheme: str  # as in BenchConfig
    method: str  # as in BenchConfig
    status: str = "ok"  # ok | skipped | failed
    ppl: float | None = None  # final perplexity
    drift: float | None = None  # ppl / baseline ppl - 1 (fraction)
    ratio: float | None = None  # drift / drift of the same scheme's rtn row
    quant_s: float | None = None  # seconds of the algorithm alone
    wall_s: float | None = None  # seconds of the whole child process
    rss_mb: float | None = None  # peak resident set of the child process, MB (1e6 bytes)
    size_bytes: int | None = None  # weight bytes of the artifact
    tokens: int | None = None  # scored evaluation tokens
    baseline_ppl: float | None = None  # the baseline this row's drift refers to
    note: str = ""  # why skipped/failed, or a caveat


def recipe_dict(model: str | Path, cfg: BenchConfig, wl: Workload, output: str | Path) -> dict:
    """The recipe (as a dict, ready for YAML) that runs `cfg` on `model` under `wl`."""
    ev = {"dataset": wl.dataset, "seq_len": wl.eval_seq_len}
    if wl.max_windows is not None:
        ev["max_windows"] = wl.max_windows
    return {
        "model": str(model),
        "output": str(output),
        "calibration": {"dataset": wl.dataset, "num_samples": wl.num_samples,
                        "seq_len": wl.calib_seq_len, "seed": wl.seed},
        "eval": ev,
        "stages": [{name: dict(opts) for name, opts in s.items()} for s in cfg.stages],
        "export": {"format": "compressed-tensors"},
    }


def recipe_yaml(model: str | Path, cfg: BenchConfig, wl: Workload, output: str | Path) -> str:
    import yaml

    header = f"# bench_quant: {cfg.scheme} {cfg.method}\n"
    return header + yaml.safe_dump(recipe_dict(model, cfg, wl, output), sort_keys=False)


def missing_stages(cfg: BenchConfig, registry) -> list[str]:
    """Stage names of `cfg` that `registry` (STAGES) does not have yet, in recipe order."""
    return [name for s in cfg.stages for name in s if name not in registry]


def add_ratios(rows: list[Row]) -> None:
    """Fill `ratio` = drift / (drift of the ok rtn row of the same scheme), where both exist.

    An rtn drift <= 0 (quantization noise that happened to help) is no yardstick: no ratio then.
    """
    rtn = {r.scheme: r.drift for r in rows if r.method == "rtn" and r.status == "ok"}
    for r in rows:
        ref = rtn.get(r.scheme)
        r.ratio = r.drift / ref if r.drift is not None and ref is not None and ref > 0 else None


def format_table(meta: dict, rows: list[Row]) -> str:
    """The benchmark's one table: header lines (hardware, model, workload), rows, column notes."""
    hw, m, wl = meta["hardware"], meta["model"], meta["workload"]
    lines = [
        hardware_line(hw),
        f"model: {m['name']} ({m['params'] / 1e6:.2f}M params, {m['dtype']}) at {m['path']}",
        f"workload: eval {wl['dataset']} validation, seq_len {wl['eval_seq_len']}, {fmt_cell(wl['windows'], 'd')} "
        f"windows = {fmt_cell(wl['tokens'], ',')} scored tokens; calibration {wl['dataset']} train, "
        f"{wl['num_samples']} x {wl['calib_seq_len']} tokens, seed {wl['seed']}",
    ]
    if meta.get("peer"):
        lines.append(f"peer: {meta['peer']}")
    head = ("scheme", "method", "ppl", "drift %", "x RTN", "quant s", "wall s", "peak RSS MB", "note")
    body = [head] + [(
        r.scheme, r.method, fmt_cell(r.ppl, ".4f"), fmt_cell(None if r.drift is None else 100 * r.drift, "+.2f"),
        fmt_cell(r.ratio, ".2f"), fmt_cell(r.quant_s, ".1f"), fmt_cell(r.wall_s, ".1f"), fmt_cell(r.rss_mb, ".0f"),
        r.note if r.status == "ok" else f"{r.status}: {r.note}",
    ) for r in rows]
    widths = [max(len(row[i]) for row in body) for i in range(len(head) - 1)]
    right = {2, 3, 4, 5, 6, 7}  # numeric columns

    def line(cells) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return ("  ".join(out) + "  " + cells[-1]).rstrip()

    lines += ["", line(head), "  ".join("-" * w for w in widths) + "  " + "-" * 4]
    lines += [line(cells) for cells in body[1:]]
    lines += ["", "drift = ppl / baseline - 1; x RTN = drift / drift of the rtn row of the same scheme; "
              "wall s / peak RSS: the whole child process; quant s: the algorithm alone"]
    return "\n".join(lines)


def run_config(cfg: BenchConfig, model: Path, wl: Workload, work: Path, registry) -> Row:
    """Run one of our configurations as a child `compress run`; a Row from its report.json."""
    row = Row(cfg.scheme, cfg.method)
    missing = missing_stages(cfg, registry)
    if missing:
        row.status, row.note = "skipped", f"stage {', '.join(missing)} not in STAGES yet"
        return row
    slug = f"{cfg.scheme}-{cfg.method}".replace(" ", "").replace("+", "-").lower()
    out = work / slug
    recipe = work / f"{slug}.yaml"
    recipe.write_text(recipe_yaml(model, cfg, wl, out), encoding="utf-8")
    child = run_child([sys.executable, "-m", "slimserve.compress.cli", "run", str(recipe),
                       "--output", str(out), "--no-progress"], work / slug)
    row.wall_s, row.rss_mb = child.seconds, child.max_rss_bytes / 1e6
    report = out / "report.json"
    if child.returncode not in (0, 3) or not report.is_file():  # 3: gate failed, report still written
        row.status, row.note = "failed", f"exit {child.returncode}: {child.stderr_tail}"
        return row
    rep = json.loads(report.read_text())
    row.ppl, row.drift = rep["final"]["ppl"], rep["gate"]["ppl_increase"]
    row.baseline_ppl, row.tokens = rep["baseline"]["ppl"], rep["tokens"]
    row.quant_s = sum(s["seconds"] for s in rep["stages"])
    row.size_bytes = rep["final"]["size_bytes"]
    return row


def dump_calibration(model: Path, wl: Workload, path: Path) -> None:
    """The exact windows `compress run` calibrates on (same tokenizer, spec, count, seed)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from slimserve.compress.datasets import calibration_batches

    tok = AutoTokenizer.from_pretrained(str(model))
    ids = calibration_batches(tok, wl.dataset, wl.num_samples, wl.calib_seq_len, wl.seed)
    save_file({"input_ids": ids.contiguous()}, str(path))


def run_peer(cfg: BenchConfig, python: str | None, model: Path, wl: Workload, work: Path,
             calib: Path, base: Row) -> tuple[Row, dict]:
    """llm-compressor GPTQ in its own venv, then our `compress eval` on its artifact."""
    row = Row(cfg.scheme, cfg.method)
    if not python:
        row.status, row.note = "skipped", "no --llmcompressor-python given (setup: see module docstring)"
        return row, {}
    if not Path(python).is_file():
        row.status, row.note = "failed", f"peer python {python} does not exist (setup: see module docstring)"
        return row, {}
    out = work / f"peer-w{cfg.peer_bits}"
    child = run_child([python, str(PEER_SCRIPT), "--model", str(model), "--calib-ids", str(calib),
                       "--out", str(out), "--bits", str(cfg.peer_bits), "--group-size", str(GROUP)], out)
    row.wall_s, row.rss_mb = child.seconds, child.max_rss_bytes / 1e6
    if child.returncode != 0:
        row.status, row.note = "failed", f"llm-compressor exit {child.returncode}: {child.stderr_tail}"
        return row, {}
    info = json_tail(child.stdout)
    if info is None:
        row.status, row.note = "failed", f"peer script printed no result line: {last_line(child.stdout)}"
        return row, {}
    row.quant_s, row.note = info["seconds_oneshot"], f"actorder {info['actorder']}"
    cmd = [sys.executable, "-m", "slimserve.compress.cli", "eval", str(out), "--dataset", wl.dataset,
           "--seq-len", str(wl.eval_seq_len), "--json"]
    if wl.max_windows is not None:
        cmd += ["--max-windows", str(wl.max_windows)]
    ev = run_child(cmd, work / f"peer-w{cfg.peer_bits}-eval")
    res = json_tail(ev.stdout) if ev.returncode == 0 else None
    if res is None:
        row.status, row.note = "failed", f"compress eval of the peer artifact: {ev.stderr_tail}"
        return row, info
    row.ppl, row.tokens, row.baseline_ppl = res["ppl"], res["tokens"], base.ppl
    row.drift = res["ppl"] / base.ppl - 1 if base.ppl else None
    if base.tokens and row.tokens != base.tokens:
        row.note += f"; scored {row.tokens} tokens, the baseline {base.tokens}"
    return row, info


def baseline_row(rows: list[Row]) -> Row:
    """The checkpoint's own perplexity, noting if the runs disagree on it (they should not)."""
    ok = [r for r in rows if r.status == "ok" and r.method != PEER_METHOD]
    base = [r.baseline_ppl for r in ok]
    row = Row("baseline", "checkpoint", ppl=base[0] if base else None, tokens=ok[0].tokens if ok else None)
    if not base:
        row.status, row.note = "failed", "no configuration ran"
    elif max(base) / min(base) - 1 > 1e-6:
        row.note = f"baselines differ across runs: {min(base):.6f} .. {max(base):.6f}"
    return row


def run_all(args, model: Path, wl: Workload, work: Path) -> tuple[list[Row], dict]:
    from slimserve.compress.registry import STAGES

    rows, peer_info = [], {}
    ours = [c for c in CONFIGS if c.peer_bits is None]
    for i, cfg in enumerate(ours, 1):
        print(f"[{i}/{len(ours)}] {cfg.scheme} {cfg.method} ...", file=sys.stderr, flush=True)
        rows.append(run_config(cfg, model, wl, work, STAGES))
    base = baseline_row(rows)
    calib = work / "calibration_ids.safetensors"
    peers = [c for c in CONFIGS if c.peer_bits is not None]
    if peers and args.llmcompressor_python:
        dump_calibration(model, wl, calib)
    for cfg in peers:
        print(f"[peer] {cfg.scheme} {cfg.method} ...", file=sys.stderr, flush=True)
        row, info = run_peer(cfg, args.llmcompressor_python, model, wl, work, calib, base)
        rows.append(row)
        peer_info = info or peer_info
    order = {(c.scheme, c.method): i for i, c in enumerate(CONFIGS)}
    rows.sort(key=lambda r: order[(r.scheme, r.method)])
    add_ratios(rows)
    return [base] + rows, peer_info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("recipes/demo-model"), help="HF checkpoint folder")
    p.add_argument("--quick", action="store_true", help="40 evaluation windows, 16 calibration samples")
    p.add_argument("--llmcompressor-python", help="python of the llm-compressor venv (see module docstring)")
    p.add_argument("--json-out", type=Path, help="also write the table's data as JSON here")
    p.add_argument("--work-dir", type=Path, help="keep recipes, logs and artifacts here (default: a temp folder)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model.expanduser().resolve()
    if not (model / "config.json").is_file():
        print(f"error: {model} is not a checkpoint folder (no config.json); pass --model PATH",
              file=sys.stderr)
        return 2
    wl = workload(args.quick)
    with tempfile.TemporaryDirectory(prefix="bench_quant-") as tmp:
        work = args.work_dir.resolve() if args.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows, peer = run_all(args, model, wl, work)
    ref = next((r for r in rows if r.tokens), None)
    windows = ref.tokens // (wl.eval_seq_len - 1) if ref else None
    meta = {
        "hardware": hardware_info(),
        "model": model_info(model),
        "workload": {**asdict(wl), "windows": windows, "tokens": ref.tokens if ref else None},
        "peer": ", ".join(f"{k} {v}" for k, v in peer.get("versions", {}).items()) + " (own venv)" if peer else "",
    }
    print(format_table(meta, rows))
    if args.json_out:
        args.json_out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    return 1 if any(r.status == "failed" and r.method != PEER_METHOD for r in rows[1:]) else 0


if __name__ == "__main__":
    sys.exit(main())
