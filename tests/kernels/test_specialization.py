"""Kernel arguments that change from one engine step to the next (row counts, block-table
widths, split counts) are not specialized on by Triton, so a server compiles one variant per
kernel config instead of a new one whenever such a value crosses a multiple of 16 or equals 1.

Checked on the JITFunctions themselves, which only exist without TRITON_INTERPRET (the test
session sets it), so in a child interpreter."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

PER_STEP = {
    "paged_attention._decode_kernel": {"num_splits", "stride_bt"},
    "paged_attention._reduce_kernel": {"num_splits"},
    "paged_attention._prefill_kernel": {"stride_bt"},
    "w4a16_gemm._w4a16_gemm_kernel": {"M", "k_tiles_per_split"},
    "w4a16_gemm._splitk_reduce_kernel": {"MN", "split"},
    "w8a8_gemm._w8a8_gemm_kernel": {"M", "k_tiles_per_split"},
    "w8a8_gemm._w8a8_splitk_reduce_kernel": {"M", "split"},
}

PROBE = r"""
import importlib, json, sys
out = {}
for name in json.loads(sys.argv[1]):
    module, kernel = name.split(".")
    k = getattr(importlib.import_module(f"slimserve.kernels.{module}"), kernel)
    out[name] = [type(k).__name__, [p.name for p in k.params if p.do_not_specialize]]
print(json.dumps(out))
"""


def test_per_step_ints_are_not_specialized():
    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(PER_STEP))],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for name, want in PER_STEP.items():
        kind, flagged = got[name]
        assert kind == "JITFunction", (name, kind)
        assert set(flagged) == want, (name, flagged)
