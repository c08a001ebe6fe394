"""The deployments users run instead of AFD, in the same model: colocated DP attention + wide EP,
and tensor parallelism (with pipeline stages when the weights need them).

Both share the catalog, the roofline costs (:mod:`afdserve.planner.roofline`) and one memory model
with the AFD search: per GPU, its weights, the KV cache of every resident request at the average
sequence length ``s``, and the activation / communication buffers of that request; the resident
request count is the largest batch that fits, then lowered until the step meets the TBT SLO.

Per layer, with ``b`` resident requests per GPU (wide EP over ``N`` GPUs, every GPU holding all
attention weights and ``E/N`` experts; uniform routing)::

    Ta    = k1(s)*b + k2                                   attention (tp 1)
    Te    = k3*b*K + k4(E/N experts)                       b*K pairs reach each GPU
    Ta2a  = 2 * max(intra / W_nvlink, inter / W_nic)       dispatch + combine of b*K*h elements,
                                                           (N-1)/N of them remote, the part beyond
                                                           the NVLink domain over the NIC
    layer = Ta + Te + Ta2a,  or with two-batch overlap 2*max(Ta + Te, Ta2a) at b/2

TP over ``t`` GPUs (``p`` pipeline stages of ``L/p`` layers, ``p`` micro-batches of ``b``)::

    layer = k1(s)*b + k2 + k3*b*K + k4(E experts) + 2 * all-reduce(b*h)   (costs at tp t)

and TBT ``= L * layer`` for both (plus ``p-1`` stage hand-offs for TP). Every family's step is
also split into GPU-seconds per output token by what they were spent on (:data:`TERMS`), which is
what :mod:`afdserve.planner.verdict` explains a winner with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from afdserve.errors import ConfigError
from afdserve.planner import perf_model as pm
from afdserve.planner import roofline
from afdserve.planner.catalog import GPUSpec
from afdserve.planner.plan import Plan
from afdserve.planner.search_config import SearchConfig
from afdserve.planner.spec import ModelSpec

__all__ = ["FAMILIES", "TERMS", "AltConfig", "FamilyPlan", "kv_bytes_per_request", "buffer_bytes_per_request",
           "a2a_time", "wide_ep_plans", "tp_plans", "afd_family_plan"]

FAMILIES = ("afd", "wide-ep", "tp")
#: What a family's GPU-seconds per output token are spent on.
TERMS = ("attention", "expert_weights", "expert_compute", "communication", "idle")


@dataclass(frozen=True)
class AltConfig:
    """Which colocated deployments to try (the SLO, ``s`` and roofline derating come from SearchConfig)."""

    families: tuple[str, ...] = FAMILIES
    ep_sizes: tuple[int, ...] | None = None  # None: powers of two dividing E, from 2
    tbo: tuple[bool, ...] = (False, True)  # two-batch overlap of the all-to-all with compute
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    pp_sizes: tuple[int, ...] = (1, 2, 4)
    a2a_latency_s: float = 0.0  # per dispatch or combine (the AFD search's Util = 1 assumes none either)

    def __post_init__(self) -> None:
        bad = set(self.families) - set(FAMILIES)
        if bad or not self.families:
            raise ConfigError(f"unknown families {sorted(bad)}; known: {', '.join(FAMILIES)}")
        if any(n < 1 for n in (*(self.ep_sizes or ()), *self.tp_sizes, *self.pp_sizes)) or not self.tbo:
            raise ConfigError("ep/tp/pp sizes must be positive and tbo non-empty")


@dataclass(frozen=True)
class FamilyPlan:
    """The best deployment of one family at the SLO, with what its time is spent on."""

    family: str  # "afd" | "wide-ep" | "tp"
    layout: str  # e.g. "DP16+EP16 TBO", "TP8xPP2", "attn H20 tp4 x5 + exp L40S tp1 x16, m=3"
    gpus: str  # GPU type (attention+expert for AFD)
    num_gpus: int
    batch: int  # resident requests = tokens per step
    tbt_s: float
    throughput_tok_s: float
    throughput_per_gpu: float
    throughput_per_cost: float | None
    weights_gb_per_gpu: float  # the most any GPU holds
    kv_gpus: int  # GPUs holding KV cache (AFD: the attention GPUs)
    limit: str  # what stopped the batch growing: "memory" or "slo"
    tokens_per_expert: float  # tokens one expert computes per layer (per micro-batch for AFD)
    comm: str  # what the communication term is, e.g. "dispatch/combine over RDMA"
    sync: str  # what its TP all-reduces run over ("" without TP)
    terms: dict[str, float] = field(default_factory=dict)  # GPU-seconds per output token, by TERMS
    plan: Plan | None = field(default=None, compare=False)  # the AFD plan

    @property
    def requests_per_gpu(self) -> float:
        return self.batch / self.num_gpus

    def objective_value(self, objective: str) -> float:
        if objective == "cost":
            return self.throughput_per_cost if self.throughput_per_cost is not None else -math.inf
        return self.throughput_per_gpu

    def to_json(self) -> dict[str, object]:
        return {"family": self.family, "layout": self.layout, "gpus": self.gpus, "num_gpus": self.num_gpus,
                "batch": self.batch, "requests_per_gpu": self.requests_per_gpu, "tbt_ms": self.tbt_s * 1e3,
                "throughput_tok_s": self.throughput_tok_s, "throughput_per_gpu": self.throughput_per_gpu,
                "throughput_per_cost": self.throughput_per_cost, "weights_gb_per_gpu": self.weights_gb_per_gpu,
                "kv_gpus": self.kv_gpus,
                "limit": self.limit, "tokens_per_expert": self.tokens_per_expert, "comm": self.comm,
                "gpu_us_per_token": {k: v * 1e6 for k, v in self.terms.items()}}


# ----- memory --------------------------------------------------------------------------------
def kv_bytes_per_request(spec: ModelSpec, seq_len: float) -> float:
    """KV cache of one request of ``seq_len`` tokens over all layers (one copy)."""
    return seq_len * spec.num_layers * spec.kv_bytes_per_token_layer


def buffer_bytes_per_request(spec: ModelSpec) -> float:
    """Activation and communication buffers one resident request needs on a GPU: its hidden state and
    residual (``2h``) and its dispatch and combine buffers (``K*h`` each)."""
    return spec.act_bytes * spec.hidden_size * (2 + 2 * spec.top_k)


def _fits(capacity_bytes: float, weights_bytes: float, per_request_bytes: float) -> int:
    free = capacity_bytes - weights_bytes
    return int(free // per_request_bytes) if free > 0 else 0


def _largest(tbt: Callable[[int], float], hi: int, slo: float) -> int:
    """Largest ``b`` in ``[1, hi]`` with ``tbt(b) <= slo`` (``tbt`` increasing); 0 if none."""
    if hi < 1 or tbt(1) > slo:
        return 0
    if tbt(hi) <= slo:
        return hi
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tbt(mid) <= slo else (lo, mid)
    return lo


# ----- communication -------------------------------------------------------------------------
def fabric_name(gpu: GPUSpec, n: int) -> str:
    intra = "NVLink" if gpu.intra_node_gbs > 128 else "PCIe"
    return intra if n <= gpu.nvlink_domain else f"{intra}+RDMA"


def a2a_time(gpu: GPUSpec, n: int, bytes_per_gpu: float, latency_s: float = 0.0) -> float:
    """One all-to-all among ``n`` GPUs, each sending ``bytes_per_gpu`` spread evenly over all ``n``
    (its own share stays): the part to GPUs in its NVLink domain at ``intra_node_gbs/2`` per
    direction, the rest over its NIC (``net_gbps``), both at once."""
    if n <= 1 or bytes_per_gpu <= 0:
        return 0.0
    local = min(n, gpu.nvlink_domain)
    intra = bytes_per_gpu * (local - 1) / n / gpu.intra_node_Bps_per_direction
    inter = bytes_per_gpu * (n - local) / n / gpu.net_Bps
    return max(intra, inter) + latency_s


def _price(gpu: GPUSpec, n: int) -> float | None:
    return None if gpu.price is None else gpu.price * n


def _plan(family: str, layout: str, gpu: GPUSpec, n: int, batch: int, tbt: float, weights: float, limit: str,
          tpe: float, comm: str, sync: str, per_step: dict[str, float]) -> FamilyPlan:
    """``per_step``: GPU-seconds of one step per term, summed over the ``n`` GPUs."""
    thr = batch / tbt
    cost = _price(gpu, n)
    return FamilyPlan(family, layout, gpu.name, n, batch, tbt, thr, thr / n, None if cost is None else thr / cost,
                      weights / 1e9, n, limit, tpe, comm, sync, {k: per_step.get(k, 0.0) / batch for k in TERMS})


# ----- colocated DP attention + wide EP ------------------------------------------------------
def _ep_sizes(spec: ModelSpec, alt: AltConfig) -> list[int]:
    if alt.ep_sizes is not None:
        bad = [n for n in alt.ep_sizes if spec.num_experts % n and n % spec.num_experts]
        if bad:
            raise ConfigError(f"EP sizes {bad} neither divide nor are multiples of the {spec.num_experts} experts")
        return sorted(set(alt.ep_sizes))
    return [n for n in (2 ** i for i in range(1, 11)) if n <= spec.num_experts and spec.num_experts % n == 0]


def wide_ep_plans(spec: ModelSpec, gpu: GPUSpec, cfg: SearchConfig, alt: AltConfig) -> list[FamilyPlan]:
    """The best plan of every EP size and overlap choice (DP attention on every GPU, tp 1)."""
    s, L, K = cfg.seq_len, spec.num_layers, spec.top_k
    att = roofline.attention_cost(spec, gpu, 1, cfg.roofline)
    k1 = att.k1(s)
    out = []
    for n in _ep_sizes(spec, alt):
        epg = max(1, spec.num_experts // n)  # experts per GPU (a multiple of E replicates them)
        exp = roofline.expert_cost(spec, gpu, 1, epg, cfg.roofline)
        weights = spec.attention_param_bytes + spec.expert_node_param_bytes(epg)
        cap = _fits(gpu.memory_bytes, weights, kv_bytes_per_request(spec, s) + buffer_bytes_per_request(spec))
        a2a_bytes = K * spec.hidden_size * spec.act_bytes  # per request, dispatch (combine the same)

        for tbo in alt.tbo:
            def parts(b: float, tbo: bool = tbo) -> tuple[float, float, float, float]:
                x = b / 2 if tbo else b
                ta, te = k1 * x + att.k2, exp.k3 * x * K + exp.k4
                tc = 2 * a2a_time(gpu, n, a2a_bytes * x, alt.a2a_latency_s)
                layer = 2 * max(ta + te, tc) if tbo else ta + te + tc
                return ta, te, tc, layer

            b = _largest(lambda b: L * parts(b)[3], cap, cfg.slo_s)
            if b < (2 if tbo else 1):
                continue
            ta, te, tc, layer = parts(b)
            reps = 2 if tbo else 1
            busy = {"attention": reps * ta, "expert_weights": reps * exp.k4, "expert_compute": reps * (te - exp.k4)}
            busy["communication" if not tbo else "idle"] = layer - sum(busy.values())
            per_step = {k: v * L * n for k, v in busy.items()}
            out.append(_plan("wide-ep", f"DP{n}+EP{n}{' TBO' if tbo else ''}", gpu, n, b * n, L * layer, weights,
                             "memory" if b == cap else "slo", n * b * K / spec.num_experts,
                             f"dispatch/combine over {fabric_name(gpu, n)}", "", per_step))
    return out


# ----- tensor parallelism (x pipeline stages) ------------------------------------------------
def tp_plans(spec: ModelSpec, gpu: GPUSpec, cfg: SearchConfig, alt: AltConfig) -> list[FamilyPlan]:
    """The best plan of every TP x PP size (TP within the NVLink domain, stages across it)."""
    s, L, K, E = cfg.seq_len, spec.num_layers, spec.top_k, spec.num_experts
    opts = replace(cfg.roofline, tp_sync=False)  # the all-reduces are counted once per token below
    out = []
    for t in alt.tp_sizes:
        if t > gpu.nvlink_domain:
            continue
        att = roofline.attention_cost(spec, gpu, t, opts)
        exp = roofline.expert_cost(spec, gpu, t, E, opts)
        ar = 0.0 if t == 1 else 2.0 * (t - 1) / t * spec.hidden_size * spec.act_bytes / gpu.intra_node_Bps_per_direction
        k1 = att.k1(s)
        for p in alt.pp_sizes:
            if p > L:
                continue
            weights = (spec.attention_param_bytes + E * spec.expert_node_param_bytes(1)) / (t * p)
            per_req = kv_bytes_per_request(spec, s) * spec.kv_replication(t) / t + buffer_bytes_per_request(spec)
            cap = _fits(gpu.memory_bytes, weights, per_req)  # b per micro-batch: each GPU holds p of L/p layers
            hop = spec.hidden_size * spec.act_bytes / (gpu.net_Bps if t * p > gpu.nvlink_domain
                                                       else gpu.intra_node_Bps_per_direction)

            def tbt(b: float, k1: float = k1, att=att, exp=exp, ar: float = ar, hop: float = hop, p: int = p) -> float:
                return L * (k1 * b + att.k2 + exp.k3 * b * K + exp.k4 + 2 * ar * b) + (p - 1) * hop * b

            b = _largest(tbt, cap, cfg.slo_s)
            if b < 1:
                continue
            g = t * p  # each GPU runs p micro-batches through L/p layers a step: L layer-visits of b
            per_step = {"attention": L * g * (k1 * b + att.k2), "expert_weights": L * g * exp.k4,
                        "expert_compute": L * g * exp.k3 * b * K,
                        "communication": L * g * 2 * ar * b + g * (p - 1) * hop * b}
            out.append(_plan("tp", f"TP{t}" + (f"xPP{p}" if p > 1 else ""), gpu, g, b * p, tbt(b), weights,
                             "memory" if b == cap else "slo", b * K / E,
                             f"all-reduce over {fabric_name(gpu, t)}", f"all-reduce over {fabric_name(gpu, t)}",
                             per_step))
    return out


# ----- AFD (the search's plan, in the same terms) --------------------------------------------
def afd_family_plan(spec: ModelSpec, p: Plan, gpu_a: GPUSpec, gpu_e: GPUSpec, cfg: SearchConfig) -> FamilyPlan:
    """An AFD plan of :func:`afdserve.planner.search.search` as a :class:`FamilyPlan` (roofline costs)."""
    L, m = spec.num_layers, p.micro_batches
    flat = replace(cfg.roofline, tp_sync=False)  # the TP all-reduces go to "communication"
    exp = roofline.expert_cost(spec, gpu_e, p.tp_e, p.experts_per_node, flat)
    att = roofline.attention_cost(spec, gpu_a, p.tp_a, flat)
    mem_cap = pm.max_b_a_for_memory(spec, m, cfg.seq_len, p.tp_a, gpu_a.memory_bytes)
    ta = att.time(p.b_a, cfg.seq_len)
    te_w, te_c = exp.k4, exp.k3 * p.b_e
    steps_a, steps_e = p.tp_a * p.n_a * m * L, p.tp_e * p.n_e * m * L  # GPU x (micro-batch, layer) visits
    per_step = {"attention": steps_a * ta, "expert_weights": steps_e * te_w, "expert_compute": steps_e * te_c,
                "communication": steps_a * (p.ta_s - ta) + steps_e * (p.te_s - te_w - te_c)}
    per_step["idle"] = p.num_gpus * p.tbt_s - sum(per_step.values())
    weights = max(spec.attention_param_bytes / p.tp_a, spec.expert_node_param_bytes(p.experts_per_node) / p.tp_e)
    thr = p.batch / p.tbt_s
    nvlink = not p.heterogeneous and p.num_gpus <= gpu_a.nvlink_domain  # as PlanEvaluator.links
    fabric = fabric_name(gpu_a, p.num_gpus) if nvlink else "RDMA"
    sync = (gpu_e, p.tp_e) if p.tp_e > p.tp_a else (gpu_a, p.tp_a)  # the larger TP group's link
    layout = (f"attn tp{p.tp_a}x{p.n_a} + exp tp{p.tp_e}x{p.n_e}"
              + (f" ({p.experts_per_node}/node)" if p.experts_per_node > 1 else "") + f", m={m}")
    return FamilyPlan("afd", layout, p.attention_gpu if not p.heterogeneous else f"{p.attention_gpu}+{p.expert_gpu}",
                      p.num_gpus, p.batch, p.tbt_s, thr, p.throughput_per_gpu, p.throughput_per_cost, weights / 1e9,
                      p.n_a * p.tp_a,
                      "memory" if p.b_a >= mem_cap else "slo", p.b_e / p.experts_per_node,
                      f"A2E/E2A over {fabric} (Tc {p.tc_s * 1e3:.2f} ms, Tf {max(p.ta_s, p.te_s) * 1e3:.2f} ms)",
                      "" if max(p.tp_a, p.tp_e) == 1 else f"TP all-reduce over {fabric_name(*sync)}",
                      {k: per_step.get(k, 0.0) / p.batch for k in TERMS}, p)
