# SPDX-License-Identifier: Apache-2.0
# Ported from vLLM's unified Triton attention (vllm/v1/attention/ops/triton_unified_attention.py,
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project; authors Burkhard Ringlein,
# Jan van Lunteren, Chih-Chieh Yang, Thomas Parnell), reduced to what afdserve runs: its 2D kernel
# over a cache of slots [block * block_size + offset, kv_heads, head_dim], causal, GQA, sliding
# windows, sinks and FP8 caches (a scale per block and head). Changes: the cache addressed by slot, loads masked to the keys a query block
# can see (blocks a sliding window gave back are -1 in the table and never read), float32 dots in
# IEEE precision (float32 models, and the interpreter, whose bfloat16 dot is wrong in triton 3.9).
"""Paged attention in Triton: one kernel for a flat batch of prefill pieces (whole prompts, chunks
after a cached prefix) and decodes, reading the KV cache in place through the block tables.

Each program takes ``BLOCK_Q`` query tokens of one sequence times the ``QUERIES_PER_KV`` query
heads of one KV head (``BLOCK_M`` rows), and runs an online softmax over the sequence's key tiles.
Imported only through ``afdserve.backends.triton.load``, which decides interpreted (CPU tensors)
or compiled (CUDA) before the kernels are defined."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_seq(query_start_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks hold global block ``q_block`` (binary search over the
    cumulative query lengths, one block boundary per sequence)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, sinks_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr,
    k_scale_ptr, v_scale_ptr, scale, num_seqs, table_width,
    q_stride0, q_stride1, o_stride0, o_stride1, k_stride0, k_stride1, v_stride0, v_stride1, table_stride,
    scale_stride,
    NUM_HEADS: tl.constexpr, QUERIES_PER_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    WINDOW: tl.constexpr, USE_SINKS: tl.constexpr, F32_DOT: tl.constexpr, FP8_KV: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)  # this program's query block within its sequence
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys before the first new token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_t = tl.arange(0, TILE)
    q_pos = local * BLOCK_Q + offs_m // QUERIES_PER_KV  # [BLOCK_M]: each row's token within the piece
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_ok = (q_pos < q_len) & (head < NUM_HEADS)
    d_ok = offs_d < HEAD
    row = (q_start + q_pos).to(tl.int64)
    q = tl.load(q_ptr + row[:, None] * q_stride0 + head[:, None] * q_stride1 + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if F32_DOT:
        q = q.to(tl.float32)

    if USE_SINKS:  # one more value-less logit per head: the running max and sum start from it
        m_i = tl.load(sinks_ptr + head, mask=head < NUM_HEADS, other=float("-inf")).to(tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    # keys this block's queries can see: [key_lo, key_hi)
    last_q = tl.minimum(local * BLOCK_Q + (BLOCK_M - 1) // QUERIES_PER_KV, q_len - 1)
    key_hi = context + last_q + 1
    key_lo = 0
    if WINDOW > 0:
        key_lo = tl.maximum(context + local * BLOCK_Q - WINDOW + 1, 0)
    q_abs = context + q_pos  # [BLOCK_M]
    for j in range(key_lo // TILE, tl.cdiv(key_hi, TILE)):
        key = j * TILE + offs_t  # [TILE]
        key_ok = (key >= key_lo) & (key < key_hi)
        block = tl.load(block_table_ptr + seq.to(tl.int64) * table_stride + key // BLOCK_SIZE,
                        mask=key_ok & (key // BLOCK_SIZE < table_width), other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + key % BLOCK_SIZE
        k = tl.load(k_ptr + slot[None, :] * k_stride0 + kv_head * k_stride1 + offs_d[:, None],
                    mask=d_ok[:, None] & key_ok[None, :], other=0.0)  # [HEAD_PAD, TILE]
        v = tl.load(v_ptr + slot[:, None] * v_stride0 + kv_head * v_stride1 + offs_d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE, HEAD_PAD]
        if FP8_KV:  # e4m3 times the scale of its block and head, in float32, then the model's dtype
            at = block * scale_stride + kv_head
            k_s = tl.load(k_scale_ptr + at, mask=key_ok, other=0.0)
            v_s = tl.load(v_scale_ptr + at, mask=key_ok, other=0.0)
            k = (k.to(tl.float32) * k_s[None, :]).to(q_ptr.dtype.element_ty)
            v = (v.to(tl.float32) * v_s[:, None]).to(q_ptr.dtype.element_ty)
        if F32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, k, input_precision="ieee") * scale
        else:
            s = tl.dot(q, k) * scale
        seen = row_ok[:, None] & key_ok[None, :] & (key[None, :] <= q_abs[:, None])
        if WINDOW > 0:
            seen = seen & (q_abs[:, None] - key[None, :] < WINDOW)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row with nothing seen yet
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if F32_DOT:
            acc += tl.dot(p, v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # 0: a padding row, never stored
    tl.store(out_ptr + row[:, None] * o_stride0 + head[:, None] * o_stride1 + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
