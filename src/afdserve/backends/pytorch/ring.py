"""The attention math of a context-parallel prefill (pass-KV ring), in device-agnostic PyTorch.

A rank's queries attend to each rank's keys apart (``partial``: the float32 outputs normalized over
those keys, with their log-sum-exp), and the partials are combined exactly by their log-sum-exps
(``merge``): with ``lse_i`` the log of partial i's softmax denominator,
``o = sum_i exp(lse_i - lse) o_i`` where ``lse = logsumexp_i lse_i`` (plus a sink's logit, gpt-oss).
MLA's absorbed form attends to the latents as one shared key head whose values are the latents'
first ``r`` dimensions (``latent_partial``); the merge is linear in the values, so ``W_UV`` is
applied once after it.

Visibility is by position: key j is seen by query i iff ``k_pos[j] <= q_pos[i]`` and, with a window
W, ``q_pos[i] - k_pos[j] < W``. A query that sees no key of a partial gets ``lse = -inf`` and a zero
output (it weighs nothing in the merge).

``partial`` runs on any device (scores materialized per chunk of queries); ``cpu_partial`` computes
the same through torch's fused CPU flash-attention kernel (equal within float32 rounding, about twice
as fast). ``RingAttention.on(device)`` picks one once, for a device.
"""

from __future__ import annotations

import torch

SCORE_BYTES = 64 << 20  # float32 scores per chunk of queries, at most (one chunk holds one query at least)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int = 0) -> torch.Tensor:
    """bool [Tq, Tk]: which keys each query sees (causal, through ``window`` keys; 0: all)."""
    d = q_pos[:, None] - k_pos[None, :]
    return (d >= 0) & (d < window) if window else d >= 0


def _empty(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A partial's (o, lse) before any key is seen (zeros, -inf), its heads checked to group."""
    t, h = q.shape[:2]
    if h % k.shape[1]:
        raise ValueError(f"partial: {h} query heads are not a multiple of {k.shape[1]} kv heads")
    return (q.new_zeros(t, h, v.shape[-1], dtype=torch.float32),
            q.new_full((t, h), float("-inf"), dtype=torch.float32))


def partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
            scale: float, window: int = 0, mode: str = "mask") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q [T, H, D] at ``q_pos`` (int64 [T]) over keys k [L, kv_heads, D] and values
    v [L, kv_heads, Dv] at ``k_pos`` (int64 [L]): (o float32 [T, H, Dv], lse float32 [T, H]). Head h
    reads kv head ``h // (H / kv_heads)`` (GQA); the scores are ``scale * q . k``; computed in
    float32 in chunks of queries whose scores take at most ``SCORE_BYTES``; every ``mode`` (``blocks``)
    is masked by the positions."""
    t, h, _ = q.shape
    kvh, dv, n_keys = k.shape[1], v.shape[-1], k.shape[0]
    out, lse = _empty(q, k, v)
    if t == 0 or n_keys == 0:
        return out, lse
    g = h // kvh
    keys = k.float().permute(1, 2, 0)  # [kvh, D, L]
    vals = v.float().transpose(0, 1)  # [kvh, L, Dv]
    step = max(1, SCORE_BYTES // (4 * h * n_keys))
    for s in range(0, t, step):
        e = min(t, s + step)
        n = e - s
        qs = q[s:e].float().view(n, kvh, g, -1).transpose(0, 1).reshape(kvh, n * g, -1)
        scores = torch.bmm(qs, keys).mul_(scale).view(kvh, n, g, n_keys)
        scores.masked_fill_(~visible(q_pos[s:e], k_pos, window)[None, :, None, :], float("-inf"))
        m = scores.amax(-1, keepdim=True)
        m = torch.where(torch.isneginf(m), 0.0, m)  # a query that sees nothing: exp(-inf - 0) = 0
        p = scores.sub_(m).exp_()
        denom = p.sum(-1)  # [kvh, n, g]
        o = torch.bmm(p.view(kvh, n * g, n_keys), vals).view(kvh, n, g, dv)
        o = o / denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]  # 0 / tiny = 0 where nothing is seen
        out[s:e] = o.permute(1, 0, 2, 3).reshape(n, h, dv)
        lse[s:e] = (m[..., 0] + denom.log()).permute(1, 0, 2).reshape(n, h)
    return out, lse


def cpu_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                scale: float, window: int = 0, mode: str = "mask") -> tuple[torch.Tensor, torch.Tensor]:
    """``partial`` through ``aten._scaled_dot_product_flash_attention_for_cpu`` (CPU tensors): the
    query heads of a kv head in the batch dimension. ``mode`` (``blocks``): "full" (every query sees
    every key: no mask), "causal" (queries and keys at the same positions) or "mask" (visibility as an
    additive mask, in chunks of queries whose mask takes at most ``SCORE_BYTES``). Values narrower
    than the keys are padded with zeros (the kernel needs one head size)."""
    t, h, d = q.shape
    kvh, dv, n_keys = k.shape[1], v.shape[-1], k.shape[0]
    out, lse = _empty(q, k, v)
    if t == 0 or n_keys == 0:
        return out, lse
    g = h // kvh
    qs = q.float().view(t, kvh, g, d).permute(2, 1, 0, 3)  # [g, kvh, t, d]
    keys = k.float().transpose(0, 1)[None].expand(g, kvh, n_keys, d)
    vals = v.float().transpose(0, 1)[None].expand(g, kvh, n_keys, dv)
    if dv < d:
        vals = torch.nn.functional.pad(vals, (0, d - dv))
    elif dv > d:
        qs, keys = (torch.nn.functional.pad(x, (0, dv - d)) for x in (qs, keys))
    if mode in ("full", "causal"):
        o, l = _FLASH_CPU(qs, keys, vals, 0.0, mode == "causal", scale=scale)
        return (o[..., :dv].permute(2, 1, 0, 3).reshape(t, h, dv),
                l.permute(2, 1, 0).reshape(t, h))
    step = max(1, SCORE_BYTES // (4 * n_keys))
    for s in range(0, t, step):
        e = min(t, s + step)
        seen = visible(q_pos[s:e], k_pos, window)  # [n, L]
        bias = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))[None, None]
        o, l = _FLASH_CPU(qs[:, :, s:e].contiguous(), keys, vals, 0.0, False, attn_mask=bias, scale=scale)
        any_seen = seen.any(-1)[:, None]  # [n, 1]
        o = o[..., :dv].permute(2, 1, 0, 3).reshape(e - s, h, dv)
        out[s:e] = torch.where(any_seen[..., None], o, 0.0)
        l = l.permute(2, 1, 0).reshape(e - s, h)
        lse[s:e] = torch.where(any_seen, l, float("-inf"))
    return out, lse


WINDOW_BLOCK = 256  # queries per block of a windowed layer (its keys cut to the block's window)


def blocks(q_pieces, k_pieces, window: int = 0) -> list[tuple[int, int, int, int, str]]:
    """The (query rows, key rows, mode) blocks whose queries see some of the keys, for queries laid
    out as the contiguous position ranges ``q_pieces`` and keys as ``k_pieces`` (rows in piece
    order): (q start, q end, k start, k end, mode); mode "full" where every query of the block sees
    every key of it, "causal" where they are the same positions, else "mask". Without a window a
    query piece is one block (zigzag pieces are whole chunks: only "full" and "causal" arise); with
    one, blocks of ``WINDOW_BLOCK`` queries, each over the keys of its window only."""
    out, qo = [], 0
    for qa, qb in q_pieces:
        size = WINDOW_BLOCK if window else max(1, qb - qa)
        for s in range(qa, qb, size):
            e, ko = min(qb, s + size), 0
            for ka, kb in k_pieces:
                lo, hi = (max(ka, s - window + 1) if window else ka), min(kb, e)
                if hi > lo:
                    if hi <= s and (not window or lo > e - 1 - window):
                        mode = "full"
                    elif lo == s and hi == e and not window:
                        mode = "causal"
                    else:
                        mode = "mask"
                    out.append((qo + s - qa, qo + e - qa, ko + lo - ka, ko + hi - ka, mode))
                ko += kb - ka
        qo += qb - qa
    return out


def attend(partial_fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           q_pieces, k_pieces, scale: float, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial`` over position ranges known on the host (``blocks``): only the blocks whose queries
    see keys are computed, each through ``partial_fn`` (``partial`` or ``cpu_partial``), and merged
    by their log-sum-exps into one (o, lse) of the queries over all the keys."""
    out, lse = _empty(q, k, v)
    for qs, qe, ks, ke, mode in blocks(q_pieces, k_pieces, window):
        o2, l2 = partial_fn(q[qs:qe], k[ks:ke], v[ks:ke], q_pos[qs:qe], k_pos[ks:ke], scale, window, mode)
        cur = lse[qs:qe]
        new = torch.logaddexp(cur, l2)
        safe = torch.where(torch.isneginf(new), 0.0, new)
        out[qs:qe] = out[qs:qe] * (cur - safe).exp()[..., None] + o2 * (l2 - safe).exp()[..., None]
        lse[qs:qe] = new
    return out, lse


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class RingAttention:
    """The partial attentions of a device, chosen once (``on``): ``cpu_partial`` on the CPU where
    torch has its kernel, ``partial`` elsewhere."""

    def __init__(self, fused_cpu: bool):
        self.partial = cpu_partial if fused_cpu else partial

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
               q_pieces, k_pieces, scale: float, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``attend`` through this device's partial attention (one ``partial`` without pieces)."""
        if q_pieces is None:
            return self.partial(q, k, v, q_pos, k_pos, scale, window)
        return attend(self.partial, q, k, v, q_pos, k_pos, q_pieces, k_pieces, scale, window)

    @classmethod
    def on(cls, device: torch.device | str) -> "RingAttention":
        return cls(torch.device(device).type == "cpu" and _FLASH_CPU is not None)

    def latent_partial(self, q_abs: torch.Tensor, latent: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                       scale: float, r: int, q_pieces=None, k_pieces=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``latent_partial`` through this device's partial attention (over ``blocks`` where the
        pieces are given)."""
        def over_blocks(q, k, v, qp, kp, sc):
            return self.attend(q, k, v, qp, kp, q_pieces, k_pieces, sc)

        return latent_partial(q_abs, latent, q_pos, k_pos, scale, r, over_blocks)


def latent_partial(q_abs: torch.Tensor, latent: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float,
                   r: int, attend=partial) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's absorbed attention: queries ``[q_nope W_UK | q_pe]`` [T, H, r + rope] over the latents
    ``[c | k_pe]`` [L, r + rope] as one shared key head whose values are ``c`` (their first ``r``
    dimensions): (o_lat float32 [T, H, r], lse float32 [T, H]), through ``attend`` (a partial)."""
    keys = latent[:, None, :]
    return attend(q_abs, keys, keys[..., :r], q_pos, k_pos, scale)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor | None,
          dtype: torch.dtype) -> torch.Tensor:
    """The attention over all the partials' keys together, [T, H, Dv] in ``dtype``, from the partials
    (o [T, H, Dv], lse [T, H]) of one set of queries. ``sinks`` [H]: one more value-less logit per head
    (gpt-oss) in every query's softmax. A query that sees no key (and no sink) gets zeros."""
    if not parts:
        raise ValueError("merge: no partials")
    lses = torch.stack([lse for _, lse in parts])  # [P, T, H]
    total = torch.logsumexp(lses, dim=0)
    if sinks is not None:
        total = torch.logaddexp(total, sinks.float()[None, :])
    total = torch.where(torch.isneginf(total), 0.0, total)
    out = None
    for (o, _), lse in zip(parts, lses):
        term = o * (lse - total).exp()[..., None]
        out = term if out is None else out.add_(term)
    return out.to(dtype)
