"""A lost worker (killed or stalled) is replaced and no request fails; workers die with their parent;
nothing is left behind."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from afdserve import LLM, SamplingParams
from tiny_models import generate_losing


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("afd")}


@pytest.mark.parametrize("victim,fault", [("expert1", "kill"), ("attention0", "kill"), ("expert0", "stop"),
                                          ("attention1", "stop")])
def test_a_lost_worker_is_replaced_and_requests_go_on(tiny_mixtral, victim, fault):
    """kill -9 an expert or an attention worker, or SIGSTOP one for 5 s, mid-decode: the worker is
    fenced (a stopped attention worker by the front end's heartbeat deadline) and replaced, the others keep their state, and greedy outputs equal the
    fault-free run's (the interrupted step runs again; a lost attention worker's requests are
    recomputed from prompt plus the tokens already delivered)."""
    before = _shm()
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(4)]
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_mixtral), num_kv_blocks=128, attention_workers=2, expert_workers=2, micro_batches=2)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    pids = [w.pid for w in llm.engine.workers.values()]
    target = llm.engine.workers[victim]
    assert generate_losing(llm, prompts, params, victim, fault) == want
    assert llm.engine.membership.restarts == {victim: 1} and llm.engine.failed is None
    assert not _alive(target.pid)  # fenced: a stalled process does not come back
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want  # and serving goes on
    now = [w.pid for w in llm.engine.workers.values()]
    llm.shutdown()
    assert not any(_alive(p) for p in pids + now)
    ours = {str(p) for p in pids + now + [os.getpid()]}  # other tests on this machine may hold segments now
    assert {n for n in _shm() - before if n.split("_")[1] in ours} == set()


def test_workers_die_with_their_parent(tiny_mixtral, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        from afdserve import LLM
        llm = LLM({str(tiny_mixtral)!r}, num_kv_blocks=64, expert_workers=2)
        print(" ".join(str(w.pid) for w in llm.engine.workers.values()), flush=True)
        sys.stdin.readline()
        os.kill(os.getpid(), 9)   # the parent crashes without shutting anything down
    """))
    before = _shm()
    p = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in p.stdout.readline().split()]
    assert len(pids) == 3 and all(_alive(x) for x in pids)
    p.stdin.write("\n")
    p.stdin.flush()
    p.wait(30)
    deadline = time.monotonic() + 10
    while any(_alive(x) for x in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(x) for x in pids), "orphan worker processes"
    ours = {str(x) for x in pids + [p.pid]}  # other tests on this machine may create segments meanwhile

    def leftover() -> set[str]:
        return {n for n in _shm() - before if n.split("_")[1] in ours}

    deadline = time.monotonic() + 5
    while leftover() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftover(), f"leftover shared memory: {leftover()}"
