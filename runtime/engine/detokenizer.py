"""Incremental detokenization: each step decodes a few tokens around the new ones, not the whole
output (decoding everything every step is quadratic in the output length).

The scheme is vLLM's: keep `prefix_offset <= read_offset`; decode ids[prefix_offset:read_offset]
and ids[prefix_offset:]; the difference is the new text, emitted only once it does not end in an
incomplete UTF-8 character (U+FFFD). Starting the window a few prompt tokens back gives
SentencePiece-style tokenizers the context that decides a word's leading space.
"""

from __future__ import annotations

from dataclasses import dataclass

_PROMPT_CONTEXT = 5  # prompt tokens the first window starts with


def make_decoder(tokenizer):
    """A fast `ids -> str` (skipping special tokens): the Rust backend when transformers would not
    post-process the text, else tokenizer.decode."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class DetokenizerState:
    prefix_offset: int  # start of the decode window in the full token list
    read_offset: int  # tokens before this one are already part of `text`
    text: str = ""  # generated text so far (complete characters only)

    @classmethod
    def for_prompt(cls, num_prompt_tokens: int) -> DetokenizerState:
        return cls(max(0, num_prompt_tokens - _PROMPT_CONTEXT), num_prompt_tokens)

    def update(self, decode, token_ids: list[int]) -> str:
        """Append the text of the tokens past read_offset; returns the new text (maybe "")."""
        prefix = decode(token_ids[self.prefix_offset : self.read_offset])
        full = decode(token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
            self.text += delta
            return delta
        return ""

    def flush(self, decode, token_ids: list[int]) -> str:
        """At the end of a request: emit what is left, even an incomplete character."""
        prefix = decode(token_ids[self.prefix_offset : self.read_offset])
        full = decode(token_ids[self.prefix_offset :])
        delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self.prefix_offset = self.read_offset = len(token_ids)
        self.text += delta
        return delta
