"""Roofline estimates: k1..k4 from catalog specs when no profile has been measured.

Everything here is an *estimate* (peak FLOPS and bandwidth from spec sheets); plans built from it
are labelled ``roofline-estimate``.

Per micro-batch and layer, for a node of ``tp`` GPUs:

* attention ``Ta = k1(s) * b_a + k2``: ``k2`` streams the attention-side weights (QKV, output,
  router, shared experts) once, ``k1`` is per token: its GEMM FLOPs, the TP all-reduce of its
  hidden vector, and -- proportional to ``s`` -- reading its KV cache and the attention FLOPs;
* experts ``Te = k3 * b_e + k4``: ``k4`` streams the node's expert weights once, ``k3`` is per
  token-expert pair: the two FFN GEMMs' FLOPs plus the TP all-reduce of the output.

Memory time and compute time are *added* (no overlap), which is conservative near the ridge point
and exact far from it on either side.  §2.3's two formulas are :func:`roofline_batch` and
:func:`moe_ffn_utilization`.
"""

from __future__ import annotations

from dataclasses import dataclass

from afdserve.planner.catalog import GPUSpec
from afdserve.planner.costs import AttentionCost, ExpertCost
from afdserve.planner.spec import ModelSpec

__all__ = ["RooflineOptions", "roofline_batch", "moe_ffn_utilization", "attention_cost", "expert_cost"]


@dataclass(frozen=True)
class RooflineOptions:
    """Derating of spec-sheet peaks (1.0 = the pure roofline)."""

    compute_eff: float = 1.0
    mem_eff: float = 1.0
    tp_sync: bool = True


def roofline_batch(flops: float, mem_bw: float, bytes_per_param: float = 2.0) -> float:
    """Tokens a ``b x h`` by ``h x n`` GEMM needs to be compute-bound: ``2bhn/F >= bytes*hn/B``.

    For bf16 this is ``F / B`` (paper §2.3: 312 TFLOPS / 2 TB/s = 156 tokens on an A100).
    """
    return flops * bytes_per_param / (2.0 * mem_bw)


def moe_ffn_utilization(batch: float, top_k: int, num_experts: int, flops: float, mem_bw: float) -> float:
    """Theoretical FFN utilisation of a colocated MoE at decoding batch ``b`` (paper §2.3):
    ``min(K/E * B/F * b, 1)``; a dense model is the case ``K = E``."""
    return min(top_k / num_experts * mem_bw / flops * batch, 1.0)


def _allreduce_per_token_s(gpu: GPUSpec, tp: int, hidden: int, act_bytes: float) -> float:
    if tp <= 1:
        return 0.0
    return 2.0 * (tp - 1) / tp * hidden * act_bytes / gpu.intra_node_Bps_per_direction


def attention_cost(spec: ModelSpec, gpu: GPUSpec, tp: int, opts: RooflineOptions | None = None) -> AttentionCost:
    o = opts or RooflineOptions()
    f = gpu.flops * o.compute_eff
    bw = gpu.mem_bw_Bps * o.mem_eff
    p = spec.attention_side_params_per_layer
    k2 = p * spec.bytes_per_param / tp / bw
    k1_tok = 2.0 * p / tp / f
    if o.tp_sync:
        k1_tok += _allreduce_per_token_s(gpu, tp, spec.hidden_size, spec.act_bytes)
    kv_read = spec.kv_bytes_per_token_layer * spec.kv_replication(tp) / tp / bw
    k1_ctx = kv_read + spec.attention_core_flops_per_ctx_token() / tp / f
    return AttentionCost(k1_tok=k1_tok, k1_ctx=k1_ctx, k2=k2, tp=tp, gpu=gpu.name)


def expert_cost(
    spec: ModelSpec, gpu: GPUSpec, tp: int, experts_per_node: int = 1, opts: RooflineOptions | None = None
) -> ExpertCost:
    o = opts or RooflineOptions()
    f = gpu.flops * o.compute_eff
    bw = gpu.mem_bw_Bps * o.mem_eff
    k4 = experts_per_node * spec.expert_params * spec.bytes_per_param / tp / bw
    k3 = 2.0 * spec.expert_params / tp / f
    if o.tp_sync:
        k3 += _allreduce_per_token_s(gpu, tp, spec.hidden_size, spec.act_bytes)
    return ExpertCost(k3=k3, k4=k4, tp=tp, experts_per_node=experts_per_node, gpu=gpu.name)
