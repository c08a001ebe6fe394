"""What an expert worker does with the tokens it received for one layer (and with a share of the
LM head, when attention workers send one)."""

from __future__ import annotations

import torch

from afdserve.balance.load import LoadTracker
from afdserve.model.greedy import Best
from afdserve.model.linear import linear_rows, lm_head_argmax
from afdserve.model.model import ExpertModel
from afdserve.model.router import Router
from afdserve.runtime.expert_map import ExpertMap


class ExpertCompute:
    """Runs this worker's experts of a layer once over the tokens gathered from all attention
    workers. With the expert-side gate, the router runs here on the full activations, and the
    expert map (of the version the sender used) says which (token, k) pairs are this worker's."""

    def __init__(self, experts: ExpertModel, routers: dict[int, Router] | None, worker: int,
                 maps: dict[int, ExpertMap], tracker: LoadTracker | None = None, lm_head: torch.Tensor | None = None):
        self.experts, self.routers, self.worker, self.maps = experts, routers, worker, maps
        self.lm_head = lm_head  # [vocab, hidden]: for the share of the LM head attention workers send
        self.tracker = tracker  # records logical routing when the gate runs here
        cfg = experts.cfg
        self.tokens_per_expert = torch.zeros(cfg.num_layers, cfg.num_experts + 1, dtype=torch.int64)

    @torch.inference_mode()
    def logits(self, xn: torch.Tensor, start: int, end: int, out: torch.Tensor) -> None:
        """float32 logits of the vocabulary ``[start, end)`` for the final normalized hidden states
        ``xn``, into ``out`` [len(xn), end - start]."""
        w = self._held_lm_head()
        linear_rows(xn.to(w.device), w, start, end, torch.float32, out=out)

    @torch.inference_mode()
    def greedy(self, xn: torch.Tensor, start: int, end: int, best: Best) -> None:
        """Merges each row's largest logit of the vocabulary ``[start, end)`` and its index into
        ``best`` (a greedy job's run, in host memory like the replies)."""
        w = self._held_lm_head()
        lm_head_argmax(xn.to(w.device), w, best, start, end)

    def _held_lm_head(self) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError("an LM head share came to an expert worker that holds no LM head (lm_head_share=0)")
        return self.lm_head

    @torch.inference_mode()
    def run(self, layer: int, parts: list[list[torch.Tensor]], version: int = 0) -> list[torch.Tensor]:
        """``parts``: per sender, [y] (expert gate) or [y, ids, weights] (attention gate).
        Returns per sender the partial sums [n_i, H]."""
        dev = self.experts.device  # the messages are in host memory (the M2N slots)
        sizes = [p[0].shape[0] for p in parts]
        y = (torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]).to(dev)
        n_exp = self.experts.cfg.num_experts
        if len(parts[0]) == 1:
            if self.routers is None:
                raise RuntimeError("expert-side gate requested but this worker has no router weights")
            # Route each sender's micro-batch on its own: every expert worker received exactly that
            # batch, so all of them compute the same assignment whatever else they merged with it.
            routed = [self.routers[layer](p[0].to(dev)) for p in parts]
            ids_host = [i.cpu() for i, _ in routed]  # the expert map routes on the host
            mine = [self.maps[version].route(layer, i) == self.worker for i in ids_host]
            ids = torch.cat([torch.where(m, i, n_exp) for i, m in zip(ids_host, mine)])
            w = torch.cat([w for _, w in routed])
            if self.tracker is not None:
                self.tracker.record(layer, torch.cat(ids_host))
        else:
            ids = torch.cat([p[1] for p in parts]).to(torch.int64) if len(parts) > 1 else parts[0][1].to(torch.int64)
            w = (torch.cat([p[2] for p in parts]) if len(parts) > 1 else parts[0][2]).to(dev)
        self.tokens_per_expert[layer] += torch.bincount(ids.reshape(-1), minlength=n_exp + 1)
        out = self.experts.layers[layer](y, ids.to(dev), w)
        return list(out.split(sizes))
