"""The config fields of sliding-window attention (every family) and of gpt-oss, and the refusal of
quantized checkpoints.

Which layers attend through a window, as transformers applies the config:

* Mixtral: every layer when ``sliding_window`` is set;
* Qwen3-MoE: every layer when ``use_sliding_window`` (and ``sliding_window``) is set;
* Qwen2-MoE: when ``use_sliding_window``, the layers ``layer_types`` names ``sliding_attention``
  (transformers writes them into config.json; without them, its rule: even layers below
  ``max_window_layers``);
* gpt-oss: the layers ``layer_types`` names ``sliding_attention`` (without them: even layers).

A window of W keys: the token at position p attends to positions p - W + 1 .. p.
"""

from __future__ import annotations

from typing import Any, Callable

from afdserve.errors import ModelError


def check_not_quantized(raw: dict[str, Any], source: str) -> None:
    """Quantized checkpoints are refused with a clear error at start-up, but for gpt-oss's MXFP4
    experts, which are dequantized at load (``gpt_oss_weights``)."""
    q = raw.get("quantization_config")
    if q:
        method = q.get("quant_method", "unknown") if isinstance(q, dict) else str(q)
        gpt_oss = raw.get("model_type") == "gpt_oss" or "GptOssForCausalLM" in (raw.get("architectures") or [])
        if method == "mxfp4" and gpt_oss:
            return
        raise ModelError(
            f"{source}: the checkpoint is quantized (quantization_config.quant_method = {method!r}); "
            f"afdserve loads bfloat16/float16/float32 weights (and gpt-oss's MXFP4 experts) only: "
            f"use an unquantized checkpoint"
        )


def layer_windows(family: str, raw: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The window of every layer (0: full attention); () when no layer has one."""
    window = int(raw.get("sliding_window") or 0)
    if window <= 0:
        return ()
    if family in ("qwen2_moe", "qwen3_moe") and not raw.get("use_sliding_window", False):
        return ()
    types = raw.get("layer_types")
    if family in ("mixtral", "qwen3_moe"):
        sliding = [True] * num_layers
    elif types:
        if len(types) != num_layers:
            raise ModelError(f"layer_types has {len(types)} entries, the model {num_layers} layers")
        sliding = [t == "sliding_attention" for t in types]
    elif family == "qwen2_moe":
        limit = int(raw.get("max_window_layers", num_layers))
        sliding = [(i + 1) % 2 == 1 and i < limit for i in range(num_layers)]
    else:  # gpt-oss's default: sliding and full attention alternate, starting with a window
        sliding = [(i + 1) % 2 == 1 for i in range(num_layers)]
    if not any(sliding):
        return ()
    return tuple(window if s else 0 for s in sliding)


def gpt_oss_fields(raw: dict[str, Any], need: Callable[[str], Any]) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a gpt-oss config (all but the common ones)."""
    return dict(
        moe_intermediate_size=int(need("intermediate_size")),
        num_experts=int(need("num_local_experts")),
        top_k=int(need("num_experts_per_tok")),
        norm_topk_prob=False,  # softmax over the top-k logits: the weights sum to 1 already
        qkv_bias=bool(raw.get("attention_bias", True)),
        o_proj_bias=bool(raw.get("attention_bias", True)),
        attention_sinks=True,
        router_bias=True,
        expert_bias=True,
        expert_activation="swiglu_oai",
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )
