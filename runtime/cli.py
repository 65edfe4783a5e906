"""The `runtime` command: `serve` (the OpenAI-compatible server), `bench` (the serving load
generator, runtime/bench/driver.py) and `generate` (one prompt, a quick look).

`serve` runs the continuous-batching engine behind the HTTP API of runtime/server/.
"""

from __future__ import annotations

import dataclasses
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
) -> None:
    """Continue a prompt with the serving engine (paged KV cache, our kernels)."""
    from pathlib import Path

    from slimserve.runtime.errors import ArtifactError, RequestError
    from slimserve.runtime.gguf import resolve_model
    from slimserve.runtime.llm import LLM
    from slimserve.runtime.sequence import SamplingParams

    if not prompt:
        _fail(ValueError("--prompt is empty; give some text to continue"))
    try:
        path = resolve_model(model)  # a GGUF checkpoint: its cached HF conversion
        path = path if Path(path).expanduser().is_dir() else _download(model)
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed)
        llm = LLM(path, device=device, trust_remote_code=trust_remote_code, verify=verify,
                  allow_failed_gate=allow_failed_gate, kv_cache_memory=256 * 2**20)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
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


@app.command()
def serve(
    artifact: str = typer.Argument(..., help="slimserve artifact or HF checkpoint folder, or a .gguf "
                                             "file (or pkg:<module> shipping one)"),
    host: str = typer.Option("127.0.0.1", help="interface to listen on (0.0.0.0: every one)"),
    port: int = typer.Option(8000, min=0, max=65535),
    max_num_seqs: int = typer.Option(_ENGINE["max_num_seqs"], help="sequences per batch at most"),
    max_num_batched_tokens: int = typer.Option(_ENGINE["max_num_batched_tokens"],
                                               help="tokens (prefill chunks + decodes) per step"),
    max_model_len: Optional[int] = typer.Option(None, help="prompt + output tokens per request "
                                                "(default: the model's)"),
    block_size: int = typer.Option(_ENGINE["block_size"], help="tokens per KV-cache block"),
    kv_cache_dtype: str = typer.Option(_ENGINE["kv_cache_dtype"], help="auto | fp8_e4m3"),
    kv_cache_memory: Optional[str] = typer.Option(
        None, help="KV-cache size, e.g. 2GiB (default: 90% of free GPU memory; 512MiB on CPU)"),
    enable_prefix_caching: bool = typer.Option(
        _ENGINE["enable_prefix_caching"], "--enable-prefix-caching/--no-enable-prefix-caching"),
    api_key: Optional[str] = typer.Option(None, envvar="SLIMSERVE_API_KEY",
                                          help="require 'Authorization: Bearer KEY' on /v1/*"),
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
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from slimserve.runtime.errors import ArtifactError

    try:
        config = EngineConfig(
            model=artifact, served_model_name=served_model_name, device=device, dtype=dtype,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching,
            trust_remote_code=trust_remote_code, verify=verify, allow_failed_gate=allow_failed_gate)
    except (ValueError, ArtifactError) as e:  # ArtifactError: a GGUF that cannot be converted
        _fail(e)
    import uvicorn

    from slimserve.runtime.async_engine import AsyncEngine
    from slimserve.runtime.server.app import build_app

    try:
        engine = AsyncEngine.from_config(config, step_watchdog_s=step_watchdog)
    except (ArtifactError, FileNotFoundError, ValueError) as e:
        _fail(e)
    s = engine.stats()
    console.print(f"[bold]{escape(engine.model_name)}[/]: KV cache {s.num_blocks} blocks x "
                  f"{s.block_size} tokens = {s.capacity_tokens} tokens; max_model_len "
                  f"{engine.max_model_len}; "
                  f"serving on http://{host}:{port}/v1", highlight=False, soft_wrap=True)
    api = build_app(engine, api_key=api_key, max_queue=max_queue, body_timeout_s=body_timeout,
                    stream_timeout_s=stream_timeout)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            # Ctrl-C: end open requests with finish_reason "abort" (streams get [DONE]) so that
            # the connections close by themselves instead of being cancelled after the timeout.
            api.state.serving.drain()
            await super().shutdown(sockets)

    Server(uvicorn.Config(api, host=host, port=port, limit_concurrency=max_connections,
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)).run()


# The load generator lives in runtime/bench/driver.py; its typed keyword signature is the CLI.
from slimserve.runtime.bench.driver import bench_main as _bench_main  # noqa: E402

app.command("bench")(_bench_main)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
