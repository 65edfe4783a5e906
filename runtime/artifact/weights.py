"""Which weight files a folder holds, their tensor shapes (headers only), and config bounds.

Both loaders call `weight_files` (confined to the folder: no `..`, absolute paths or symlinks
leaving it) and `check_config_bounds` before anything is allocated, so a config.json whose shape
values disagree with the tensors present (e.g. `num_hidden_layers: 1000000000`) is one
ArtifactError line instead of a hang or an out-of-memory.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from safetensors import safe_open

from slimserve.runtime.artifact.manifest import confined_file
from slimserve.runtime.errors import ArtifactError

INDEX_NAME = "model.safetensors.index.json"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_MAX_DIM = 1 << 31  # no real config value is larger; beyond it int math / allocation is nonsense


def decoder_layer_index(name: str) -> int | None:
    """The decoder layer a tensor or module name belongs to ("model.layers.3.self_attn" -> 3), or None."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def weight_files(path: Path) -> list[str]:
    """The *.safetensors files to read: those of model.safetensors.index.json, else every
    *.safetensors in the folder. Each is checked to be a regular file inside `path`."""
    index = path / INDEX_NAME
    if os.path.lexists(index):
        index = confined_file(path, INDEX_NAME, "the artifact")
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ArtifactError(
                f"{index} is not a safetensors index (a 'weight_map' of tensor -> "
                f"file): {e!r}; re-export or re-download it"
            ) from None
        if not all(isinstance(f, str) for f in files):
            raise ArtifactError(f"{index}: weight_map values must be file names")
        source = INDEX_NAME
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        source = "the artifact"
    if not files:
        raise ArtifactError(f"{path} has no *.safetensors weight files; re-export the artifact")
    for f in files:
        confined_file(path, f, source)
    return files


def tensor_shapes(path: Path, files: list[str] | None = None) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors headers (no tensor data is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files if files is not None else weight_files(path):
        try:
            with safe_open(str(path / f), framework="pt") as st:
                for key in st.keys():
                    shapes[key] = tuple(st.get_slice(key).get_shape())
        except ArtifactError:
            raise
        except Exception as e:  # safetensors raises its own SafetensorError for a bad header
            raise ArtifactError(f"{path / f} is not a readable safetensors file ({e})") from None
    return shapes


def _out_features(shapes: dict[str, tuple[int, ...]], prefix: str) -> int | None:
    """Output width of Linear `prefix` in any stored layout (dense/CT, or GPTQ/AWQ `scales`)."""
    for suffix, dim in (
        (".weight", 0),
        (".weight_packed", 0),
        (".weight_scale", 0),
        (".scales", -1),
    ):
        shape = shapes.get(prefix + suffix)
        if shape and len(shape) == 2:
            return shape[dim]
    return None


def check_config_bounds(config: dict, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """config.json's shape values against the tensors present; ArtifactError naming the key, the
    config's value and what the files hold. Keys a config lacks (or tensors a layout lacks)
    are not checked."""
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

    def fail(key: str, value, held: str) -> None:
        raise ArtifactError(
            f"{where}: config.json {key} = {value!r}, but the weight files hold "
            f"{held}; config.json does not match the weights (re-export the "
            "artifact or fix config.json)"
        )

    values: dict[str, int] = {}
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "vocab_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    ):
        v = cfg.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < _MAX_DIM:
            raise ArtifactError(
                f"{where}: config.json {key} = {v!r} is not a positive integer "
                f"below {_MAX_DIM}; fix config.json or re-export the artifact"
            )
        values[key] = v
    layers = sorted({i for k in shapes if (i := decoder_layer_index(k)) is not None})
    n = values.get("num_hidden_layers")
    if n is not None and (len(layers) != n or layers != list(range(n))):  # len first: n may be huge
        held = (
            f"{len(layers)} decoder layer(s) (indices {layers[0]}..{layers[-1]})"
            if layers
            else "no decoder layer tensors"
        )
        fail("num_hidden_layers", n, held)
    emb = next((s for k, s in shapes.items() if k.endswith("embed_tokens.weight")), None)
    if emb is not None and len(emb) == 2:
        for key, dim in (("vocab_size", 0), ("hidden_size", 1)):
            if key in values and values[key] != emb[dim]:
                fail(key, values[key], f"embed_tokens.weight of shape {list(emb)}")
    prefix = next(
        (k[: m.end()] for k in sorted(shapes) if (m := _LAYER.search(k)) and m.group(1) == "0"),
        None,
    )
    if prefix is None:
        return
    heads, kv_heads = values.get("num_attention_heads"), values.get("num_key_value_heads")
    head_dim = values.get("head_dim") or (
        values["hidden_size"] // heads if heads and "hidden_size" in values else None
    )
    expect = {
        "self_attn.q_proj": (
            "num_attention_heads * head_dim",
            heads and head_dim and heads * head_dim,
        ),
        "self_attn.k_proj": (
            "num_key_value_heads * head_dim",
            (kv_heads or heads) and head_dim and (kv_heads or heads) * head_dim,
        ),
        "mlp.gate_proj": ("intermediate_size", values.get("intermediate_size")),
        "mlp.up_proj": ("intermediate_size", values.get("intermediate_size")),
        "mlp.down_proj": ("hidden_size", values.get("hidden_size")),
        "self_attn.o_proj": ("hidden_size", values.get("hidden_size")),
    }
    for module, (key, want) in expect.items():
        got = _out_features(shapes, prefix + module)
        if want and got is not None and got != want:
            fail(key, want, f"{prefix}{module} with {got} output features")
    norm = shapes.get(prefix + "input_layernorm.weight")
    if norm is not None and "hidden_size" in values and norm != (values["hidden_size"],):
        fail(
            "hidden_size",
            values["hidden_size"],
            f"{prefix}input_layernorm.weight of shape {list(norm)}",
        )
