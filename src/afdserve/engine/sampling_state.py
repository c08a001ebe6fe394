"""The sampling state of the sequences that sample, kept across steps on the logits' device, as vLLM
V1's InputBatch and SamplingMetadata keep it.

Each sequence holds a row of persistent arrays from the step it first samples until it leaves
(finished, or preempted: it joins again when it next samples, its counts rebuilt from its tokens
once). Its params are written into the row when it joins; the tokens it samples are added to its
row's output counts on the device after each step (``advance``: one ``index_put_``), never counted
again from the token lists. A step gathers its rows by one index.

What a step has to compute is decided from counters kept as rows join and leave (how many rows use
a penalty, ``min_p``, top-k/top-p, a bias, ``min_tokens``, logprobs, a seed), and which rows do what
from host mirrors (numpy) of the params: no scan of the params per step, no read from the device.
The [rows, vocab] output counts (and the prompt's presence, for the repetition penalty) are
allocated when the first row that needs them joins.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence

import numpy as np
import torch

from afdserve.engine.sampling_params import SamplingParams

# the float params of a row, in the rows of ``SamplingState.scalars``
TEMPERATURE, TOP_P, MIN_P, TOP_K, REPETITION, FREQUENCY, PRESENCE = range(7)


class SamplingState:
    def __init__(self, vocab: int, device: torch.device | str, eos_token_ids: Iterable[int] = ()):
        """``eos_token_ids``: masked with a row's stop token ids until its ``min_tokens``."""
        self.vocab, self.device = vocab, torch.device(device)
        self.eos = frozenset(eos_token_ids)
        self.rows: dict[Hashable, int] = {}  # a sequence's row
        self._free: list[int] = []
        self.uses: Counter[str] = Counter()  # rows that use each feature (``_features``)
        self._features: list[tuple[str, ...]] = []
        # host mirrors, one entry per row
        self.scalars = np.zeros((7, 0), dtype=np.float32)  # TEMPERATURE .. PRESENCE (top_k as a float: exact)
        self.greedy = np.zeros(0, dtype=bool)
        self.seeded = np.zeros(0, dtype=bool)
        self.logprobs = np.zeros(0, dtype=np.int64)  # top alternatives asked for; -1: no logprobs
        self.min_tokens = np.zeros(0, dtype=np.int64)  # 0 where nothing is masked before min_tokens
        self.num_output = np.zeros(0, dtype=np.int64)  # tokens generated so far
        self.stop_ids = np.zeros((0, 1), dtype=np.int64)  # masked before min_tokens; padded with the first
        self.bias_ids = np.zeros((0, 1), dtype=np.int64)  # logit_bias, padded with (token 0, bias 0)
        self.bias = np.zeros((0, 1), dtype=np.float32)
        self.generators: list[torch.Generator | None] = []
        self._on_device: dict[str, torch.Tensor] | None = None  # the mirrors on the device (None: stale)
        self.counts: torch.Tensor | None = None  # [rows, vocab] float32: output tokens (rows with a penalty)
        self.prompt_seen: torch.Tensor | None = None  # [rows, vocab] bool: prompt tokens (repetition penalty)

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.rows

    def add(self, key: Hashable, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
            generator: torch.Generator | None = None) -> None:
        """Gives ``key`` (a sequence) a row: its params, and its counts from the tokens so far."""
        row = self._free.pop() if self._free else self._grow()
        self.rows[key] = row
        p, vocab = params, self.vocab
        stops: list[int] = []
        if p.min_tokens and p.structured_outputs is None:  # (a grammar decides when a constrained row ends)
            stops = sorted(t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos) if t < vocab)
        bias = {t: b for t, b in (p.logit_bias or {}).items() if t < vocab}
        sampled = not p.greedy
        self.scalars[:, row] = (p.temperature if sampled else 1.0, p.top_p, p.min_p,
                                p.top_k if 0 < p.top_k < vocab else vocab, p.repetition_penalty,
                                p.frequency_penalty, p.presence_penalty)
        self.greedy[row], self.seeded[row] = not sampled, sampled and generator is not None
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.min_tokens[row] = p.min_tokens if stops else 0
        self.num_output[row] = len(output_ids)
        self.stop_ids = _put(self.stop_ids, row, stops, stops[:1] or [0], first=True)
        self.bias_ids = _put(self.bias_ids, row, list(bias), [0], first=False)
        self.bias = _put(self.bias, row, list(bias.values()), [0.0], first=False)
        self.generators[row] = generator if sampled else None
        repetition = p.repetition_penalty != 1.0
        features = tuple(name for name, used in (
            ("penalty", repetition or p.frequency_penalty != 0 or p.presence_penalty != 0),
            ("repetition", repetition), ("min_tokens", bool(stops)), ("bias", bool(bias)),
            ("logprobs", p.logprobs is not None), ("sampled", sampled), ("seeded", bool(self.seeded[row])),
            ("min_p", sampled and p.min_p > 0), ("top", sampled and (0 < p.top_k < vocab or p.top_p < 1))) if used)
        self._features[row] = features
        self.uses.update(features)
        self._on_device = None
        if "penalty" in features:
            self.counts = self._rows_by_vocab(self.counts, torch.float32)
            self.counts[row] = 0
            if output_ids:
                ids = torch.tensor(output_ids, dtype=torch.int64, device=self.device)
                self.counts[row].index_put_((ids,), torch.ones(len(output_ids), device=self.device), accumulate=True)
        if repetition:
            self.prompt_seen = self._rows_by_vocab(self.prompt_seen, torch.bool)
            self.prompt_seen[row] = False
            self.prompt_seen[row, torch.tensor(prompt_ids, dtype=torch.int64, device=self.device)] = True

    def remove(self, key: Hashable) -> None:
        """Frees ``key``'s row (nothing if it has none)."""
        row = self.rows.pop(key, None)
        if row is None:
            return
        self.uses.subtract(self._features[row])
        self._features[row] = ()
        self.generators[row] = None
        self._free.append(row)

    def index(self, keys: Sequence[Hashable]) -> np.ndarray:
        """The rows of ``keys`` (int64), in their order."""
        rows = self.rows
        return np.fromiter((rows[k] for k in keys), dtype=np.int64, count=len(keys))

    def on_device(self) -> dict[str, torch.Tensor]:
        """The host mirrors on the device: copied once after rows joined, not every step."""
        if self._on_device is None:
            self._on_device = {name: torch.from_numpy(getattr(self, name)).to(self.device, non_blocking=True)
                               for name in ("scalars", "stop_ids", "bias_ids", "bias")}
        return self._on_device

    def advance(self, idx: np.ndarray, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """The rows ``idx`` (distinct; ``rows`` on the device) generated ``tokens`` [len(idx)] (on the
        device): their output counts grow, on the device, with no read back."""
        self.num_output[idx] += 1
        if self.counts is not None:
            self.counts.index_put_((rows, tokens), torch.ones(len(idx), device=self.device), accumulate=True)

    def _grow(self) -> int:
        """Doubles the number of rows; returns the first new one (the others are free)."""
        old = len(self.greedy)
        new = max(8, 2 * old)
        self.scalars = np.pad(self.scalars, ((0, 0), (0, new - old)))
        for name in ("greedy", "seeded", "logprobs", "min_tokens", "num_output"):
            setattr(self, name, np.pad(getattr(self, name), (0, new - old)))
        for name in ("stop_ids", "bias_ids", "bias"):
            setattr(self, name, np.pad(getattr(self, name), ((0, new - old), (0, 0))))
        self.generators += [None] * (new - old)
        self._features += [()] * (new - old)
        for name in ("counts", "prompt_seen"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, torch.cat([t, t.new_zeros(new - old, self.vocab)]))
        self._free += range(new - 1, old, -1)  # popped lowest first
        return old

    def _rows_by_vocab(self, t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(len(self.greedy), self.vocab, dtype=dtype, device=self.device) if t is None else t


def _put(a: np.ndarray, row: int, values: list, pad: list, first: bool) -> np.ndarray:
    """``a`` [rows, K] with ``values`` (padded with ``pad``'s one value) in ``row``; widened when they
    do not fit, every other row padded with its own first value (``first``) or with zeros."""
    if len(values) > a.shape[1]:
        more = len(values) - a.shape[1]
        a = np.concatenate([a, np.repeat(a[:, :1], more, axis=1) if first else np.zeros_like(a[:, :1]).repeat(more, 1)],
                           axis=1)
    a[row] = values + pad * (a.shape[1] - len(values))
    return a
