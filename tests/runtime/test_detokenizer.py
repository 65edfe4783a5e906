"""Incremental detokenization equals decoding the whole output at once."""

import random

from transformers import AutoTokenizer

from slimserve.runtime.engine.detokenizer import DetokenizerState, make_decoder
from tests.helpers import DEMO_MODEL


def test_incremental_text_equals_full_decode_including_multibyte_characters():
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    decode = make_decoder(tok)
    prompt = tok("def f():\n").input_ids
    text = "    return 'héllo wörld ✓ 日本語' + x  # ok\n    pass\n"
    out_ids = tok(text).input_ids
    byte_ids = [
        i
        for i in range(tok.vocab_size)
        if len(tok.decode([i])) == 1 and tok.decode([i]) == "\ufffd"
    ][:6]  # lone UTF-8 fragments: must be held back
    rng = random.Random(0)
    for ids in (
        out_ids,
        out_ids[:7] + byte_ids + out_ids[7:],
        rng.sample(range(tok.vocab_size), 40),
    ):
        state = DetokenizerState.for_prompt(len(prompt))
        seen, tokens = "", list(prompt)
        for t in ids:
            tokens.append(t)
            delta = state.update(decode, tokens)
            assert not delta.endswith("\ufffd")
            seen += delta
        seen += state.flush(decode, tokens)
        assert seen == state.text
        assert (
            seen
            == tok.decode(tokens[len(prompt) - min(5, len(prompt)) :], skip_special_tokens=True)[
                len(
                    tok.decode(
                        tokens[len(prompt) - min(5, len(prompt)) : len(prompt)],
                        skip_special_tokens=True,
                    )
                ) :
            ]
        )
    assert tok.decode(out_ids) == text
