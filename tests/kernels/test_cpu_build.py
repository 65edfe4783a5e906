"""Building the C kernels (kernels/cpu_build.py): a machine without a compiler gets the torch twins
and a reason, a failing flag set falls through to the next, a fresh cache builds with no
temporary file left, and the engine's ops table follows what built."""

import shutil

import pytest
import torch

from slimserve.kernels import cpu_attention as ca
from slimserve.kernels import cpu_build
from slimserve.kernels import reference_attention as ra


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMSERVE_CACHE", str(tmp_path))
    cpu_build.library.cache_clear()
    yield tmp_path
    cpu_build.library.cache_clear()


def test_builds_wherever_a_compiler_exists():
    if shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"):
        assert ca.available(), ca.unavailable_reason()


def test_no_compiler_means_unavailable_not_an_error(monkeypatch, fresh_build):
    from slimserve.runtime.layers import ops

    monkeypatch.setenv("CC", str(fresh_build / "no-such-cc"))
    monkeypatch.setattr(cpu_build.shutil, "which", lambda name: None)
    assert not ca.available()
    assert "no C compiler" in ca.unavailable_reason()
    assert ops.select(torch.device("cpu")) is ops.TORCH
    with pytest.raises(RuntimeError, match="unavailable"):
        ca.paged_attention_decode(
            torch.zeros(1, 1, 8),
            torch.zeros(2, 4, 1, 8),
            torch.zeros(2, 4, 1, 8),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            1.0,
        )


def test_a_failing_compile_is_reported_and_a_fresh_cache_builds(monkeypatch, fresh_build):
    if cpu_build.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_build, "FLAG_SETS", (("-fno-such-flag-anywhere",), ("-fopenmp",)))
    assert ca.available()  # the first flag set fails, the second builds
    assert "-fno-such-flag-anywhere" in ca.unavailable_reason()
    folder = fresh_build / "cpu_kernels"
    assert len(list(folder.glob("cpu_attention-*.so"))) == 1 and not list(folder.glob(".*"))
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(4, 16, 2, 64, generator=g), torch.randn(4, 16, 2, 64, generator=g)
    q = torch.randn(1, 6, 64, generator=g)
    tables, lens = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    torch.testing.assert_close(
        ca.paged_attention_decode(q, kc, vc, tables, lens, 0.125),
        ra.paged_attention_decode(q, kc, vc, tables, lens, 0.125),
        atol=2e-6,
        rtol=1e-5,
    )
