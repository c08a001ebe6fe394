"""The memory-bandwidth bound of a generate run: the bytes it must move over this machine's memcpy rate.

Decode on a CPU streams the weights from memory every step, so no engine can beat
``tokens / (bytes moved / bandwidth)``. The bytes of a run of ``batch`` prompts of ``prompt_len``
tokens, ``new_tokens`` generated each (the first by the prefill step):

* the prefill step reads every weight its tokens touch once and writes their KV;
* each decode step reads the attention weights, the final norm and the LM head, the rows of the
  embedding it looks up, the experts the batch's tokens are routed to in each layer, and the KV of
  every sequence's context (growing by one token a step).

Which experts a decode step touches is either measured (the distinct experts per layer per decode
step of these prompts' routing, ``touched``) or, when not measured, the expectation under uniform
routing, ``E * (1 - (1 - k/E) ** tokens)`` -- "all" once that rounds to E.

The bandwidth is a large torch tensor copy's bytes moved per second (each copied byte is read once
and written once; STREAM's Copy counts it so), with the benchmark's thread count.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from afdserve.model.config import ModelConfig


def memcpy_bytes_per_s(nbytes: int = 256 << 20, reps: int = 7, threads: int | None = None,
                       device: str = "cpu") -> float:
    """Bytes moved per second (read + written) by copying a ``nbytes`` tensor on ``device``, median
    of ``reps`` (on a GPU: a device-to-device copy, timed between synchronizations)."""
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        dst.copy_(src)  # first touch of dst's pages
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            dst.copy_(src)
            sync()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return 2 * nbytes / statistics.median(times)


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts of ``tokens`` tokens each routed to ``top_k`` of ``num_experts``
    uniformly at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class WeightBytes:
    attention_layer: int  # per layer: norms, q/k/v/o (with biases and q/k norms), router, shared expert
    expert: int  # one routed expert of one layer
    head: int  # final norm + LM head (read every step)
    embedding_row: int  # one row of the token embedding

    @classmethod
    def of(cls, cfg: ModelConfig, dtype_bytes: int) -> "WeightBytes":
        h, hd = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        attn = 2 * h + h * q + 2 * h * kv + q * h + cfg.num_experts * h
        if cfg.qkv_bias:
            attn += q + 2 * kv
        if cfg.qk_norm:
            attn += 2 * hd
        if cfg.has_shared_expert:
            attn += 3 * h * cfg.shared_expert_intermediate_size + h
        return cls(attention_layer=attn * dtype_bytes, expert=3 * h * cfg.moe_intermediate_size * dtype_bytes,
                   head=(h + cfg.vocab_size * h) * dtype_bytes, embedding_row=h * dtype_bytes)


def kv_token_bytes(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """K and V of one token, every layer."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def step_bytes(cfg: ModelConfig, batch: int, kv_len: float, touched: float,
               dtype_bytes: int = 2) -> tuple[float, float]:
    """(weight bytes, KV bytes) one decode step of ``batch`` sequences reads, each attending over
    ``kv_len`` positions, ``touched`` distinct experts per layer."""
    w = WeightBytes.of(cfg, dtype_bytes)
    weights = cfg.num_layers * (w.attention_layer + touched * w.expert) + w.head + batch * w.embedding_row
    return weights, batch * kv_len * kv_token_bytes(cfg, dtype_bytes)


@dataclass(frozen=True)
class Bound:
    """The bound of one point (batch, prompt length, new tokens)."""

    tok_s: float  # batch * new_tokens / (run bytes / bandwidth)
    run_bytes: float  # prefill + every decode step
    decode_step_bytes: float  # mean over the decode steps
    weight_step_bytes: float  # of which weights
    kv_step_bytes: float  # of which KV reads
    experts_touched: float  # per layer per decode step
    basis: str  # "routed" (measured), "expected" (uniform routing) or "all"


def run_bound(cfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int, bandwidth: float,
              touched: float | None = None, dtype_bytes: int = 2) -> Bound:
    """The memory-bandwidth bound of generating ``new_tokens`` for each of ``batch`` prompts;
    ``touched``: measured distinct experts per layer per decode step (None: uniform routing)."""
    if min(batch, prompt_len, new_tokens) < 1 or bandwidth <= 0:
        raise ValueError("batch, prompt_len and new_tokens must be >= 1 and the bandwidth > 0")
    w = WeightBytes.of(cfg, dtype_bytes)
    e, k, layers = cfg.num_experts, cfg.top_k, cfg.num_layers
    if touched is None:
        touched = expected_experts(e, k, batch)
        basis = "all" if round(touched, 2) >= e else "expected"
    else:
        basis = "routed"
    kv_token = kv_token_bytes(cfg, dtype_bytes)
    steps = new_tokens - 1
    weights = step_bytes(cfg, batch, 0, touched, dtype_bytes)[0]
    # decode step j = 2..n attends over prompt_len + j - 1 positions
    kv_reads = sum(batch * (prompt_len + j - 1) * kv_token for j in range(2, new_tokens + 1))
    prefill = (layers * (w.attention_layer + expected_experts(e, k, batch * prompt_len) * w.expert) + w.head
               + batch * prompt_len * (w.embedding_row + kv_token))
    run = prefill + steps * weights + kv_reads
    return Bound(tok_s=batch * new_tokens * bandwidth / run, run_bytes=run,
                 decode_step_bytes=(weights + kv_reads / steps) if steps else 0.0,
                 weight_step_bytes=weights if steps else 0.0, kv_step_bytes=kv_reads / steps if steps else 0.0,
                 experts_touched=touched, basis=basis)
