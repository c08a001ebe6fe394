"""The LM head shared out in pieces (runtime.lm_head): the claim words that both ends take blocks
from (kernels/csrc/claims.cpp), an expert worker's runs of blocks, and a deployment whose expert
workers take blocks of a large vocabulary's LM head (with a core board) or fixed shares (without)."""

import multiprocessing as mp
import random

import pytest
import torch

from afdserve import LLM, SamplingParams, kernels
from afdserve.config import EngineConfig
from afdserve.errors import ConfigError
from afdserve.model.config import ModelConfig
from afdserve.runtime.trace_plot import load
from afdserve.kernels import build
from afdserve.runtime.core_board import CLAIM_LANES, CoreBoard
from afdserve.runtime.lm_head import BLOCK, EXPERT_PIECE_DIVISOR, ClaimWords, ExpertLMWork, FixedRange, LMJob
from tiny_models import generate_losing, hf_greedy, make_checkpoint

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {build.load().reason}")


@needs_kernels
def test_both_ends_take_blocks_until_they_meet_and_an_old_tag_takes_nothing():
    words = ClaimWords(torch.zeros(4 * CLAIM_LANES, dtype=torch.int64))
    r = words.open(1, 2, tag=7, blocks=10)
    assert r.take(False, 3) == (0, 3) and r.take(True, 4) == (6, 10) and r.take(True, 4) == (3, 6)
    assert r.take(False, 1) is None and r.take(True, 1) is None
    r2 = words.open(1, 2, tag=8, blocks=5)
    assert words.range(1, 2, tag=7).take(True, 1) is None  # the old job's tag: none of the new job's blocks
    assert r2.take(True, 9) == (0, 5)
    assert words.range(1, 3, tag=8).take(False, 1) is None  # another lane's word: no job open
    assert ClaimWords.index(0, CLAIM_LANES) == -1 and ClaimWords.index(-1, 0) == -1


def _taker(words: torch.Tensor, top: bool, seed: int, out) -> None:
    rng = random.Random(seed)
    r = ClaimWords(words).range(3, 1, tag=5)
    got = []
    while (piece := r.take(top, rng.randrange(1, 4))) is not None:
        got.append(piece)
    out.send(got)


@needs_kernels
def test_two_processes_take_every_block_exactly_once():
    board = CoreBoard.create()
    try:
        words = ClaimWords(board.claim_words)
        for trial in range(5):
            words.open(3, 1, tag=5, blocks=4000)
            ctx = mp.get_context("fork")
            pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
            procs = [ctx.Process(target=_taker, args=(board.claim_words, top, trial * 2 + top, pipes[top][1]))
                     for top in (False, True)]
            for p in procs:
                p.start()
            taken = [pipes[top][0].recv() for top in (False, True)]
            for p in procs:
                p.join(30)
            blocks = sorted(b for pieces in taken for a, e in pieces for b in range(a, e))
            assert blocks == list(range(4000))
            assert all(a < e for pieces in taken for a, e in pieces)
    finally:
        board.close()


def test_an_expert_worker_sends_runs_of_adjacent_blocks_and_stops_when_a_message_comes():
    vocab, rows = 10 * BLOCK - 5, 3  # the last block is partial
    w = torch.randn(vocab, 8)
    xn = torch.randn(rows, 8)

    def logits(x, a, b, out):
        out.copy_(x @ w[a:b].T)

    sent = []
    work = ExpertLMWork(logits, vocab, None, capacity=lambda i: 4 * BLOCK * rows * 4)  # 4 blocks per reply
    work.add(0, 11, 1, 2, LMJob(9, 2 * EXPERT_PIECE_DIVISOR, 3, 10, False).ints(), xn)  # pieces of 2 blocks
    stops = iter([False, True])
    work.work(lambda: next(stops, False), lambda i, t, meta, a, b: sent.append((i, t[0].clone(), meta, a, b)))
    assert [(a, b) for *_, a, b in sent] == [(6 * BLOCK, vocab)] and work.jobs  # two pieces, then a message came
    work.work(lambda: False, lambda i, t, meta, a, b: sent.append((i, t[0].clone(), meta, a, b)))
    assert [(a, b) for *_, a, b in sent] == [(6 * BLOCK, vocab), (3 * BLOCK, 6 * BLOCK)] and not work.jobs
    for i, t, meta, a, b in sent:
        assert i == 0 and meta == (11, 1, 2, 0)
        torch.testing.assert_close(t, xn @ w[a:b].T)


def test_a_greedy_job_sends_each_rows_best_logit_and_index_per_run():
    vocab, rows = 10 * BLOCK - 5, 4
    w = torch.randn(vocab, 8)
    xn = torch.randn(rows, 8)
    w[70] = w[40]  # a tie inside one run: the lower index is the choice

    def greedy(x, a, b, best):
        val, idx = (x @ w[a:b].T).max(dim=-1)
        best.merge(val, idx + a)

    def no_logits(*_):
        raise AssertionError("a greedy job computes no logits")

    sent = []
    work = ExpertLMWork(no_logits, vocab, None, capacity=lambda i: 64, greedy=greedy)  # a slot of 64 bytes fits
    work.add(0, 3, 1, 2, LMJob(4, 2 * EXPERT_PIECE_DIVISOR, 0, 10, False, True).ints(), xn)
    stops = iter([False, False, True])
    send = lambda i, t, meta, a, b: sent.append((a, b, t[0].clone(), t[1].clone()))  # noqa: E731
    work.work(lambda: next(stops, False), send)
    work.work(lambda: False, send)
    assert [(a, b) for a, b, *_ in sent] == [(4 * BLOCK, vocab), (0, 4 * BLOCK)] and not work.jobs
    for a, b, val, idx in sent:
        want = xn @ w[a:b].T
        assert torch.equal(idx, torch.argmax(want, dim=-1) + a)
        assert torch.equal(val, want.max(dim=-1).values)


def test_fixed_ranges_take_from_their_own_end():
    r = FixedRange(2, 9)
    assert r.take(True, 3) == (6, 9) and r.take(False, 3) == (2, 5) and r.take(True, 3) == (5, 6)
    assert r.take(False, 1) is None


@pytest.fixture(scope="module")
def big_vocab_model(tmp_path_factory):
    """A tiny Mixtral whose LM head is most of its work (8192 vocabulary rows): its expert workers
    take blocks of it."""
    return make_checkpoint(tmp_path_factory.mktemp("mixtral_vocab"), "mixtral", vocab_size=8192)


@pytest.mark.parametrize("lend,logprobs", [(True, None), (False, None), (True, 1)])
def test_a_shared_lm_head_gives_transformers_tokens(big_vocab_model, lend, logprobs):
    """Plain greedy steps take the argmax in the LM head (no logits); asking for logprobs makes
    every side compute the logits: the same tokens either way."""
    rng = random.Random(2)
    ps = [[rng.randrange(3, 256) for _ in range(rng.randrange(5, 40))] for _ in range(12)]
    want = hf_greedy(big_vocab_model, ps, 8)
    with LLM(str(big_vocab_model), num_kv_blocks=64, expert_workers=1, micro_batches=2, lend_idle_cores=lend) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=logprobs))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all((o.outputs[0].logprobs is not None) == (logprobs is not None) for o in outs)


@pytest.mark.parametrize("logprobs", [None, 1])
def test_the_lm_head_in_one_call_gives_transformers_tokens(big_vocab_model, logprobs, tmp_path):
    """``lm_head_pieces=False`` (the default on an accelerator): the attention worker computes each
    lane's LM head in one call and the expert workers take none of it; the same tokens."""
    rng = random.Random(3)
    ps = [[rng.randrange(3, 256) for _ in range(rng.randrange(5, 40))] for _ in range(12)]
    want = hf_greedy(big_vocab_model, ps, 8)
    trace = str(tmp_path / "trace.json")
    with LLM(str(big_vocab_model), num_kv_blocks=64, expert_workers=1, micro_batches=2, lm_head_pieces=False,
             trace=trace) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=logprobs))
    assert [o.outputs[0].token_ids for o in outs] == want
    spans = load(trace)
    layers = ModelConfig.from_pretrained(big_vocab_model).num_layers
    lm = [e for e in spans["attention0"] if e["args"].get("phase") == "lm_head"]
    last = [e for e in spans["attention0"] if e["name"] == "attention" and e["args"].get("layer") == layers - 1
            and "phase" not in e["args"]]  # each lane step's last layer
    assert lm and len(lm) == len(last)  # one LM head call per lane step
    assert not [e for e in spans["expert0"] if e["args"].get("phase") == "lm_head"]


def test_the_lm_head_goes_in_pieces_and_to_expert_workers_only_on_the_cpu():
    assert EngineConfig(model="m").lm_head_in_pieces and EngineConfig(model="m").lm_head_helper_share == 0.75
    assert not EngineConfig(model="m", device="cuda").lm_head_in_pieces
    assert EngineConfig(model="m", device="cuda").lm_head_helper_share == 0.0
    assert EngineConfig(model="m", expert_device="cuda").lm_head_helper_share == 0.0  # pieces, none to experts
    assert EngineConfig(model="m", expert_device="cuda").lm_head_in_pieces
    assert EngineConfig(model="m", lm_head_pieces=False).lm_head_helper_share == 0.0
    assert EngineConfig(model="m", device="cuda", lm_head_pieces=True).lm_head_in_pieces
    with pytest.raises(ConfigError, match="lm_head_pieces"):
        EngineConfig(model="m", lm_head_pieces="yes")


def test_a_run_goes_out_when_the_reply_slot_is_full():
    vocab, rows = 8 * BLOCK, 2
    w, xn = torch.randn(vocab, 4), torch.randn(rows, 4)
    sent = []
    work = ExpertLMWork(lambda x, a, b, out: out.copy_(x @ w[a:b].T), vocab, None,
                        capacity=lambda i: 3 * BLOCK * rows * 4)  # 3 blocks per reply
    work.add(1, 5, 0, 2, LMJob(1, 1, 0, 8, False).ints(), xn)
    work.work(lambda: False, lambda i, t, meta, a, b: sent.append((a // BLOCK, b // BLOCK, t[0].clone())))
    assert [(a, b) for a, b, _ in sent] == [(5, 8), (2, 5), (0, 2)]
    for a, b, t in sent:
        torch.testing.assert_close(t, xn @ w[a * BLOCK:b * BLOCK].T)


@pytest.mark.parametrize("victim,fault", [("expert0", "kill"), ("expert0", "stop"), ("attention0", "kill")])
def test_a_worker_lost_while_lm_head_blocks_are_taken_is_replaced_and_outputs_stay(big_vocab_model, victim, fault):
    """kill -9 (or SIGSTOP for 5 s) the expert worker mid-decode, when it takes blocks of the LM head
    (most of this model's work) as well as layers, or kill an attention worker whose LM heads it
    takes blocks of: only the lost worker is replaced (an expert worker whose run finds its receiver
    gone waits for new links), greedy outputs equal the fault-free run's, nothing hangs."""
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(6)]
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    with LLM(str(big_vocab_model), num_kv_blocks=128, attention_workers=2, expert_workers=1,
             micro_batches=2) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert generate_losing(llm, prompts, params, victim, fault) == want
        assert llm.engine.membership.restarts == {victim: 1}


def test_an_expert_worker_reads_its_lm_head_when_the_first_share_comes(big_vocab_model):
    """Where its own config expects no shares (an accelerator) an expert worker holds a loader, not
    the LM head: an attention worker of a deployment spec may run on the CPU and send shares anyway."""
    from afdserve.model.loader import CheckpointReader
    from afdserve.model.model import ExpertModel, read_lm_head
    from afdserve.runtime.expert_compute import ExpertCompute
    from afdserve.runtime.expert_map import ExpertMap

    cfg = ModelConfig.from_pretrained(big_vocab_model)
    reader = CheckpointReader(big_vocab_model)
    reads = []
    loader = lambda: reads.append(1) or read_lm_head(reader, cfg, torch.float32)  # noqa: E731
    experts = ExpertModel.load(big_vocab_model, None, torch.float32, cfg, reader)
    emap = ExpertMap.contiguous(cfg.num_layers, cfg.num_experts, 1, [cfg.num_experts])
    compute = ExpertCompute(experts, None, 0, {0: emap}, lm_head=loader)
    assert not reads
    w = read_lm_head(reader, cfg, torch.float32)
    xn = torch.randn(3, cfg.hidden_size)
    for a, b in ((0, 64), (64, 160)):
        out = torch.empty(3, b - a)
        compute.logits(xn, a, b, out)
        torch.testing.assert_close(out, xn @ w[a:b].T)
    assert len(reads) == 1
