"""The built-in demo model: layout, determinism, HF compatibility, tokenizer fidelity."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from afdserve.cli import demo_model as demo_cli
from afdserve.model import demo
from afdserve.model.demo import DEMO_CONFIG, DEMO_MODEL_VERSION, build_demo_model, demo_model_path

STRINGS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "a  b   c    d",
    "   ",
    "\n",
    "line one\nline two\n\n\tindented",
    "I'm here, aren't you? Yes—no… maybe!",
    "3.14159 2,718 1e-10 0x1F 1234567890",
    "naïve café résumé Zürich",
    "Ελληνικά и русский",
    "日本語のテキストです。中文文本",
    "한국어 العربية עברית हिन्दी",
    "😀👍 🚀🔥",
    "👨‍👩‍👧‍👦 family",
    "e\u0301 combining, \u200b zero width, \u00a0nbsp",
    "def f(x):\n    return x * 2\n",
    'for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}',
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<html><body>Hi</body></html>",
    "[INST] What is 2+2? [/INST]",
    "~!@#$%^&*()_+`-=[]\\{}|;':\",./<>?",
    "\x00\x01 control \x7f",
    "https://example.com/path?q=1&b=2#frag",
]


def _sha256_tree(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo") / "model")


def test_files_and_layout(demo_dir: Path) -> None:
    names = {f.name for f in demo_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    cfg = json.loads((demo_dir / "config.json").read_text())
    assert cfg == DEMO_CONFIG
    index = json.loads((demo_dir / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = index["weight_map"]
    assert set(weight_map.values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}

    h, inter, e_n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    expected = {"model.embed_tokens.weight": (32000, h), "model.norm.weight": (h,), "lm_head.weight": (32000, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        expected |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (8 * 32, h),
            f"{p}.self_attn.k_proj.weight": (2 * 32, h),
            f"{p}.self_attn.v_proj.weight": (2 * 32, h),
            f"{p}.self_attn.o_proj.weight": (h, 8 * 32),
            f"{p}.block_sparse_moe.gate.weight": (e_n, h),
        }
        for e in range(e_n):
            q = f"{p}.block_sparse_moe.experts.{e}"
            expected |= {f"{q}.w1.weight": (inter, h), f"{q}.w2.weight": (h, inter), f"{q}.w3.weight": (inter, h)}
    assert set(weight_map) == set(expected)

    total = expert = 0
    for fname in sorted(set(weight_map.values())):
        with safe_open(str(demo_dir / fname), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert weight_map[name] == fname
                t = f.get_tensor(name)
                assert t.dtype == torch.bfloat16 and tuple(t.shape) == expected[name], name
                total += t.numel()
                expert += t.numel() if ".experts." in name else 0
                if name.endswith("norm.weight"):
                    assert bool((t == 1).all())
                elif name == "model.layers.0.block_sparse_moe.experts.0.w1.weight":
                    assert abs(t.float().std().item() - 0.02) < 1e-3
    assert index["metadata"]["total_size"] == 2 * total
    assert expert / total > 0.7  # expert weights dominate memory
    assert 2 * total < 300 * 2**20


def test_build_is_deterministic(demo_dir: Path, tmp_path: Path) -> None:
    other = build_demo_model(tmp_path / "again")
    assert _sha256_tree(other) == _sha256_tree(demo_dir)


def test_transformers_loads_and_generates(demo_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.MixtralForCausalLM.from_pretrained(demo_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert next(model.parameters()).dtype == torch.bfloat16
    # the classic per-expert tensors land in transformers' fused layout: gate_up = [w1; w3], down = w2
    with safe_open(str(demo_dir / "model-00001-of-00002.safetensors"), "pt") as f:
        w1 = f.get_tensor("model.layers.0.block_sparse_moe.experts.5.w1.weight")
        w3 = f.get_tensor("model.layers.0.block_sparse_moe.experts.5.w3.weight")
    gate_up = model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"][5]
    assert torch.equal(gate_up, torch.cat([w1, w3]))

    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    assert ids[0, 0].item() == 1
    out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 2)


def test_tokenizer_matches_sentencepiece(demo_dir: Path) -> None:
    import sentencepiece as spm
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    sp = spm.SentencePieceProcessor(model_file=str(demo._spm_model_file()))
    assert tok.get_vocab_size() == sp.get_piece_size() == DEMO_CONFIG["vocab_size"]
    for s in STRINGS:
        ids = tok.encode(s, add_special_tokens=False).ids
        assert ids == sp.encode(s), s
        assert tok.encode(s).ids == [1, *ids]  # <s> from the post-processor
        assert tok.decode(ids) == s == sp.decode(ids)


def test_tokenizer_matches_mistral_common(demo_dir: Path) -> None:
    pytest.importorskip("mistral_common")
    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    mt = MistralTokenizer.v1()
    for s in STRINGS:
        assert tok.encode(s, add_special_tokens=False).ids == mt.instruct_tokenizer.tokenizer.encode(s, False, False)

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(demo_dir)
    cls = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    chats = [
        [("user", "Hi there")],
        [("system", "Be terse."), ("user", "2+2?"), ("assistant", "4"), ("user", "  and 3+3?\nthanks 😀")],
    ]
    for chat in chats:
        ref = mt.encode_chat_completion(ChatCompletionRequest(messages=[cls[r](content=c) for r, c in chat])).tokens
        text = hf.apply_chat_template([{"role": r, "content": c} for r, c in chat], tokenize=False)
        assert tok.encode(text, add_special_tokens=False).ids == ref, text


def test_tokenizer_matches_transformers(demo_dir: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    hf = transformers.AutoTokenizer.from_pretrained(demo_dir)
    for s in STRINGS:
        assert hf.encode(s) == tok.encode(s).ids, s
        assert hf.decode(hf.encode(s), skip_special_tokens=True) == s

    # transformers' own conversion of the .model file agrees except where it deviates from
    # SentencePiece (5.x: text starting with a space, and runs of spaces; see demo.py)
    shutil.copy(demo._spm_model_file(), tmp_path / "tokenizer.model")
    conv = transformers.LlamaTokenizerFast.from_pretrained(tmp_path)
    for s in STRINGS:
        if not s.startswith(" ") and "  " not in s:
            assert conv.encode(s, add_special_tokens=False) == tok.encode(s, add_special_tokens=False).ids, s


def test_demo_model_path_builds_once_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def fake_build(path: str | Path, seed: int = 0) -> Path:
        calls.append(Path(path))
        (Path(path) / "config.json").write_text("{}")
        return Path(path)

    monkeypatch.setenv("AFDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo, "build_demo_model", fake_build)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(demo_model_path())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = tmp_path / "cache" / f"demo-model-v{DEMO_MODEL_VERSION}"
    assert results == [final] * 4
    assert (final / "config.json").read_text() == "{}"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [final.name]  # no temp dirs left
    n = len(calls)
    assert demo_model_path() == final and len(calls) == n  # cached: no rebuild


def test_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[tuple[Path, int]] = []
    monkeypatch.setattr(demo, "build_demo_model", lambda p, seed=0: seen.append((Path(p), seed)) or Path(p))
    (tmp_path / "out").mkdir()
    parser = argparse.ArgumentParser(prog="afdserve")
    demo_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo-model", str(tmp_path / "out"), "--seed", "3"])
    assert args.func(args) == 0
    assert seen == [(tmp_path / "out", 3)]
    assert str(tmp_path / "out") in capsys.readouterr().out
