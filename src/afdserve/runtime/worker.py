"""A worker process's entry point: build the worker its spec names, tell the front end it is ready,
serve until told to stop, report a crash."""

from __future__ import annotations

import os
import traceback

from afdserve.runtime.attention_worker import AttentionWorker
from afdserve.runtime.control import ControlChannel
from afdserve.runtime.expert_worker import ExpertWorker
from afdserve.runtime.messages import Crashed, Ready, WorkerSpec


def run_worker(spec: WorkerSpec, ctl: ControlChannel) -> None:
    try:  # ps/top show the role: "afdserve: attention0"
        import setproctitle

        setproctitle.setproctitle(f"afdserve: {spec.name}")
    except Exception:  # optional: a missing module only costs the title
        pass
    worker: AttentionWorker | ExpertWorker | None = None
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
        if worker is not None:
            worker.close()
