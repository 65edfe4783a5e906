"""What the serving benchmark sends and how it scores the answers (driver: runtime/bench/driver.py).

Workload: `num_prompts` requests whose prompt and output lengths are drawn from clipped
log-normal distributions (long-tailed, like real traffic: most requests short, a few long). Prompts
are windows of exactly the drawn number of tokens, cut at seeded random offsets from the `stdlib`
validation corpus tokenized with the served model's tokenizer (random offsets, so the prefix cache
does not turn the benchmark into a cache test), or the "prompt" field of a JSONL file. Arrivals
are a Poisson process of the given rate (or all at t=0 for an infinite rate). Everything is a
function of the seed: the lengths and arrivals do not depend on the dataset.

A `PromptMix` skews the corpus workload the way routing and prefix caching are tested: a fraction
of the prompts `long_factor` times their drawn length (long prompts that stall whoever shares their
engine), and a fraction that start with one shared prefix of `shared_prefix_len` tokens (a system
prompt a prefix cache can reuse), put before their drawn window. Its draws come from their own
seeded stream, so a workload without a mix is the same as before the mix existed.

Scoring follows `vllm bench serve`: per request TTFT (send -> first token chunk), ITL (gaps
between token chunks), TPOT ((E2E - TTFT) / (output tokens - 1)) and E2E latency; per run the
throughputs, mean/median/P99 of each latency, and goodput (requests/s meeting every given SLO).

The reference run, `hf_baseline`, serves the same requests the way a static-batching server
would: transformers `generate` in fixed batches of the requests in order, left-padded, greedy,
EOS masked so every row runs to its batch's longest requested output; only the tokens each
request asked for count as output, so the padding and the overrun rows are charged to it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAX_ERRORS = 5  # distinct error messages kept per run
PERCENTILES = (("mean", None), ("median", 50.0), ("p99", 99.0))


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A clipped log-normal distribution of lengths, in tokens."""

    median: int  # exp(mu) of the log-normal: half the unclipped draws are shorter, tokens
    sigma: float  # std of log(length); larger = longer tail, 0 = every length is `median`
    low: int  # shorter draws are raised to this, tokens
    high: int  # longer draws are cut to this, tokens

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.median <= self.high:
            raise ValueError(
                f"length distribution min {self.low} <= median {self.median} <= max "
                f"{self.high} must hold with min >= 1; fix the --*-len-* options"
            )
        if not self.sigma >= 0:
            raise ValueError(f"length sigma {self.sigma} must be >= 0 (0 = fixed length)")

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        draws = rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=n)
        return [int(x) for x in np.clip(np.rint(draws), self.low, self.high)]


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of the workload."""

    prompt_ids: list[int]  # prompt token ids (the model's tokenizer), sent as the prompt
    prompt_text: str  # the same prompt as text (sent instead when text prompts are asked for)
    output_len: int  # output tokens asked for (max_tokens with EOS ignored)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True, slots=True)
class PromptMix:
    """Skew of a corpus workload: long prompts and a shared prefix (module doc)."""

    long_fraction: float = 0.0  # of the prompts, those made long_factor times their drawn length
    long_factor: int = 1
    shared_prefix_len: int = 0  # tokens of the shared prefix (0: none)
    shared_prefix_fraction: float = 0.0  # of the prompts, those that start with it

    def __post_init__(self) -> None:
        for name in ("long_fraction", "shared_prefix_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(
                    f"--{name.replace('_', '-')} {getattr(self, name)} must be in [0, 1]"
                )
        if self.long_factor < 1:
            raise ValueError(f"--long-factor {self.long_factor} must be >= 1")
        if self.shared_prefix_len < 0:
            raise ValueError(f"--shared-prefix-len {self.shared_prefix_len} must be >= 0 (0: none)")

    @property
    def active(self) -> bool:
        return (self.long_fraction > 0 and self.long_factor > 1) or (
            self.shared_prefix_len > 0 and self.shared_prefix_fraction > 0
        )


def _rngs(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent streams for the lengths and for the dataset choices (offsets, order)."""
    return np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    # verbose=False: stdlib files are longer than model_max_length, which is fine for slicing
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def corpus_requests(
    tokenizer,
    n: int,
    inputs: LengthDist,
    outputs: LengthDist,
    seed: int,
    texts: list[str] | None = None,
    mix: PromptMix = PromptMix(),
) -> list[BenchRequest]:
    """n requests cut from `texts` (default: the stdlib validation split), exact prompt lengths
    (a long prompt: long_factor times its draw; a shared-prefix one: the prefix, then its draw)."""
    len_rng, pick_rng = _rngs(seed)
    in_lens, out_lens = inputs.sample(n, len_rng), outputs.sample(n, len_rng)
    mix_rng = np.random.default_rng([seed, 3])
    long = mix_rng.random(n) < mix.long_fraction if mix.long_factor > 1 else np.zeros(n, bool)
    shared = (
        mix_rng.random(n) < mix.shared_prefix_fraction
        if mix.shared_prefix_len
        else np.zeros(n, bool)
    )
    in_lens = [k * mix.long_factor if is_long else k for k, is_long in zip(in_lens, long)]
    if texts is None:
        from slimserve.runtime.corpus import read_texts

        texts = read_texts("validation")
    stream = [t for ids in _encode(tokenizer, texts) for t in ids]  # documents back to back
    if len(stream) < max(in_lens + [mix.shared_prefix_len]):
        raise ValueError(
            f"the corpus has {len(stream)} tokens, fewer than the longest drawn "
            f"prompt ({max(in_lens + [mix.shared_prefix_len])}); lower "
            "--input-len-max, --long-factor or --shared-prefix-len"
        )
    start = int(mix_rng.integers(0, len(stream) - mix.shared_prefix_len + 1))
    prefix = stream[start : start + mix.shared_prefix_len]
    reqs = []
    for in_len, out_len, with_prefix in zip(in_lens, out_lens, shared):
        start = int(pick_rng.integers(0, len(stream) - in_len + 1))
        ids = (prefix if with_prefix else []) + stream[start : start + in_len]
        reqs.append(BenchRequest(ids, tokenizer.decode(ids), out_len))
    return reqs


def jsonl_requests(
    path: str | Path, tokenizer, n: int, inputs: LengthDist, outputs: LengthDist, seed: int
) -> list[BenchRequest]:
    """n requests from a JSONL file's "prompt" fields (seeded order, repeated when it has fewer
    lines); a prompt keeps its own length, cut to inputs.high tokens; a line's optional
    "output_len" overrides the drawn output length."""
    len_rng, pick_rng = _rngs(seed)
    out_lens = outputs.sample(n, len_rng)
    rows = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e.msg}); one JSON object per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f'{path}:{i}: needs a non-empty string field "prompt"')
        out_len = row.get("output_len", 1)
        if isinstance(out_len, bool) or not isinstance(out_len, int) or out_len < 1:
            raise ValueError(
                f'{path}:{i}: "output_len" must be a positive integer (output '
                f"tokens), got {out_len!r}"
            )
        rows.append(row)
    if not rows:
        raise ValueError(f'{path}: no prompts; give one JSON object with a "prompt" per line')
    order = pick_rng.permutation(len(rows))
    chosen = [rows[order[i % len(rows)]] for i in range(n)]
    encoded = _encode(tokenizer, [r["prompt"] for r in chosen])
    reqs = []
    for row, ids, out_len in zip(chosen, encoded, out_lens):
        text = row["prompt"] if len(ids) <= inputs.high else tokenizer.decode(ids[: inputs.high])
        reqs.append(BenchRequest(ids[: inputs.high], text, int(row.get("output_len", out_len))))
    return reqs


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times in s from the start: the first at 0, then exponential gaps of mean 1/rate."""
    if not rate > 0:
        raise ValueError(f"request rate {rate} must be > 0 requests/s (inf: all at once)")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng([seed, 2]).exponential(1.0 / rate, size=n)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()][:n]


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request; times in s."""

    prompt_len: int  # prompt tokens sent
    output_len: int  # output tokens asked for
    start_s: float = 0.0  # when it was sent, s after the run started
    success: bool = False  # a complete stream without an error
    ttft_s: float = 0.0  # send -> first token chunk
    latency_s: float = 0.0  # send -> end of the stream (E2E)
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive token chunks
    output_tokens: int = 0  # tokens generated (the usage chunk's completion_tokens)
    error: str = ""  # why it failed

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None with a single output token."""
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def latency_stats(values_s: list[float]) -> dict[str, float] | None:
    """Mean, median and P99 (linear interpolation, as numpy / vLLM) in ms; None when empty."""
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    return {
        name: float(ms.mean() if q is None else np.percentile(ms, q)) for name, q in PERCENTILES
    }


def length_stats(values: list[int]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "min": int(a.min()),
        "max": int(a.max()),
        "total": int(a.sum()),
    }


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if slo_ttft_ms is not None and r.ttft_s * 1e3 > slo_ttft_ms:
        return False
    tpot = r.tpot_s
    return slo_tpot_ms is None or tpot is None or tpot * 1e3 <= slo_tpot_ms


def compute_metrics(
    results: list[RequestResult],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict:
    """Run totals and latency statistics over the successful requests (failed ones are counted
    and their first distinct messages kept). Goodput is None unless an SLO is given."""
    ok = [r for r in results if r.success]
    errors: list[str] = []
    for r in results:
        if not r.success and r.error not in errors and len(errors) < MAX_ERRORS:
            errors.append(r.error)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in ok) if slo else None
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        # finished with another token count than asked for (ignore_eos not honoured?)
        "wrong_length": sum(r.output_tokens != r.output_len for r in ok),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,  # requests/s
        "output_throughput": total_out / dur,  # output tokens/s
        "total_token_throughput": (total_in + total_out) / dur,  # prompt + output tokens/s
        "ttft_ms": latency_stats([r.ttft_s for r in ok]),
        "tpot_ms": latency_stats([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": latency_stats([g for r in ok for g in r.itl_s]),
        "e2e_ms": latency_stats([r.latency_s for r in ok]),
        "slo_met": good,  # requests meeting every given SLO
        "goodput": None if good is None else good / dur,  # requests/s meeting every given SLO
    }


def hf_baseline(
    requests: list[BenchRequest],
    model_path: str,
    batch_size: int,
    device: str,
    progress: bool = True,
    verify: str = "strict",
    dtype=None,
) -> dict:
    """transformers `generate` over static batches in request order, every row to the batch's
    longest requested output, computing in `dtype` (fp32 when None); only the requested tokens
    count as output."""
    import torch
    from tqdm.auto import tqdm

    from slimserve.runtime.loading.loader import load_model

    dtype = dtype or torch.float32
    loaded = load_model(model_path, dtype=dtype, device=device, verify=verify)
    model, cfg = loaded.model, loaded.model.config
    pad = next((t for t in (cfg.pad_token_id, cfg.eos_token_id, 0) if isinstance(t, int)), 0)

    def generate(batch: list[BenchRequest], new: int) -> int:
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):  # left padding: every row's last prompt token aligned
            ids[i, width - r.prompt_len :] = torch.tensor(r.prompt_ids)
            mask[i, width - r.prompt_len :] = 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            min_new_tokens=new,  # min = max: EOS masked out
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
        )
        return out.shape[1] - width

    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    ends: list[float] = []  # per request: its batch's finish time, s after the start
    useful = generated = 0
    with torch.inference_mode():
        generate(requests[:1], 2)  # untimed warm-up
        t0 = time.perf_counter()
        for batch in tqdm(batches, desc="HF generate", unit="batch", disable=not progress):
            new = generate(batch, max(r.output_len for r in batch))
            generated += new * len(batch)
            useful += sum(min(r.output_len, new) for r in batch)
            ends += [time.perf_counter() - t0] * len(batch)
        duration = time.perf_counter() - t0
    total_in = sum(r.prompt_len for r in requests)
    return {
        "batch_size": batch_size,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "completed": len(requests),
        "failed": 0,
        "duration_s": duration,
        "total_output_tokens": useful,
        "generated_tokens": generated,  # including rows run past their request (waste)
        "padding_waste": 1 - useful / max(generated, 1),
        "request_throughput": len(requests) / duration,
        "output_throughput": useful / duration,
        "total_token_throughput": (total_in + useful) / duration,
        "e2e_ms": latency_stats(ends),
    }  # all requests arriving at t=0
