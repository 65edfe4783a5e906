"""Host overhead of one engine step: everything but the forward pass.

    python -m slimserve.eval.bench_host_overhead [--seqs 16 64 256] [--contexts 512 4096 16384]

The engine (runtime/engine/llm_engine.py) runs with its ModelRunner's forward replaced by a constant-time
stub that returns fixed logits, so a step's time is the host work the GPU would wait on:
scheduling, building the batch (token slices, positions, slot mapping, block tables and their
copies), sampling, and the update (scheduler, prefix-cache commit, detokenizing, stop checks).
For each (running sequences x context length) the sequences are first prefilled to the context
(through the stub), then `--steps` decode steps are timed; the table gives the median ms per
step and its split. Sampling is measured on its own rows: half greedy, half top-p 0.9 / top-k 50.

Only the engine's public construction (`LLMEngine(config, runner)`) and the runner interface
(`prepare`, `execute`, `built`, `spec`, `num_blocks`, `max_model_len`) are used, so the same file
measures an older checkout with its packages first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoTokenizer

from slimserve.runtime.batch import prepare_batch
from slimserve.runtime.bench.sysinfo import hardware_info, hardware_line
from slimserve.runtime.config import EngineConfig
from slimserve.runtime.engine import llm_engine as engine_mod
from slimserve.runtime.engine.llm_engine import LLMEngine
from slimserve.runtime.engine.sequence import SamplingParams

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "recipes" / "demo-model"
VOCAB = 49152  # SmolLM2's vocabulary: the sampler's work scales with it


@dataclass
class StubRunner:
    """The ModelRunner interface with a constant-time forward (fixed logits)."""

    built: object
    spec: object
    num_blocks: int
    max_model_len: int
    block_size: int
    logits: torch.Tensor  # [max rows, vocab]
    device: torch.device = torch.device("cpu")
    tensor_parallel_size: int = 1

    def __post_init__(self):
        try:  # the runner's cache of block-table tensors, where this checkout has one
            from slimserve.runtime.batch import BlockTableCache

            self._tables = BlockTableCache()
        except ImportError:
            self._tables = None

    def prepare(self, token_chunks, starts, block_tables, sample, extra_rows=None):
        return prepare_batch(
            token_chunks,
            starts,
            block_tables,
            sample,
            self.block_size,
            self.device,
            self._tables,
            extra_rows=extra_rows,
        )

    def execute(self, batch):
        return self.logits[: batch.logits_indices.shape[0]]


class _Timer:
    """Wraps a function and adds its wall time to a bucket."""

    def __init__(self):
        self.buckets: dict[str, float] = {}

    def wrap(self, name, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.buckets[name] = self.buckets.get(name, 0.0) + time.perf_counter() - t0

        return timed


# Sequences prefilled first keep decoding while the others prefill: room for those tokens.
HEADROOM = 512


def _engine(num_seqs: int, context: int, tokenizer, block_size: int = 16) -> LLMEngine:
    blocks = num_seqs * ((context + HEADROOM) // block_size + 2) + 16
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(num_seqs, VOCAB, generator=gen) * 3
    built = SimpleNamespace(tokenizer=tokenizer, eos_token_ids=[], model=None)
    runner = StubRunner(
        built, SimpleNamespace(vocab_size=VOCAB), blocks, context + HEADROOM, block_size, logits
    )
    config = EngineConfig(
        model=str(DEMO_MODEL),
        device="cpu",
        max_num_seqs=num_seqs,
        max_num_batched_tokens=16384,
        block_size=block_size,
        enable_prefix_caching=True,
    )
    return LLMEngine(config, runner)


def measure(num_seqs: int, context: int, steps: int, tokenizer) -> dict:
    eng = _engine(num_seqs, context, tokenizer)
    rng = torch.Generator().manual_seed(1)
    for i in range(num_seqs):
        prompt = torch.randint(100, 40000, (context - 1,), generator=rng).tolist()
        params = SamplingParams(
            max_tokens=HEADROOM,
            ignore_eos=True,
            seed=i,
            **(
                {"temperature": 0.0}
                if i % 2 == 0
                else {"temperature": 0.8, "top_p": 0.9, "top_k": 50}
            ),
        )
        eng.add_request(f"r{i}", prompt, params)
    while any(not r.seq.output_token_ids for r in eng.requests.values()):
        eng.step()  # prefill (through the stub) until every sequence decodes
    prefill_steps = num_seqs * context // 16384 + 1
    assert prefill_steps + steps < HEADROOM, "more steps than the headroom holds"
    timer = _Timer()
    sched, runner = eng.scheduler, eng.runner
    sched.schedule = timer.wrap("schedule", sched.schedule)
    sched.update = timer.wrap("update", sched.update)
    runner.prepare = timer.wrap("prepare", runner.prepare)
    orig_sample = engine_mod.sample
    engine_mod.sample = timer.wrap("sample", orig_sample)
    try:
        per_step, splits = [], []
        for _ in range(steps):
            timer.buckets.clear()
            t0 = time.perf_counter()
            outs = eng.step()
            per_step.append(time.perf_counter() - t0)
            splits.append(dict(timer.buckets))
            assert len(outs) == num_seqs, len(outs)
    finally:
        engine_mod.sample = orig_sample
    med = statistics.median(per_step)
    split = {
        k: statistics.median(s.get(k, 0.0) for s in splits)
        for k in ("schedule", "prepare", "sample", "update")
    }
    split["other"] = max(0.0, med - sum(split.values()))  # outputs, detokenizing, stop checks
    return {
        "seqs": num_seqs,
        "context": context,
        "step_ms": 1e3 * med,
        **{f"{k}_ms": 1e3 * v for k, v in split.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 16384])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    print(hardware_line(hardware_info()))
    print(
        f"host time per decode step, forward stubbed, vocab {VOCAB}, half greedy / half "
        f"top-p 0.9 top-k 50, median of {args.steps} steps {args.label}"
    )
    head = "| seqs | context | step ms | schedule | prepare | sample | update | other |"
    print(head + "\n|" + "---|" * 8)
    rows = []
    for n in args.seqs:
        for ctx in args.contexts:
            r = measure(n, ctx, args.steps, tok)
            rows.append(r)
            print(
                f"| {n} | {ctx} | {r['step_ms']:.2f} | {r['schedule_ms']:.2f} | "
                f"{r['prepare_ms']:.2f} | {r['sample_ms']:.2f} | {r['update_ms']:.2f} | "
                f"{r['other_ms']:.2f} |",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
