"""Incremental detokenization: the text emitted token by token is the text of the whole sequence past
its prompt, for byte-level BPE (GPT-2 style) and for SentencePiece-style BPE (metaspace word starts,
byte-fallback pieces of multi-byte characters); a character's text waits for its last byte piece."""

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers

from afdserve.engine.detokenizer import MAX_LOOKBACK, IncrementalDetokenizer, extend_all, settle
from tiny_models import write_tokenizer

TEXTS = ["the quick brown fox jumps over the lazy dog, again and again",
         "naïve café déjà vu — ünïcödé and emoji 🙂🚀 in a long-ish sentence of words",
         "mixture of experts   serve   tokens fast\n\nnew paragraph\twith tabs",
         "日本語のテキストと English words mixed together 🙂"]


def _metaspace() -> Tokenizer:
    """A small SentencePiece-like BPE: ▁ for spaces, <0xXX> pieces for what the vocabulary lacks."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator([t for t in TEXTS if t.isascii()] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                show_progress=False))
    spec = json.loads(tok.to_str())  # the byte pieces join the vocabulary as ordinary tokens
    vocab = spec["model"]["vocab"]
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))


def _streamed(tok: Tokenizer, prompt: list[int], gen: list[int]) -> str:
    d = IncrementalDetokenizer(tok, prompt)
    return "".join(d.step(t) for t in gen)


def _check(tok: Tokenizer, ids: list[int], cut: int) -> None:
    while tok.decode(ids[:cut]).endswith("\ufffd"):  # a prompt does not end within a character's bytes
        cut += 1
    prompt, gen = ids[:cut], ids[cut:]
    whole, head = tok.decode(prompt + gen), tok.decode(prompt)
    assert whole.startswith(head)
    assert _streamed(tok, prompt, gen) == whole[len(head):], (ids, cut)


@pytest.mark.parametrize("kind", ["metaspace", "byte_level"])
def test_streamed_text_is_the_whole_text_past_the_prompt(kind, tmp_path):
    if kind == "metaspace":
        tok = _metaspace()
    else:
        write_tokenizer(tmp_path)
        tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    longest = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        longest = max(longest, len(ids))
        for cut in (1, 3, len(ids) // 2, len(ids) - 2):
            _check(tok, ids, cut)
    assert longest > 20  # past the first decode window


def test_random_streams_of_words_and_whole_characters():
    """Prompts that end with characters in byte pieces included: the first window starts at a whole
    character, not within one (whose pieces, and those of the characters after them, would decode
    as replacement characters)."""
    tok = _metaspace()
    rng = random.Random(0)
    pieces = {tok.token_to_id(f"<0x{i:02X}>") for i in range(256)}
    words = [i for i in range(3, tok.get_vocab_size()) if i not in pieces]
    for _ in range(300):
        ids: list[int] = []
        while len(ids) < 40:
            if rng.random() < 0.2:  # a whole character in byte pieces
                ids += [tok.token_to_id(f"<0x{b:02X}>") for b in rng.choice("éü🙂日本—ß").encode()]
            else:
                ids.append(rng.choice(words))
        _check(tok, ids, rng.randrange(1, 10))


def test_a_character_waits_for_its_last_byte_piece():
    tok = _metaspace()
    prompt = tok.encode("hello", add_special_tokens=False).ids
    emoji = [tok.token_to_id(f"<0x{b:02X}>") for b in "🙂".encode()]
    d = IncrementalDetokenizer(tok, prompt)
    assert [d.step(t) for t in emoji] == ["", "", "", "🙂"]
    assert IncrementalDetokenizer(None, prompt).step(5) == ""


@pytest.mark.parametrize("kind", ["metaspace", "byte_level"])
def test_tokens_added_at_once_give_the_streamed_text(kind, tmp_path):
    """``extend`` (a request whose text is read only when it finishes) returns what ``step`` over
    each token would have, joined: in one call, for streams of stray byte pieces (garbled text)
    too; in several, for text."""
    if kind == "metaspace":
        tok = _metaspace()
    else:
        write_tokenizer(tmp_path)
        tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    rng = random.Random(1)
    real = [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
    batch = []
    for n in range(400):
        prompt = [rng.randrange(3, tok.get_vocab_size()) for _ in range(rng.randrange(1, 12))]
        gen = rng.choice(real)[rng.randrange(0, 5):] if n % 2 else [
            rng.randrange(3, tok.get_vocab_size()) for _ in range(rng.randrange(1, 40))]
        cuts = sorted(rng.sample(range(len(gen) + 1), min(2, len(gen) + 1))) if n % 2 else []
        d = IncrementalDetokenizer(tok, prompt)
        at_once = "".join(d.extend(gen[a:b]) for a, b in zip([0] + cuts, cuts + [len(gen)]))
        assert at_once == _streamed(tok, prompt, gen), (prompt, gen, cuts)
        batch.append((prompt, gen))
    # all at once, in one batch (clean and garbled, and one without a tokenizer)
    detoks = [IncrementalDetokenizer(tok, p) for p, _ in batch] + [IncrementalDetokenizer(None, [5])]
    texts = extend_all(detoks, [g for _, g in batch] + [[7, 8]])
    assert texts == [_streamed(tok, p, g) for p, g in batch] + [""]
    assert detoks[-1].ids == [5, 7, 8]


def _window_start(tok: Tokenizer, ids: list[int], skip: bool = True) -> int:
    """Where the first window starts, by definition (``settle`` finds it in batch decodes): six
    tokens back, or further back up to MAX_LOOKBACK, the first start from which the ids decode whole
    (or the sequence's start); six back where none does."""
    n = len(ids)
    six_back = max(n - 6, 0)
    for start in range(six_back, max(n - MAX_LOOKBACK, 0) - 1, -1):
        if start == 0 or "\ufffd" not in tok.decode(ids[start:], skip_special_tokens=skip):
            return start
    return six_back


def _by_definition(tok: Tokenizer, prompt: list[int], gen: list[int], skip: bool) -> list[str]:
    """Each token's text as stepping defines it, with both windows decoded afresh per token (what
    ``step`` computes with fewer decodes: a prefix's text kept, a one-token prefix's looked up)."""
    ids = list(prompt)
    start, read = _window_start(tok, prompt, skip), len(ids)
    out = []
    for t in gen:
        ids.append(t)
        prefix = tok.decode(ids[start:read], skip_special_tokens=skip)
        full = tok.decode(ids[start:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            out.append(full[len(prefix):])
            start, read = read, len(ids)
        else:
            out.append("")
    return out


@pytest.mark.parametrize("kind", ["metaspace", "byte_level"])
def test_stepping_and_extending_random_byte_streams_follow_the_definition(kind, tmp_path):
    """Random streams, heavy in byte pieces (stray ones: garbled text) and special tokens, after
    prompts whose tails are garbled too: each token's text from ``step`` and the joined text from
    ``extend_all`` (a batch of them, clean and garbled) are what the definition gives, with special
    tokens skipped and kept (one tokenizer, so one cache of token texts for both)."""
    if kind == "metaspace":
        tok = _metaspace()
        pieces = [tok.token_to_id(f"<0x{i:02X}>") for i in range(256)]
    else:
        write_tokenizer(tmp_path)
        tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
        pieces = [i for i in range(3, tok.get_vocab_size()) if "\ufffd" in tok.decode([i])]  # partial characters
    assert len(pieces) > 50
    rng = random.Random(2)

    def draw() -> int:
        r = rng.random()
        return rng.randrange(0, 3) if r < 0.1 else rng.choice(pieces) if r < 0.5 else rng.randrange(3, tok.get_vocab_size())

    differ = 0  # how many streams come out other than their whole decode past the prompt: garbled ones
    for skip in (True, False):
        batch = []
        for _ in range(300):
            prompt = [draw() for _ in range(rng.randrange(0, 30))]
            gen = [draw() for _ in range(rng.randrange(1, 50))]
            want = _by_definition(tok, prompt, gen, skip)
            d = IncrementalDetokenizer(tok, prompt, skip)
            assert [d.step(t) for t in gen] == want, (skip, prompt, gen)
            batch.append((prompt, gen, "".join(want)))
            differ += "".join(want) != tok.decode(prompt + gen, skip_special_tokens=skip)[len(tok.decode(prompt, skip_special_tokens=skip)):]
        detoks = [IncrementalDetokenizer(tok, p, skip) for p, _, _ in batch]
        assert extend_all(detoks, [g for _, g, _ in batch]) == [w for _, _, w in batch]
    assert differ > 100
    # the window starts in batch (``settle``) are those each finds alone: for random prompts and for
    # texts cut anywhere (within a character's pieces too, whose start is found further back)
    prompts = [p for p, _, _ in batch] + [ids[:cut] for text in TEXTS
                                          for ids in [tok.encode(text, add_special_tokens=False).ids]
                                          for cut in range(len(ids))]
    detoks = [IncrementalDetokenizer(tok, p) for p in prompts]
    settle(detoks)
    starts = [_window_start(tok, p) for p in prompts]
    assert [d.prefix_offset for d in detoks] == starts
    assert sum(s < len(p) - 6 for s, p in zip(starts, prompts)) > 5
    assert all(d.prefix in (None, tok.decode(d.ids[d.prefix_offset:])) for d in detoks)
