"""The router (gate) of a MoE layer: scores over experts, then top-k.

* softmax scores, plain top-k (Mixtral, Qwen-MoE, DeepSeek-V2 ``greedy``);
* DeepSeek-V2 ``group_limited_greedy``: experts in ``n_group`` groups, a group scores its best
  expert, only the ``topk_group`` best groups compete;
* DeepSeek-V3 ``noaux_tc``: sigmoid scores; the choice uses scores + ``e_score_correction_bias``
  (a group scores the sum of its two best), the weights the unbiased scores;
* gpt-oss: logits with a bias, top-k of the logits, softmax over those k.

Then optional renormalization (``norm_topk_prob``) and ``routed_scaling_factor``, as transformers'
routers of these families do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.backends import Backends
from afdserve.backends.base import LinearOp
from afdserve.model.config import ModelConfig


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.top_k = cfg.top_k
        self.normalize = cfg.norm_topk_prob
        self.scoring, self.method = cfg.scoring, cfg.topk_method
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.scaling = cfg.routed_scaling_factor
        self.fp32_logits = cfg.mla is not None  # DeepSeek's routers compute their logits in float32
        # DeepSeek-V3's correction bias (float32, as transformers keeps it)
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False) \
            if cfg.scoring == "sigmoid" else None
        # gpt-oss: a bias on the logits; top-k of the logits, then softmax over those k
        self.logit_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=dtype), requires_grad=False) \
            if cfg.router_bias else None
        self.op: LinearOp | None = None  # the logits' projection, packed by ``prepare``

    def prepare(self, backends: Backends) -> None:
        weight = self.weight.float() if self.fp32_logits else self.weight
        self.op = backends.linear.pack(weight, self.logit_bias)

    def _group_mask(self, choice: torch.Tensor) -> torch.Tensor:
        """[T, E] bool: the experts of each token's ``topk_group`` best groups."""
        t, e = choice.shape
        grouped = choice.view(t, self.n_group, e // self.n_group)
        if self.method == "noaux_tc":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        return mask[:, :, None].expand(-1, -1, e // self.n_group).reshape(t, e)

    @property
    def plain_logits(self) -> bool:
        """Its logits are ``y W^T`` in y's dtype widened to float32, as an attention backend computes
        them with the attention half (``route`` takes them from there)."""
        return self.logit_bias is None and not self.fp32_logits

    def forward(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (topk_ids [T, k] int64, topk_weights [T, k] float32)."""
        if self.logit_bias is not None:  # gpt-oss
            top, ids = torch.topk(self.op(y).float(), self.top_k, dim=-1)
            return ids, F.softmax(top, dim=-1)
        return self.route(self.op(y.float() if self.fp32_logits else y).float())

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids, topk_weights) from the float32 logits [T, E] (not gpt-oss's: ``forward``)."""
        if self.scoring == "sigmoid":
            scores = logits.sigmoid()
            choice = scores + self.bias
            if self.n_group > 1 and self.topk_group < self.n_group:
                choice = choice.masked_fill(~self._group_mask(choice), float("-inf"))
            ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if self.normalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            probs = F.softmax(logits, dim=-1)
            if self.method == "group_limited_greedy" and self.topk_group < self.n_group:
                probs = probs.masked_fill(~self._group_mask(probs), 0.0)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return ids, weights
