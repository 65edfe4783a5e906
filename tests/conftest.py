"""Shared fixtures: a tiny random Llama checkpoint with a real (tiny) BPE tokenizer, one-thread torch."""

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_model import save_tiny_llama

torch.set_num_threads(2)
# Triton kernels run through the interpreter on machines without a GPU; the switch is read
# when a @triton.jit function is defined, so it is set before any test imports a kernel module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


@pytest.fixture
def one_thread():
    """GPTQ's column loop is thousands of ops on tensors of a few kB: intra-op threads only add
    synchronization, and on an oversubscribed 2-core box every parallel region stalls, so these
    tests run torch on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A 2-layer GQA Llama (bf16, vocab 512) saved as a plain HF checkpoint (tests/helpers/tiny_model.py)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped (not failed) when `-m gpu` runs on a machine without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
