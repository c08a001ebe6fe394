"""The ``triton`` attention backend: the step's tokens attend over the paged KV cache in place, one
kernel launch per layer for prefill pieces and decodes together (``paged_attention``, a custom op
with a fake implementation, so ``torch.compile`` and CUDA graphs take it whole). Its context is the
cpu backend's (``PagedContext``: block tables, context lengths, query offsets), staged once per
step. MLA's latent attention stays on the torch backend (``latent`` is False)."""

from __future__ import annotations

import torch

from afdserve.backends.base import LinearOp, NormBackend
from afdserve.backends.pytorch.attention import TorchHalf
from afdserve.backends.step import PagedContext, StepBuffers, StepLayout
from afdserve.backends.triton import load

TILE = 32  # keys per inner step


class TritonAttention:
    name = "triton"
    latent = False

    def __init__(self, norm: NormBackend, device: torch.device):
        self.norm = norm  # RoPE with the cache write
        load(device)

    def prepare(self, layout: StepLayout, windows: tuple[int, ...], buffers: StepBuffers) -> PagedContext:
        return PagedContext.staged(layout, buffers)

    def bind(self, layer, router: LinearOp | None) -> TorchHalf:
        return TorchHalf(self, layer, router)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: PagedContext, window: int,
               sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
        """q [T, heads, D] of the step's tokens over the paged cache [slots, kv_heads, D]."""
        return paged_attention(q, k_cache, v_cache, ctx.block_tables, ctx.cu_q, ctx.kv_lens, sinks, scale, window,
                               ctx.block_size)


@torch.library.custom_op("afdserve::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start: torch.Tensor, seq_lens: torch.Tensor, sinks: torch.Tensor | None, scale: float,
                    window: int, block_size: int) -> torch.Tensor:
    """Causal attention of the flat batch's queries q [T, heads, D] (sequence i's are rows
    ``query_start[i]:query_start[i + 1]``, the last of its ``seq_lens[i]`` tokens) over the keys and
    values at cache slots ``block_table[i, p // block_size] * block_size + p % block_size``
    (caches [slots, kv_heads, D]); ``window`` > 0 keeps the last ``window`` keys of each query;
    ``sinks`` [heads]: one more value-less logit per head."""
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
        scale, num_seqs, block_table.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_table.stride(0),
        NUM_HEADS=heads, QUERIES_PER_KV=per_kv, BLOCK_SIZE=block_size, TILE=TILE, HEAD=d,
        HEAD_PAD=max(16, _pow2(d)), BLOCK_Q=block_q, BLOCK_M=block_m, WINDOW=window,
        USE_SINKS=sinks is not None,
        F32_DOT=q.dtype == torch.float32 or q.device.type == "cpu")  # cpu: the interpreter (bfloat16 dots wrong)
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_table, query_start, seq_lens, sinks, scale, window, block_size):
    return torch.empty_like(q)
