"""Incremental detokenization: text grows token by token without re-decoding everything."""

from __future__ import annotations

from weakref import WeakKeyDictionary

from tokenizers import Tokenizer

MAX_LOOKBACK = 24  # prompt tokens the first window may reach back, to start at a whole character
# per tokenizer and skip_special_tokens: the text of each token decoded alone, once
_TOKEN_TEXTS: WeakKeyDictionary[Tokenizer, dict[bool, dict[int, str]]] = WeakKeyDictionary()


class IncrementalDetokenizer:
    """Emits the text of new tokens once it is complete (no dangling UTF-8 byte pieces).

    Decodes a short window of recent tokens, so the cost per token is constant and word-start
    spaces (SentencePiece's metaspace) come out right: per token, the text of the window (from
    ``prefix_offset``) past that of its prefix (up to ``read_offset``), once it is longer and does
    not end in a replacement character; the window then starts at the read offset. One decode per
    token: the prefix's text is kept while the offsets stay, and that of a one-token prefix (the
    common one, once text came out) is looked up (``_prefix``).
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids)
        # where the next window starts; None: found when first needed (``settle``, a batch of them
        # at once, or never for a request that ends unread)
        self.prefix_offset: int | None = None
        self.read_offset = len(self.ids)
        self.prefix: str | None = None  # the text of ids[prefix_offset:read_offset], once decoded
        self.pairs: dict[tuple[int, int], str] | None = None  # texts of two-token windows (``extend_all``)
        texts = {} if tokenizer is None else _TOKEN_TEXTS.setdefault(tokenizer, {})
        self.texts: dict[int, str] = texts.setdefault(skip_special_tokens, {})

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def _prefix(self) -> str:
        """The text of ids[prefix_offset:read_offset]; of one token, decoded once per tokenizer."""
        if self.read_offset - self.prefix_offset != 1:
            return self._decode(self.ids[self.prefix_offset : self.read_offset])
        one = self.ids[self.prefix_offset]
        text = self.texts.get(one)
        if text is None:
            text = self.texts[one] = self._decode([one])
        return text

    def step(self, token_id: int) -> str:
        """Adds one token and returns the newly completed text (possibly empty)."""
        if self.prefix_offset is None:
            settle([self])
        self.ids.append(token_id)
        if self.tok is None:
            return ""
        prefix = self.prefix
        if prefix is None:
            prefix = self.prefix = self._prefix()
        full = None
        if self.pairs is not None and len(self.ids) - self.prefix_offset == 2:
            full = self.pairs.get((self.ids[-2], token_id))
        if full is None:
            full = self.tok.decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset, self.prefix = self.read_offset, len(self.ids), None
            return full[len(prefix) :]
        return ""

    def extend(self, token_ids: list[int]) -> str:
        """Adds tokens at once and returns what ``step`` over each would have, joined (``extend_all``
        of one)."""
        return extend_all([self], [token_ids])[0]


def extend_all(detoks: list[IncrementalDetokenizer], token_ids: list[list[int]]) -> list[str]:
    """``detoks[i].extend(token_ids[i])`` for every i: one batch decode of the windows (in Rust, on
    all cores, without the GIL) where their text is whole; ``step`` by ``step`` where it holds a
    replacement character (byte pieces decode differently alone and in runs), with the texts of the
    windows of two tokens it mostly decodes (where text came out at the two tokens before) decoded
    ahead in one batch. A later call starts from a fresh window, so for text that is not whole what
    follows may differ from stepping: exact for a request detokenized once, when it finishes."""
    out = [""] * len(detoks)
    todo = [i for i, d in enumerate(detoks) if token_ids[i]]
    for i in todo:
        if detoks[i].tok is None:
            detoks[i].ids.extend(token_ids[i])
    todo = [i for i in todo if detoks[i].tok is not None]
    if not todo:
        return out
    tok, skip = detoks[todo[0]].tok, detoks[todo[0]].skip
    if any(detoks[i].tok is not tok or detoks[i].skip != skip for i in todo):  # not one batch: each alone
        for i in todo:
            out[i] = extend_all([detoks[i]], [token_ids[i]])[0]
        return out
    settle([detoks[i] for i in todo])
    starts = {i: len(detoks[i].ids) for i in todo}
    for i in todo:
        detoks[i].ids.extend(token_ids[i])
    fulls = tok.decode_batch([detoks[i].ids[detoks[i].prefix_offset:] for i in todo], skip_special_tokens=skip)
    whole = [i for i, full in zip(todo, fulls) if "\ufffd" not in full]
    full_of = dict(zip(todo, fulls))
    unknown = [detoks[i] for i in whole if detoks[i].prefix is None]  # (``settle`` decoded most)
    for d, text in zip(unknown, tok.decode_batch([d.ids[d.prefix_offset:d.read_offset] for d in unknown],
                                                 skip_special_tokens=skip)):
        d.prefix = text
    for i in whole:
        d = detoks[i]
        out[i] = full_of[i][len(d.prefix):]
        d.prefix_offset, d.read_offset, d.prefix = None, len(d.ids), None  # found when more tokens come
    garbled = [i for i in todo if "\ufffd" in full_of[i]]
    for i in garbled:
        del detoks[i].ids[starts[i]:]
    pairs = list(dict.fromkeys(p for i in garbled for p in zip(detoks[i].ids[-1:] + token_ids[i], token_ids[i])))
    texts = dict(zip(pairs, tok.decode_batch([list(p) for p in pairs], skip_special_tokens=skip)))
    for i in garbled:
        d = detoks[i]
        d.pairs = texts
        out[i] = "".join([d.step(t) for t in token_ids[i]])
        d.pairs = None
    return out


def settle(detoks: list[IncrementalDetokenizer]) -> None:
    """Finds where the first window of each detokenizer that has none yet starts: six tokens back,
    or further back up to ``MAX_LOOKBACK``, the first start from which the ids so far decode whole
    (the sequence's start counts as whole); six back where none does, or without a tokenizer. A
    window that starts within the byte pieces of a character (a byte-fallback tokenizer's <0xXX>
    tokens) decodes them as replacement characters, and a run of such pieces is decoded together,
    so the characters generated next in that run would come out garbled too. In two batch decodes:
    of the six-token tails (whole, for most prompts), then, for those that are not, of all their
    candidate starts further back (for random token ids, few of them find one). All of one
    tokenizer."""
    todo = []
    for d in detoks:
        if d.prefix_offset is not None:
            continue
        if d.tok is None or len(d.ids) <= 6:  # from six back, or its start
            d.prefix_offset = max(len(d.ids) - 6, 0)
        else:
            todo.append(d)
    if not todo:
        return
    tok, skip = todo[0].tok, todo[0].skip
    garbled = []
    for d, text in zip(todo, tok.decode_batch([d.ids[-6:] for d in todo], skip_special_tokens=skip)):
        if "\ufffd" in text:
            garbled.append(d)
        else:
            d.prefix_offset, d.prefix = len(d.ids) - 6, text
    starts = [(d, start) for d in garbled for start in range(len(d.ids) - 7, max(len(d.ids) - MAX_LOOKBACK, 0) - 1, -1)]
    texts = tok.decode_batch([d.ids[start:] for d, start in starts], skip_special_tokens=skip)
    for (d, start), text in zip(starts, texts):
        if d.prefix_offset is None and (start == 0 or "\ufffd" not in text):  # the first whole one
            d.prefix_offset, d.prefix = start, text
    for d in garbled:
        if d.prefix_offset is None:  # none whole: from six back, as it comes
            d.prefix_offset = len(d.ids) - 6
