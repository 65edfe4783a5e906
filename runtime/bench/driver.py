"""Serving benchmark: a client-side load generator in the style of `vllm bench serve`.

    runtime bench recipes/demo-model --num-prompts 200 --baseline hf --json-out bench.json
    runtime bench --url http://127.0.0.1:8000 --tokenizer recipes/demo-model --sweep 1,2,4,inf

Without --url it serves MODEL itself (`runtime serve` on a free port, engine flags passed on),
waits for /health and stops it at the end. Requests stream from POST /v1/completions (greedy,
ignore_eos, usage chunk) with prompts of exact drawn token lengths, Poisson arrivals, at most
--max-concurrency in flight (workload, timing fields and scoring: runtime/bench/workload.py).
--baseline hf runs the same requests through transformers `generate` in static batches
afterwards; runtime/bench/report.py prints the one table and writes the JSON and sweep plot.

--router-policy least-latency,round-robin compares routing policies in one run: for each policy
it serves MODEL afresh with `--data-parallel-size N --router-policy P` (N replicas behind the
router, empty prefix caches) and sends the same requests at the same rates; the table has a
column per policy and rate. --long-fraction/--long-factor and --shared-prefix-len/-fraction skew
the workload the way routing is tested (a `PromptMix`, runtime/bench/workload.py).

Before each measured run the server's prefix cache is reset (POST /reset_prefix_cache), so the
same prompts sent by the warm-up or an earlier rate are prefilled again, not found cached.
Around each measured run the server's /metrics is scraped and its engine step histograms
subtracted (runtime/bench/breakdown.py): the step-phase breakdown and batch composition are
printed beside the latency table (for a model split with -tp/-pp, also rank 0's time in
collectives per step, a row of the latency table too). --profile also brackets each measured
run (after the warm-up) with POST /start_profile and /stop_profile and reports the trace files
the server wrote; a served MODEL gets `--profile-dir` (beside --json-out, else a temporary
folder).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated

import httpx
import typer
from tqdm.auto import tqdm

from slimserve.runtime.bench.breakdown import scrape_step_totals, step_breakdown
from slimserve.runtime.bench.peer_vllm import (
    AGREEMENT_PROMPTS,
    DEFAULT_VLLM_PYTHON,
    agreement,
    greedy_texts,
    vllm_server,
    vllm_version,
)
from slimserve.runtime.bench.sse_client import SSEStream, plain_http
from slimserve.runtime.bench.workload import (
    BenchRequest,
    LengthDist,
    PromptMix,
    RequestResult,
    compute_metrics,
    corpus_requests,
    hf_baseline,
    jsonl_requests,
    poisson_arrivals,
)
from slimserve.runtime.loading.gguf import resolve_model
from slimserve.runtime.router.policy import POLICIES
from slimserve.runtime.serve_options import serve_argv
from slimserve.runtime.server.process import BenchError, free_port, launched_server, serve_cmd
from slimserve.runtime.server.protocol import error_message
from slimserve.runtime.server.trust import INTERNAL_KEY_ENV, internal_headers, new_internal_key

WARMUP_TOKENS = 8  # output tokens of each untimed warm-up request
ENGINE_FLAGS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_dtype",
    "kv_cache_memory",
    "device",
    "dtype",
    "verify",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "distributed_executor_backend",
    "data_parallel_size",
    "prefill_replicas",
    "router_policy",
)  # BenchArgs fields passed to `runtime serve` as --flags when set


@dataclass(slots=True)
class BenchArgs:
    url: str | None = None  # base URL of a running server (http://host:port); None: serve `model`
    model: str | None = None  # artifact/checkpoint folder: served, tokenizer, HF baseline model
    tokenizer: str | None = None  # tokenizer for the prompts; None: the model's
    served_model_name: str | None = None  # requests' "model"; None: the server's first /v1/models
    dataset: str = "stdlib"  # "stdlib" (validation split) or a JSONL file with a "prompt" field
    num_prompts: int = 200  # requests per run
    request_rate: float = math.inf  # Poisson arrivals, requests/s; inf: all at t=0
    max_concurrency: int | None = None  # requests in flight at most; None: no limit
    input_len: LengthDist = LengthDist(128, 0.8, 32, 512)  # prompt tokens (JSONL: cut to .high)
    output_len: LengthDist = LengthDist(64, 1.0, 16, 512)  # output tokens asked for
    mix: PromptMix = PromptMix()  # long prompts and a shared prefix (stdlib dataset only)
    seed: int = 0  # seeds lengths, prompt offsets and arrivals
    text_prompts: bool = False  # send prompts as text (a server with another tokenizer)
    slo_ttft_ms: float | None = None  # goodput SLO on time to first token, ms
    slo_tpot_ms: float | None = None  # goodput SLO on time per output token, ms
    json_out: str | None = None  # where to save the JSON result
    sweep: list[float] = field(default_factory=list)  # request rates, one run each (overrides rate)
    plot_out: str | None = None  # sweep PNG; None: beside json_out, else serving_sweep.png
    baseline: str | None = None  # "hf": transformers generate, static batches; "vllm": vllm serve
    vllm_python: str = DEFAULT_VLLM_PYTHON  # --baseline vllm: the python of vLLM-CPU's venv
    vllm_cores: str = "all"  # --baseline vllm: all (every core computes) | default (vLLM's)
    hf_batch_size: int = 8  # rows per static HF batch
    hf_device: str = "cpu"  # device of the HF baseline
    max_num_seqs: int | None = None  # engine flags for the served model; None: serve's default
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str | None = None
    kv_cache_memory: str | None = None
    device: str | None = None
    dtype: str | None = (
        None  # engine flag (compute dtype); the HF baseline runs at what it resolves to
    )
    verify: str | None = None  # engine flag (strict | none), also used by the HF baseline's loader
    tensor_parallel_size: int | None = None  # engine flag: ranks the served model is split over
    pipeline_parallel_size: int | None = None  # engine flag: pipeline stages (x the TP ranks)
    distributed_executor_backend: str | None = None  # engine flag: mp | ray (how ranks start)
    data_parallel_size: int | None = None  # engine flag: replicas behind serve's router
    prefill_replicas: int | None = None  # engine flag: of those, prefill ones (the rest decode)
    router_policies: list[str] = field(default_factory=list)  # compared, one fresh server each
    router_policy: str | None = None  # engine flag of the run in progress (set by run_bench)
    allow_failed_gate: bool = False  # serve MODEL even when its perplexity gate failed
    api_key: str | None = None  # Bearer token for --url servers that require one
    # a --url server's internal key (runtime/server/trust.py), for its admin endpoints (prefix
    # cache reset, profiling); a served MODEL gets a fresh one (run_bench)
    internal_key: str | None = None
    warmup_requests: int = 1  # untimed requests before the runs
    request_timeout_s: float = 600.0  # per HTTP read/connect, s
    server_start_timeout_s: float = 600.0  # s `runtime serve` gets to answer /health
    progress: bool = True  # progress bars on stderr
    profile: bool = False  # torch profiler trace of each measured run (POST /start_profile ...)
    profile_dir: str | None = None  # served MODEL's --profile-dir; None: chosen by run_bench

    @property
    def rates(self) -> list[float]:
        return list(self.sweep) or [self.request_rate]

    def validate(self) -> None:
        if self.url is None and self.model is None:
            raise ValueError("give a MODEL to serve, or --url of a running server")
        if self.tokenizer is None and self.model is None:
            raise ValueError("--url without MODEL needs --tokenizer to build the prompts")
        if self.verify not in (None, "strict", "none"):
            raise ValueError(f"--verify {self.verify!r} is unknown; use strict or none")
        if self.baseline not in (None, "hf", "vllm"):
            raise ValueError(f"--baseline {self.baseline!r} is unknown; use hf or vllm")
        if self.baseline and self.model is None:
            raise ValueError(
                f"--baseline {self.baseline} needs MODEL (the folder the baseline loads)"
            )
        if self.baseline == "vllm" and (self.url is not None or self.router_policies):
            raise ValueError(
                "--baseline vllm serves MODEL itself, then vLLM; drop --url and --router-policy"
            )
        if self.vllm_cores not in ("all", "default"):
            raise ValueError(f"--vllm-cores {self.vllm_cores!r} is unknown; use all or default")
        for name in ("num_prompts", "hf_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(
                f"--max-concurrency {self.max_concurrency} must be >= 1 (omit: no limit)"
            )
        if self.dataset != "stdlib" and not Path(self.dataset).is_file():
            raise ValueError(f"--dataset {self.dataset}: no such file; use stdlib or a JSONL path")
        for rate in self.rates:
            poisson_arrivals(1, rate, 0)  # raises for rates <= 0
        if self.mix.active and self.dataset != "stdlib":
            raise ValueError(
                "--long-fraction and --shared-prefix-len shape the stdlib workload; "
                "a JSONL dataset keeps its own prompts (drop them or use stdlib)"
            )
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if (n := getattr(self, name)) is not None and n < 1:
                raise ValueError(f"--{name.replace('_', '-')} {n} must be >= 1")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError(
                f"--distributed-executor-backend {self.distributed_executor_backend!r} "
                "is unknown; use mp or ray"
            )
        if self.data_parallel_size is not None and self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size {self.data_parallel_size} must be >= 1")
        if self.prefill_replicas and not 0 < self.prefill_replicas < (self.data_parallel_size or 1):
            raise ValueError(
                f"--prefill-replicas {self.prefill_replicas} needs --data-parallel-size "
                f"of at least {self.prefill_replicas + 1} (one decode replica or more)"
            )
        for policy in self.router_policies:
            if policy not in POLICIES:
                raise ValueError(
                    f"--router-policy {policy!r} is unknown; choose from "
                    f"{', '.join(POLICIES)} (comma-separated)"
                )
        if len(set(self.router_policies)) < len(self.router_policies):
            raise ValueError("--router-policy names a policy twice; list each once")
        if self.router_policies and self.url is not None:
            raise ValueError(
                "--router-policy starts its own replicas per policy; give MODEL, not --url"
            )
        if self.router_policies and (self.data_parallel_size or 1) < 2:
            raise ValueError(
                "--router-policy compares routing over replicas; add "
                "--data-parallel-size 2 (or more)"
            )


def build_requests(args: BenchArgs) -> list[BenchRequest]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        resolve_model(args.tokenizer or args.model)
    )  # GGUF: converted once
    if args.dataset == "stdlib":
        return corpus_requests(
            tok, args.num_prompts, args.input_len, args.output_len, args.seed, mix=args.mix
        )
    return jsonl_requests(
        args.dataset, tok, args.num_prompts, args.input_len, args.output_len, args.seed
    )


def serve_command(args: BenchArgs, port: int) -> list[str]:
    """`runtime serve MODEL` on 127.0.0.1:port with the engine flags that are set (spelled as
    serve's option table says, runtime/serve_options.py)."""
    return serve_cmd(
        serve_argv(
            {
                "artifact": str(args.model),
                "host": "127.0.0.1",
                "port": port,
                **{name: getattr(args, name) for name in ENGINE_FLAGS},  # None: left out
                "allow_failed_gate": args.allow_failed_gate,
                "profile_dir": args.profile_dir,
            }
        )
    )


def default_profile_dir(args: BenchArgs) -> str:
    """Where a served MODEL writes --profile traces: `<json-out stem>-profiles/` beside
    --json-out, else a new temporary folder."""
    if args.json_out:
        out = Path(args.json_out)
        return str(out.parent / f"{out.stem}-profiles")
    return tempfile.mkdtemp(prefix="slimserve-profiles-")


def profile_request(url: str, action: str, args: BenchArgs) -> dict:
    """POST /start_profile or /stop_profile (action "start" or "stop"); the JSON answer, or
    BenchError with the server's one-line reason."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    headers.update(internal_headers(args.internal_key))
    try:
        r = httpx.post(
            f"{url}/{action}_profile",
            headers=headers,
            timeout=args.request_timeout_s,
            trust_env=False,
        )
    except httpx.HTTPError as e:
        raise BenchError(
            f"--profile: POST {url}/{action}_profile failed: {type(e).__name__}: {e}"
        ) from None
    if r.status_code != 200:
        raise BenchError(
            f"--profile: POST {url}/{action}_profile answered HTTP {r.status_code}: "
            f"{error_message(r.content)} (--profile needs a slimserve `runtime serve` "
            "started with --profile-dir, and for a --url server its --internal-key)"
        )
    return r.json()


@contextmanager
def server_for(args: BenchArgs) -> Iterator[tuple[str, str | None]]:
    """(base URL, server log path or None): --url as given, else a freshly served MODEL."""
    if args.url is not None:
        yield args.url.rstrip("/"), None
        return
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="slimserve-bench-serve-", suffix=".log")[1])
    env = {**os.environ, **({INTERNAL_KEY_ENV: args.internal_key} if args.internal_key else {})}
    with launched_server(
        serve_command(args, port), f"http://127.0.0.1:{port}", args.server_start_timeout_s, log, env
    ) as url:
        yield url, str(log)


async def send_one(
    client: httpx.AsyncClient,
    model: str | None,
    req: BenchRequest,
    text_prompt: bool,
    start_s: float,
    raw_url: str | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 600.0,
) -> RequestResult:
    """One streamed /v1/completions request, timed per token chunk (perf_counter): through the
    light SSE client (runtime/bench/sse_client.py) when raw_url is given, else through httpx."""
    res = RequestResult(req.prompt_len, req.output_len, start_s)
    payload = {
        "model": model,
        "prompt": req.prompt_text if text_prompt else req.prompt_ids,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks, t0 = 0, time.perf_counter()
    last = t0

    def consume(data: str) -> bool:
        """One `data:` payload; True when the stream is over (done, or an error recorded)."""
        nonlocal chunks, last
        if data == "[DONE]":
            return True
        obj = json.loads(data)
        if obj.get("error"):
            res.error = f"error in stream: {obj['error'].get('message', obj['error'])}"
            return True
        if obj.get("usage"):
            res.output_tokens = int(obj["usage"]["completion_tokens"])
        choice = (obj.get("choices") or [None])[0]
        # a token chunk; an empty one that only carries finish_reason is no token
        if choice is not None and (choice.get("text") or choice.get("finish_reason") is None):
            now = time.perf_counter()
            if chunks == 0:
                res.ttft_s = now - t0
            else:
                res.itl_s.append(now - last)
            last, chunks = now, chunks + 1
        return False

    try:
        if raw_url is not None:
            async with SSEStream(raw_url, "/v1/completions", payload, headers, timeout_s) as stream:
                if stream.status != 200:
                    res.error = f"HTTP {stream.status}: {error_message(await stream.body())}"
                    return res
                async for data in stream.events():
                    if consume(data):
                        break
        else:
            async with client.stream("POST", "/v1/completions", json=payload) as resp:
                if resp.status_code != 200:
                    res.error = f"HTTP {resp.status_code}: {error_message(await resp.aread())}"
                    return res
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and consume(line[5:].strip()):
                        break
    except Exception as e:  # transport errors, bad JSON: the request failed, the run goes on
        res.error = f"{type(e).__name__}: {e}"
        return res
    if res.error:
        return res
    res.latency_s = time.perf_counter() - t0
    if chunks == 0:
        res.error = "the stream ended without a token"
        return res
    res.output_tokens = res.output_tokens or chunks  # no usage chunk: count chunks
    res.success = True
    return res


async def run_requests(
    url: str,
    model: str | None,
    requests: list[BenchRequest],
    arrivals: list[float],
    *,
    max_concurrency: int | None = None,
    text_prompts: bool = False,
    timeout_s: float = 600.0,
    api_key: str | None = None,
    desc: str | None = None,
) -> tuple[list[RequestResult], float]:
    """Send each request at its arrival time (s), at most max_concurrency at once, through one
    client; returns the results in request order and the run's duration in s. desc: progress bar."""
    conc = max_concurrency or len(requests)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    sem = asyncio.Semaphore(conc)
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=desc is None)
    async with httpx.AsyncClient(
        base_url=url,
        headers=headers,
        trust_env=False,
        timeout=httpx.Timeout(timeout_s),
        limits=httpx.Limits(max_connections=conc, max_keepalive_connections=conc),
    ) as client:
        t0 = time.perf_counter()

        raw = url if plain_http(url) else None  # the light client where it applies

        async def one(req: BenchRequest) -> RequestResult:
            async with sem:
                res = await send_one(
                    client,
                    model,
                    req,
                    text_prompts,
                    time.perf_counter() - t0,
                    raw,
                    headers,
                    timeout_s,
                )
            bar.update()
            return res

        tasks = []
        for req, at in zip(requests, arrivals):
            if (delay := t0 + at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


def served_model_name(url: str, args: BenchArgs) -> str | None:
    if args.served_model_name:
        return args.served_model_name
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    try:
        r = httpx.get(url + "/v1/models", headers=headers, timeout=10, trust_env=False)
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return Path(args.model).name if args.model else None


def warm_up(url: str, model: str | None, requests: list[BenchRequest], args: BenchArgs) -> None:
    """A few short untimed requests, one after another (--warmup-requests per replica behind a
    --data-parallel-size router, which spreads sequential requests over idle replicas); a
    failure here stops the benchmark with its message."""
    n = args.warmup_requests * (args.data_parallel_size or 1)
    warm = [replace(r, output_len=min(r.output_len, WARMUP_TOKENS)) for r in (requests * n)[:n]]
    results, _ = asyncio.run(
        run_requests(
            url,
            model,
            warm,
            [0.0] * len(warm),
            max_concurrency=1,
            text_prompts=args.text_prompts,
            api_key=args.api_key,
            timeout_s=args.request_timeout_s,
        )
    )
    if failed := [r for r in results if not r.success]:
        raise BenchError(f"warm-up request failed: {failed[0].error}")


def run_bench(args: BenchArgs) -> dict:
    """Run the workload at every rate (and the HF baseline), print one table, save JSON/PNG."""
    from slimserve.runtime.bench.report import describe_workload, finish_result
    from slimserve.runtime.bench.sysinfo import hardware_info

    args.validate()
    if args.profile and args.url is None and args.profile_dir is None:
        args = replace(args, profile_dir=default_profile_dir(args))
    if args.url is None and args.internal_key is None:  # the servers we start: their admin key
        args = replace(args, internal_key=new_internal_key())
    requests = build_requests(args)
    load_before = os.getloadavg()[0]  # other work on the machine skews every number: recorded
    runs, server_logs, our_texts = [], [], []
    for policy in args.router_policies or [None]:  # a fresh server (and replicas) per policy
        served = replace(args, router_policy=policy)
        with server_for(served) as (url, server_log):
            server_logs.append(server_log)
            model = served_model_name(url, args)
            if args.warmup_requests:
                warm_up(url, model, requests, args)
            for rate in args.rates:
                desc = f"{policy + ', ' if policy else ''}rate {rate:g} req/s"
                runs.append(
                    {
                        "router_policy": policy,
                        **measure_rate(
                            url, model, requests, rate, args, desc if args.progress else None
                        ),
                    }
                )
            if args.baseline == "vllm":
                probe = [r.prompt_ids for r in requests[:AGREEMENT_PROMPTS]]
                our_texts = greedy_texts(url, model, probe)
    peer = vllm_runs(args, requests, model, our_texts) if args.baseline == "vllm" else None
    baseline = (
        hf_baseline(
            requests,
            args.model,
            args.hf_batch_size,
            args.hf_device,
            args.progress,
            verify=args.verify or "strict",
            dtype=baseline_dtype(args),
        )
        if args.baseline == "hf"
        else None
    )
    engine_flags = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    server_log = server_logs[0] if len(server_logs) == 1 else server_logs
    hardware = {**hardware_info(), "load_avg_1m": [load_before, os.getloadavg()[0]]}
    result = {
        "hardware": hardware,
        "served_model": model,
        "server": {"url": args.url, "engine_flags": engine_flags, "log": server_log},
        "workload": describe_workload(args, requests),
        "runs": runs,
        "baseline": baseline,
        "vllm": peer,
        "args": {
            **asdict(args),
            "api_key": "(set)" if args.api_key else None,
            "internal_key": "(set)" if args.internal_key else None,
        },
    }
    return finish_result(result, args)


def vllm_runs(
    args: BenchArgs, requests: list[BenchRequest], model: str | None, our_texts: list
) -> dict:
    """--baseline vllm: `vllm serve` on the same model, the same requests at every rate
    (runtime/bench/peer_vllm.py), and whether its greedy texts are ours."""
    log = Path(tempfile.mkstemp(prefix="slimserve-bench-vllm-", suffix=".log")[1])
    dtype = str(baseline_dtype(args)).removeprefix("torch.")
    longest = max(r.prompt_len + r.output_len for r in requests)
    peer_args = replace(args, profile=False, internal_key=None)
    runs = []
    with vllm_server(
        args.vllm_python,
        str(resolve_model(args.model)),
        args.vllm_cores,
        log,
        args.server_start_timeout_s,
        served_name=model or "model",
        dtype=dtype,
        max_model_len=max(longest + 16, 256),
        max_num_seqs=args.max_num_seqs,
        kv_cache_dtype=args.kv_cache_dtype,
    ) as url:
        if args.warmup_requests:
            warm_up(url, model, requests, peer_args)
        for rate in args.rates:
            desc = f"vLLM, rate {rate:g} req/s" if args.progress else None
            run = measure_rate(url, model, requests, rate, peer_args, desc)
            run.pop("prefix_cache_reset", None)  # its prefix caching is off
            runs.append(run)
        their_texts = greedy_texts(url, model, [r.prompt_ids for r in requests[:AGREEMENT_PROMPTS]])
    return {
        "version": vllm_version(args.vllm_python),
        "cores": args.vllm_cores,
        "dtype": dtype,
        "runs": runs,
        "agreement": agreement(our_texts, their_texts),
        "log": str(log),
    }


def baseline_dtype(args: BenchArgs):
    """The HF baseline's compute dtype: what the engine's --dtype (auto unless given) resolves to
    on the baseline's device, so both sides compute alike (bf16 on a CPU with native bf16)."""
    import torch

    from slimserve.runtime.dtypes import checkpoint_dtype, resolve_dtype

    model = resolve_model(args.model)  # a GGUF file or package: its converted folder
    return resolve_dtype(
        args.dtype or "auto", torch.device(args.hf_device), checkpoint_dtype(model)
    )


def measure_rate(
    url: str,
    model: str | None,
    requests: list[BenchRequest],
    rate: float,
    args: BenchArgs,
    desc: str | None,
) -> dict:
    """One measured run at `rate`: its metrics, step breakdown and (--profile) trace."""
    arrivals = poisson_arrivals(len(requests), rate, args.seed)
    reset = reset_prefix_cache(
        url, args.api_key, args.internal_key
    )  # warm-up's, earlier runs' prompts
    before = scrape_step_totals(url, args.api_key)
    if args.profile:
        profile_request(url, "start", args)
    results, duration = asyncio.run(
        run_requests(
            url,
            model,
            requests,
            arrivals,
            max_concurrency=args.max_concurrency,
            text_prompts=args.text_prompts,
            timeout_s=args.request_timeout_s,
            api_key=args.api_key,
            desc=desc,
        )
    )
    trace = profile_request(url, "stop", args) if args.profile else None
    after = scrape_step_totals(url, args.api_key)
    metrics = compute_metrics(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    return {
        "request_rate": rate,
        "max_concurrency": args.max_concurrency,
        **metrics,
        "prefix_cache_reset": reset,
        "step_breakdown": step_breakdown(before, after),
        "profile_trace": trace
        and (os.path.join(args.profile_dir, trace["path"]) if args.profile_dir else trace["path"]),
        "profile_steps": trace and trace["steps"],
        "requests": [asdict(r) for r in results],
    }


def reset_prefix_cache(url: str, api_key: str | None, internal_key: str | None = None) -> bool:
    """POST /reset_prefix_cache (vLLM's endpoint; a router passes it to every replica) before a
    measured run: every run sends the same prompts, and without it a run after the warm-up or an
    earlier rate finds them cached and measures no prefill. False when the server cannot (an
    older server, another product, a --url server without its --internal-key): the run goes on
    and the report says so."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    headers.update(internal_headers(internal_key))
    try:
        r = httpx.post(f"{url}/reset_prefix_cache", headers=headers, timeout=30, trust_env=False)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def parse_policies(value: str | None) -> list[str]:
    """'least-latency,round-robin' -> the policies (checked by BenchArgs.validate)."""
    return [p.strip() for p in (value or "").split(",") if p.strip()]


def parse_rates(sweep: str | list[float] | None) -> list[float]:
    """'1,2,4,inf' (or a list of numbers) -> request rates."""
    if sweep is None or isinstance(sweep, (list, tuple)):
        return [float(r) for r in sweep or []]
    try:
        return [float(r) for r in sweep.split(",") if r.strip()]
    except ValueError:
        raise ValueError(
            f"--sweep {sweep!r}: give request rates separated by commas, e.g. 1,2,4,inf"
        ) from None


Opt = typer.Option
# The workload's length options, shared with `runtime tune` (runtime/tune/command.py).
InputLenMedian = Annotated[int, Opt(help="prompt tokens: log-normal median")]
InputLenSigma = Annotated[float, Opt(help="prompt tokens: sigma of log(length)")]
OutputLenMedian = Annotated[int, Opt(help="output tokens: log-normal median")]
OutputLenSigma = Annotated[float, Opt(help="output tokens: sigma of log(length)")]


def bench_main(
    model: Annotated[
        str | None,
        typer.Argument(
            help="artifact or checkpoint folder: served (without --url), tokenizer, HF baseline"
        ),
    ] = None,
    url: Annotated[
        str | None, Opt(help="base URL of a running server; default: serve MODEL")
    ] = None,
    tokenizer: Annotated[
        str | None, Opt(help="tokenizer for the prompts (default: MODEL's)")
    ] = None,
    served_model_name: Annotated[
        str | None, Opt(help="requests' model (default: /v1/models)")
    ] = None,
    dataset: Annotated[str, Opt(help='stdlib, or a JSONL file with a "prompt" field')] = "stdlib",
    num_prompts: Annotated[int, Opt(help="requests per run")] = 200,
    request_rate: Annotated[
        float, Opt(help="Poisson arrivals, req/s; inf: all at once")
    ] = math.inf,
    max_concurrency: Annotated[int | None, Opt(help="requests in flight at most")] = None,
    input_len_median: InputLenMedian = 128,
    input_len_sigma: InputLenSigma = 0.8,
    input_len_min: int = 32,
    input_len_max: int = 512,
    output_len_median: OutputLenMedian = 64,
    output_len_sigma: OutputLenSigma = 1.0,
    output_len_min: int = 16,
    output_len_max: int = 512,
    long_fraction: Annotated[
        float, Opt(help="of the prompts, those made --long-factor times their drawn length")
    ] = 0.0,
    long_factor: Annotated[int, Opt(help="length multiple of a long prompt")] = 8,
    shared_prefix_len: Annotated[
        int,
        Opt(help="tokens of a prefix shared by --shared-prefix-fraction of the prompts (0: none)"),
    ] = 0,
    shared_prefix_fraction: Annotated[
        float, Opt(help="of the prompts, those that start with the shared prefix")
    ] = 0.5,
    seed: Annotated[int, Opt(help="seeds lengths, prompt offsets and arrivals")] = 0,
    text_prompts: Annotated[
        bool, Opt(help="send text, not token ids (server with another tokenizer)")
    ] = False,
    slo_ttft_ms: Annotated[float | None, Opt(help="goodput SLO: time to first token, ms")] = None,
    slo_tpot_ms: Annotated[float | None, Opt(help="goodput SLO: time per output token, ms")] = None,
    json_out: Annotated[str | None, Opt(help="save everything as JSON here")] = None,
    sweep: Annotated[
        str | None, Opt(help="request rates, e.g. 1,2,4,inf: a run each + plot")
    ] = None,
    plot_out: Annotated[str | None, Opt(help="sweep PNG (default: beside --json-out)")] = None,
    baseline: Annotated[
        str | None,
        Opt(
            help="hf: transformers generate, static batches | vllm: `vllm serve` (vLLM-CPU in "
            "its own venv) at the same rates, same requests"
        ),
    ] = None,
    vllm_python: Annotated[
        str, Opt("--vllm-python", help="--baseline vllm: the python of vLLM-CPU's venv")
    ] = DEFAULT_VLLM_PYTHON,
    vllm_cores: Annotated[
        str,
        Opt(
            "--vllm-cores",
            help="--baseline vllm: all (its threads bound to every core: equal cores) | "
            "default (vLLM's own: one core kept for its engine loop on small machines)",
        ),
    ] = "all",
    hf_batch_size: Annotated[int, Opt(help="rows per static HF batch")] = 8,
    hf_device: Annotated[str, Opt(help="device of the HF baseline")] = "cpu",
    max_num_seqs: Annotated[int | None, Opt(help="engine flag for the served MODEL")] = None,
    max_num_batched_tokens: Annotated[int | None, Opt(help="engine flag")] = None,
    kv_cache_dtype: Annotated[
        str | None, Opt(help="engine flag: auto | fp8_e4m3 | int8 | int4")
    ] = None,
    kv_cache_memory: Annotated[str | None, Opt(help="engine flag, e.g. 512MiB")] = None,
    device: Annotated[str | None, Opt(help="engine flag: auto | cpu | cuda")] = None,
    dtype: Annotated[
        str | None, Opt(help="engine flag and HF baseline: auto | float16 | bfloat16 | float32")
    ] = None,
    verify: Annotated[
        str | None,
        Opt(
            help="engine flag and HF baseline: strict (default) | "
            "none (skip the slimserve.json check)"
        ),
    ] = None,
    allow_failed_gate: Annotated[
        bool,
        Opt(
            "--allow-failed-gate",
            help="engine flag: serve an artifact whose perplexity gate failed",
        ),
    ] = False,
    tensor_parallel_size: Annotated[
        int | None, Opt("--tensor-parallel-size", "-tp", help="engine flag: ranks")
    ] = None,
    pipeline_parallel_size: Annotated[
        int | None, Opt("--pipeline-parallel-size", "-pp", help="engine flag: pipeline stages")
    ] = None,
    distributed_executor_backend: Annotated[
        str | None,
        Opt(
            "--distributed-executor-backend", help="engine flag: mp | ray (how -tp/-pp ranks start)"
        ),
    ] = None,
    data_parallel_size: Annotated[
        int | None, Opt("--data-parallel-size", help="engine flag: replicas behind serve's router")
    ] = None,
    prefill_replicas: Annotated[
        int | None,
        Opt(
            "--prefill-replicas",
            help="engine flag: of the "
            "--data-parallel-size replicas, this many "
            "prefill and the rest decode",
        ),
    ] = None,
    router_policy: Annotated[
        str | None,
        Opt(
            "--router-policy",
            help="compare routing policies, "
            "e.g. least-latency,round-robin: fresh replicas "
            "per policy (needs --data-parallel-size >= 2)",
        ),
    ] = None,
    api_key: Annotated[str | None, Opt(envvar="SLIMSERVE_API_KEY", help="Bearer key")] = None,
    internal_key: Annotated[
        str | None,
        Opt(
            "--internal-key",
            envvar="SLIMSERVE_INTERNAL_KEY",
            help="a --url server's --internal-key (prefix cache reset, --profile)",
        ),
    ] = None,
    warmup_requests: Annotated[int, Opt(help="untimed requests first")] = 1,
    progress: Annotated[bool, Opt(help="progress bars")] = True,
    profile: Annotated[
        bool,
        Opt(
            "--profile",
            help="torch profiler trace of each measured run "
            "(POST /start_profile, /stop_profile; a --url server needs "
            "--profile-dir)",
        ),
    ] = False,
) -> dict:
    """Load-test a served model (vllm bench serve style); optionally against HF generate."""
    from rich.console import Console
    from rich.markup import escape

    from slimserve.runtime.errors import ArtifactError

    try:
        args = BenchArgs(
            url=url,
            model=model,
            tokenizer=tokenizer,
            served_model_name=served_model_name,
            dataset=dataset,
            num_prompts=num_prompts,
            request_rate=request_rate,
            max_concurrency=max_concurrency,
            seed=seed,
            text_prompts=text_prompts,
            input_len=LengthDist(input_len_median, input_len_sigma, input_len_min, input_len_max),
            output_len=LengthDist(
                output_len_median, output_len_sigma, output_len_min, output_len_max
            ),
            slo_ttft_ms=slo_ttft_ms,
            slo_tpot_ms=slo_tpot_ms,
            json_out=json_out,
            sweep=parse_rates(sweep),
            plot_out=plot_out,
            baseline=baseline,
            vllm_python=vllm_python,
            vllm_cores=vllm_cores,
            hf_batch_size=hf_batch_size,
            hf_device=hf_device,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory=kv_cache_memory,
            device=device,
            dtype=dtype,
            verify=verify,
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            prefill_replicas=prefill_replicas,
            pipeline_parallel_size=pipeline_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
            router_policies=parse_policies(router_policy),
            mix=PromptMix(
                long_fraction,
                long_factor,
                shared_prefix_len,
                shared_prefix_fraction if shared_prefix_len else 0.0,
            ),
            allow_failed_gate=allow_failed_gate,
            api_key=api_key,
            internal_key=internal_key,
            warmup_requests=warmup_requests,
            progress=progress,
            profile=profile,
        )
        return run_bench(args)
    except (
        ValueError,
        BenchError,
        ArtifactError,
        OSError,
    ) as e:  # user errors and a server that would not run
        Console(stderr=True).print(
            f"[bold red]error:[/] {escape(str(e).splitlines()[0])}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(2) from None
