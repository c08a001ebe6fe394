"""What an expert worker does with the tokens it received for one layer."""

from __future__ import annotations

import torch

from afdserve.balance.load import LoadTracker
from afdserve.model.model import ExpertModel
from afdserve.model.router import Router
from afdserve.runtime.data_plane import ExpertInput
from afdserve.runtime.expert_map import ExpertMap


class ExpertCompute:
    """Runs this worker's experts of a layer once over the tokens gathered from all attention
    workers. With the expert-side gate, the router runs here on the full activations, and the
    expert map (of the version the sender used) says which (token, k) pairs are this worker's."""

    def __init__(self, experts: ExpertModel, routers: dict[int, Router] | None, worker: int,
                 maps: dict[int, ExpertMap], tracker: LoadTracker | None = None):
        self.routers, self.worker, self.maps = routers, worker, maps
        self.experts = experts
        self.tracker = tracker  # records logical routing when the gate runs here
        cfg = experts.cfg
        # pairs per (layer, logical expert), the last column those routed elsewhere: counted on the
        # experts' device as they run (``ExpertPart.forward``'s ``counts``)
        self.tokens_per_expert = torch.zeros(cfg.num_layers, cfg.num_experts + 1, dtype=torch.int64,
                                             device=experts.device)
        self._count_rows = list(self.tokens_per_expert)  # per layer, a view of its row

    # every torch or module call on a layer's path costs microseconds on the expert worker's core, the
    # pipeline's busiest: the layers, their device and the count rows are looked up once
    @property
    def experts(self) -> ExpertModel:
        return self._experts

    @experts.setter
    def experts(self, experts: ExpertModel) -> None:  # a regrouped model replaces the old one
        self._experts, self._parts = experts, list(experts.layers)
        self._device = experts.device
        self._on_host = self._device.type == "cpu"  # the messages are there: no moves

    @torch.inference_mode()
    def run(self, layer: int, inputs: list[ExpertInput]) -> list[torch.Tensor]:
        """The same layer's inputs of several senders (or lanes), routed by the same expert map
        version; returns per input the partial sums [n_i, H]."""
        dev = self._device  # the messages are in host memory (the M2N slots)
        version = inputs[0].map_version
        parts = [[i.hidden] if i.ids is None else [i.hidden, i.ids, i.weights] for i in inputs]
        y = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        y = y if self._on_host else y.to(dev)
        if inputs[0].ids is None:
            n_exp = self.experts.cfg.num_experts
            if self.routers is None:
                raise RuntimeError("expert-side gate requested but this worker has no router weights")
            # Route each sender's micro-batch on its own: every expert worker received exactly that
            # batch, so all of them compute the same assignment whatever else they merged with it.
            routed = [self.routers[layer](p[0].to(dev)) for p in parts]
            # the expert map routes on the device too: nothing is read back to the host
            mine = [self.maps[version].route(layer, i) == self.worker for i, _ in routed]
            ids = torch.cat([torch.where(m, i, n_exp) for (i, _), m in zip(routed, mine)])
            w = torch.cat([w for _, w in routed])
            if self.tracker is not None:
                self.tracker.record(layer, torch.cat([i for i, _ in routed]))
        else:  # the ids as sent (int32 or int64: the kernel takes either)
            ids = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
            w = torch.cat([p[2] for p in parts]) if len(parts) > 1 else parts[0][2]
        if not self._on_host:
            ids, w = ids.to(dev), w.to(dev)
        out = self._parts[layer](y, ids, w, counts=self._count_rows[layer])
        return [out] if len(parts) == 1 else list(out.split([p[0].shape[0] for p in parts]))
