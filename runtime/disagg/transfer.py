"""The engine's KV hand-over hooks (runtime/engine/llm_engine.py calls them on the engine thread; the
import's read runs in a worker thread of runtime/engine/async_engine.py).

Export (prefill side): once a prefill-only request has sampled its first token, the K/V of its
prompt's blocks (every layer) are gathered from the cache and written into a segment
(runtime/disagg/segment.py) with the layout, the prompt's token ids and the first token.
Import (decode side): the segment is read (and unlinked), its layout checked against ours
(runtime/disagg/layout.py), its prompt compared with the request's own tokenization; then, once
the engine has blocks for it, the blocks are copied into the cache (`scatter`) and the request
continues from its first token as if it had been prefilled here.

Blocks travel as raw bytes (`cache.view(uint8)`), so every cache dtype (fp8 included) copies
the same way, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slimserve.runtime.disagg.errors import KVHandleError, KVLayoutError
from slimserve.runtime.disagg.layout import KVLayout
from slimserve.runtime.disagg.segment import SegmentRegistry, read_segment, write_segment

Logprob = tuple[float, dict[int, float]]


@dataclass
class ImportedKV:
    """A prefilled prompt received from a prefill replica, ready to enter this engine."""

    segment: str
    num_tokens: int  # prompt tokens whose K/V the blocks hold
    first_token: int  # the token the prefill side sampled after the prompt
    first_logprob: Logprob | None  # its logprob entry, when the request asked for logprobs
    keys: list[torch.Tensor]  # per layer: uint8 [blocks, block_size, kv_heads, row bytes]
    values: list[torch.Tensor]

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0


def _encode_logprob(lp: Logprob | None) -> Any:
    return None if lp is None else [lp[0], [[int(t), float(p)] for t, p in lp[1].items()]]


def _decode_logprob(obj: Any) -> Logprob | None:
    if obj is None:
        return None
    return float(obj[0]), {int(t): float(p) for t, p in obj[1]}


def export_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    layout: KVLayout,
    block_table: list[int],
    num_tokens: int,
    prompt_token_ids: list[int],
    first_token: int,
    first_logprob: Logprob | None,
    name: str,
    registry: SegmentRegistry | None = None,
) -> int:
    """Write the K/V of the first `num_tokens` tokens' blocks into segment `name`; returns bytes."""
    nb = -(-num_tokens // layout.block_size)
    if nb > len(block_table):
        raise RuntimeError(
            f"exporting {num_tokens} tokens needs {nb} blocks; the sequence holds "
            f"{len(block_table)}"
        )
    idx = torch.tensor(block_table[:nb], dtype=torch.long, device=kv_caches[0][0].device)
    tensors: list[tuple[str, torch.Tensor]] = []
    for i, (k, v) in enumerate(kv_caches):
        tensors.append((f"k{i}", k.view(torch.uint8).index_select(0, idx)))
        tensors.append((f"v{i}", v.view(torch.uint8).index_select(0, idx)))
    for i, (ks, vs) in enumerate(layout.scales or ()):
        tensors += [(f"k_scale{i}", ks), (f"v_scale{i}", vs)]
    header = {
        "layout": layout.fields(),
        "has_scales": layout.scales is not None,
        "num_tokens": num_tokens,
        "num_blocks": nb,
        "prompt_token_ids": list(prompt_token_ids),
        "first_token": int(first_token),
        "first_logprob": _encode_logprob(first_logprob),
    }
    size = write_segment(name, header, tensors)
    if registry is not None:
        registry.add(name, size)
    return size


def load_import(name: str, layout: KVLayout, prompt_token_ids: list[int]) -> ImportedKV:
    """Read segment `name` (unlinking it), check it against our layout and the request's prompt."""
    header, tensors = read_segment(name)
    try:
        fields = header["layout"]
        scales = None
        if header.get("has_scales"):
            scales = tuple(
                (tensors[f"k_scale{i}"].clone(), tensors[f"v_scale{i}"].clone())
                for i in range(int(fields["num_layers"]))
            )
        remote = KVLayout(**fields, scales=scales)
        num_tokens, nb = int(header["num_tokens"]), int(header["num_blocks"])
        ids = [int(t) for t in header["prompt_token_ids"]]
        first = int(header["first_token"])
        first_lp = _decode_logprob(header.get("first_logprob"))
    except (KeyError, TypeError, ValueError) as e:
        raise KVHandleError(
            f"KV segment {name}: header field {e} is missing or malformed"
        ) from None
    layout.check_matches(remote)
    if ids != list(prompt_token_ids):
        raise KVLayoutError(
            f"KV segment {name} holds a prompt of {len(ids)} tokens that is not "
            f"this request's ({len(prompt_token_ids)} tokens); both replicas must "
            "serve the same model and tokenizer"
        )
    if num_tokens != len(ids) or nb != -(-num_tokens // layout.block_size):
        raise KVHandleError(f"KV segment {name}: {num_tokens} tokens in {nb} blocks do not add up")
    keys, values = [], []
    for i in range(layout.num_layers):
        shape = [
            nb,
            layout.block_size,
            layout.num_kv_heads,
            layout.row_bytes(i),
        ]
        k, v = tensors.get(f"k{i}"), tensors.get(f"v{i}")
        for t, what in ((k, "k"), (v, "v")):
            if t is None or t.dtype != torch.uint8 or list(t.shape) != shape:
                raise KVHandleError(
                    f"KV segment {name}: layer {i} {what} blocks have shape "
                    f"{None if t is None else list(t.shape)}, expected {shape}"
                )
        keys.append(k)
        values.append(v)
    return ImportedKV(name, num_tokens, first, first_lp, keys, values)


def scatter(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], imported: ImportedKV, block_ids: list[int]
) -> None:
    """Copy the imported blocks into our cache at `block_ids` (one per imported block)."""
    assert len(block_ids) == imported.num_blocks, (len(block_ids), imported.num_blocks)
    device = kv_caches[0][0].device
    idx = torch.tensor(block_ids, dtype=torch.long, device=device)
    for (k, v), kb, vb in zip(kv_caches, imported.keys, imported.values):
        k.view(torch.uint8).index_copy_(0, idx, kb.to(device, non_blocking=True))
        v.view(torch.uint8).index_copy_(0, idx, vb.to(device, non_blocking=True))
