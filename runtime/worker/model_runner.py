"""ModelRunner: owns the model and the paged KV cache on the device, runs one step's batch.

With `tensor_parallel_size` N and/or `pipeline_parallel_size` M above 1 the runner the engine
holds is rank 0 of N x M, made by runtime/worker/launch.py (`make_runner`): it checks that
the model splits that way (before anything loads), starts the other ranks through the executor
(`mp`: runtime/worker/executor.py, `ray`: runtime/worker/ray_executor.py), each of
which builds a runner of its own (`group=` given), and gives rank 0's runner the executor. Rank
0 holds shard 0: its share of the heads and the vocabulary (TP), its stage's layers
(PP), and the KV cache of those. Every rank sizes its KV cache from its own memory, and all take
the smallest block count, so the one block manager's block ids are valid everywhere. `execute`
sends the step's batch to the workers first, then runs rank 0's part (runtime/distributed/
pipeline.py for PP); the logits come back whole on rank 0. With N = M = 1 nothing of this runs:
no process, no collective. `rank_stats()` gives every rank's weight, KV and process memory
and collective time for /metrics (runtime/stats/rank_stats.py).
"""

from __future__ import annotations

import logging
import time

import torch
from torch.distributed import PrefixStore

from slimserve.kernels import cpu_attention, cpu_layer_ops, kv_quant
from slimserve.kernels._launch import kernel_backend
from slimserve.runtime.batch import BatchInputs, BlockTableCache, StagingBuffer, prepare_batch
from slimserve.runtime.config import EngineConfig
from slimserve.runtime.devices import resolve_device
from slimserve.runtime.distributed.group import TPGroup
from slimserve.runtime.distributed.loading import TensorShard
from slimserve.runtime.distributed.pipeline import StageShard, pipeline_step, stage_layers
from slimserve.runtime.dtypes import checkpoint_dtype, resolve_dtype
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.layers import ops
from slimserve.runtime.layers.cpu_linear import pack_linears, warm_up
from slimserve.runtime.models.load import BuiltModel, build_model
from slimserve.runtime.stats.rank_stats import RankStats, model_bytes, process_memory_bytes
from slimserve.runtime.worker.cpu_malloc import keep_freed_memory
from slimserve.runtime.worker.cuda_graphs import DecodeGraphs
from slimserve.runtime.worker.threads import ThreadGovernor

log = logging.getLogger(__name__)


INT_KV_BITS = {"int8": 8, "int4": 4}  # --kv-cache-dtype names of the uint8-row caches


def kv_row_bytes(head_dim: int, dtype: torch.dtype, bits: int = 0) -> int:
    """Bytes of one token's row of one KV head in a cache of `dtype`: head_dim elements, or for
    a uint8 cache of `bits` (8, 4) its codes + fp16 scale and zero (kernels/kv_quant.py)."""
    if dtype == torch.uint8:
        return kv_quant.row_bytes(head_dim, bits)
    return head_dim * dtype.itemsize


def kv_block_bytes(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype | list[torch.dtype],
    bits: int = 0,
) -> int:
    """Bytes of one block across all layers, K and V; `dtype` one for all layers or one per layer;
    `bits` (8, 4) of the layers whose cache is uint8 rows (int8 / int4)."""
    dtypes = dtype if isinstance(dtype, list) else [dtype] * num_layers
    return 2 * block_size * num_kv_heads * sum(kv_row_bytes(head_dim, d, bits) for d in dtypes)


def kv_capacity(
    budget: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    seq_len: int,
    plain: torch.dtype,
) -> list[tuple[str, int, int]]:
    """(cache, blocks, sequences of `seq_len` tokens) that `budget` bytes hold for the
    unquantized cache (`plain`) and fp8, int8, int4 caches, every layer quantized: the start-up
    log's capacity table (docs/results-serving.md)."""
    rows = []
    kinds = [(str(plain).removeprefix("torch."), plain, 0), ("fp8_e4m3", torch.float8_e4m3fn, 0)]
    kinds += [(name, torch.uint8, bits) for name, bits in INT_KV_BITS.items()]
    for name, dtype, bits in kinds:
        if bits == 4 and head_dim % 2:
            continue
        per_block = kv_block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype, bits)
        blocks = budget // per_block
        rows.append((name, blocks, blocks // max(1, -(-seq_len // block_size))))
    return rows


class ModelRunner:
    """Loads the model, sizes and allocates the KV cache, executes batches."""

    def __init__(
        self,
        config: EngineConfig,
        built: BuiltModel | None = None,
        group: TPGroup | None = None,
        executor=None,
    ):
        """group: this rank's communicator (all ranks) when the model is split over several
        (runtime/worker/launch.py makes rank 0's, runtime/worker/rank_process.py the others');
        executor: on rank 0, the executor that runs ranks 1.. (sent each step's batch)."""
        self.config = config
        self.device = resolve_device(config.device)
        self.executor = executor
        self.group = group
        self.steps = 0
        self.tp = tp = config.tensor_parallel_size
        self.pp = config.pipeline_parallel_size
        self.tp_group: TPGroup | None = None  # a stage's own tensor-parallel group (tp and pp > 1)
        if tp * self.pp > 1:
            if built is not None:
                raise ValueError(
                    "tensor/pipeline parallelism builds its own shards; pass no `built` model"
                )
            if group is None:
                raise ValueError(
                    "a tensor/pipeline-parallel runner needs its group; make the "
                    "engine's with runtime/worker/launch.py (make_runner)"
                )
            if self.device.type == "cuda":  # a rank's GPU is its group's (cuda:rank, or Ray's one)
                self.device = group.device
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches on the current device: without this `cuda:1` would run on cuda:0
            torch.cuda.set_device(self.device)
        # a one-rank CPU engine sizes its compute threads to the free cores, step by step
        # (runtime/worker/threads.py); split ranks keep the executor's fixed share
        self.threads: ThreadGovernor | None = None
        if self.device.type == "cpu":
            keep_freed_memory()  # activations stay in the heap between steps (runtime/worker/cpu_malloc.py)
            if group is None:
                self.threads = ThreadGovernor(config.cpu_threads)
        self._setup(config, built)

    def _setup(self, config: EngineConfig, built: BuiltModel | None) -> None:
        clock = _Stopwatch()
        if built is None:
            dtype = resolve_dtype(config.dtype, self.device, checkpoint_dtype(config.model))
            # the manifest and gate: checked once
            driver = self.group is None or self.group.rank == 0
            built = build_model(
                config.model,
                dtype,
                self.device,
                config.trust_remote_code,
                verify=config.verify if driver else "none",
                allow_failed_gate=config.allow_failed_gate or not driver,
                shard=self._shard(),
            )
        self.built = built
        self.model, self.spec, self.dtype = built.model, built.spec, built.dtype
        clock.lap("load")
        self._prepare_weights()
        self.weight_bytes = model_bytes(self.model)  # this rank's, in their run-time form
        clock.lap("weights")
        if self.device.type == "cpu" and warm_up(
            self.model, max(config.max_num_batched_tokens, config.max_num_seqs)
        ):
            clock.lap("linear_warmup")  # oneDNN's GEMM primitives (runtime/layers/cpu_linear.py)
        self.kv_bits = 0  # 8 / 4 for an int8 / int4 cache (`_kv_dtype` sets it)
        self.kv_dtype = self._kv_dtype()
        self.kv_dtypes = self._kv_dtypes()  # per layer: kv_dtype, or unquantized where skipped
        if self.device.type == "cpu" and not self._triton_on():
            self._log_cpu_kernels()
        self.block_size = config.block_size
        self.activation_bytes = self._profile_activations()
        clock.lap("profile")
        self.num_blocks = self._num_blocks()
        self.kv_caches = self._allocate_kv(self.num_blocks)  # this stage's layers
        self.max_model_len = self._max_model_len()
        if hasattr(self.model, "set_max_model_len"):  # Phi-3's LongRoPE factor set
            self.model.set_max_model_len(self.max_model_len)
        clock.lap("kv_cache")
        if self.group is None or self.group.rank == 0:
            log.info("%s", self.capacity_line())
        self._tables = BlockTableCache()  # block tables as tensors, kept across steps
        # a GPU step's inputs in one pinned copy; on CPU the tensors are already where they run
        self._staging = StagingBuffer(self.device) if self.device.type != "cpu" else None
        self.graphs: DecodeGraphs | None = None
        if self._use_cuda_graphs():
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                config.max_num_seqs,
                -(-self.max_model_len // self.block_size),
                self.block_size,
                self.device,
            )
            self.graphs.capture()
            clock.lap("cuda_graphs")
        self.startup = clock.laps  # seconds per start-up part, in order (the start-up log)
        log.info("start-up: %s", startup_line(self.startup, self.activation_bytes))

    def _allocate_kv(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) [num_blocks, block_size, kv_heads, head_dim] of the layer's dtype, or
        uint8 [..., row bytes] for an int8 / int4 layer (codes, then its scale and zero)."""
        out = []
        for dt in self.kv_dtypes:
            width = self.spec.head_dim
            if dt == torch.uint8:
                width = kv_quant.row_bytes(width, self.kv_bits)
            shape = (num_blocks, self.block_size, self.kv_heads, width)
            out.append(
                (
                    torch.zeros(shape, dtype=dt, device=self.device),
                    torch.zeros(shape, dtype=dt, device=self.device),
                )
            )
        return out

    @property
    def kv_cache_name(self) -> str:
        """The cache as --kv-cache-dtype names it (int8, int4, fp8_e4m3) or its torch dtype."""
        if self.kv_bits:
            return f"int{self.kv_bits}"
        if self.kv_dtype == torch.float8_e4m3fn:
            return "fp8_e4m3"
        return str(self.kv_dtype).removeprefix("torch.")

    def capacity_line(self) -> str:
        """This cache's blocks, and what the same bytes would hold in the other cache dtypes
        (sequences of max_model_len tokens each): logged at start-up, printed by `runtime serve`."""
        budget = max(self.kv_budget, self.num_blocks * self._block_bytes())
        rows = kv_capacity(
            budget,
            self.model.spec.num_layers,
            self.block_size,
            self.kv_heads,
            self.spec.head_dim,
            self.max_model_len,
            self._plain_kv_dtype(),
        )
        others = "; ".join(f"{n} {b} blocks, {s} seqs" for n, b, s in rows)
        return (
            f"KV cache: {self.kv_cache_name}, {self.num_blocks} blocks of {self.block_size} "
            f"tokens ({budget / 2**20:.1f} MiB budget); the same memory, every layer in one dtype, at "
            f"{self.max_model_len} tokens a sequence: {others}"
        )

    def profile_batch(self) -> tuple[BatchInputs, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The largest step the scheduler can make and a scratch KV cache just big enough for it:
        max_num_batched_tokens prompt tokens over min(max_num_seqs, tokens) sequences (more when
        a sequence would pass the model's positions), each sampling its last token, so the
        logits are as many rows as a step can have."""
        tokens = self.config.max_num_batched_tokens
        seqs = max(1, min(self.config.max_num_seqs, tokens))
        seqs = max(seqs, -(-tokens // self.spec.max_position_embeddings))
        sizes = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
        tables, used = [], 0
        for n in sizes:
            blocks = max(1, -(-n // self.block_size))
            tables.append(list(range(used, used + blocks)))
            used += blocks
        batch = prepare_batch(
            [[0] * n for n in sizes],
            [0] * seqs,
            tables,
            [True] * seqs,
            self.block_size,
            self.device,
        )
        return batch, self._allocate_kv(used)

    def _profile_activations(self) -> int:
        """CUDA, one process: the bytes one forward of the largest step allocates at its peak
        beyond the weights and its scratch KV cache (activations, logits, kernel workspaces),
        measured by running it; the KV cache is then sized from what is left after them. It also
        compiles the prefill kernels at their largest shapes before any request. 0 elsewhere and
        when --kv-cache-memory fixes the cache."""
        if (
            self.device.type != "cuda"
            or self.group is not None
            or self.config.kv_cache_memory is not None
        ):
            return 0
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        batch, caches = self.profile_batch()
        scratch = torch.cuda.memory_allocated(self.device) - base
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.inference_mode():
            self.model(batch, caches)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base - scratch
        del batch, caches
        torch.cuda.empty_cache()
        return max(0, int(peak))

    def _shard(self):
        """What build_model loads on this rank: a tensor-parallel shard, a pipeline stage (whose
        layers are split over the stage's own tensor-parallel group when tp > 1), or (None) the
        whole model. Ranks are numbered stage * tp + tensor rank."""
        if self.group is None:
            return None
        if self.pp == 1:
            return TensorShard(self.group)
        tensor = None
        if self.tp > 1:
            stage = self.group.rank // self.tp
            self.tp_group = TPGroup(
                self.group.rank % self.tp,
                self.tp,
                self.group.device,
                store=PrefixStore(f"tp-stage{stage}", self.group.store),
            )
            tensor = TensorShard(self.tp_group)
        return StageShard(self.group.rank // self.tp, self.pp, tensor)

    def _prepare_weights(self) -> None:
        """Every quantized layer takes its run-time form now, before the KV cache is sized: the
        W4A16 kernel path repacks once and releases the buffers it replaces (one copy of the
        weights, not two: the repack used to happen on the first request, after the sizing);
        layers no kernel serves here (every one on CPU, and fp32 models) dequantize once.
        On CPU the dense fp32 (and natively supported bf16) Linears are reordered for oneDNN
        (runtime/layers/cpu_linear.py).
        Then the CUDA allocator's cache is emptied, so the sizing sees what the fused q/k/v
        and the repack freed."""
        from slimserve.runtime.layers.quant_linear import QuantLinear

        triton_on = self._triton_on()
        half = self.dtype in (torch.float16, torch.bfloat16)  # what the kernels take
        for m in self.model.modules():
            if not isinstance(m, QuantLinear):
                continue
            if triton_on and half and m._kernel_path() is not None:
                m.prepare_kernel()
            else:
                m.freeze_dense(self.dtype)
        if self.device.type == "cpu":
            pack_linears(self.model, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _use_cuda_graphs(self) -> bool:
        """`cuda_graphs` resolved (runtime/config.py): asked for, or by default on a one-rank
        CUDA runner whose ops are the Triton kernels."""
        asked = self.config.cuda_graphs
        if asked is False or self.device.type != "cuda" or self.group is not None:
            return False
        if not getattr(self.model, "CUDA_GRAPHS", True):  # e.g. attention planned on the host
            return False
        return asked is True or self._triton_on()

    def _triton_on(self) -> bool:
        """Whether the Triton kernels serve this runner (the backend asked for, or `auto` on
        CUDA at fp16/bf16: runtime/layers/ops.py)."""
        return ops.triton_enabled(self.device, self.dtype)

    def _log_cpu_kernels(self) -> None:
        """Say which CPU path serves: the C kernels, or the torch twins and why (a machine
        without a C compiler runs ~1.3x slower, which should not go unnoticed)."""
        if ops.select(self.device) is ops.CPU:
            log.info(
                "CPU kernels: C (decode attention, RMSNorm, RoPE + KV-cache write), KV cache %s",
                self.kv_cache_name,
            )
        elif kernel_backend() == "auto":
            why = "; ".join(
                r
                for r in (cpu_attention.unavailable_reason(), cpu_layer_ops.unavailable_reason())
                if r
            )
            log.warning(
                "CPU C kernels unavailable (%s): the torch twins serve, slower; install a C "
                "compiler (cc/gcc/clang) or set CC",
                why or "not built",
            )

    def _kv_dtype(self) -> torch.dtype:
        """uint8 rows for int8 / int4 (asked, or under `auto` recorded in the artifact's
        manifest; `kv_bits` says which); fp8 when asked, or under `auto` when the artifact was
        calibrated for fp8 KV; else the unquantized cache dtype (`_plain_kv_dtype`)."""
        asked = self.config.kv_cache_dtype
        name = self.built.kv_cache_dtype if asked == "auto" else asked
        if name in INT_KV_BITS:
            bits = INT_KV_BITS[name]
            kv_quant.code_bytes(self.spec.head_dim, bits)  # int4 with an odd head_dim: refused
            self.kv_bits = bits
            return torch.uint8
        if self.config.kv_cache_dtype == "fp8_e4m3" or (
            self.config.kv_cache_dtype == "auto" and self.built.has_kv_scales
        ):
            if self.config.kv_cache_dtype == "fp8_e4m3" and not self.built.has_kv_scales:
                log.warning(
                    "kv_cache_dtype fp8_e4m3 without calibrated scales: using scale 1.0 "
                    "(run the kv_cache stage of `compress` for calibrated scales)"
                )
            return torch.float8_e4m3fn
        return self._plain_kv_dtype()

    def _plain_kv_dtype(self) -> torch.dtype:
        """The cache dtype without fp8: the compute dtype, except fp32 where the CPU's torch twin
        attends (no compiled CPU kernel, or SLIMSERVE_KERNELS=torch)."""
        if self.device.type == "cpu" and not self._triton_on():
            if ops.select(self.device) is ops.CPU and cpu_attention.supports(self.dtype):
                return self.dtype  # the compiled kernel reads bf16 in place: half the bytes of fp32
            # The torch twin reads K/V in fp32: an fp32 cache stores bf16/fp16 K/V exactly and
            # spares every step's upcast of each gathered context (2x the bytes).
            return torch.float32
        return self.dtype

    def _kv_dtypes(self) -> list[torch.dtype]:
        """One cache dtype per layer this runner holds: `kv_dtype`, except that with an fp8, int8
        or int4 cache the layers the artifact keeps unquantized (its manifest's
        kv_cache_skip_layers, or --kv-cache-dtype-skip-layers; indices of the whole model) cache
        K/V unquantized (`_plain_kv_dtype`), with their k/v scales set to 1 (kernels read scales
        only from fp8 caches; the disaggregation layout compares them)."""
        n, total = self.model.spec.num_layers, self.spec.num_layers
        if self.kv_dtype != torch.float8_e4m3fn and not self.kv_bits:
            return [self.kv_dtype] * n
        asked = self.config.kv_cache_skip_layers
        skip = set(self.built.kv_skip_layers if asked is None else asked)
        bad = sorted(i for i in skip if not 0 <= i < total)
        if bad:
            raise ValueError(
                f"kv_cache_skip_layers: {bad} are not layers of this {total}-layer "
                f"model; use 0 to {total - 1}"
            )
        held = (
            stage_layers(total, self.pp)[self.group.rank // self.tp]
            if self.pp > 1
            else range(total)
        )
        local = {i - held.start for i in skip if i in held}
        plain = self._plain_kv_dtype()
        for i in local:
            attn = self.model.model.layers[i].self_attn
            attn.k_scale.fill_(1.0)
            attn.v_scale.fill_(1.0)
        if skip:
            log.info(
                "KV cache: %s except layers %s (%s)",
                self.kv_cache_name,
                ", ".join(map(str, sorted(skip))),
                str(plain).removeprefix("torch."),
            )
        return [plain if i in local else self.kv_dtype for i in range(n)]

    @property
    def kv_heads(self) -> int:
        """KV heads this rank caches (all of them without tensor parallelism)."""
        return self.model.spec.num_kv_heads

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's KV cache (each rank of a tensor-parallel model holds as much)."""
        return self.num_blocks * self._block_bytes()

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.group is None else self.tp

    def _block_bytes(self) -> int:
        """Bytes of one KV block across this runner's layers, K and V."""
        return kv_block_bytes(
            self.model.spec.num_layers,
            self.block_size,
            self.kv_heads,
            self.spec.head_dim,
            self.kv_dtypes,
            self.kv_bits,
        )

    def _num_blocks(self) -> int:
        per_block = self._block_bytes()
        budget = self.config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.memory_fraction) - self.activation_bytes
            else:
                budget = self.config.cpu_kv_cache_memory
        blocks = budget // per_block
        self.kv_budget = budget  # bytes the cache was sized from (the capacity line's)
        if self.group is not None:  # one block manager for all ranks: the smallest count
            blocks = self.group.min_int(blocks)
        if blocks < 2:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes hold {blocks} KV blocks of "
                f"{per_block} bytes; give at least {2 * per_block} bytes"
            )
        return int(blocks)

    def _max_model_len(self) -> int:
        limit = self.spec.max_position_embeddings
        if self.spec.sliding_window:
            limit = min(limit, self.spec.sliding_window)  # no windowed attention: stay inside it
        capacity = self.num_blocks * self.block_size
        asked = self.config.max_model_len
        if asked is not None:
            if asked > capacity:
                raise ValueError(
                    f"max_model_len: {asked} tokens do not fit the KV cache "
                    f"({capacity} tokens); raise --kv-cache-memory or lower it"
                )
            if asked > limit:
                raise ArtifactError(
                    f"max_model_len: {asked} exceeds the model's limit of {limit} "
                    "positions (max_position_embeddings / sliding_window)"
                )
            return asked
        return min(limit, capacity)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def prepare(self, token_chunks, starts, block_tables, sample, extra_rows=None) -> BatchInputs:
        """The step's batch (runtime/batch.py `prepare_batch`; extra_rows: prompt-logprob rows)."""
        return prepare_batch(
            token_chunks,
            starts,
            block_tables,
            sample,
            self.block_size,
            self.device,
            self._tables,
            self._staging,
            extra_rows,
        )

    @torch.inference_mode()
    def execute(self, batch: BatchInputs) -> torch.Tensor:
        """fp32 logits [S, vocab] of the rows to sample: decode-only steps replay a CUDA graph
        when they are on, everything else runs eagerly."""
        self.steps += 1
        if self.threads is not None:
            self.threads.tick()
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        if self.group is None:
            return self.model(batch, self.kv_caches)
        if self.executor is None:  # a worker: its forward takes part in the collectives
            return self._forward(batch)
        self.executor.send(batch)
        try:
            return self._forward(batch)
        except RuntimeError as e:  # a collective failed: a worker died or hung
            raise self.executor.failure(e) from None

    def _forward(self, batch: BatchInputs):
        if self.pp > 1:
            return pipeline_step(
                self.model,
                batch,
                self.kv_caches,
                self.group,
                self.dtype,
                self.spec.vocab_size,
                self.tp,
            )
        return self.model(batch, self.kv_caches)

    def comm_stats(self) -> dict:
        """Steps run and seconds this rank spent in all-reduces and the logits gather."""
        if self.group is None:
            return {"steps": self.steps, "comm_s": 0.0, "comm_calls": 0}
        groups = [g for g in (self.group, self.tp_group) if g is not None]
        return {
            "steps": self.steps,
            "comm_s": sum(g.comm_seconds for g in groups),
            "comm_calls": sum(g.comm_calls for g in groups),
        }

    def rank_stats(self) -> list[RankStats]:
        """Rank 0's row (this process) and every live worker's; one row without parallelism,
        whose collective counters are then None (no collective runs). Cheap: no worker is asked."""
        comm = self.comm_stats() if self.group is not None else None
        rows = [
            RankStats(
                0 if self.group is None else self.group.rank,
                self.weight_bytes,
                self.kv_cache_bytes,
                process_memory_bytes(self.device),
                comm and comm["comm_s"],
                comm and comm["comm_calls"],
            )
        ]
        if self.executor is not None:
            rows += self.executor.worker_stats()
        return rows

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without them); idempotent."""
        if self.executor is not None:
            self.executor.shutdown()


class _Stopwatch:
    """Seconds per named part of the start-up, each from the end of the one before."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._t
        self._t = now


def startup_line(laps: dict[str, float], activation_bytes: int = 0) -> str:
    """'load 2.31 s, weights 0.12 s, ..., total 2.6 s' (+ the profiled activation peak)."""
    parts = [f"{name.replace('_', ' ')} {sec:.2f} s" for name, sec in laps.items()]
    line = ", ".join(parts + [f"total {sum(laps.values()):.1f} s"])
    if activation_bytes:
        line += f"; peak activations {activation_bytes / 2**20:.0f} MiB kept free of the KV cache"
    return line
