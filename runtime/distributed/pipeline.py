"""Pipeline parallelism: contiguous layer ranges per stage, activations sent point to point.

Stage s of M (rank s of the `mp` executor, runtime/worker/executor.py) holds decoder layers
`stage_layers(L, M)[s]` and their KV cache; stage 0 also holds the embedding, the last stage the
final norm and lm_head. Rank 0 (the engine's runner) is stage 0. A step's batch (which every
rank receives by the executor's broadcast) is cut by sequences into micro-batches
(`split_batch`); stage 0 runs them one after another and sends each one's hidden state and
residual to stage 1 as soon as it is done, so stage 1 works on micro-batch 0 while stage 0
computes micro-batch 1: two micro-batches in flight. The last stage sends the logits of each
micro-batch's sampled rows back to rank 0, which concatenates them in order.

`StageShard` is what `build_model` (runtime/models/load.py) asks of a stage: its shapes (fewer
layers, each with the sliding window of its index in the whole model: Gemma's alternate), only
its tensors (read with `safe_open`, layer indices renamed to local ones), and no
embedding / norm / lm_head where the stage does not own them.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from slimserve.runtime.artifact.weights import weight_files
from slimserve.runtime.batch import BatchInputs
from slimserve.runtime.distributed.group import TPGroup
from slimserve.runtime.models.llama import ModelSpec

MICRO_BATCHES = 2


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """Contiguous layer ranges, the first `num_layers % stages` stages one layer longer."""
    if stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size: {stages} stages for {num_layers} layers; "
            f"use at most {num_layers}"
        )
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


class StageShard:
    """Stage `stage` of `stages`; with `tensor` (a `TensorShard` of the stage's TP group,
    runtime/distributed/loading.py) each of the stage's layers is split over that group too."""

    def __init__(self, stage: int, stages: int, tensor=None):
        self.rank, self.world, self.tensor = stage, stages, tensor
        self.first, self.last = stage == 0, stage == stages - 1
        if tensor is not None:
            tensor.rename = self._local_name

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        self.spec = spec
        self.layers = stage_layers(spec.num_layers, self.world)[self.rank]
        held = slice(self.layers.start, self.layers.stop)
        local = dataclasses.replace(spec, num_layers=len(self.layers))
        if spec.moe is not None:  # which of this stage's layers are MoE blocks
            sparse = spec.moe.sparse_layers[held]
            local = dataclasses.replace(
                local, moe=dataclasses.replace(spec.moe, sparse_layers=sparse)
            )
        if spec.layer_windows:  # each layer keeps the window (and RoPE) of its global index
            local = dataclasses.replace(local, layer_windows=spec.layer_windows[held])
        return local if self.tensor is None else self.tensor.local_spec(local)

    def _local_name(self, name: str) -> str | None:
        if name.startswith("model.layers."):
            idx, _, rest = name[len("model.layers.") :].partition(".")
            i = int(idx)
            return f"model.layers.{i - self.layers.start}.{rest}" if i in self.layers else None
        if name.startswith("model.embed_tokens."):
            if self.first:
                return name
            if (
                self.last and self.spec.tie_word_embeddings
            ):  # the last stage's lm_head is the tied embedding
                return "lm_head." + name[len("model.embed_tokens.") :]
            return None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.last else None
        return name

    def read(self, path: Path, model: nn.Module) -> dict[str, torch.Tensor]:
        if not self.first:
            model.model.embed_tokens = None
        if not self.last:
            model.model.norm = None
            model.lm_head = None
        if self.tensor is not None:
            return self.tensor.read(path, model)
        tensors = {}
        for f in weight_files(path):
            with safe_open(str(path / f), framework="pt", device="cpu") as h:
                for name in h.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    local = self._local_name(name)
                    if local is not None:
                        tensors[local] = h.get_tensor(name)
        return tensors

    def after_replace(self, model: nn.Module) -> None:
        if self.tensor is not None:
            self.tensor.after_replace(model)

    def parallelize(self, model: nn.Module) -> None:
        if self.tensor is not None:
            self.tensor.parallelize(model)


def split_batch(batch: BatchInputs, parts: int = MICRO_BATCHES) -> list[BatchInputs]:
    """The batch cut by sequences into up to `parts` micro-batches (one when it holds one)."""
    b = batch.block_tables.shape[0]
    if b < 2 or parts < 2:
        return [batch]
    cu = batch.cu_seqlens_q.tolist()
    cuts = [k * b // parts for k in range(parts + 1)]
    out = []
    for b0, b1 in itertools.pairwise(cuts):
        t0, t1 = cu[b0], cu[b1]
        li = batch.logits_indices
        mine = li[(li >= t0) & (li < t1)] - t0
        q_lens = [cu[i + 1] - cu[i] for i in range(b0, b1)]
        ctx = batch.context_lens[b0:b1]
        out.append(
            BatchInputs(
                batch.input_ids[t0:t1],
                batch.positions[t0:t1],
                batch.slot_mapping[t0:t1],
                batch.block_tables[b0:b1],
                batch.cu_seqlens_q[b0 : b1 + 1] - t0,
                ctx,
                mine,
                max(q_lens),
                int(ctx.max()),
                all(q == 1 for q in q_lens),
            )
        )
    return out


def run_stage(model, batch: BatchInputs, kv_caches, x=None, residual=None):
    """This stage's layers over `batch` (`CausalLM.run`, runtime/models/llama.py); (hidden,
    residual), or the sampled rows' fp32 logits on the last stage."""
    return model.run(batch, kv_caches, x, residual)


@torch.inference_mode()
def pipeline_step(
    model,
    batch: BatchInputs,
    kv_caches,
    group: TPGroup,
    dtype: torch.dtype,
    vocab: int,
    tp: int = 1,
) -> torch.Tensor | None:
    """One step on this rank: global rank 0 returns the logits [S, vocab]; the others None.
    `group`: all ranks, rank = stage * tp + tensor rank; each tensor rank exchanges activations
    with the same tensor rank of the neighbouring stages (every rank of a stage holds the whole
    hidden state after its all-reduces); the last stage's tensor rank 0, which gathers the
    vocabulary-parallel logits, sends them to rank 0. `dtype`: the activations'; `vocab`: the
    full vocabulary size."""
    stage, t, stages = group.rank // tp, group.rank % tp, group.world // tp
    hidden = model.spec.hidden_size
    mbs = split_batch(batch)
    nxt, prev = (stage + 1) * tp + t, (stage - 1) * tp + t
    if stage == 0:
        sends = []
        for i, mb in enumerate(mbs):
            x, residual = run_stage(model, mb, kv_caches)
            sends.append(group.isend(torch.stack([x, residual]), nxt, tag=i))
        if t != 0:
            for w in sends:
                group.wait(w)
            return None
        logits = []
        for i, mb in enumerate(mbs):
            s = mb.logits_indices.numel()
            if s:
                logits.append(
                    group.recv(
                        torch.empty(s, vocab, dtype=torch.float32, device=batch.input_ids.device),
                        (stages - 1) * tp,
                        tag=i,
                    )
                )
        for w in sends:
            group.wait(w)
        return torch.cat(logits) if logits else torch.empty(0, vocab, device=batch.input_ids.device)
    sends = []
    for i, mb in enumerate(mbs):
        buf = group.recv(
            torch.empty(
                2, mb.input_ids.numel(), hidden, dtype=dtype, device=batch.input_ids.device
            ),
            prev,
            tag=i,
        )
        out = run_stage(model, mb, kv_caches, buf[0], buf[1])
        if stage == stages - 1:
            if t == 0 and out.numel():
                sends.append(group.isend(out.contiguous(), 0, tag=i))
        else:
            sends.append(group.isend(torch.stack(out), nxt, tag=i))
    for w in sends:
        group.wait(w)
    return None
