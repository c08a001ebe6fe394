"""Starts workers as local processes that never outlive their parent, and the rendezvous store."""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener

from afdserve.errors import WorkerError
from afdserve.runtime.control import ControlChannel
from afdserve.runtime.messages import ToWorker, WorkerSpec
from afdserve.runtime.worker import run_worker

PR_SET_PDEATHSIG = 1
_SPAWNER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="afdserve-spawn")


class ControlLink:
    """What every launched worker handle shares: its control channel ``ctl``, and ``dead`` set once
    that channel breaks (a send to a dead worker is dropped)."""

    ctl: ControlChannel
    dead: bool

    def send(self, msg: ToWorker) -> None:
        if self.dead:
            return
        try:
            self.ctl.send(msg)
        except (BrokenPipeError, EOFError, OSError):
            self.dead = True


@dataclass
class Launched(ControlLink):
    """A worker process and its control connection (whose EOF also signals the worker's death)."""

    name: str
    process: subprocess.Popen
    ctl: ControlChannel
    dead: bool = False

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def exitcode(self) -> int | None:
        return self.process.poll()

    def describe(self) -> str:
        """Where the worker runs, for messages."""
        return f"pid {self.pid}"

    def exit_status(self) -> str:
        return f"exit code {self.exitcode()}"

    def wait(self, timeout: float) -> None:
        """Waits up to ``timeout`` for the process to exit (after its control connection closed)."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """Fences the worker: SIGKILL (a stopped process too), reaped; its channel closed."""
        self.dead = True
        try:
            self.process.kill()
            self.process.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.ctl.close()

    def join(self, timeout: float) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        self.ctl.close()


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux prctl), with a polling fallback."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


# ``python -c``, not ``-m afdserve.cluster.process_launcher``: the package imports this module, and runpy
# warns when ``-m`` runs a module that its package already imported
_CHILD = ("import sys; from afdserve.cluster.process_launcher import _child_main; "
          "_child_main(sys.argv[1], int(sys.argv[2]))")


def spawn_worker(spec: WorkerSpec) -> Launched:
    """Starts a Python process running ``_child_main`` and hands it its spec over an authenticated
    local socket (no re-import of the caller's ``__main__``, unlike multiprocessing's spawn)."""
    key = secrets.token_bytes(16)
    sock_dir = tempfile.mkdtemp(prefix="afdserve-")
    address = os.path.join(sock_dir, "ctl")
    with Listener(address, family="AF_UNIX", authkey=key) as listener:
        env = dict(os.environ, OMP_NUM_THREADS=str(spec.config.num_threads or 1))
        # started from one long-lived thread: the child's PR_SET_PDEATHSIG fires when the *thread*
        # that forked it ends, and a replacement may be launched from a short-lived caller thread
        proc = _SPAWNER.submit(subprocess.Popen, [sys.executable, "-c", _CHILD, address, str(os.getpid())],
                               stdin=subprocess.PIPE, env=env,
                               pass_fds=(spec.host_share,) if spec.host_share is not None else ()).result()
        assert proc.stdin is not None
        proc.stdin.write(key.hex().encode() + b"\n")
        proc.stdin.close()
        listener._listener._socket.settimeout(60)  # type: ignore[attr-defined]
        try:
            conn = listener.accept()
        except OSError as e:
            proc.kill()
            raise WorkerError(f"{spec.name} did not connect back (exit code {proc.poll()}): {e}") from e
    shutil.rmtree(sock_dir, ignore_errors=True)
    ctl = ControlChannel(conn)
    ctl.send(spec)
    return Launched(spec.name, proc, ctl)


def _child_main(address: str, parent: int) -> None:
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when workers stop
    key = bytes.fromhex(sys.stdin.readline().strip())
    ctl = ControlChannel(Client(address, family="AF_UNIX", authkey=key))
    spec = ctl.recv()
    if not isinstance(spec, WorkerSpec):
        raise WorkerError(f"expected a WorkerSpec first, got {type(spec).__name__}")
    run_worker(spec, ctl)


class Store:
    """The rendezvous key-value store of one deployment (torch's TCPStore, hosted here)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        from torch.distributed import TCPStore

        self.host = host  # the address workers dial: loopback locally, the node's IP for remote workers
        with socket.socket() as s:
            s.bind((self.host, 0))
            port = s.getsockname()[1]
        self._store = TCPStore(self.host, port, is_master=True, wait_for_workers=False)
        self.addr = (self.host, port)

    def close(self) -> None:
        self._store = None


def start_store(host: str = "127.0.0.1") -> Store:
    return Store(host)


if __name__ == "__main__":
    _child_main(sys.argv[1], int(sys.argv[2]))
