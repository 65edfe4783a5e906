"""ModelRunner: owns the model and the paged KV cache on the device, runs one step's batch."""

from __future__ import annotations

import logging

import torch

from slimserve.runtime.batch import BatchInputs, BlockTableCache, prepare_batch
from slimserve.runtime.config import EngineConfig
from slimserve.runtime.cuda_graphs import DecodeGraphs
from slimserve.runtime.devices import resolve_device
from slimserve.runtime.dtypes import checkpoint_dtype, resolve_dtype
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.models.load import BuiltModel, build_model

log = logging.getLogger(__name__)


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


class ModelRunner:
    """Loads the model, sizes and allocates the KV cache, executes batches."""

    def __init__(self, config: EngineConfig, built: BuiltModel | None = None):
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches on the current device: without this `cuda:1` would run on cuda:0
            torch.cuda.set_device(self.device)
        if built is None:
            dtype = resolve_dtype(config.dtype, self.device, checkpoint_dtype(config.model))
            built = build_model(config.model, dtype, self.device, config.trust_remote_code,
                                verify=config.verify, allow_failed_gate=config.allow_failed_gate)
        self.built = built
        self.model, self.spec, self.dtype = built.model, built.spec, built.dtype
        self._prepare_weights()
        self.kv_dtype = self._kv_dtype()
        self.block_size = config.block_size
        self.num_blocks = self._num_blocks()
        shape = (self.num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                           torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
                          for _ in range(self.spec.num_layers)]
        self.max_model_len = self._max_model_len()
        self._tables = BlockTableCache()  # block tables as tensors, kept across steps
        self.graphs: DecodeGraphs | None = None
        if config.cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(self.model, self.kv_caches, config.max_num_seqs,
                                       -(-self.max_model_len // self.block_size), self.block_size,
                                       self.device)
            self.graphs.capture()

    def _prepare_weights(self) -> None:
        """Every quantized layer takes its run-time form now, before the KV cache is sized: the
        W4A16 kernel path repacks once and releases the buffers it replaces (one copy of the
        weights, not two: the repack used to happen on the first request, after the sizing);
        layers no kernel serves here (every one on CPU, and fp32 models) dequantize once.
        Then the CUDA allocator's cache is emptied, so the sizing sees what the fused q/k/v
        and the repack freed."""
        from slimserve.kernels._launch import kernel_backend
        from slimserve.runtime.layers.quant_linear import QuantLinear

        triton_on = kernel_backend() == "triton" or (kernel_backend() == "auto" and self.device.type == "cuda")
        half = self.dtype in (torch.float16, torch.bfloat16)  # what the kernels take
        for m in self.model.modules():
            if not isinstance(m, QuantLinear):
                continue
            if triton_on and half and m._kernel_path() is not None:
                m.prepare_kernel()
            else:
                m.freeze_dense(self.dtype)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _kv_dtype(self) -> torch.dtype:
        """fp8 when asked, or under `auto` when the artifact was calibrated for fp8 KV."""
        if self.config.kv_cache_dtype == "fp8_e4m3" or (self.config.kv_cache_dtype == "auto"
                                                        and self.built.has_kv_scales):
            if self.config.kv_cache_dtype == "fp8_e4m3" and not self.built.has_kv_scales:
                log.warning("kv_cache_dtype fp8_e4m3 without calibrated scales: using scale 1.0 "
                            "(run the kv_cache stage of `compress` for calibrated scales)")
            return torch.float8_e4m3fn
        return self.dtype

    def _num_blocks(self) -> int:
        per_block = kv_block_bytes(self.spec.num_layers, self.block_size, self.spec.num_kv_heads,
                                   self.spec.head_dim, self.kv_dtype)
        budget = self.config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.memory_fraction)
            else:
                budget = self.config.cpu_kv_cache_memory
        blocks = budget // per_block
        if blocks < 2:
            raise ValueError(f"kv_cache_memory: {budget} bytes hold {blocks} KV blocks of "
                             f"{per_block} bytes; give at least {2 * per_block} bytes")
        return int(blocks)

    def _max_model_len(self) -> int:
        limit = self.spec.max_position_embeddings
        if self.spec.sliding_window:
            limit = min(limit, self.spec.sliding_window)  # no windowed attention: stay inside it
        capacity = self.num_blocks * self.block_size
        asked = self.config.max_model_len
        if asked is not None:
            if asked > capacity:
                raise ValueError(f"max_model_len: {asked} tokens do not fit the KV cache "
                                 f"({capacity} tokens); raise --kv-cache-memory or lower it")
            if asked > limit:
                raise ArtifactError(f"max_model_len: {asked} exceeds the model's limit of {limit} "
                                    "positions (max_position_embeddings / sliding_window)")
            return asked
        return min(limit, capacity)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def prepare(self, token_chunks, starts, block_tables, sample) -> BatchInputs:
        return prepare_batch(token_chunks, starts, block_tables, sample, self.block_size,
                             self.device, self._tables)

    @torch.inference_mode()
    def execute(self, batch: BatchInputs) -> torch.Tensor:
        """fp32 logits [S, vocab] of the rows to sample: decode-only steps replay a CUDA graph
        when they are on, everything else runs eagerly."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self.model(batch, self.kv_caches)
