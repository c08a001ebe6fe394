"""Structured outputs with xgrammar: a request's constraint (``StructuredOutputsParams``) is compiled
once per process into a grammar over the model's vocabulary (cached, LRU), each constrained request
gets its own ``GrammarMatcher``, and before every sampling step the matchers fill a token mask that
the sampler applies. When a grammar is complete only the model's EOS tokens are allowed; sampling one
terminates the matcher and the engine finishes the request ("stop").

xgrammar is imported on first use, so deployments (and workers) that never see a constrained
request do not load it. The vocabulary comes from ``tokenizer.json`` (``tokenizers`` only): the
token strings indexed by id, padded or cut to the model's vocabulary (ids the tokenizer lacks and
special tokens are never allowed: they decode to nothing), with the encoding (byte-level BPE,
SentencePiece byte fallback, raw) read from the tokenizer's decoder or, failing that, its tokens.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from afdserve.engine.sampling_params import StructuredOutputsParams
from afdserve.engine.sequence import Sequence
from afdserve.engine.tokenizer import TokenizerInfo, load_tokenizer
from afdserve.errors import RequestError

log = logging.getLogger(__name__)

MAX_GRAMMARS = 256  # compiled grammars kept per vocabulary
MAX_VOCABS = 4  # vocabularies (tokenizer, model vocab size, EOS ids) kept per process
_MAX_MESSAGE = 400


def spec_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """``(kind, text)``: what is compiled, and the cache key. ``choice`` becomes an EBNF alternation."""
    if spec.json is not None:
        schema: Any = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise RequestError(f"structured outputs: the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise RequestError("structured outputs: a JSON schema must be a JSON object")
        try:
            return "json", json.dumps(schema, ensure_ascii=False)  # keeps the order of properties
        except (TypeError, ValueError) as e:
            raise RequestError(f"structured outputs: the JSON schema is not JSON-serializable: {e}") from None
    if spec.json_object:
        return "json_object", ""
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.choice is not None:
        return "grammar", "root ::= " + " | ".join(_ebnf_literal(c) for c in spec.choice)
    assert spec.grammar is not None
    return "grammar", spec.grammar


def _ebnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _clean(err: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    msg = re.sub(r"^\[[\d:.]+\]\s+\S+:\d+:\s*", "", msg)
    return msg if len(msg) <= _MAX_MESSAGE else msg[:_MAX_MESSAGE] + "..."


# Two gaps of xgrammar (0.2.8) are closed in the grammar's text before it is compiled:
# * a character of a JSON string with minLength / maxLength is [^"\\\r\n]: raw control characters
#   pass (not JSON) and escapes cannot be written (mlc-ai/xgrammar#800); it becomes JSON's string
#   character, unescaped (no control character) or an escape;
# * a negated character class admits the surrogates U+D800..U+DFFF, whose UTF-8 form is invalid (the
#   text decodes to U+FFFD); they are excluded.
_BOUNDED_CHAR = re.compile(r'^(\w+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_CHAR = r'\1 ::= (([^\\0-\\x1f\\"\\\\]) | ("\\\\" basic_escape))'
_LITERAL_OR_CLASS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]')


def _patched(text: str) -> str:
    if "basic_escape ::=" in text:
        text = _BOUNDED_CHAR.sub(_JSON_CHAR, text)
    return _LITERAL_OR_CLASS.sub(lambda m: m[0][:-1] + "\\uD800-\\uDFFF]" if m[0].startswith("[^") else m[0], text)


def _compile(compiler: Any, kind: str, text: str) -> Any:
    import xgrammar as xgr

    grammar = (xgr.Grammar.from_json_schema(text) if kind == "json" else  # these raise for invalid input
               xgr.Grammar.builtin_json_grammar() if kind == "json_object" else
               xgr.Grammar.from_regex(text) if kind == "regex" else xgr.Grammar.from_ebnf(text))
    printed = str(grammar)
    patched = _patched(printed)
    if patched != printed:
        try:
            return compiler.compile_grammar(patched)
        except Exception as e:  # the printed grammar did not parse back: compile it as it is
            log.debug("patched %s grammar did not compile (%s)", kind, _clean(e))
    return compiler.compile_grammar(grammar)


# ---- the vocabulary, as xgrammar sees it -----------------------------------------------------------
def _byte_level_alphabet() -> frozenset[str]:
    """The 256 characters GPT-2's byte-level BPE spells bytes with (``bytes_to_unicode``)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    hidden = [b for b in range(256) if b not in shown]
    return frozenset(map(chr, shown + [256 + i for i in range(len(hidden))]))


_BYTE_LEVEL_CHARS = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte fallback


def _component_types(node: Any) -> list[str]:
    """The ``type`` of a tokenizer.json component and of the components of a ``Sequence``."""
    if not isinstance(node, dict):
        return []
    out = [node.get("type", "")]
    for key in ("decoders", "pretokenizers", "normalizers"):
        for child in node.get(key) or []:
            out += _component_types(child)
    return out


def vocab_type(tok: Tokenizer, vocab: dict[str, int]) -> tuple[str, bool]:
    """(``"BYTE_LEVEL"`` | ``"BYTE_FALLBACK"`` | ``"RAW"``, add_prefix_space) of a tokenizer."""
    decoder = _component_types(json.loads(tok.to_str()).get("decoder"))
    if "ByteLevel" in decoder:
        kind = "BYTE_LEVEL"
    elif "ByteFallback" in decoder or "Metaspace" in decoder:
        kind = "BYTE_FALLBACK"
    elif sum(f"<0x{b:02X}>" in vocab for b in range(256)) >= 128:
        kind = "BYTE_FALLBACK"
    elif sum(c in vocab for c in _BYTE_LEVEL_CHARS) >= 128 and \
            sum(all(c in _BYTE_LEVEL_CHARS for c in t) for t in vocab) >= 0.99 * len(vocab):
        kind = "BYTE_LEVEL"
    else:
        kind = "RAW"
    prefix = {"BYTE_LEVEL": "Ġ", "BYTE_FALLBACK": "▁"}.get(kind)
    return kind, bool(prefix) and "".join(tok.encode("a", add_special_tokens=False).tokens).startswith(str(prefix))


class GrammarBackend:
    """One vocabulary's xgrammar ``TokenizerInfo`` and compiler, and its compiled grammars (LRU)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: set[int] | frozenset[int]):
        import xgrammar as xgr

        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(t for t in eos_token_ids if 0 <= t < vocab_size)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        encoded = [""] * min(vocab_size, max(vocab.values(), default=-1) + 1)  # ids past the end: never allowed
        for text, i in vocab.items():
            if i < len(encoded):
                encoded[i] = text
        for i, added in tokenizer.get_added_tokens_decoder().items():
            if added.special and i < len(encoded) and not _BYTE_PIECE.fullmatch(added.content):
                encoded[i] = ""  # special: never part of the constrained text (decoding skips it)
        kind, prefix_space = vocab_type(tokenizer, vocab)
        self.info = xgr.TokenizerInfo(encoded, getattr(xgr.VocabType, kind), vocab_size=vocab_size,
                                      stop_token_ids=self.stop_token_ids or None, add_prefix_space=prefix_space)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The spec's ``xgrammar.CompiledGrammar`` (compiled on first use); RequestError if invalid."""
        key = spec_key(spec)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        kind, text = key
        try:
            compiled = _compile(self.compiler, kind, text)
        except Exception as e:  # xgrammar reports every invalid input as an exception (RuntimeError mostly)
            what = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex"}.get(kind, "grammar")
            if spec.choice is not None:
                what = "choice"
            raise RequestError(f"structured outputs: invalid {what}: {_clean(e)}") from None
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > MAX_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec), terminate_without_stop_token=not self.stop_token_ids)


_backends: OrderedDict[tuple, GrammarBackend] = OrderedDict()
_backends_lock = threading.Lock()


def grammar_backend(tokenizer: Tokenizer | str | Path, vocab_size: int,
                    eos_token_ids: set[int] | frozenset[int]) -> GrammarBackend:
    """The process's backend for this vocabulary: a tokenizer object, or a folder with tokenizer.json
    (loaded here). The front end and the colocated engine share one (and its compiled grammars)."""
    is_path = isinstance(tokenizer, (str, Path))
    key = (str(Path(tokenizer).resolve()) if is_path else id(tokenizer), vocab_size, frozenset(eos_token_ids))
    with _backends_lock:
        backend = _backends.get(key)
        if backend is not None:
            _backends.move_to_end(key)
            return backend
    tok = load_tokenizer(tokenizer).tokenizer if is_path else tokenizer
    backend = GrammarBackend(tok, vocab_size, eos_token_ids)  # holds ``tok``: its id stays unique while cached
    with _backends_lock:
        backend = _backends.setdefault(key, backend)
        _backends.move_to_end(key)
        while len(_backends) > MAX_VOCABS:
            _backends.popitem(last=False)
    return backend


def validate_structured_outputs(spec: StructuredOutputsParams, tokenizer: TokenizerInfo | None,
                                vocab_size: int) -> None:
    """Compiles (cached) ``spec`` in the front end, so an invalid one fails in ``add_request``."""
    if tokenizer is None:
        raise RequestError("structured outputs need the model's tokenizer (tokenizer.json)")
    grammar_backend(tokenizer.tokenizer, vocab_size, tokenizer.eos_token_ids).compile(spec)


@dataclass
class TokenBitmask:
    """The structured-output mask of a batch, packed: ``bits`` int32 [S, ceil(vocab / 32)] on the
    host (bit t % 32 of word t // 32: token t allowed), as xgrammar fills it, for the batch's
    ``rows`` with a grammar over ``vocab`` tokens (the grammar's: the tokenizer's, at most the model's).
    Applied on the logits' device, in place, by xgrammar's kernel (CPU or Triton): logits past
    ``vocab`` are never allowed."""

    bits: torch.Tensor
    rows: list[int]
    vocab: int

    def __call__(self, logits: torch.Tensor) -> None:
        import xgrammar as xgr

        n = min(self.vocab, logits.shape[1])
        rows = None if len(self.rows) == logits.shape[0] else self.rows
        xgr.apply_token_bitmask_inplace(logits, self.bits.to(logits.device, non_blocking=True), vocab_size=n,
                                        indices=rows)
        if n < logits.shape[1]:
            logits[self.rows, n:] = float("-inf")


class XGrammars:
    """The engine's ``Grammars`` with xgrammar. ``tokenizer``: the tokenizer, or its folder (then it is
    loaded, with xgrammar, on the first constrained request)."""

    def __init__(self, tokenizer: Tokenizer | str | Path, vocab_size: int, eos_token_ids: set[int] | frozenset[int]):
        self._tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, frozenset(eos_token_ids)
        self._backend: GrammarBackend | None = None

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = grammar_backend(self._tokenizer, self.vocab_size, self.eos_token_ids)
        return self._backend

    def add(self, seq: Sequence) -> None:
        assert seq.params.structured_outputs is not None
        seq.grammar = self.backend.matcher(seq.params.structured_outputs)

    def mask(self, seqs: list[Sequence]) -> TokenBitmask | None:
        """The tokens each of ``seqs``' grammars allows next, as xgrammar packs them (unconstrained
        rows untouched); None when no sequence has a grammar."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        import xgrammar as xgr

        n = self.backend.vocab_size
        bits = xgr.allocate_token_bitmask(len(seqs), n)
        for i in rows:
            seqs[i].grammar.fill_next_token_bitmask(bits, i)
        return TokenBitmask(bits, rows, n)

    def allowed(self, seqs: list[Sequence], vocab: int) -> torch.Tensor | None:
        """``mask`` as [len(seqs), vocab] bool (True: allowed), for ``vocab`` logits."""
        mask = self.mask(seqs)
        if mask is None:
            return None
        logits = torch.zeros(len(seqs), vocab)
        mask(logits)
        return logits == 0

    def accept(self, seq: Sequence, token: int) -> bool:
        matcher = seq.grammar
        if matcher.accept_token(token):
            return bool(matcher.is_terminated())
        log.warning("request %s: token %d does not fit its grammar; finishing it", seq.request_id, token)
        return True

    def remove(self, seq: Sequence) -> None:
        seq.grammar = None
