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
        # where the next window starts; None: ``_window_start`` of the ids so far, found when first
        # needed (``settle``: a batch of them at once, or never for a request that ends unread)
        self.prefix_offset: int | None = None
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
        if self.prefix_offset is None:
            self.prefix_offset = self._window_start()
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
        """Adds tokens at once and returns what ``step`` over each would have, joined (``extend_all``
        of one)."""
        return extend_all([self], [token_ids])[0]


def extend_all(detoks: list[IncrementalDetokenizer], token_ids: list[list[int]]) -> list[str]:
    """``detoks[i].extend(token_ids[i])`` for every i, with the tokenizer's batch decodes (in Rust, on
    all cores, without the GIL): one decode of each window where its text is whole; token by token,
    all of them in lockstep, where it holds a replacement character (byte pieces decode differently
    alone and in runs). A later call starts from a fresh window, so for text that is not whole what
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
    prefixes = tok.decode_batch([detoks[i].ids[detoks[i].prefix_offset:detoks[i].read_offset] for i in whole],
                                skip_special_tokens=skip)
    for i, prefix in zip(whole, prefixes):
        d = detoks[i]
        out[i] = full_of[i][len(prefix):]
        d.prefix_offset, d.read_offset = None, len(d.ids)  # found when more tokens come
    garbled = [i for i in todo if "\ufffd" in full_of[i]]
    for i in garbled:
        del detoks[i].ids[starts[i]:]
    for i, text in zip(garbled, _lockstep(tok, skip, [detoks[i] for i in garbled], [token_ids[i] for i in garbled])):
        out[i] = text
    return out


def _lockstep(tok: Tokenizer, skip: bool, detoks: list[IncrementalDetokenizer],
              token_ids: list[list[int]]) -> list[str]:
    """``step`` over each detokenizer's tokens, all of them in lockstep: per token, one batch decode
    of their windows (a prefix window only when it moved; a window of one token, the common one after
    text came out, from each token's text decoded once)."""
    order = sorted(range(len(detoks)), key=lambda j: -len(token_ids[j]))  # the longest first
    ids = [detoks[j].ids for j in order]
    toks = [token_ids[j] for j in order]
    po = [detoks[j].prefix_offset for j in order]
    ro = [detoks[j].read_offset for j in order]
    pieces: list[list[str]] = [[] for _ in order]
    known: list[str | None] = [None] * len(order)  # the prefix window's text, while its offsets stay
    single: dict[int, str] = {}  # the text of one token alone
    live = len(order)
    for k in range(len(toks[0]) if toks else 0):
        while len(toks[live - 1]) <= k:
            live -= 1
        for j in range(live):
            ids[j].append(toks[j][k])
        fresh = [j for j in range(live) if known[j] is None]
        ones = list(dict.fromkeys(ids[j][po[j]] for j in fresh if ro[j] - po[j] == 1 and ids[j][po[j]] not in single))
        single.update(zip(ones, tok.decode_batch([[t] for t in ones], skip_special_tokens=skip)))
        many = [j for j in fresh if ro[j] - po[j] != 1]
        for j, text in zip(many, tok.decode_batch([ids[j][po[j]:ro[j]] for j in many], skip_special_tokens=skip)):
            known[j] = text
        for j in fresh:
            if ro[j] - po[j] == 1:
                known[j] = single[ids[j][po[j]]]
        full = tok.decode_batch([ids[j][po[j]:] for j in range(live)], skip_special_tokens=skip)
        for j, f in enumerate(full):
            p = known[j]
            if len(f) > len(p) and not f.endswith("\ufffd"):
                pieces[j].append(f[len(p):])
                po[j], ro[j], known[j] = ro[j], len(ids[j]), None
    out = [""] * len(detoks)
    for j, i in enumerate(order):
        detoks[i].prefix_offset, detoks[i].read_offset = po[j], ro[j]
        out[i] = "".join(pieces[j])
    return out


def settle(detoks: list[IncrementalDetokenizer]) -> None:
    """Finds the window start of each detokenizer that has none yet (``_window_start``) in batch
    decodes: of the six-token tails (whole, for most prompts), then, for those that are not, of one
    candidate start further back per round. All of one tokenizer."""
    todo = []
    for d in detoks:
        if d.prefix_offset is not None:
            continue
        if d.tok is None or len(d.ids) <= 6:  # from six back, or its start (``_window_start``)
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
            d.prefix_offset = len(d.ids) - 6
    todo = [(d, len(d.ids) - 7) for d in garbled]  # each one's next candidate start, one further back
    while todo:  # a round per candidate, for those whose windows so far held byte pieces
        later = []
        for (d, start), text in zip(todo, tok.decode_batch([d.ids[start:] for d, start in todo],
                                                           skip_special_tokens=skip)):
            if start == 0 or "\ufffd" not in text:
                d.prefix_offset = start
            elif start > max(len(d.ids) - MAX_LOOKBACK, 0):
                later.append((d, start - 1))
            else:  # none whole: from six back (``_window_start``)
                d.prefix_offset = len(d.ids) - 6
        todo = later
