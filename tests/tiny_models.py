"""Tiny random-weight HF checkpoints of each supported architecture (transformers is a test dependency)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
VOCAB = 256
_CORPUS = ["the quick brown fox jumps over the lazy dog", "mixture of experts serve tokens fast",
           "attention nodes and expert nodes", "hello world 0123456789", "ping pong pipeline micro batches"] * 20


def write_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "tokenizer_class": "PreTrainedTokenizerFast"}))


def hf_config(arch: str, **over):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=512,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if arch == "mixtral":
        cfg = tf.MixtralConfig(num_local_experts=6, intermediate_size=48, **common)
    elif arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(num_experts=6, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                intermediate_size=96, norm_topk_prob=False, **common)
    else:
        cfg = tf.Qwen3MoeConfig(num_experts=6, moe_intermediate_size=48, intermediate_size=96, head_dim=16,
                                norm_topk_prob=True, **common)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def make_checkpoint(path: Path, arch: str, seed: int = 0, shard_size: str | None = None, **over) -> Path:
    import transformers as tf

    cls = {"mixtral": tf.MixtralForCausalLM, "qwen2_moe": tf.Qwen2MoeForCausalLM,
           "qwen3_moe": tf.Qwen3MoeForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(hf_config(arch, **over)).eval()
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **kwargs)
    write_tokenizer(path)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, EOS included
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                           do_sample=False, pad_token_id=0)
        outs.append(g[0, len(p):].tolist())
    return outs


#: A chat template that declares tools (Hermes / Qwen 2.5 style, compact for the tiny tokenizer).
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %}{{ t.function | tojson }}{% endfor %}"
    "call as <tool_call>{...}</tool_call>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}\n"
    "{% elif m.role == 'tool' %}<|tool|>{{ m.tool_call_id }}: {{ m.content }}\n"
    "{% else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tool_checkpoint(path):
    """A tiny Mixtral whose tokenizer_config.json has a chat template that declares tools."""
    make_checkpoint(path, "mixtral", max_position_embeddings=2048)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": TOOL_TEMPLATE}))
    return path
