"""The ``triton`` attention backend: the step's tokens attend over the paged KV cache in place, one
kernel launch per layer for prefill pieces and decodes together (``paged_attention``, a custom op
with a fake implementation, so ``torch.compile`` and CUDA graphs take it whole). Its context is the
cpu backend's (``PagedContext``: block tables, context lengths, query offsets), staged once per
step. MLA's latent attention stays on the torch backend (``latent`` is False)."""

from __future__ import annotations

import torch

from afdserve.backends.base import LinearOp, NormBackend
from afdserve.backends.pytorch.attention import TorchHalf
from afdserve.backends.pytorch.kv import kv_access
from afdserve.backends.step import PagedContext, StepBuffers, StepLayout
from afdserve.backends.triton import load
from afdserve.kvcache.fp8 import Fp8Pages

TILE = 32  # keys per inner step


class TritonAttention:
    name = "triton"
    latent = False

    def __init__(self, norm: NormBackend, device: torch.device, fp8_kv: bool = False):
        self.norm = norm  # RoPE with the cache write
        self.kv = kv_access(fp8_kv)  # how RoPE's keys and values are written (afdserve.backends.pytorch.kv)
        self.attend = self._attend_fp8 if fp8_kv else self._attend
        load(device)

    def prepare(self, layout: StepLayout, windows: tuple[int, ...], buffers: StepBuffers) -> PagedContext:
        return PagedContext.staged(layout, buffers)

    def bind(self, layer, router: LinearOp | None) -> TorchHalf:
        return TorchHalf(self, layer, router)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: PagedContext, window: int,
                sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
        """q [T, heads, D] of the step's tokens over the paged cache [slots, kv_heads, D]."""
        return paged_attention(q, k_cache, v_cache, ctx.block_tables, ctx.cu_q, ctx.kv_lens, sinks, scale, window,
                               ctx.block_size)

    def _attend_fp8(self, q: torch.Tensor, k_cache: Fp8Pages, v_cache: Fp8Pages, ctx: PagedContext, window: int,
                    sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
        """``_attend`` over the FP8 cache: the kernel scales each key and value by its block's and head's scale."""
        return paged_attention(q, k_cache.data, v_cache.data, ctx.block_tables, ctx.cu_q, ctx.kv_lens, sinks, scale,
                               window, ctx.block_size, k_cache.scale, v_cache.scale)


@torch.library.custom_op("afdserve::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start: torch.Tensor, seq_lens: torch.Tensor, sinks: torch.Tensor | None, scale: float,
                    window: int, block_size: int, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the flat batch's queries q [T, heads, D] (sequence i's are rows
    ``query_start[i]:query_start[i + 1]``, the last of its ``seq_lens[i]`` tokens) over the keys and
    values at cache slots ``block_table[i, p // block_size] * block_size + p % block_size``
    (caches [slots, kv_heads, D]); ``window`` > 0 keeps the last ``window`` keys of each query;
    ``sinks`` [heads]: one more value-less logit per head. ``k_scale``/``v_scale`` [num_blocks,
    kv_heads] float32: the caches are FP8 (``afdserve.kvcache.fp8``), a value is its e4m3 times these."""
    kernels = load(q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    tokens, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    per_kv = heads // kv_heads
    block_m = max(16, _pow2(per_kv))
    block_q = block_m // per_kv
    num_seqs = seq_lens.shape[0]
    if tokens == 0 or num_seqs == 0:
        return out
    grid = (tokens // block_q + num_seqs, kv_heads)
    kernels.paged_attention_kernel[grid](
        out, q, k_cache, v_cache, sinks if sinks is not None else q, block_table, seq_lens, query_start,
        q if k_scale is None else k_scale, q if v_scale is None else v_scale, scale, num_seqs, block_table.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_table.stride(0), 0 if k_scale is None else k_scale.stride(0),
        NUM_HEADS=heads, QUERIES_PER_KV=per_kv, BLOCK_SIZE=block_size, TILE=TILE, HEAD=d,
        HEAD_PAD=max(16, _pow2(d)), BLOCK_Q=block_q, BLOCK_M=block_m, WINDOW=window,
        USE_SINKS=sinks is not None, FP8_KV=k_scale is not None,
        F32_DOT=q.dtype == torch.float32 or q.device.type == "cpu")  # cpu: the interpreter (bfloat16 dots wrong)
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_table, query_start, seq_lens, sinks, scale, window, block_size, k_scale=None,
      v_scale=None):
    return torch.empty_like(q)
