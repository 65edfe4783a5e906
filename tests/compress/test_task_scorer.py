"""The task scorer (compress/tasks/scorer.py) on the demo model against log-likelihoods computed by
hand from one transformers forward per choice, and lm-eval's context/continuation split."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slimserve.compress.tasks.scorer import Encoded, encode_pair, score_items, shared_prefix
from slimserve.runtime.llm import LLM
from tests.helpers import DEMO_MODEL

LONG = (
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser("
    "description='run the thing')\n    parser.add_argument('--verbose', action='store_true')\n"
    "    args = parser.parse_args(argv)\n    if args.verbose:\n        print("
)
ITEMS = [
    # a context of several KV blocks: its shared prefix is prefilled once and then cached
    ([LONG] * 3, ["'hello')\n", "args)\n", " 42)\n"]),
    (["def __init__(self"] * 2, [", name):", "):\n        pass"]),
    # per-choice contexts (winogrande's partial evaluation), one shared continuation
    (["x = 1\ny = ", "x = 1\ny = x + "], ["2\n", "2\n"]),
]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(DEMO_MODEL), dtype="float32", kv_cache_memory=8 << 20)


@pytest.fixture(scope="module")
def hf():
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(DEMO_MODEL)


def by_hand(hf, context: str, continuation: str) -> tuple[float, bool, int]:
    """Sum of log p(continuation token | everything before), whether each is the argmax, count."""
    model, tok = hf
    n = len(context) - len(context.rstrip())  # lm-eval moves a context's trailing spaces
    context, continuation = context[: len(context) - n], context[len(context) - n :] + continuation
    ctx = tok.encode(context, add_special_tokens=False)
    whole = tok.encode(context + continuation, add_special_tokens=False)
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    rows = range(len(ctx) - 1, len(whole) - 1)
    total = sum(lp[r, whole[r + 1]].item() for r in rows)
    greedy = all(lp[r].argmax().item() == whole[r + 1] for r in rows)
    return total, greedy, len(whole) - len(ctx)


def test_scores_match_a_transformers_forward(llm, hf):
    llm.engine.block_manager.reset_prefix_cache()
    done = []
    scores = score_items(llm, ITEMS, round_items=2, on_progress=done.append)
    assert done == [2, 3]
    for (contexts, continuations), row in zip(ITEMS, scores):
        assert len(row) == len(continuations)
        for c, x, s in zip(contexts, continuations, row):
            total, greedy, n = by_hand(hf, c, x)
            assert s.logprob == pytest.approx(total, abs=2e-3)
            assert (s.greedy, s.tokens) == (greedy, n)
    # the long item's context came from the prefix cache for every choice after its warm-up
    assert llm.engine.block_manager.num_hit_tokens >= 3 * 16


def test_trailing_spaces_move_to_the_continuation(hf):
    _, tok = hf
    a = encode_pair(tok, "x = ", "1", 100)
    b = encode_pair(tok, "x =", " 1", 100)
    assert a == b
    assert a.ids == tok.encode("x = 1", add_special_tokens=False)
    assert a.start == len(tok.encode("x =", add_special_tokens=False))


def test_empty_context_starts_with_end_of_text(hf):
    _, tok = hf
    e = encode_pair(tok, "", "import os", 100)
    assert e.ids[0] == tok.eos_token_id and e.start == 1
    assert e.ids[1:] == tok.encode("import os", add_special_tokens=False)


def test_long_prompts_are_cut_on_the_left(hf):
    _, tok = hf
    full = encode_pair(tok, LONG, "args)\n", 10_000)
    cut = encode_pair(tok, LONG, "args)\n", 20)
    assert len(cut.ids) == 20 and cut.ids == full.ids[-20:]
    assert len(cut.ids) - cut.start == len(full.ids) - full.start
    with pytest.raises(ValueError, match="more than the model's context"):
        encode_pair(tok, LONG, LONG, 20)


def test_shared_prefix_stops_at_the_first_difference_and_the_continuations():
    a, b = Encoded([1, 2, 3, 4, 5], 3), Encoded([1, 2, 3, 9, 9], 4)
    assert shared_prefix([a, b]) == 3
    assert shared_prefix([Encoded([1, 2, 7], 2), Encoded([1, 5, 7], 2)]) == 1
