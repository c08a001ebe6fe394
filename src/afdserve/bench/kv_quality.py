"""How much a KV cache dtype changes a model's next-token distributions (``afdserve bench kv``).

Holdout prompts (natural-language text used nowhere else) run through the model in float32 with its
KV cache in float32 (the reference), and then, teacher-forced on the reference's greedy tokens, in
the configurations compared: the same model with the FP8 KV cache, and the model in bfloat16 (its KV
cache bfloat16: what serving the checkpoint's dtype stores). At every generated position (the
prompt's last, then each decode step reading the cache) each configuration's full next-token
distribution is kept; reported per pair: the greedy agreement (positions whose argmax is the same)
and the mean KL divergence of the distributions (nats, the first of the pair the reference)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from afdserve.backends.step import StepLayout
from afdserve.config import EngineConfig
from afdserve.engine.builder import front_end_tokenizer, load_attention_side, resolve_model
from afdserve.engine.runner import LocalExperts, ModelInput, ModelRunner
from afdserve.model.config import ModelConfig
from afdserve.model.loader import CheckpointReader
from afdserve.model.model import ExpertModel

HOLDOUT_PROMPTS = (
    "The lighthouse keeper wrote in her logbook that the storm had finally passed, and",
    "To repair a bicycle chain that keeps slipping, the first thing you should check is",
    "In the small village market, the baker argued with the cheesemaker about",
    "Glaciers carve valleys slowly over thousands of years because the ice",
    "My grandmother's recipe for lentil soup begins with onions, garlic and",
    "The committee postponed its decision on the new railway line until",
    "When the orchestra tuned up before the concert, the oboe played a single",
    "A good way to explain photosynthesis to a ten-year-old is to say that plants",
)

RUNS = {"float32": ("float32", "auto"), "bfloat16": ("bfloat16", "auto"), "fp8": ("float32", "fp8_e4m3")}
PAIRS = (("float32", "fp8"), ("float32", "bfloat16"), ("bfloat16", "fp8"))


@dataclass(frozen=True)
class PairQuality:
    reference: str
    candidate: str
    positions: int
    greedy_agreement: float  # share of positions with the same argmax
    mean_kl: float  # nats: KL(reference || candidate), averaged over positions
    max_kl: float
    mean_margin: float  # nats: the reference's top-1 minus top-2 log-probability, averaged (how close the calls are)


def _engine(model: str | None, dtype: str, kv_cache_dtype: str, backend: str, max_len: int) -> ModelRunner:
    cfg = EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, backend=backend, device="cpu",
                       max_model_len=max_len, num_kv_blocks=-(-max_len // 16) + 1, enable_prefix_caching=False)
    path = resolve_model(cfg.model)
    model_cfg = ModelConfig.from_pretrained(path)
    reader = CheckpointReader(path)
    side = load_attention_side(cfg, path, model_cfg, reader)
    experts = LocalExperts(ExpertModel.load(path, None, side.model.dtype, model_cfg, reader).prepare(side.backends),
                           cfg.load_window)
    return ModelRunner(side.model, side.kv, experts)


def _distributions(runner: ModelRunner, prompt: list[int], forced: list[int] | None,
                   new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Log-probabilities [new_tokens, vocab] at the prompt's last position and after each next token:
    the runner's greedy tokens, or ``forced`` ones (teacher forcing)."""
    bs = runner.kv.block_size
    table = list(range(-(-(len(prompt) + new_tokens) // bs)))
    ids, out = list(prompt), []
    step = (np.asarray(prompt), StepLayout.from_blocks([len(prompt)], [len(prompt)], [table], bs), len(prompt) - 1)
    for i in range(new_tokens):
        tokens, layout, row = step
        logits = runner.forward(ModelInput(np.asarray(tokens, dtype=np.int64), layout, np.asarray([row]))).logits
        out.append(torch.log_softmax(logits[0].double(), -1))
        nxt = int(out[-1].argmax()) if forced is None else forced[i]
        ids.append(nxt)
        step = (np.asarray([nxt]), StepLayout.from_blocks([1], [len(ids)], [table], bs), 0)
    return ids[len(prompt):], torch.stack(out)


def kv_quality(model: str | None = None, new_tokens: int = 32, backend: str = "auto",
               prompts: tuple[str, ...] = HOLDOUT_PROMPTS) -> list[PairQuality]:
    """The figures of the module docstring, for every pair of ``PAIRS``."""
    path = resolve_model(model)
    tok = front_end_tokenizer(EngineConfig(model=model), path, ModelConfig.from_pretrained(path))
    encoded = [tok.encode(p) for p in prompts]
    max_len = max(len(p) for p in encoded) + new_tokens + 1
    dists: dict[str, list[torch.Tensor]] = {}
    forced: list[list[int]] = []
    for name, (dtype, kv) in RUNS.items():  # the reference first: its greedy tokens are forced on the others
        runner = _engine(model, dtype, kv, backend, max_len)
        dists[name] = []
        for i, p in enumerate(encoded):
            toks, lp = _distributions(runner, p, None if name == "float32" else forced[i], new_tokens)
            dists[name].append(lp)
            if name == "float32":
                forced.append(toks)
        del runner
    out = []
    for ref, cand in PAIRS:
        a, b = torch.cat(dists[ref]), torch.cat(dists[cand])
        kl = (a.exp() * (a - b)).sum(-1)
        top2 = a.topk(2, dim=-1).values
        out.append(PairQuality(ref, cand, int(a.shape[0]), float((a.argmax(-1) == b.argmax(-1)).double().mean()),
                               float(kl.mean()), float(kl.max()), float((top2[:, 0] - top2[:, 1]).mean())))
    return out


def report(rows: list[PairQuality]) -> str:
    lines = [f"{'reference':<10} {'candidate':<10} {'positions':>9} {'greedy agreement':>17} {'mean KL (nats)':>15} "
             f"{'max KL':>9} {'top-1 margin':>13}"]
    for r in rows:
        lines.append(f"{r.reference:<10} {r.candidate:<10} {r.positions:>9} {100 * r.greedy_agreement:>16.1f}% "
                     f"{r.mean_kl:>15.2e} {r.max_kl:>9.2e} {r.mean_margin:>13.3f}")
    lines.append("float32: model and KV cache in float32; bfloat16: model and KV cache in bfloat16; "
                 "fp8: model in float32, KV cache fp8_e4m3 (teacher-forced on float32's greedy tokens); top-1 "
                 "margin: the reference's mean top-1 minus top-2 log-probability (nats)")
    return "\n".join(lines)
