"""Does transformers load an artifact and measure the perplexity our report claims?

    python -m slimserve.eval.interop_check ARTIFACT [ARTIFACT ...] [--tolerance 1e-3] [--json-out FILE]

For each artifact folder written by `compress run`, this loads it with transformers
(`AutoModelForCausalLM.from_pretrained`, compressed-tensors decompressing the weights, float32
compute so the comparison is not about fp16 rounding), scores the evaluation split the artifact's
report names (same dataset, sequence length and windows, through compress/perplexity.py) and
compares it with the perplexity the recipe's gate used.

Which of our numbers transformers should reproduce: the perplexity after the last stage whose
effect the checkpoint carries into transformers. A `kv_cache` stage only adds FP8 K/V scales,
which transformers does not apply when it runs the model (it keeps its KV cache in the compute
dtype), so for a `... + kv_cache` recipe the reference is the perplexity after the stage before it;
the table says which stage it used.

Exit code 0 when every artifact is within `--tolerance` (relative), 1 when one is not, 2 when an
artifact cannot be read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from slimserve.compress.datasets import load_token_documents
from slimserve.compress.perplexity import evaluate_perplexity
from slimserve.runtime.bench.sysinfo import hardware_info, hardware_line

# Stages whose effect lives outside the weights transformers runs (see the module docstring).
NOT_IN_TRANSFORMERS = frozenset({"kv_cache"})
TOLERANCE = 1e-3


class InteropError(Exception):
    """An artifact folder this check cannot read (one line for the user)."""


@dataclass(frozen=True, slots=True)
class Check:
    artifact: str
    reference_stage: str  # the stage whose perplexity transformers should reproduce
    ours: float  # our pipeline's perplexity after that stage
    transformers: float  # transformers' perplexity on the same windows
    windows: int
    seq_len: int
    dataset: str

    @property
    def rel_diff(self) -> float:
        return abs(self.transformers - self.ours) / self.ours

    def ok(self, tolerance: float = TOLERANCE) -> bool:
        return math.isfinite(self.transformers) and self.rel_diff <= tolerance


def reference_ppl(report: dict) -> tuple[str, float]:
    """(stage name, perplexity) our report says transformers should reproduce."""
    stages = report.get("stages") or []
    for stage in reversed(stages):
        if stage.get("name") not in NOT_IN_TRANSFORMERS:
            return stage["name"], float(stage["ppl"])
    return "baseline", float(report["baseline"]["ppl"])


def read_report(artifact: Path) -> dict:
    path = artifact / "report.json"
    if not path.is_file():
        raise InteropError(f"{artifact}: no report.json; pass a folder written by `compress run`")
    try:
        report = json.loads(path.read_text())
        windows = report["tokens"] // (report["seq_len"] - 1)
        report["windows"] = windows
        return report
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        raise InteropError(f"{path}: not a compress run report ({e}); re-run the recipe") from None


def check_artifact(artifact: Path, base_dir: Path | None = None, progress: bool = True) -> Check:
    """Load `artifact` in transformers and score its report's evaluation windows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = read_report(artifact)
    stage, ours = reference_ppl(report)
    tok = AutoTokenizer.from_pretrained(artifact)
    model = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32).eval()
    ids = load_token_documents(report["dataset"], tok, base_dir)
    with torch.no_grad():
        res = evaluate_perplexity(
            model,
            ids,
            report["seq_len"],
            report["windows"],
            progress=progress,
            dataset=report["dataset"],
        )
    if res.windows != report["windows"]:
        raise InteropError(
            f"{artifact}: the report scored {report['windows']} windows of {report['dataset']!r} "
            f"but only {res.windows} exist now; the corpus changed"
        )
    return Check(str(artifact), stage, ours, res.ppl, res.windows, res.seq_len, report["dataset"])


def format_table(checks: list[Check], tolerance: float) -> str:
    lines = [
        hardware_line(hardware_info()),
        "transformers loads each artifact (float32 compute) and scores the "
        "windows its report scored",
        "",
        "| artifact | reference stage | ours | transformers | rel. diff | within |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        lines.append(
            f"| {Path(c.artifact).name} | {c.reference_stage} | {c.ours:.4f} | {c.transformers:.4f} | "
            f"{c.rel_diff:.1e} | {'yes' if c.ok(tolerance) else 'NO'} ({tolerance:g}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "artifacts", nargs="+", type=Path, help="artifact folders written by `compress run`"
    )
    p.add_argument(
        "--tolerance", type=float, default=TOLERANCE, help="largest relative perplexity difference"
    )
    p.add_argument("--json-out", type=Path, help="also write the results as JSON")
    args = p.parse_args(argv)
    checks = []
    try:
        for artifact in args.artifacts:
            checks.append(check_artifact(artifact))
    except (InteropError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(checks, args.tolerance))
    if args.json_out:
        args.json_out.write_text(
            json.dumps([asdict(c) | {"rel_diff": c.rel_diff} for c in checks], indent=2)
        )
    return 0 if all(c.ok(args.tolerance) for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
