"""Cores lent between the workers of one machine (the cpu backend's host hooks:
backends/cpu/cores.py, csrc/lend.h): what a fused MoE or LM-head call may borrow, the claim
protocol, results unchanged by borrowed threads, the slots of both roles, the hooks the runtime
calls, and a local deployment that lends (and cleans its board up)."""

import os
import random

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.backends import cpu as kernels
from afdserve.backends.cpu import build
from afdserve.backends.cpu.cores import SLOTS, CoreBoard, CoreHooks, lent_chunks, lent_threads_now, slot, stop_borrowing
from tiny_models import hf_greedy

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {build.load().reason}")


@pytest.fixture
def board():
    b = CoreBoard.create()
    try:
        yield b
    finally:
        stop_borrowing()  # this process borrows nothing again
        b.close()


@needs_kernels
def test_a_call_borrows_only_what_idle_owners_lend_and_nobody_holds(board):
    a, b = board.lender(0, 1), board.lender(5, 2)
    assert board.lender(SLOTS, 1) is None  # past the board: that worker lends nothing
    assert board.borrow(3)
    assert lent_threads_now() == 0  # nobody waits
    a.lend()
    assert lent_threads_now() == 1
    b.lend()
    assert lent_threads_now() == 3
    assert all(holder == 0 for _, holder in board.read())  # a call gives what it claimed back
    board.borrow(2)  # at most 2: slot 0 (1 thread) fits, slot 5 (2 more) would not
    assert lent_threads_now() == 1
    board.borrow(3)
    board._ints[SLOTS + 5] = os.getpid() + 1  # another worker holds slot 5's threads
    assert lent_threads_now() == 1
    b.reclaim()  # its owner woke: the claim lapses with the lending
    assert board.read()[5] == (0, 0)
    a.reclaim()
    assert lent_threads_now() == 0
    stop_borrowing()
    a.lend()
    assert lent_threads_now() == 0  # no board registered: nothing borrowed


def _moe_inputs(seed: int, tokens: int, hidden: int, inter: int, dtype: torch.dtype, experts: int = 8, k: int = 2):
    """Random fused-MoE inputs: x, packed w13 and w2, top-k ids and weights, the local expert map."""
    from afdserve.backends.cpu.ops import pack_down, pack_gate_up

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = pack_gate_up((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype))
    w2 = pack_down((torch.randn(experts, hidden, inter, generator=g) * 0.1).to(dtype))
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, k, generator=g), -1)
    return x, w13, w2, ids, w, torch.arange(experts)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_borrowed_threads_leave_the_moe_output_unchanged(board, dtype):
    from afdserve.backends.cpu.ops import fused_moe

    if not kernels.supports("fused_moe", dtype):
        pytest.skip(f"no fused_moe kernel for {dtype} on this CPU")

    inter = 96
    x, w13, w2, ids, w, local = _moe_inputs(1, 600, 64, inter, dtype)  # 1,200 routed pairs: enough to borrow
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = fused_moe(x, w13, w2, ids, w, local, inter)
        lender = board.lender(0, 1)
        board.borrow(1)
        lender.lend()
        assert lent_threads_now() == 1
        lent = fused_moe(x, w13, w2, ids, w, local, inter)
        assert torch.get_num_threads() == 1  # its own threads again after the call
        assert board.read()[0] == (1, 0)  # claims given back
        lender.reclaim()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, lent)  # threads split the column blocks: the same arithmetic per output


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_borrowed_threads_leave_the_lm_head_unchanged(board, dtype):
    """An LM-head-sized linear (2^24 multiply-adds or more) borrows the threads an expert worker lends
    while it waits; its logits are the same bits."""
    from afdserve.backends.cpu.ops import linear, pack

    if not kernels.supports("linear", dtype):
        pytest.skip(f"no linear kernel for {dtype} on this CPU")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 256, generator=g).to(dtype)
    w = pack((torch.randn(2000, 256, generator=g) * 0.1).to(dtype))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = linear(x, w, 2000, out_dtype=torch.float32)
        lender = board.lender(slot("expert", 0), 1)
        board.borrow(1)
        lender.lend()
        assert lent_threads_now() == 1
        lent = linear(x, w, 2000, out_dtype=torch.float32)
        assert torch.get_num_threads() == 1
        assert board.read()[slot("expert", 0)] == (1, 0)  # claims given back
        lender.reclaim()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, lent)


@needs_kernels
def test_a_lent_thread_takes_chunks_of_a_big_call_and_gives_its_slot_back(board):
    """A call long enough for a lent thread to wake (~0.1 s of MoE on one thread) has chunks run by
    this process's helper on it; the output is the same bits, and the claim is gone afterwards."""
    from afdserve.backends.cpu.ops import fused_moe

    inter = 512
    x, w13, w2, ids, w, local = _moe_inputs(4, 2048, 256, inter, torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = fused_moe(x, w13, w2, ids, w, local, inter)
        lender = board.lender(slot("expert", 3), 1)
        board.borrow(1)
        lender.lend()
        before = lent_chunks()
        lent = fused_moe(x, w13, w2, ids, w, local, inter)
        helped = lent_chunks() - before
        assert board.read()[slot("expert", 3)] == (1, 0)  # claim given back, the owner still lends
        lender.reclaim()
        before = lent_chunks()
        again = fused_moe(x, w13, w2, ids, w, local, inter)  # the owner woke: nobody helps
        assert lent_chunks() == before
    finally:
        torch.set_num_threads(threads)
    assert helped > 0
    assert torch.equal(alone, lent) and torch.equal(alone, again)


def _forked_borrower(board: CoreBoard, done) -> None:
    """In a forked child: the parent's helper threads are not here; a lent call starts its own (a
    call long enough, ~10 ms, for one to wake and take chunks)."""
    from afdserve.backends.cpu.ops import linear, pack

    torch.set_num_threads(1)
    board.borrow(1)
    before = lent_chunks()
    x, w = torch.randn(64, 256), pack(torch.randn(32768, 256))
    linear(x, w, 32768)
    done.put(lent_chunks() - before)


@needs_kernels
def test_a_forked_child_does_not_wait_on_its_parents_helpers(board):
    import multiprocessing as mp

    from afdserve.backends.cpu.ops import linear, pack

    lender = board.lender(slot("expert", 1), 1)
    lender.lend()
    board.borrow(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, w = torch.randn(64, 256), pack(torch.randn(4096, 256))
        linear(x, w, 4096)  # this process now has a helper thread
        ctx = mp.get_context("fork")
        done = ctx.Queue()
        child = ctx.Process(target=_forked_borrower, args=(board, done))
        child.start()
        child.join(60)
        alive = child.is_alive()
        if alive:
            child.kill()
    finally:
        torch.set_num_threads(threads)
        lender.reclaim()
    assert not alive, "the forked child hung in a lent call"
    assert child.exitcode == 0 and done.get(timeout=5) > 0


@needs_kernels
def test_a_sender_takes_the_receivers_lending_back_before_it_sends(board):
    """The message wakes the receiver: its cores must not be claimed again before it could run."""
    expert = board.lender(slot("expert", 0), 1)
    attention = board.lender(slot("attention", 0), 1)
    board.borrow(1)
    attention.lend()
    assert lent_threads_now() == 1
    expert.wake(slot("attention", 0))  # the expert worker is about to reply to attention worker 0
    assert board.read()[slot("attention", 0)][0] == 0
    assert lent_threads_now() == 0
    attention.reclaim()  # it woke: a clean slot, and it lends again at its next wait
    attention.lend()
    assert lent_threads_now() == 1
    attention.reclaim()


@needs_kernels
def test_the_hooks_lend_while_waiting_wake_a_peer_and_stop_spinning_on_a_borrowed_core(board):
    """What the runtime calls (``afdserve.backends.host.WorkerHooks``): ``waiting`` lends the worker's
    threads for the wait only, ``sending`` takes a peer's lending back, ``spin_yield`` holds while
    another process holds this worker's lent threads."""
    hooks = CoreHooks(board.lender(slot("attention", 0), 1))
    peer = board.lender(slot("expert", 2), 1)
    with hooks.waiting():
        assert board.read()[slot("attention", 0)] == (1, 0)
        assert not hooks.spin_yield()
        board._ints[SLOTS + slot("attention", 0)] = os.getpid() + 1  # another worker borrowed them
        assert hooks.spin_yield()
    assert board.read()[slot("attention", 0)] == (0, 0) and not hooks.spin_yield()
    peer.lend()
    hooks.sending("expert", 2)
    assert board.read()[slot("expert", 2)][0] == 0


def test_each_role_has_its_half_of_the_board():
    assert [slot("attention", i) for i in (0, 5)] == [0, 5]
    assert [slot("expert", j) for j in (0, 5)] == [SLOTS // 2, SLOTS // 2 + 5]
    assert slot("attention", SLOTS // 2) == -1 and slot("expert", SLOTS // 2) == -1 and slot("expert", -1) == -1


def test_a_local_deployment_lends_and_closes_its_board(tiny_model):
    """A prefill large enough to borrow on (one expert round of > 512 routed pairs) gives
    transformers' tokens, with and without lending; the front end's board descriptor is closed
    after shutdown."""
    arch, path = tiny_model
    rng = random.Random(3)
    ps = [[rng.randrange(3, 256) for _ in range(n)] for n in (90, 120, 70, 60)]
    want = hf_greedy(path, ps, 6)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for lend in (True, False):
        with LLM(str(path), num_kv_blocks=64, expert_workers=1, micro_batches=2, lend_idle_cores=lend) as llm:
            board = llm.engine.share
            assert (board is not None) == lend
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], greedy)
            assert [o.outputs[0].token_ids for o in outs] == want
        if lend:
            assert board.fd is None


def test_a_lender_knows_when_its_lent_cores_are_borrowed(board):
    lender = board.lender(slot("attention", 0), 1)
    assert not lender.borrowed()
    lender.lend()
    assert not lender.borrowed()  # lent, nobody holds them
    board._ints[SLOTS + lender.slot] = os.getpid()  # a borrower's claim (kernels/csrc/lend.cpp)
    assert lender.borrowed()
    lender.reclaim()
    assert not lender.borrowed()
