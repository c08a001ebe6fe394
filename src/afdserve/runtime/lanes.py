"""The attention worker's steps in flight: ``m`` lanes interleaved on one thread.

Each lane runs engine steps of its own (``Engine.begin(m)``: a micro-batch of the running
sequences, none of them in another lane's step) through the pipeline. While the expert workers
compute one lane's layer, the others run: a lane whose expert replies came resumes first (it feeds
the experts again), then a new step on an idle lane, then a lane with work of its own (sampling).
So a lane's step boundary (LM head, sampling, scheduling) overlaps the experts' work on the other
lanes' layers, and the pipeline never drains between steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from afdserve.engine.engine import Engine, StepInputs
from afdserve.engine.outputs import TokenOutput
from afdserve.runtime.cp import CPAborted
from afdserve.runtime.pipeline import Dispatch, PipelinedRunner
from afdserve.runtime.trace import Span, Tracer


@dataclass
class _Task:
    step: StepInputs
    run: Generator[Dispatch | None, None, None]
    t0_ns: int
    waiting: Dispatch | None = None  # the dispatch it yielded, until it is resumed


class Lanes:
    def __init__(self, engine: Engine, runner: PipelinedRunner, tracer: Tracer,
                 emit: Callable[[list[TokenOutput]], None]):
        self.engine, self.runner, self.tracer, self.emit = engine, runner, tracer, emit
        self.tasks: dict[int, _Task] = {}  # lane -> its step in flight
        self.ready: deque[int] = deque()  # lanes whose expert replies came: resumed first
        self.runnable: list[int] = []  # lanes that can go on without the experts (the oldest step first)
        self.nothing_to_begin = False  # the last begin found nothing: retried after a change

    @property
    def busy(self) -> bool:
        """A step is in flight."""
        return bool(self.tasks)

    def changed(self) -> None:
        """Requests came or went: an idle lane may find work again."""
        self.nothing_to_begin = False

    @torch.inference_mode()
    def advance(self, begin: bool, timeout: float) -> None:
        """Does the next piece of work: resumes a lane whose replies came, else (if ``begin``) starts
        a step on an idle lane, else resumes a lane that can go on; with nothing to do but wait for
        the experts, waits for their next reply up to ``timeout``."""
        run = self.runner
        if run.in_flight:
            self._completed(run.poll(0.0))
        if self.ready:
            return self._resume(self.ready.popleft())
        # a new step gives the experts work at once (with none in flight, always worth a try: a
        # sequence preempted by the last try is scheduled by this one)
        if begin and (not self.nothing_to_begin or not self.tasks):
            lane = next((i for i in range(run.m) if i not in self.tasks), None)
            if lane is not None:
                with self.tracer.span("engine", phase="begin"):
                    step = self.engine.begin(run.m)
                if step is not None:
                    self.tasks[lane] = _Task(step, self._task(lane, step), time.time_ns())
                    return self._resume(lane)
                self.nothing_to_begin = True
        if self.runnable:
            # the oldest step goes on: lanes that reach their step boundary together finish it one
            # after the other, the first to reach it first
            lane = min(self.runnable, key=lambda i: self.tasks[i].t0_ns)
            self.runnable.remove(lane)
            return self._resume(lane)
        if run.in_flight:
            self._completed(run.poll(timeout))

    def _completed(self, done: list[Dispatch]) -> None:
        """Lanes waiting on these dispatches are ready (one that completed before its lane yielded it
        is seen as complete when the lane yields)."""
        for d in done:
            task = self.tasks.get(d.lane)
            if task is not None and task.waiting is d:
                self.ready.append(d.lane)

    def abandon(self) -> None:
        """Drops every step in flight (a peer was lost): they run again once the links are new."""
        self.runner.reset([t.waiting for t in self.tasks.values() if t.waiting is not None])
        for task in self.tasks.values():
            task.run.close()
            self.engine.cancel(task.step)
        self.tasks.clear()
        self.ready.clear()
        self.runnable.clear()
        self.nothing_to_begin = False

    def _task(self, lane: int, step: StepInputs) -> Generator[Dispatch | None, None, None]:
        out = yield from self.runner.run(lane, self.runner.next_step(), step.model_input, step.batch)
        yield None  # sampling after the lanes whose replies came
        with self.tracer.span("engine", phase="finish", mb=lane):
            outs = self.engine.finish(step, out)
        with self.tracer.span("engine", phase="emit", mb=lane):
            self.emit(outs)

    def _resume(self, lane: int) -> None:
        task = self.tasks[lane]
        task.waiting = None
        try:
            waits = task.run.send(None)
        except CPAborted:  # a context-parallel prefill aborted or interrupted mid-step: dropped (or run again)
            del self.tasks[lane]
            self.engine.cancel(task.step)
            self.nothing_to_begin = False
            return
        except StopIteration:
            del self.tasks[lane]
            self.nothing_to_begin = False
            if self.tracer.enabled:
                self.tracer.spans.append(Span("step", task.t0_ns / 1e3, (time.time_ns() - task.t0_ns) / 1e3,
                                              {"tokens": task.step.batch.num_tokens, "lane": lane, "m": self.runner.m}))
            return
        if waits is None:
            self.runnable.append(lane)
            return
        task.waiting = waits  # (its replies are released by abandon if it never resumes)
        if waits.complete:
            self.ready.append(lane)
