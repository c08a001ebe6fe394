"""Structured outputs (xgrammar) through the Python API, colocated and disaggregated: a JSON schema,
any JSON object, a regex, a choice and an EBNF grammar constrain random-weight models sampling at
temperature 1; an invalid spec fails in ``add_request``. Plus the vocabulary xgrammar is given."""

import json
import re
import subprocess
import sys

import jsonschema
import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.engine.sampling_params import StructuredOutputsParams
from afdserve.engine.sequence import Sequence
from afdserve.engine.structured_output import XGrammars, grammar_backend, vocab_type
from afdserve.errors import RequestError

DEPLOYMENTS = {"colocated": {}, "disaggregated": dict(attention_workers=1, expert_workers=1)}
EOS = 2

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "ok"],
}


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def llm(request, tiny_mixtral):
    with LLM(str(tiny_mixtral), num_kv_blocks=256, **DEPLOYMENTS[request.param]) as llm:
        yield llm


def _generate(llm, so, n, max_tokens=1000, **kw):
    prompts = [{"prompt_token_ids": [5 + i, 17, 42]} for i in range(n)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured_outputs=so, **kw)
              for i in range(n)]
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def test_json_schema_outputs_parse_and_validate(llm):
    outs = _generate(llm, StructuredOutputsParams(json=SCHEMA), 20)
    for c in outs:
        assert c.finish_reason == "stop" and c.token_ids[-1] == EOS, c
        jsonschema.validate(json.loads(c.text), SCHEMA)  # strict json.loads: no raw control characters
    # the schema as JSON text, in one batch with unconstrained requests
    ps = [{"prompt_token_ids": [9, 10 + i]} for i in range(4)]
    params = [SamplingParams(max_tokens=1000 if i % 2 else 12, temperature=1.0, seed=i, ignore_eos=not i % 2,
                             structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)) if i % 2 else None)
              for i in range(4)]
    for i, o in enumerate(llm.generate(ps, params)):
        c = o.outputs[0]
        if i % 2:
            jsonschema.validate(json.loads(c.text), SCHEMA)
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 12


def test_regex_choice_and_grammar_outputs_match(llm):
    regex = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    for c in _generate(llm, StructuredOutputsParams(regex=regex), 8):
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
    choice = ("yes", "no", 'maybe "so"')
    texts = [c.text for c in _generate(llm, StructuredOutputsParams(choice=choice), 8)]
    assert set(texts) <= set(choice), texts
    grammar = 'root ::= "(" num (("+" | "*") num)? ")"\nnum ::= [1-9] [0-9]{0,2}'
    for c in _generate(llm, StructuredOutputsParams(grammar=grammar), 8):
        assert re.fullmatch(r"\([1-9][0-9]{0,2}([+*][1-9][0-9]{0,2})?\)", c.text), c.text


def test_json_object_outputs_parse(llm):
    tok = llm.engine.tokenizer.tokenizer
    closing = {tok.token_to_id(ch): 4.0 for ch in '"}]'}  # random weights: close strings and containers soon
    for c in _generate(llm, StructuredOutputsParams(json_object=True), 8, logit_bias=closing):
        assert c.finish_reason == "stop", c
        assert isinstance(json.loads(c.text), (dict, list))


@pytest.mark.parametrize("so,match", [
    (dict(json={"type": "nonsense"}), r"invalid JSON schema: .*nonsense"),
    (dict(json={"type": "object", "properties": 5}), r"invalid JSON schema: properties must be an object"),
    (dict(json="{not json"), r"not valid JSON"),
    (dict(json="[1, 2]"), r"must be a JSON object"),
    (dict(regex="(ab"), r"invalid regex: .*parenthesis"),
    (dict(grammar='rule ::= "a"'), r"invalid grammar: .*root"),
])
def test_invalid_specs_fail_in_add_request(llm, so, match):
    with pytest.raises(RequestError, match=match):
        llm.engine.add_request({"prompt_token_ids": [5, 6]},
                               SamplingParams(structured_outputs=StructuredOutputsParams(**so)))
    assert not llm.engine.has_unfinished()
    c = _generate(llm, StructuredOutputsParams(choice=("a", "b")), 1)[0]  # the deployment still serves
    assert c.text in ("a", "b")


# ---- the vocabulary xgrammar is given ------------------------------------------------------------------
def test_mask_covers_the_models_vocabulary(tiny_mixtral):
    """The tiny tokenizer has 259 tokens, the model 256 logits: the mask has the model's width, the
    tokenizer's special tokens are never allowed, EOS only where the grammar is complete."""
    from afdserve.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_mixtral)
    grammars = XGrammars(tiny_mixtral, 256, {EOS})
    seqs = [Sequence(f"r{i}", [5], SamplingParams(structured_outputs=so))
            for i, so in enumerate([StructuredOutputsParams(regex="ab?"), None])]
    grammars.add(seqs[0])
    mask = grammars.allowed(seqs, 260)  # logits wider than the grammar's vocabulary
    assert mask.shape == (2, 260) and mask[1].all()
    assert mask[0].nonzero().flatten().tolist() == [tok.tokenizer.token_to_id("a")]
    assert not grammars.accept(seqs[0], tok.tokenizer.token_to_id("a"))
    allowed = set(grammars.allowed(seqs[:1], 256)[0].nonzero().flatten().tolist())
    assert allowed == {tok.tokenizer.token_to_id("b"), EOS}
    assert grammars.accept(seqs[0], EOS)
    assert grammars.allowed(seqs[1:], 256) is None


def test_json_strings_are_json_even_with_a_length_bound(tiny_mixtral):
    """xgrammar 0.2.8 lets raw control characters into (and escapes out of) strings with maxLength,
    and surrogates (invalid UTF-8) into strings; the compiled grammar does neither."""
    backend = grammar_backend(tiny_mixtral, 256, {EOS})
    compiled = backend.compile(StructuredOutputsParams(json=SCHEMA))

    def accepts(text: str) -> bool:
        import xgrammar as xgr

        m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return m.accept_string(text) and m.is_terminated()

    ok = '{"name": "%s", "age": 3, "color": "red", "ok": true}'
    assert accepts(ok % "abc") and accepts(ok % 'a\\"b\\n\\u00e9')
    assert not accepts(ok % "a\tb") and not accepts(ok % "a\x0bb") and not accepts(ok % "123456789")
    assert backend.compile(StructuredOutputsParams(json=json.dumps(SCHEMA))) is compiled  # cached


def test_byte_fallback_vocabulary():
    """A SentencePiece-style tokenizer (byte fallback, "▁" for spaces) is read as such: generated
    tokens spell exactly what the regex asks for, bytes included."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "▁the", "he", "q", "u", "ick",
                                                                                 "▁qu", "t", "h", "e", "d", "o", "g"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(p, special=True) for p in pieces[:3]])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    assert vocab_type(tok, tok.get_vocab(with_added_tokens=True)) == ("BYTE_FALLBACK", True)
    grammars, gen = XGrammars(tok, len(pieces) + 5, {EOS}), torch.Generator().manual_seed(0)
    for _ in range(5):
        seq = Sequence("r", [1], SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"the quick\n[é-ë]")))
        grammars.add(seq)
        out: list[int] = []
        while True:
            allowed = grammars.allowed([seq], len(pieces) + 5)[0].nonzero().flatten()
            out.append(int(allowed[torch.randint(len(allowed), (1,), generator=gen)]))
            if grammars.accept(seq, out[-1]):
                break
        assert out[-1] == EOS and re.fullmatch(r"the quick\n[é-ë]", tok.decode(out)), [tok.id_to_token(t) for t in out]


def test_importing_afdserve_does_not_load_xgrammar():
    code = ("import sys, afdserve.engine.builder, afdserve.runtime.attention_worker, afdserve.engine.frontend;"
            "assert 'xgrammar' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)

