"""glibc tuning for CPU inference (runtime/worker/cpu_malloc.py): freed activations stay in the heap
instead of being unmapped (or trimmed) and faulted in again on the next step."""

import subprocess
import sys

import pytest

from tests.helpers import DEMO_MODEL

# Generates twice on the demo model and prints the minor page faults of the second round.
# "default" keeps glibc's own settings (the runner's call is replaced by a no-op).
PROBE = r"""
import resource, sys
from slimserve.runtime.worker import cpu_malloc, model_runner
if sys.argv[2] == "default":
    model_runner.keep_freed_memory = lambda: False
from slimserve.runtime.llm import LLM
from slimserve.runtime.engine.sequence import SamplingParams
llm = LLM(sys.argv[1], device="cpu")
prompts = [[(7 * i + j) % 3000 + 10 for j in range(40 + 37 * i)] for i in range(12)]
params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
llm.generate(prompts, params, use_tqdm=False)
llm.engine.block_manager.reset_prefix_cache()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
llm.generate(prompts, params, use_tqdm=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(DEMO_MODEL), mode],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_cpu_runner_stops_refaulting_freed_activations():
    default, tuned = faults("default"), faults("tuned")
    assert tuned * 4 < default, (default, tuned)
