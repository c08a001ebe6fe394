"""Incremental detokenization: text grows token by token without re-decoding everything."""

from __future__ import annotations

from tokenizers import Tokenizer


class IncrementalDetokenizer:
    """Emits the text of new tokens once it is complete (no dangling UTF-8 byte pieces).

    Decodes a short window of recent tokens, so the cost per token is constant and word-start
    spaces (SentencePiece's metaspace) come out right.
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - 6, 0)
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def step(self, token_id: int) -> str:
        """Adds one token and returns the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        if self.tok is None:
            return ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new
        return ""
