"""Prints docs/models.md's table: for each supported architecture, the KV-cache bytes one token
takes in one layer, measured from the allocator (a ``KVCache`` allocated the way the engine
allocates it, for the architecture's transformers default config, or for model folders given).

    PYTHONPATH=src python scripts/kv_bytes.py                     # bfloat16 cache, default configs
    PYTHONPATH=src python scripts/kv_bytes.py float32 PATH...     # float32, these model folders

Needs transformers (a test dependency) for the default configs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def default_configs() -> list[tuple[str, dict]]:
    import transformers as tf

    out = []
    for cls_name in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
                     "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        raw = getattr(tf, cls_name.replace("ForCausalLM", "Config"))().to_dict() | {"architectures": [cls_name]}
        # a default config may leave routing unset (DeepSeek-V2's top-k): it does not change the cache
        raw["num_experts_per_tok"] = raw.get("num_experts_per_tok") or 1
        out.append((f"`{cls_name}`", raw))
    return out


def rows(dtype: torch.dtype, configs: list[tuple[str, dict]]) -> list[str]:
    from afdserve.kvcache.cache import KVCache
    from afdserve.model.config import ModelConfig

    out = []
    for name, raw in configs:
        cfg = ModelConfig.from_dict(raw, source=name)
        block_size = 16
        kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, block_size, dtype, cfg.kv_latent_dim)
        per_layer = kv.bytes_per_token_per_layer()
        held = sum(t.numel() * t.element_size() for t in (kv.k, kv.v, kv.lat) if t is not None)
        assert held == per_layer * cfg.num_layers * block_size, (name, held, per_layer)
        if cfg.mla is not None:
            layout = f"latent: kv_lora_rank {cfg.mla.kv_lora_rank} + qk_rope_head_dim {cfg.mla.qk_rope_head_dim}"
        else:
            layout = f"K+V: 2 x {cfg.num_kv_heads} kv heads x head_dim {cfg.head_dim}"
        windows = sorted(set(cfg.sliding_windows) - {0})
        if not windows:
            window = "-"
        else:
            n = sum(1 for w in cfg.sliding_windows if w)
            window = f"{windows[0]} on {n}/{cfg.num_layers} layers" + (", blocks freed" if cfg.kv_window else "")
        out.append(f"| {name} | {cfg.num_layers} | {layout} | {per_layer:,} | "
                   f"{per_layer * cfg.num_layers:,} | {window} |")
    return out


def main() -> None:
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    args = sys.argv[1:]
    name = args.pop(0) if args and args[0] in dtypes else "bfloat16"
    configs = [(f"`{p}`", json.loads((Path(p) / "config.json").read_text())) for p in args] or default_configs()
    print(f"| model | layers | cached per token and layer | bytes / token / layer ({name}) "
          f"| bytes / token (all layers) | sliding window |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows(dtypes[name], configs)))


if __name__ == "__main__":
    main()
