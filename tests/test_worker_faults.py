"""A dead expert worker fails in-flight requests quickly and names the worker; nothing is left behind."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from afdserve import LLM, SamplingParams
from afdserve.errors import WorkerError


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


def test_expert_worker_killed_mid_decode(tiny_mixtral):
    before = _shm()
    llm = LLM(str(tiny_mixtral), num_kv_blocks=64, expert_workers=2, micro_batches=2)
    pids = [w.pid for w in llm.engine.workers.values()]
    victim = llm.engine.workers["expert1"]
    result: dict = {}

    def run():
        try:
            llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 4,
                         SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        except Exception as e:  # noqa: BLE001
            result["error"] = e
        result["t"] = time.monotonic()

    th = threading.Thread(target=run)
    th.start()
    time.sleep(1.0)  # decoding by now
    killed_at = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    th.join(10)
    assert not th.is_alive(), "generate hung after a worker died"
    assert isinstance(result.get("error"), WorkerError)
    assert "expert1" in str(result["error"])
    assert result["t"] - killed_at < 1.0, "in-flight requests must fail within a second"
    llm.shutdown()
    time.sleep(0.5)
    assert not any(_alive(p) for p in pids)
    assert _shm() <= before


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
    deadline = time.monotonic() + 5
    while not _shm() <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _shm() <= before, f"leftover shared memory: {_shm() - before}"
