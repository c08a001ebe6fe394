"""Every message that crosses a process boundary between the front end and its workers, and their
one encoding (``encode``/``decode``: pickle, protocol 5, of these dataclasses only).

Front end -> worker: ``WorkerSpec`` (once, at start), ``AddRequest``, ``AbortRequests``, ``GetStats``,
``GetTrace``, ``SetMicroBatches``, the three phases of re-placing experts (``PrepareMap`` on expert
workers, ``SwitchMap`` on attention workers, ``CommitMap`` on expert workers), ``Regroup`` (a worker
was replaced, added or removed: new M2N links, and a new expert map when the expert pool changed),
``Shutdown``.
Worker -> front end: ``Ready`` (health: the worker serves), ``StepOutputs`` (new token ids, finish
events and the progress of chunked prefills of one engine step, with the worker's stats), ``StatsReply``,
``TraceReply``, ``Ack`` (a
control call took effect), ``PeerLost`` (a peer died or stalled: waiting for a ``Regroup``),
``Heartbeat`` (the process runs), ``Crashed``.
Token payloads between workers travel over the M2N library, not here.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Union

from afdserve.config import EngineConfig
from afdserve.engine.cp import CPShard
from afdserve.engine.outputs import TokenOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.errors import WorkerError
from afdserve.kvcache.prefix import PrefixCacheStats
from afdserve.runtime.expert_map import ExpertMap


@dataclass(frozen=True)
class WorkerSpec:
    role: str  # "attention" | "expert"
    index: int
    config: EngineConfig
    model_path: str
    expert_map: ExpertMap
    store: tuple[str, int]  # rendezvous store of the deployment's M2N group
    group: str  # unique name of this deployment (shared-memory names, store keys)
    eos_token_ids: frozenset[int] = frozenset()  # the front end's (model config + tokenizer)
    epoch: int = 0  # membership epoch it starts in (a replacement's is > 0)
    map_version: int = 0  # version of expert_map (re-placed experts while serving)
    deferred: bool = False  # a replacement that loads, says Ready, and connects only on its Regroup
    trace: bool = False
    comm: dict = field(default_factory=dict)  # CommConfig overrides
    host_share: int | None = None  # inherited descriptor of the machine's share (afdserve.backends.host; None: none)

    @property
    def name(self) -> str:
        return worker_name(self.role, self.index)


def worker_name(role: str, index: int) -> str:
    return f"{role}{index}"


# ---- front end -> worker ------------------------------------------------------------------------
@dataclass(frozen=True)
class KVTarget:
    """Prefill/decode disaggregation: where a prefill worker sends a prompt's KV, layer by layer --
    attention worker ``decode``'s reservation ``handle`` (blocks it allocated up front), but for its
    first ``skip_blocks`` blocks, which its prefix cache holds already."""

    decode: int
    handle: int
    skip_blocks: int = 0


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)  # already generated (a re-admitted request)
    kv: KVTarget | None = None  # a prefill worker's request: its KV goes there as it is computed
    cp: CPShard | None = None  # a context-parallel prefill's share (a helper rank, rank > 0, emits no outputs)


@dataclass(frozen=True)
class ReserveKV:
    """Decode worker: allocate the blocks of this prompt (its prefix-cache hits held, not copied) for a
    prefill worker to fill; answered by ``KVReserved`` once the blocks are free."""

    request_id: str
    prompt_token_ids: list[int]
    attempt: int = 0  # the front end's count of this request's reservations (a stale answer is told apart)


@dataclass(frozen=True)
class AdoptKV:
    """Decode worker: the prefill of reservation ``handle`` produced ``output_token_ids``: decode the
    request from there once every layer's KV has landed (a reservation it no longer holds, its links
    having been renewed meanwhile: recompute the prompt)."""

    request_id: str
    handle: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int]


ADDS_PER_MESSAGE = 1024  # requests of one AddRequests message at most (a huge batch goes in several)


@dataclass(frozen=True)
class AddRequests:
    """Requests a caller submitted together (``FrontEnd.add_requests``): the worker has them all
    before it schedules any, so the first step of its lanes is not cut to the few that came first."""

    requests: list[AddRequest]


def batched(adds: list[AddRequest]) -> list[AddRequest | AddRequests]:
    """One worker's requests as the messages that carry them, in order: at most
    ``ADDS_PER_MESSAGE`` per ``AddRequests`` (a lone request as itself)."""
    parts = (adds[i:i + ADDS_PER_MESSAGE] for i in range(0, len(adds), ADDS_PER_MESSAGE))
    return [part[0] if len(part) == 1 else AddRequests(part) for part in parts]


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True)
class GetStats:
    pass


@dataclass(frozen=True)
class GetTrace:
    tid: int  # the worker's row in the merged trace


@dataclass(frozen=True)
class SetMicroBatches:
    m: int


@dataclass(frozen=True)
class PrepareMap:
    """Expert workers: hold the union of the current and the new map's experts."""

    version: int
    expert_map: ExpertMap


@dataclass(frozen=True)
class SwitchMap:
    """Attention workers: dispatch with the new map from the next step on."""

    version: int
    expert_map: ExpertMap


@dataclass(frozen=True)
class CommitMap:
    """Expert workers: every attention worker uses map ``version``; drop what it does not need."""

    version: int


@dataclass(frozen=True)
class Regroup:
    """The deployment's membership changed (a worker was replaced, added or removed): connect the M2N
    links anew, in group ``group`` (one per membership epoch, so a fenced process can never rejoin),
    to ``attention_workers`` x ``expert_workers`` peers, keeping everything else (weights, KV cache,
    requests); then ``Ready(worker, pid, epoch)``. With ``expert_map`` (the expert pool was resized)
    expert workers first hold that map's experts and attention workers dispatch with it. With
    ``missing`` expert workers, attention workers connect to the others only and send the missing
    ones' tokens to replicas, or drop them (``EngineConfig.on_expert_loss``)."""

    epoch: int
    group: str
    attention_workers: int
    expert_workers: int
    expert_map: ExpertMap | None = None
    map_version: int = 0
    missing: tuple[int, ...] = ()  # expert workers lost and not replaced yet: served around (--on-expert-loss)


@dataclass(frozen=True)
class Shutdown:
    pass


# ---- worker -> front end ------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionStats:
    running: int
    waiting: int
    kv_usage: float
    step_seconds: float
    step_tokens: int
    tokens_per_expert_worker: list[int]
    load: str | None = None  # LoadSnapshot JSON (on GetStats, when this worker routes)
    transports: dict[str, str] = field(default_factory=dict)  # peer -> M2N transport (on GetStats)
    prefix: PrefixCacheStats | None = None  # its prefix cache's counters and tiers (on GetStats)
    dropped: int = 0  # (token, k) expert assignments dropped since the last stats (a missing expert worker)
    capacity_dropped: int = 0  # ... dropped over an expert worker's capacity (--on-expert-overflow=drop)
    second_pass_rows: int = 0  # token rows sent in a second pass since the last stats (over capacity)
    kv_landed: list[KVLanded] = field(default_factory=list)  # a decode worker's transfers since the last GetStats
    kv_reserved: int = 0  # a decode worker's blocks held for transfers (reserved, not adopted yet)
    cp_steps: int = 0  # context-parallel prefill steps this worker ran (its part of a split prompt)
    sharded_steps: int = 0  # decode steps it ran over KV sharded by a context-parallel prefill
    shards: int = 0  # shards of such KV it holds for other workers' requests


@dataclass(frozen=True)
class ExpertStats:
    tokens_per_expert: list[list[int]]  # [layer][expert + 1]: the last column counts pairs not its own
    experts: list[list[int]]  # [layer] -> logical experts held
    load: str | None = None
    transports: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Ready:
    """The worker serves, with links of membership epoch ``epoch`` (at start, or after a ``Regroup``)."""

    worker: str
    pid: int
    epoch: int = 0


@dataclass(frozen=True)
class StepOutputs:
    worker: str
    outputs: list[TokenOutput]
    stats: AttentionStats


@dataclass(frozen=True)
class KVReserved:
    """A decode worker's answer to ``ReserveKV``."""

    worker: str
    request_id: str
    handle: int
    skip_blocks: int
    attempt: int = 0


@dataclass(frozen=True)
class KVLanded:
    """A transfer's timing (``time.time_ns``, one clock on one machine): the prefill's first step
    began, its last layer ended there, every layer had landed here."""

    request_id: str
    tokens: int
    blocks: int
    prefill_start_ns: int
    last_layer_ns: int
    landed_ns: int


@dataclass(frozen=True)
class StatsReply:
    worker: str
    stats: AttentionStats | ExpertStats


@dataclass(frozen=True)
class TraceReply:
    worker: str
    events: list[dict]


@dataclass(frozen=True)
class Ack:
    worker: str
    version: int


@dataclass(frozen=True)
class PeerLost:
    """``peer`` died or stalled past the deadline: this worker waits for a ``Regroup`` (its
    requests and caches kept; an attention worker then runs the interrupted step again)."""

    worker: str
    peer: str
    reason: str
    epoch: int  # the membership epoch of the links that failed (older than the front end's: stale)


@dataclass(frozen=True)
class Heartbeat:
    """The worker process runs (sent from a thread of its own, whatever its main loop is doing)."""

    worker: str


@dataclass(frozen=True)
class Crashed:
    worker: str
    error: str
    traceback: str


ToWorker = Union[WorkerSpec, AddRequest, AddRequests, AbortRequests, GetStats, GetTrace, SetMicroBatches, PrepareMap,
                 SwitchMap, CommitMap, Regroup, Shutdown, ReserveKV, AdoptKV]
FromWorker = Union[Ready, StepOutputs, StatsReply, TraceReply, Ack, PeerLost, Heartbeat, Crashed, KVReserved]
_TYPES = ToWorker.__args__ + FromWorker.__args__  # type: ignore[attr-defined]


def encode(msg: ToWorker | FromWorker) -> bytes:
    if not isinstance(msg, _TYPES):
        raise TypeError(f"not a control message: {type(msg).__name__}")
    return pickle.dumps(msg, protocol=5)


def decode(data: bytes) -> ToWorker | FromWorker:
    msg = pickle.loads(data)
    if not isinstance(msg, _TYPES):
        raise WorkerError(f"unexpected control message {type(msg).__name__}")
    return msg
