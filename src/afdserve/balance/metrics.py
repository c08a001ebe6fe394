"""Prometheus export of expert load: a collector that reads a fresh snapshot on every scrape.

Register it with the server's registry, giving it a function that returns the current (merged)
:class:`LoadSnapshot`::

    registry.register(ExpertLoadCollector(lambda: tracker.snapshot()))

Series: ``afdserve_expert_tokens_per_step{layer,expert}`` (omitted with ``per_expert=False``),
``afdserve_expert_load_imbalance{layer}`` (max/mean tokens of the layer's experts),
``afdserve_expert_load_window_steps``. Co-activation (E x E per layer) is too many series for
Prometheus; it is in the JSON snapshot.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from afdserve.balance.load import LoadSnapshot


class ExpertLoadCollector(Collector):
    def __init__(self, source: Callable[[], LoadSnapshot | None], *, per_expert: bool = True, prefix: str = "afdserve") -> None:
        self._source = source
        self._per_expert = per_expert
        self._prefix = prefix

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._source()
        if snap is None:
            return
        load = snap.tokens_per_step()
        steps = GaugeMetricFamily(f"{self._prefix}_expert_load_window_steps", "Engine steps covered by the expert load window")
        steps.add_metric([], float(snap.steps))
        yield steps
        mean = load.mean(axis=1)
        ratio = np.divide(load.max(axis=1), mean, out=np.zeros_like(mean), where=mean > 0)
        imb = GaugeMetricFamily(
            f"{self._prefix}_expert_load_imbalance", "Max over mean tokens per expert of a layer (1 = balanced)", labels=["layer"]
        )
        for layer, v in enumerate(ratio.tolist()):
            imb.add_metric([str(layer)], v)
        yield imb
        if self._per_expert:
            tok = GaugeMetricFamily(
                f"{self._prefix}_expert_tokens_per_step", "Tokens routed to a logical expert per engine step", labels=["layer", "expert"]
            )
            for layer in range(snap.num_layers):
                for expert, v in enumerate(load[layer].tolist()):
                    tok.add_metric([str(layer), str(expert)], v)
            yield tok
