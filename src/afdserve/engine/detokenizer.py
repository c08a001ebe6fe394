"""Incremental detokenization: text grows token by token without re-decoding everything."""

from __future__ import annotations

from tokenizers import Tokenizer

MAX_LOOKBACK = 24  # prompt tokens the first window may reach back, to start at a whole character


class IncrementalDetokenizer:
    """Emits the text of new tokens once it is complete (no dangling UTF-8 byte pieces).

    Decodes a short window of recent tokens, so the cost per token is constant and word-start
    spaces (SentencePiece's metaspace) come out right.
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids)
        self.prefix_offset = self._window_start()
        self.read_offset = len(self.ids)

    def _window_start(self) -> int:
        """Where the first window starts: six tokens back, or further back up to ``MAX_LOOKBACK``, as
        far as needed for the prompt's tail to decode whole. A window that starts within the byte
        pieces of a character (a byte-fallback tokenizer's <0xXX> tokens) decodes them as replacement
        characters, and a run of such pieces is decoded together, so the characters generated next
        in that run would come out garbled too."""
        n = len(self.ids)
        six_back = max(n - 6, 0)
        if self.tok is not None:
            for start in range(six_back, max(n - MAX_LOOKBACK, 0) - 1, -1):
                if start == 0 or "\ufffd" not in self.tok.decode(self.ids[start:], skip_special_tokens=self.skip):
                    return start
        return six_back  # no tokenizer, or a prompt with invalid bytes in its tail: as it comes

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

    def extend(self, token_ids: list[int]) -> str:
        """Adds tokens at once and returns what ``step`` over each would have, joined: one decode of
        the window where its text is whole, token by token where it holds a replacement character
        (byte pieces decode differently alone and in runs). A later call starts from a fresh window,
        so for text that is not whole, what follows may differ from stepping (only the first call
        is exact for garbled text: a request detokenized once, when it finishes)."""
        if self.tok is None or not token_ids:
            self.ids.extend(token_ids)
            return ""
        n = len(self.ids)
        self.ids.extend(token_ids)
        full = self._decode(self.ids[self.prefix_offset :])
        if "\ufffd" in full:
            del self.ids[n:]
            return "".join([self.step(t) for t in token_ids])
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        self.prefix_offset, self.read_offset = self._window_start(), len(self.ids)
        return full[len(prefix) :]
