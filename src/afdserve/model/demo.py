"""The built-in demo model: a random-weight Mixtral-style checkpoint with a real tokenizer.

``build_demo_model(path)`` writes a Hugging Face format checkpoint:

* ``config.json`` -- a ``MixtralConfig`` (8 layers, hidden 256, 8 experts of width 1024, top-2,
  vocab 32000); expert weights are ~74% of the ~68M parameters (~137 MB in bfloat16).
* ``model-0000{1,2}-of-00002.safetensors`` + ``model.safetensors.index.json`` -- bfloat16 weights
  with the classic HF Mixtral tensor names (``block_sparse_moe.experts.{e}.w1/w2/w3``), split in two
  shards (embeddings + first half of the layers, second half + final norm + lm_head).
* ``generation_config.json``.
* ``tokenizer.json`` + ``tokenizer_config.json`` -- the Mixtral v1 SentencePiece BPE tokenizer that
  ships inside ``mistral_common``, converted (without transformers) to a ``tokenizers`` BPE laid
  out like the official Mixtral ``tokenizer.json``: byte fallback, merges ranked by SentencePiece
  score, normalizer ``Prepend("▁") + Replace(" ", "▁")``, decoder ``Replace/ByteFallback/Fuse/
  Strip``, ``<s>`` added by the post-processor; plus the Mixtral ``[INST]`` chat template.  It
  encodes exactly like SentencePiece and ``mistral_common`` (checked in the tests).

Every tensor is drawn from its own ``torch.Generator`` whose seed is derived from ``(seed, name)``,
in float64 and then rounded to bfloat16, and every file is written deterministically, so every
machine builds byte-identical files.

``demo_model_path()`` is the embedded default model: it is built on first use into
``$AFDSERVE_CACHE/demo-model-v{DEMO_MODEL_VERSION}`` (default cache ``~/.cache/afdserve``).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from afdserve.config import cache_root

__all__ = [
    "DEMO_MODEL_VERSION",
    "DEMO_CONFIG",
    "MIXTRAL_CHAT_TEMPLATE",
    "build_demo_model",
    "demo_model_path",
    "demo_model_cached",
    "demo_model_dir",
]

#: Bump whenever the bytes written by ``build_demo_model`` change (it names the cache directory).
DEMO_MODEL_VERSION = 1

#: ``config.json`` of the demo model (a valid ``MixtralConfig``).
DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "sliding_window": None,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.02,
    "router_jitter_noise": 0.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

#: The Mixtral-8x7B-Instruct chat template (optional leading system message, merged into the first
#: user turn).  With this tokenizer it encodes token-for-token like ``mistral_common``'s v1 instruct
#: tokenizer: ``<s>▁[INST]▁user▁[/INST]▁answer</s>▁[INST]...``.
MIXTRAL_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}"
    "{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}"
    "{{- raise_exception('Only user and assistant roles are supported, with the exception of an "
    "initial optional system message!') }}"
    "{%- endif %}"
    "{%- endfor %}"
)

_INIT_STD = 0.02
_NUM_SHARDS = 2
_SPM_SPACE = "\u2581"  # "▁"


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------


def _tensor_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], bool]]:
    """``(name, shape, is_norm)`` for every tensor, in the order they are written."""
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    hd = int(cfg["head_dim"])
    nq, nkv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    specs: list[tuple[str, tuple[int, ...], bool]] = [
        ("model.embed_tokens.weight", (int(cfg["vocab_size"]), h), False)
    ]
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}"
        specs += [
            (f"{p}.input_layernorm.weight", (h,), True),
            (f"{p}.self_attn.q_proj.weight", (nq * hd, h), False),
            (f"{p}.self_attn.k_proj.weight", (nkv * hd, h), False),
            (f"{p}.self_attn.v_proj.weight", (nkv * hd, h), False),
            (f"{p}.self_attn.o_proj.weight", (h, nq * hd), False),
            (f"{p}.post_attention_layernorm.weight", (h,), True),
            (f"{p}.block_sparse_moe.gate.weight", (int(cfg["num_local_experts"]), h), False),
        ]
        for e in range(int(cfg["num_local_experts"])):
            q = f"{p}.block_sparse_moe.experts.{e}"
            specs += [
                (f"{q}.w1.weight", (inter, h), False),  # gate_proj
                (f"{q}.w2.weight", (h, inter), False),  # down_proj
                (f"{q}.w3.weight", (inter, h), False),  # up_proj
            ]
    specs += [
        ("model.norm.weight", (h,), True),
        ("lm_head.weight", (int(cfg["vocab_size"]), h), False),
    ]
    return specs


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"afdserve-demo-model:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _make_tensor(seed: int, name: str, shape: tuple[int, ...], is_norm: bool) -> torch.Tensor:
    if is_norm:
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_tensor_seed(seed, name))
    # float64 sampling takes torch's scalar (non-SIMD) normal path, so the values do not depend
    # on the CPU's vector extensions; the bfloat16 rounding then absorbs any last-ulp libm noise.
    t = torch.empty(shape, dtype=torch.float64).normal_(0.0, _INIT_STD, generator=gen)
    return t.to(torch.bfloat16)


def _shard_of(name: str, num_layers: int) -> int:
    if name.startswith("model.layers."):
        return 0 if int(name.split(".")[2]) < num_layers // 2 else 1
    return 0 if name.startswith("model.embed_tokens.") else 1


def _write_weights(path: Path, cfg: dict[str, Any], seed: int) -> None:
    num_layers = int(cfg["num_hidden_layers"])
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(_NUM_SHARDS)]
    for name, shape, is_norm in _tensor_specs(cfg):
        shards[_shard_of(name, num_layers)][name] = _make_tensor(seed, name, shape, is_norm)
    weight_map: dict[str, str] = {}
    total_size = 0
    for idx, tensors in enumerate(shards):
        fname = f"model-{idx + 1:05d}-of-{_NUM_SHARDS:05d}.safetensors"
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total_size += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(path / "model.safetensors.index.json", index)


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------


def _spm_model_file() -> Path:
    """The Mixtral v1 SentencePiece model shipped as package data of ``mistral_common``."""
    res = importlib.resources.files("mistral_common") / "data" / "tokenizer.model.v1"
    path = Path(str(res))
    if not path.is_file():
        raise FileNotFoundError(f"mistral_common does not ship {path}; is mistral_common installed?")
    return path


def _bpe_merges(pieces: list[tuple[str, float]], vocab: dict[str, int], mergeable: list[bool]) -> list[list[str]]:
    """BPE merges from SentencePiece pieces, ranked like SentencePiece applies them (by score).

    Mirrors transformers 4.x ``LlamaConverter`` (``generate_merges(vocab, vocab_scores)``): every
    split of every piece into two pieces of the vocab is a merge carrying the piece's score; merges
    are sorted by ``(score, len(left), len(right))`` descending, ties kept in (piece id, left id,
    right id) order.  (transformers 5.x ranks merges by piece id instead, which merges the
    whitespace runs "▁▁", "▁▁▁▁", ... -- score -1e9 in SentencePiece -- first.)
    """
    merges: list[tuple[str, str, float]] = []
    for idx, (piece, score) in enumerate(pieces):
        if not mergeable[idx]:
            continue
        local = [
            (piece[:k], piece[k:], score)
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [[left, right] for left, right, _ in merges]


def _tokenizer_json(model_file: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """``tokenizer.json`` content and the ``{bos,eos,unk}_token`` strings."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    n = sp.get_piece_size()
    pieces = [(sp.id_to_piece(i), float(sp.get_score(i))) for i in range(n)]
    vocab = {p: i for i, (p, _) in enumerate(pieces)}
    if len(vocab) != n:
        raise ValueError("duplicate pieces in the SentencePiece model")
    special = [sp.is_control(i) or sp.is_unknown(i) for i in range(n)]
    mergeable = [not (special[i] or sp.is_byte(i) or sp.is_unused(i)) for i in range(n)]
    unk, bos, eos = sp.id_to_piece(sp.unk_id()), sp.id_to_piece(sp.bos_id()), sp.id_to_piece(sp.eos_id())
    added_tokens = [
        {
            "id": i,
            "content": pieces[i][0],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i in range(n)
        if special[i]
    ]
    tokens = {"bos_token": bos, "eos_token": eos, "unk_token": unk}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        # SentencePiece's add_dummy_prefix + whitespace escaping, done as a normalizer (what the
        # official Mixtral tokenizer.json does): unlike a Metaspace pre-tokenizer, Prepend also
        # adds the "▁" when the text already starts with a space, as SentencePiece does.
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": _SPM_SPACE},
                {"type": "Replace", "pattern": {"String": " "}, "content": _SPM_SPACE},
            ],
        },
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [vocab[bos]], "tokens": [bos]}},
        },
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": _SPM_SPACE}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": _bpe_merges(pieces, vocab, mergeable),
        },
    }, tokens


def _write_tokenizer(path: Path, max_length: int) -> None:
    tok, tokens = _tokenizer_json(_spm_model_file())
    _write_json(path / "tokenizer.json", tok, indent=None)
    tok_config: dict[str, Any] = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "add_prefix_space": True,
        "legacy": True,
        **tokens,
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "spaces_between_special_tokens": False,
        "use_default_system_prompt": False,
        "model_max_length": max_length,
        "added_tokens_decoder": {
            str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tok["added_tokens"]
        },
        "chat_template": MIXTRAL_CHAT_TEMPLATE,
    }
    _write_json(path / "tokenizer_config.json", tok_config)
    _write_json(path / "special_tokens_map.json", tokens)


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def _write_json(path: Path, obj: Any, indent: int | None = 2) -> None:
    text = json.dumps(obj, indent=indent, ensure_ascii=False, separators=None if indent else (",", ":"))
    path.write_text(text + "\n", encoding="utf-8")


def build_demo_model(path: str | os.PathLike[str], seed: int = 0,
                     overrides: dict[str, Any] | None = None) -> Path:
    """Write the demo checkpoint (weights, configs, tokenizer) into ``path``; returns ``path``.

    The output is a pure function of ``seed`` and ``overrides`` (byte-identical files on every
    machine). ``overrides`` changes config fields (e.g. more layers, a smaller vocabulary) for
    benchmark variants; the tokenizer stays the demo's. Existing files are overwritten.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(DEMO_CONFIG)
    cfg.update(overrides or {})
    _write_json(out / "config.json", cfg)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]},
    )
    _write_weights(out, cfg, seed)
    _write_tokenizer(out, int(cfg["max_position_embeddings"]))
    return out


def demo_model_dir() -> Path:
    """Where the embedded default model is (or will be built by ``demo_model_path``)."""
    return cache_root() / f"demo-model-v{DEMO_MODEL_VERSION}"


def demo_model_cached() -> bool:
    """Whether the embedded default model is built already (else ``demo_model_path`` builds it)."""
    return demo_model_dir().is_dir()


def demo_model_path() -> Path:
    """Path of the embedded default model, building it into the cache on first use.

    The build goes to a temporary sibling directory that is renamed into place, so readers never
    see a half-written model and concurrent first uses (threads or processes) are safe: the
    loser of the rename race discards its copy.
    """
    root = cache_root()
    final = root / f"demo-model-v{DEMO_MODEL_VERSION}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        build_demo_model(tmp, seed=0)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # another process won the race; its copy is identical
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
