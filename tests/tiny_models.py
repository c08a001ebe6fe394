"""Tiny random-weight HF checkpoints of each supported architecture (transformers is a test dependency)."""

from __future__ import annotations

import json
import random
import warnings
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


def generate_losing(llm, prompts, params, victim: str, fault: str) -> list[list[int]]:
    """Generates ``prompts`` while worker ``victim`` is lost mid-decode, once every request has
    tokens: ``fault`` "kill" (SIGKILL) or "stop" (SIGSTOP for 5 s, the stall itself, then SIGCONT if
    it was not fenced yet). Returns each request's token ids; fails if generation hung or raised."""
    import os
    import signal
    import threading
    import time

    started, result = threading.Event(), {}

    def run():
        try:
            ids = [llm.engine.add_request(p, params) for p in prompts]
            done, seen = {}, set()
            while len(done) < len(ids):
                for o in llm.engine.get_outputs(timeout=1.0):
                    assert o.error is None, o.error
                    seen.add(o.request_id)
                    if o.finished:
                        done[o.request_id] = o.outputs[0].token_ids
                if len(seen) == len(ids):
                    started.set()
            result["out"] = [done[r] for r in ids]
        except Exception as e:  # noqa: BLE001
            result["error"] = e

    target = llm.engine.workers[victim]
    th = threading.Thread(target=run)
    th.start()
    assert started.wait(30)  # decoding by now
    os.kill(target.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    if fault == "stop":
        time.sleep(5)  # the fault itself: a 5 s stall
        try:
            os.kill(target.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # fenced already
    th.join(120)
    assert not th.is_alive(), f"generate hung after {victim} was lost"
    assert "error" not in result, result.get("error")
    return result["out"]


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu") -> list[list[int]]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, EOS included
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
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


# -- DeepSeek-V2 / V3 (MLA) and dense layers inside MoE models (issue 15) --

def deepseek_config(version: int, **over):
    """A tiny DeepSeek-V2/V3 config: MLA with odd head count, groups of experts, a dense first layer."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=60, intermediate_size=72, moe_intermediate_size=24,
                  num_hidden_layers=3, num_attention_heads=5, n_routed_experts=8, n_shared_experts=2,
                  num_experts_per_tok=3, kv_lora_rank=20, q_lora_rank=28, qk_rope_head_dim=6, qk_nope_head_dim=10,
                  v_head_dim=12, first_k_dense_replace=1, max_position_embeddings=512, initializer_range=0.1,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if version == 2:
        common |= dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5)
        cfg = tf.DeepseekV2Config(**(common | over))
    else:
        common |= dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
        cfg = tf.DeepseekV3Config(**(common | over))
    return cfg


def make_deepseek_checkpoint(path: Path, version: int, seed: int = 0, **over) -> Path:
    """A tiny DeepSeek checkpoint; V3's ``e_score_correction_bias`` gets non-zero random values."""
    import transformers as tf

    torch.manual_seed(seed)
    cls = tf.DeepseekV2ForCausalLM if version == 2 else tf.DeepseekV3ForCausalLM
    model = cls(deepseek_config(version, **over)).eval()
    if version == 3:
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(torch.rand(gate.e_score_correction_bias.shape) * 0.4 - 0.2)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


# -- gpt-oss, sliding windows and RoPE scaling (issue 15) --

def make_gpt_oss_checkpoint(path: Path, seed: int = 0, **over) -> Path:
    """A tiny gpt-oss: sinks (random, so they matter), biases everywhere, sliding and full attention
    alternating (window 8), YaRN; ``over`` changes any config field."""
    import transformers as tf

    fields = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=48, num_local_experts=6,
                  num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512, initializer_range=0.3,
                  bos_token_id=1, eos_token_id=2, swiglu_limit=1.5,
                  rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "truncate": False, "original_max_position_embeddings": 128,
                                   "rope_theta": 150000.0})
    torch.manual_seed(seed)
    model = tf.GptOssForCausalLM(tf.GptOssConfig(**(fields | over))).eval()
    with torch.no_grad():  # transformers initialises sinks and biases to zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                p.normal_(0, 0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


def mxfp4_twins(src: Path, quantized: Path, reference: Path) -> None:
    """From the gpt-oss checkpoint ``src``: ``quantized``, its experts in MXFP4 (blocks of 32 FP4
    values with a power-of-two scale, as openai's release stores them) with a ``quantization_config``,
    and ``reference``, the same model with those experts dequantized by transformers
    (``convert_moe_packed_tensors``), as a float32 checkpoint."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

    lut = torch.tensor(FP4_VALUES)
    state = load_file(str(src / "model.safetensors"))
    q_state, r_state = {}, {}
    for name, t in state.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            q_state[name] = r_state[name] = t
            continue
        w = t.transpose(1, 2).float()  # [E, out, in]: quantized along the input
        e, rows, cols = w.shape
        groups = w.reshape(e, rows, cols // 32, 32)
        exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
        scaled = groups / torch.exp2(exp)[..., None]
        idx = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # nearest FP4 value
        blocks = (idx[..., 0::2] | (idx[..., 1::2] << 4)).contiguous()
        scales = (exp.int() + 127).to(torch.uint8)
        q_state[name + "_blocks"], q_state[name + "_scales"] = blocks, scales
        r_state[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    for path, st in ((quantized, q_state), (reference, r_state)):
        path.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, path / f.name)
        save_file({k: v.contiguous() for k, v in st.items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    raw = json.loads((quantized / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (quantized / "config.json").write_text(json.dumps(raw))


def prompts(lens=(3, 9, 17, 30), seed=0) -> list[list[int]]:
    """Random prompts of the given lengths, of token ids past the special ones (3..255)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lens]


def compiled_generate(path: Path, ps: list[list[int]], params, before=None, **llm_options):
    """``ps`` generated by an engine built with ``llm_options`` (``compile=True`` among them) after
    ``torch._dynamo.reset()``, a failed or refused compilation an error (it would warn and run eager);
    ``before(llm)`` runs before the generate. Returns the token ids and dynamo's counters of the run
    (``unique_graphs`` in ``stats``, ``graph_break``)."""
    from afdserve import LLM
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with LLM(str(path), **llm_options) as llm:
            if before is not None:
                before(llm)
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    return [list(o.outputs[0].token_ids) for o in outs], {k: dict(v) for k, v in counters.items()}
