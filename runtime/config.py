"""Engine configuration: one dataclass that the CLI, the offline `LLM` API and the server fill."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from slimserve.runtime.artifact.manifest import VERIFY_MODES
from slimserve.runtime.loading.gguf import gguf_file, resolve_model

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8", "int4")
# Server limits (the defaults of `runtime serve`'s flags; docs/serving.md, "Reliability").
DEFAULT_STEP_WATCHDOG_S = 300.0  # an engine step longer than this makes /health answer 503
DEFAULT_STREAM_TIMEOUT_S = 60.0  # a stream whose client reads nothing this long is aborted
DEFAULT_BODY_TIMEOUT_S = 30.0  # a request body must arrive within this, else 408
DEFAULT_MAX_CONNECTIONS = 1024  # open connections at most; uvicorn answers 503 beyond

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str | int | float | None) -> int | None:
    """Bytes from '2GiB', '512M', '1.5G' or a plain number; None stays None."""
    if text is None or isinstance(text, (int, float)):
        return None if text is None else int(text)
    m = _SIZE.match(text)
    if not m:
        raise ValueError(
            f"kv_cache_memory: cannot read {text!r} as a size; use e.g. 2GiB or 512MiB"
        )
    unit = (m.group(2) or "").upper()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


def parse_cpu_threads(value: int | str | None) -> int | str:
    """EngineConfig.cpu_threads: "auto" or a positive count (an int, or its text)."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if not text.isdigit():
            raise ValueError(f"cpu_threads: {value!r} is neither auto nor a count; use e.g. 2")
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"cpu_threads: must be auto or a count >= 1, got {value!r}")
    return value


def parse_layers(value: list[int] | str | None) -> list[int] | None:
    """Layer indices from "1,16" (or a list of ints); "" / "none" is no layer; None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "none"):
            return []
        try:
            value = [int(t) for t in text.replace(" ", ",").split(",") if t]
        except ValueError:
            raise ValueError(
                f"kv_cache_skip_layers: cannot read {value!r} as layer indices; use e.g. "
                "1,16 (or none)"
            ) from None
    bad = [i for i in value if not isinstance(i, int) or isinstance(i, bool) or i < 0]
    if bad:
        raise ValueError(
            f"kv_cache_skip_layers: {bad} are not layer indices; use integers >= 0, e.g. 1,16"
        )
    return sorted(set(value))


@dataclass
class EngineConfig:
    """Everything the engine needs to start; validated in __post_init__ with one-line messages."""

    model: str  # artifact or HF checkpoint folder, or a GGUF checkpoint (its cached conversion, runtime/loading/gguf.py)
    served_model_name: str | None = None  # name in /v1/models; default: the folder's name
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:1"
    dtype: str = "auto"  # auto (config's on CUDA; CPU: bf16 if native, else fp32), float16, bfloat16, float32
    max_num_seqs: int = 256  # sequences in one batch at most (vLLM's default)
    max_num_batched_tokens: int = 2048  # tokens (prefill chunks + decodes) in one step at most
    max_model_len: int | None = None  # prompt + output tokens per request; default: config's
    block_size: int = 16  # tokens per KV-cache block
    # "auto" (the artifact's: fp8 when calibrated, int8/int4 when its manifest records one; else
    # the compute dtype), "fp8_e4m3" (scaled), "int8" or "int4" (per token and KV head, asymmetric,
    # no calibration: kernels/kv_quant.py)
    kv_cache_dtype: str = "auto"
    # with an fp8, int8 or int4 cache, decoder layers whose KV stays unquantized (vLLM's
    # --kv-cache-dtype-skip-layers); None: the artifact's (slimserve.json kv_cache_skip_layers);
    # a string is read as "1,16" ("" or "none": no layer)
    kv_cache_skip_layers: list[int] | str | None = None
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: fraction of free memory
    memory_fraction: float = 0.9  # of free device memory (after weights) for the KV cache on CUDA
    cpu_kv_cache_memory: int = 512 * 2**20  # default KV budget on CPU, bytes
    enable_prefix_caching: bool = True
    # CUDA graphs for decode-only steps (runtime/worker/cuda_graphs.py). None (the default): on
    # for a one-rank CUDA engine on the kernel path (fp16/bf16), where an H200 decoded 2.2x
    # faster at batch 1 with them and their tokens matched eager steps (docs/gpu.md); off on the
    # CPU, for fp32 on CUDA (the torch twins synchronize with the host) and with tensor/pipeline
    # parallelism. True (`--cuda-graphs`) insists, False (`--enforce-eager`) never.
    cuda_graphs: bool | None = None
    seed: int = 0  # default RNG seed for requests without one
    trust_remote_code: bool = False  # never on unless asked
    verify: str = (
        "strict"  # strict: a slimserve artifact needs a matching slimserve.json; none: skip
    )
    allow_failed_gate: bool = (
        False  # load an artifact whose slimserve.json says its ppl gate failed
    )
    # ranks one model is split over (runtime/distributed/): processes of the `mp` executor, one
    # GPU each on CUDA (cuda:0..N-1), an equal share of the cores each on CPU
    tensor_parallel_size: int = 1
    # pipeline stages (contiguous layer ranges, runtime/distributed/pipeline.py); one process each
    pipeline_parallel_size: int = 1
    # how the other ranks start: "mp" (processes on this machine) or "ray" (Ray actors, one per GPU,
    # on the nodes of a Ray cluster; runtime/worker/ray_executor.py)
    distributed_executor_backend: str = "mp"
    # CPU compute threads of a one-rank engine (runtime/worker/threads.py): "auto" (the usable
    # cores, fewer while other processes keep cores busy) or a fixed count
    cpu_threads: int | str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify: {self.verify!r} is not one of {', '.join(VERIFY_MODES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        self.kv_cache_skip_layers = parse_layers(self.kv_cache_skip_layers)
        self.cpu_threads = parse_cpu_threads(self.cpu_threads)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be >= 1, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend: {self.distributed_executor_backend!r} is "
                "not one of mp, ray"
            )
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size: must be >= 1, got {self.pipeline_parallel_size}"
            )
        if (
            self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1
        ) and self.cuda_graphs is True:
            raise ValueError(
                "cuda_graphs: not supported with tensor or pipeline parallelism yet; "
                "drop --cuda-graphs"
            )
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction: must be in (0, 1], got {self.memory_fraction}")
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        gguf = gguf_file(self.model)  # a .gguf file, a folder holding one, pkg:<module>
        name = gguf.stem if gguf is not None else Path(self.model).resolve().name
        self.model = resolve_model(
            self.model
        )  # last: converting a GGUF the first time takes a while
        if not Path(self.model).is_dir():
            raise ValueError(
                f"model: {self.model!r} is not a folder; pass an artifact made by "
                "`compress run`, a Hugging Face checkpoint folder or a .gguf file"
            )
        if self.served_model_name is None:
            self.served_model_name = name
