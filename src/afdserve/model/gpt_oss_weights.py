"""gpt-oss's tensors that the other families do not have, in afdserve's layouts.

* attention: ``o_proj.bias`` and the per-head ``sinks``;
* router: ``mlp.router.weight`` / ``.bias``;
* experts, stacked per layer: ``gate_up_proj`` [E, H, 2I] with gate and up *interleaved* along the
  last axis (columns 0, 2, 4... are gate, 1, 3, 5... up), ``gate_up_proj_bias`` [E, 2I],
  ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]. One expert becomes ([2I, H] gate then up,
  [H, I] down, [2I] bias, [H] bias), the layout of ``ExpertPart``.

MXFP4 checkpoints (openai's release) store the expert projections as ``*_blocks`` [E, out, G, 16]
uint8 (two FP4 e2m1 values per byte, low nibble first, 32 per block) and ``*_scales`` [E, out, G]
uint8 (a power of two, biased by 127); they are dequantized to the load dtype here, one expert at a
time, as transformers' ``convert_moe_packed_tensors`` does.
"""

from __future__ import annotations

import torch

from afdserve.model.attention import AttentionPart
from afdserve.model.config import ModelConfig
from afdserve.model.loader import CheckpointReader


def load_attention_extras(a: AttentionPart, r: CheckpointReader, prefix: str, dtype: torch.dtype) -> None:
    """The output projection's bias and the sinks of the attention at ``prefix`` (``model.layers.N.``)."""
    cfg = a.cfg
    if cfg.o_proj_bias:
        a.o_proj.bias.copy_(r.get(prefix + "self_attn.o_proj.bias", (cfg.hidden_size,), dtype))
    if a.sinks is not None:
        a.sinks.copy_(r.get(prefix + "self_attn.sinks", (cfg.num_heads,), dtype))


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[out, G, 16] uint8 blocks and [out, G] uint8 scales -> [out, G * 32] weights."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    vals = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [out, G, 16, 2]
    vals = torch.ldexp(vals.reshape(*blocks.shape[:-1], -1), (scales.to(torch.int32) - 127)[..., None])
    return vals.reshape(blocks.shape[0], -1).to(dtype)


def _read_mxfp4_expert(r: CheckpointReader, cfg: ModelConfig, moe: str, expert: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    out = []
    for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
        g = -(-cols // 32)
        blocks = r.get_rows(f"{moe}.experts.{name}_blocks", expert, (rows, g, 16), torch.uint8)
        scales = r.get_rows(f"{moe}.experts.{name}_scales", expert, (rows, g), torch.uint8)
        out.append(dequantize_mxfp4(blocks, scales, dtype)[:, :cols])
    gate_up, down = out  # [2I, H] with gate and up interleaved by row, [H, I]
    return torch.cat([gate_up[0::2], gate_up[1::2]]).contiguous(), down.contiguous()


def read_expert(r: CheckpointReader, cfg: ModelConfig, moe: str, expert: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert of the MoE block at ``moe`` (``model.layers.N.mlp``), de-interleaved."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    bias = r.get_rows(f"{moe}.experts.gate_up_proj_bias", expert, (2 * i,), dtype)
    b_down = r.get_rows(f"{moe}.experts.down_proj_bias", expert, (h,), dtype)
    if f"{moe}.experts.gate_up_proj_blocks" in r:
        w, w_down = _read_mxfp4_expert(r, cfg, moe, expert, dtype)
    else:
        gate_up = r.get_rows(f"{moe}.experts.gate_up_proj", expert, (h, 2 * i), dtype)
        w = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1).T.contiguous()
        w_down = r.get_rows(f"{moe}.experts.down_proj", expert, (i, h), dtype).T.contiguous()
    return w, w_down, torch.cat([bias[0::2], bias[1::2]]), b_down
