"""The `runtime` command: `serve` (the OpenAI-compatible server), `router` (one endpoint in front
of several servers, runtime/router/), `bench` (the serving load generator,
runtime/bench/driver.py), `tune` (the engine-setting search for a goodput SLO, runtime/tune/) and
`generate` (one prompt, a quick look). `serve --config FILE` reads its options from a YAML file
(runtime/serve_config.py), the file `tune` writes.

`serve` runs the continuous-batching engine behind the HTTP API of runtime/server/; with
`--data-parallel-size N` it starts N `serve` child processes on free local ports instead and
the router in front of them, with one internal key (runtime/server/trust.py) for the whole
deployment: --internal-key, or a fresh one, handed to every child through the environment.

The options of `serve` and `router` are defined once, in runtime/serve_options.py (`ServeOptions`,
`RouterOptions`): the commands' parameters, the --config file's keys, the children's command line
and environment and the router's shared options all come from there.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import sys

import typer
from rich.console import Console
from rich.markup import escape

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.serve_options import (
    RouterOptions,
    ServeOptions,
    engine_kwargs,
    file_options,
    replica_argv,
    replica_env,
    router_options,
    serve_argv,
    typer_command,
    typer_param,
)

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Run slimserve artifacts and Hugging Face checkpoints.",
)
console = Console(stderr=True)
# s that open requests get to finish after Ctrl-C before uvicorn cancels them (they are aborted)
GRACEFUL_SHUTDOWN_S = 5
# Seconds an idle keep-alive connection stays open. Clients pool idle connections for 5 s
# (httpx's and so the openai client's default) and uvicorn's default closes them after 5 s too:
# a request sent on a connection just as the server closes it fails with a read error (seen
# once in 400 requests under load). Longer than the clients' expiry, the client closes first.
KEEP_ALIVE_S = 30


def _fail(e: BaseException) -> None:
    """One clear line, exit code 2, as for every user error (docs/architecture.md, "Conventions")."""
    console.print(
        f"[bold red]error:[/] {escape(str(e).splitlines()[0])}", highlight=False, soft_wrap=True
    )
    raise typer.Exit(2)


@app.callback()
def _root() -> None:
    """Run slimserve artifacts and Hugging Face checkpoints."""


@app.command()
def generate(
    model: str = typer.Argument(
        ...,
        help="slimserve artifact or HF checkpoint folder, a .gguf file "
        "(or pkg:<module> shipping one), or a hub id (downloaded "
        "when the network allows)",
    ),
    prompt: str = typer.Option(..., "--prompt", "-p", help="text to continue"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, max=32768),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(-1, "--top-k", help="-1 = off"),
    seed: int = typer.Option(0, help="sampling seed"),
    device: str = typer.Option("auto", help="auto, cpu, cuda"),
    # the options `generate` shares with `serve`: serve's definitions (runtime/serve_options.py)
    trust_remote_code: bool = typer_param("trust_remote_code"),
    verify: str = typer_param("verify"),
    allow_failed_gate: bool = typer_param("allow_failed_gate"),
    tensor_parallel_size: int = typer_param("tensor_parallel_size"),
    pipeline_parallel_size: int = typer_param("pipeline_parallel_size"),
    distributed_executor_backend: str = typer_param("distributed_executor_backend"),
) -> None:
    """Continue a prompt with the serving engine (paged KV cache, our kernels)."""
    from pathlib import Path

    from slimserve.runtime.engine.sequence import SamplingParams
    from slimserve.runtime.errors import ArtifactError, RequestError
    from slimserve.runtime.llm import LLM
    from slimserve.runtime.loading.gguf import resolve_model

    if not prompt:
        _fail(ValueError("--prompt is empty; give some text to continue"))
    try:
        path = resolve_model(model)  # a GGUF checkpoint: its cached HF conversion
        path = path if Path(path).expanduser().is_dir() else _download(model)
        params = SamplingParams(
            max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
        llm = LLM(
            path,
            device=device,
            trust_remote_code=trust_remote_code,
            verify=verify,
            allow_failed_gate=allow_failed_gate,
            kv_cache_memory=256 * 2**20,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
        )
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        llm.engine.runner.shutdown()
    except (ArtifactError, RequestError, ValueError, OSError) as e:
        _fail(e)
    sys.stdout.write(prompt + out.outputs[0].text + "\n")


def _download(model: str) -> str:
    """A hub id's local snapshot (safetensors and configs only)."""
    import re

    if not re.match(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$", model):
        raise ValueError(
            f"no such model folder: {model}; pass an artifact or checkpoint folder "
            "or a Hugging Face model id such as org/name"
        )
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
        )
    except Exception as e:  # offline, gated, missing
        raise ValueError(f"could not download {model}: {str(e).splitlines()[0]}") from None


def _serve_config_defaults(ctx: typer.Context, value: str | None) -> str | None:
    """--config FILE (eager): the file's options become click's default_map, so every option the
    command line does not give comes from the file (runtime/serve_config.py checks it against
    the file options of runtime/serve_options.py)."""
    if value is None or ctx.resilient_parsing:
        return value
    from slimserve.runtime.serve_config import ServeConfigError, load_serve_config

    try:
        ctx.default_map = {**(ctx.default_map or {}), **load_serve_config(value, file_options())}
    except ServeConfigError as e:
        _fail(e)
    return value


# serve's options, their flags, defaults and help: ServeOptions in runtime/serve_options.py
@app.command()
@typer_command(ServeOptions, callbacks={"config": _serve_config_defaults})
def serve(o: ServeOptions) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from slimserve.runtime.errors import ArtifactError

    if o.profile_dir is not None:
        from slimserve.runtime.stats.profiler import prepare_profile_dir

        try:
            o = dataclasses.replace(o, profile_dir=str(prepare_profile_dir(o.profile_dir)))
        except ValueError as e:  # before any model loads
            _fail(e)

    ranks = o.tensor_parallel_size * o.pipeline_parallel_size
    if o.data_parallel_size > 1 and ranks > 1:
        _fail(
            ValueError(
                "--data-parallel-size cannot be combined with --tensor-parallel-size or "
                "--pipeline-parallel-size yet; use one of them"
            )
        )
    from slimserve.runtime.disagg.protocol import ROLES

    if o.role not in ROLES:
        _fail(ValueError(f"--role {o.role!r}: choose one of {', '.join(ROLES)}"))
    if o.role != "colocated" and ranks > 1:
        _fail(
            ValueError(
                f"--role {o.role} cannot be combined with --tensor-parallel-size or "
                "--pipeline-parallel-size yet (KV hand-over is from one rank); drop one"
            )
        )
    if o.role != "colocated" and o.data_parallel_size > 1:
        _fail(
            ValueError(
                f"--role {o.role} with --data-parallel-size {o.data_parallel_size}: use "
                "--prefill-replicas K to make K of the replicas prefill and the rest "
                "decode"
            )
        )
    if o.prefill_replicas and not 0 < o.prefill_replicas < o.data_parallel_size:
        _fail(
            ValueError(
                f"--prefill-replicas {o.prefill_replicas} needs --data-parallel-size of "
                f"at least {o.prefill_replicas + 1} (at least one decode replica)"
            )
        )
    from slimserve.runtime.config import parse_size

    try:
        segments_bytes = parse_size(o.kv_segments_max_bytes)
    except ValueError:
        _fail(
            ValueError(
                f"--kv-segments-max-bytes {o.kv_segments_max_bytes!r}: not a size; use "
                "e.g. 4GiB or 512MiB"
            )
        )
    if segments_bytes is not None and segments_bytes < 1:
        _fail(ValueError("--kv-segments-max-bytes must be at least 1 byte"))
    if o.data_parallel_size > 1:
        _serve_data_parallel(o)
        return

    try:
        config = EngineConfig(**engine_kwargs(o))
    except (ValueError, ArtifactError) as e:  # ArtifactError: a GGUF that cannot be converted
        _fail(e)
    import uvicorn

    from slimserve.runtime.engine.async_engine import AsyncEngine
    from slimserve.runtime.server.app import build_app

    try:
        profiling = {"profile_dir": o.profile_dir} if o.profile_dir is not None else {}
        engine = AsyncEngine.from_config(config, step_watchdog_s=o.step_watchdog, **profiling)
    except (ArtifactError, FileNotFoundError, ValueError) as e:
        _fail(e)
    s = engine.stats()
    console.print(f"start-up: {engine.startup_line()}", highlight=False, soft_wrap=True)
    console.print(
        f"[bold]{escape(engine.model_name)}[/]: KV cache {s.num_blocks} blocks x "
        f"{s.block_size} tokens = {s.capacity_tokens} tokens; max_model_len "
        f"{engine.max_model_len}; "
        f"serving on http://{o.host}:{o.port}/v1",
        highlight=False,
        soft_wrap=True,
    )
    console.print(engine.kv_capacity_line(), highlight=False, soft_wrap=True)
    if ranks > 1:
        kv = [r.kv_cache_bytes / 2**20 for r in engine.rank_stats()]  # each rank's own numbers
        console.print(
            f"{len(kv)} ranks (tensor parallel {o.tensor_parallel_size} x pipeline "
            f"parallel {o.pipeline_parallel_size}): KV cache per rank "
            f"{', '.join(f'{m:.1f}' for m in kv)} MiB, {sum(kv):.1f} MiB in total",
            highlight=False,
            soft_wrap=True,
        )
    if o.role != "colocated":
        try:
            engine.engine.kv_layout  # noqa: B018 - checked now: a split model cannot hand over
        except ValueError as e:
            _fail(e)
        console.print(
            f"role: {o.role} (KV blocks handed over through shared memory on this host)",
            highlight=False,
        )
    if o.role != "colocated" and o.internal_key is None:
        console.print(
            "note: no --internal-key: this replica refuses every KV hand-over (403); "
            "give it and the router the same --internal-key",
            highlight=False,
        )
    api = build_app(
        engine,
        api_key=o.api_key,
        max_queue=o.max_queue,
        body_timeout_s=o.body_timeout,
        stream_timeout_s=o.stream_timeout,
        role=o.role,
        internal_key=o.internal_key,
        require_cache_salt=o.require_cache_salt,
        kv_segments_max=o.kv_segments_max,
        kv_segments_max_bytes=segments_bytes,
    )

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            # Ctrl-C: end open requests with finish_reason "abort" (streams get [DONE]) so that
            # the connections close by themselves instead of being cancelled after the timeout.
            api.state.serving.drain()
            await super().shutdown(sockets)

    uv_config = uvicorn.Config(
        api,
        host=o.host,
        port=o.port,
        limit_concurrency=o.max_connections,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
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


def _run_router(r: RouterOptions) -> None:
    import uvicorn

    from slimserve.runtime.router.app import build_router_app

    try:
        api = build_router_app(
            r.replica,
            policy=r.policy,
            api_key=r.api_key,
            admin_key=r.admin_key,
            poll_interval_s=r.poll_interval,
            body_timeout_s=r.body_timeout,
            stream_timeout_s=r.stream_timeout,
            internal_key=r.internal_key,
        )
    except ValueError as e:  # a bad URL or policy
        _fail(e)
    console.print(
        f"router ({escape(r.policy)}) over {len(r.replica)} replica(s) on "
        f"http://{r.host}:{r.port}/v1",
        highlight=False,
        soft_wrap=True,
    )
    uvicorn.run(
        api,
        host=r.host,
        port=r.port,
        limit_concurrency=r.max_connections,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=KEEP_ALIVE_S,
        log_level="warning",
    )


def _replica_servers(o: ServeOptions, cuda: bool) -> list:
    """The ServerSpecs of the `--data-parallel-size` replicas: `runtime serve` on a free
    127.0.0.1 port each, with the ARGV options of `o` on the command line and the ENV ones
    (the keys) in the environment (runtime/serve_options.py); one GPU each through
    CUDA_VISIBLE_DEVICES, or cores // N threads each on CPU. With --prefill-replicas K the
    first K serve `--role prefill`, the others `--role decode`."""
    import os

    from slimserve.runtime.server.process import ServerSpec, free_port, serve_cmd

    n, prefill = o.data_parallel_size, o.prefill_replicas
    env = {**os.environ, **replica_env(o)}  # not on the command line, where `ps` shows them
    if cuda:
        import torch

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if len(gpus) < n:
            _fail(ValueError(f"--data-parallel-size {n} needs {n} GPUs; {len(gpus)} visible"))
        envs = [{**env, "CUDA_VISIBLE_DEVICES": gpus[i]} for i in range(n)]
    else:
        threads = str(max(1, (os.cpu_count() or 1) // n))
        envs = [{**env, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads} for _ in range(n)]
    shared = replica_argv(o)
    specs = []
    for i in range(n):
        port = free_port()
        own = serve_argv(
            {
                "artifact": o.artifact,
                "host": "127.0.0.1",
                "port": port,
                "device": "cuda" if cuda else "cpu",
            }
        )
        role = serve_argv({"role": ("prefill" if i < prefill else "decode") if prefill else None})
        specs.append(
            ServerSpec(serve_cmd([*own, *shared, *role]), f"http://127.0.0.1:{port}", envs[i])
        )
    return specs


def _serve_data_parallel(o: ServeOptions) -> None:
    """`o.data_parallel_size` `runtime serve` children (`_replica_servers`) and the router on
    o.host:o.port, with serve's values of the options they share (`router_options`); the
    children are stopped when the router exits (Ctrl-C, SIGTERM) and die with this process.
    One internal key for the whole deployment (--internal-key, or a fresh one), given to the
    children through the environment and to the router."""
    from slimserve.runtime.router.policy import POLICIES
    from slimserve.runtime.server.process import BenchError, launched_servers
    from slimserve.runtime.server.trust import new_internal_key

    if o.router_policy not in POLICIES:
        _fail(
            ValueError(f"--router-policy {o.router_policy!r}: choose one of {', '.join(POLICIES)}")
        )
    if o.device.startswith("cuda:"):
        _fail(
            ValueError(
                "--device cuda:N cannot be combined with --data-parallel-size: each "
                "replica gets one GPU of CUDA_VISIBLE_DEVICES; use --device cuda"
            )
        )
    cuda = o.device == "cuda"
    if o.device == "auto":
        import torch

        cuda = torch.cuda.is_available()
    o = dataclasses.replace(o, internal_key=o.internal_key or new_internal_key())
    specs = _replica_servers(o, cuda)
    n, prefill = o.data_parallel_size, o.prefill_replicas
    share = "one GPU" if cuda else f"{specs[0].env['OMP_NUM_THREADS']} threads"
    roles = f" ({prefill} prefill, {n - prefill} decode)" if prefill else ""
    console.print(
        f"starting {n} replicas{roles} ({share} each): {', '.join(s.url for s in specs)}",
        highlight=False,
        soft_wrap=True,
    )
    import signal

    def terminated(signum, frame):  # uvicorn re-raises SIGTERM after its graceful shutdown:
        raise SystemExit(128 + signum)  # exit through the finally that stops the replicas

    signal.signal(signal.SIGTERM, terminated)
    try:
        with launched_servers(specs, REPLICA_START_TIMEOUT_S):
            _run_router(router_options(o, [s.url for s in specs]))
    except BenchError as e:
        _fail(e)


# the router's options (its own, and those it shares with serve): RouterOptions in
# runtime/serve_options.py
@app.command()
@typer_command(RouterOptions)
def router(r: RouterOptions) -> None:
    """One OpenAI-compatible endpoint in front of several `runtime serve` replicas."""
    from slimserve.runtime.router.policy import POLICIES

    if r.policy not in POLICIES:
        _fail(ValueError(f"--policy {r.policy!r}: choose one of {', '.join(POLICIES)}"))
    _run_router(r)


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
