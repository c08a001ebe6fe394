"""The ping-pong timeline of a deployment trace (like MegaScale-Infer's Fig. 4) and each worker's
busy and idle fractions (drawn by ``afdserve trace-plot``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

COMPUTE = ("attention", "expert")
COLORS = {"attention": "#4C72B0", "expert": "#DD8452", "send": "#55A868", "wait": "#C44E52", "idle": "#DDDDDD"}


@dataclass
class WorkerUsage:
    worker: str
    busy: float  # fraction of the window spent computing (attention or expert spans)
    comm: float  # fraction in send spans
    wait: float  # fraction blocked on a peer or idle
    window_ms: float


def load(path: str) -> dict[str, list[dict]]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans: dict[str, list[dict]] = {n: [] for n in names.values()}
    for e in events:
        if e.get("ph") == "X":
            spans[names.get(e["tid"], str(e["tid"]))].append(e)
    return spans


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def steady_window(spans: dict[str, list[dict]], trim: float = 0.1) -> tuple[float, float]:
    """The busy part of the run: from the first to the last compute span, trimming ``trim`` of it at
    each end (pipeline fill and drain)."""
    pts = [(e["ts"], e["ts"] + e["dur"]) for evs in spans.values() for e in evs if e["name"] in COMPUTE]
    if not pts:
        return 0.0, 0.0
    t0, t1 = min(p[0] for p in pts), max(p[1] for p in pts)
    return t0 + trim * (t1 - t0), t1 - trim * (t1 - t0)


def usage(spans: dict[str, list[dict]], window: tuple[float, float] | None = None) -> list[WorkerUsage]:
    lo, hi = window or steady_window(spans)
    length = max(hi - lo, 1e-9)

    def frac(evs: list[dict], kinds: tuple[str, ...]) -> float:
        iv = [(max(e["ts"], lo), min(e["ts"] + e["dur"], hi)) for e in evs if e["name"] in kinds]
        return union_length([i for i in iv if i[1] > i[0]]) / length

    out = []
    for w, evs in sorted(spans.items()):
        busy = frac(evs, COMPUTE)
        comm = frac(evs, ("send",))
        out.append(WorkerUsage(w, busy, comm, max(0.0, 1 - busy - comm), length / 1e3))
    return out


def plot(spans: dict[str, list[dict]], out: str, start_ms: float | None, span_ms: float | None,
         title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo, hi = steady_window(spans, trim=0.0)
    if start_ms is not None:
        lo = lo + start_ms * 1e3
    if span_ms is not None:
        hi = min(hi, lo + span_ms * 1e3)
    workers = sorted(spans)
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.6 * len(workers)))
    for row, w in enumerate(workers):
        for e in spans[w]:
            s, d = e["ts"], e["dur"]
            if e["name"] not in COLORS or s + d < lo or s > hi or e["name"] == "idle":
                continue
            ax.barh(row, d / 1e3, left=(s - lo) / 1e3, color=COLORS[e["name"]], edgecolor="white", linewidth=0.3)
            mb = e.get("args", {}).get("mb")
            if e["name"] in COMPUTE and mb is not None and d / max(hi - lo, 1) > 0.012:
                ax.text((s - lo + d / 2) / 1e3, row, str(mb), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(workers)), workers)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, (hi - lo) / 1e3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in ("attention", "expert", "send", "wait")]
    ax.legend(handles, ["attention compute", "expert compute", "send", "wait"], loc="upper right", fontsize=7,
              ncol=4)
    ax.set_title(title or "ping-pong pipeline timeline (numbers: micro-batch)")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
