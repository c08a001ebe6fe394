"""A worker process's entry point: build the worker its spec names, tell the front end it is ready,
serve until told to stop, report a crash."""

from __future__ import annotations

import os
import threading
import traceback

from afdserve.runtime.attention_worker import AttentionWorker
from afdserve.runtime.control import ControlChannel
from afdserve.runtime.expert_worker import ExpertWorker
from afdserve.runtime.messages import Crashed, Heartbeat, Ready, WorkerSpec


def run_worker(spec: WorkerSpec, ctl: ControlChannel) -> None:
    try:  # ps/top show the role: "afdserve: attention0"
        import setproctitle

        setproctitle.setproctitle(f"afdserve: {spec.name}")
    except Exception:  # optional: a missing module only costs the title
        pass
    worker: AttentionWorker | ExpertWorker | None = None
    stop = threading.Event()
    threading.Thread(target=_beat, args=(ctl, spec.name, spec.config.heartbeat_timeout_ms / 4000, stop),
                     daemon=True, name="heartbeat").start()
    try:
        worker = AttentionWorker(spec) if spec.role == "attention" else ExpertWorker(spec)
        ctl.send(Ready(spec.name, os.getpid(), spec.epoch))
        worker.serve(ctl)
    except BaseException as e:  # report to the front end; it decides what fails
        try:
            ctl.send(Crashed(spec.name, f"{type(e).__name__}: {e}", traceback.format_exc()))
        except Exception:
            pass
    finally:
        stop.set()
        if worker is not None:
            worker.close()


def _beat(ctl: ControlChannel, name: str, interval: float, stop: threading.Event) -> None:
    """Tells the front end that this process runs, every ``interval`` seconds (a stopped or dead
    process falls silent; the front end fences it after ``heartbeat_timeout_ms``)."""
    while not stop.wait(interval):
        try:
            ctl.send(Heartbeat(name))
        except Exception:  # the channel closed: the worker is ending
            return
