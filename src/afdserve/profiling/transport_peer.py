"""``python -m afdserve.profiling.transport_peer JSON``: the expert-worker process of the transport
harness (:mod:`afdserve.profiling.harness_transport`)."""

from __future__ import annotations

import json
import statistics
import sys

import torch

from afdserve.profiling.harness_transport import connect_pair, spin
from afdserve.profiling.timers import cpu_time
from afdserve.runtime import ExpertOutput, LayerKey

__all__ = ["serve_peer"]


def serve_peer(arg: str) -> None:
    """The expert-worker side of :func:`~afdserve.profiling.harness_transport.measure_transport`
    (its settings as JSON); sends its own timings back over the link at the end."""
    a = json.loads(arg)
    torch.set_num_threads(1)
    dt = getattr(torch, a["dtype"])
    n, busy = a["repeats"], a["busy_s"]
    links = connect_pair("expert", "attention", tuple(a["store"]), a["group"], a["slot_bytes"])
    try:
        rows = []  # per size: [take a waiting message, reply to a spinning peer, reply to a sleeping peer]
        for tokens in a["plan"]:
            reply = ExpertOutput(LayerKey(0, 0, 0), torch.randn(tokens, a["hidden"]).to(dt))
            take, fast, ring = [], [], []
            for phase in ("fast", "asleep", "busy"):
                for i in range(n + 2):
                    if phase == "busy":
                        spin(busy)  # "computing" while the next message arrives
                    t0 = cpu_time()
                    for _i, msg in links.gather(30.0):
                        msg.release()
                    t1 = cpu_time()
                    links.send(0, reply)
                    t2 = cpu_time()
                    if i >= 2:
                        if phase == "busy":
                            take.append(t1 - t0)  # CPU time: the message was there, nothing to wait for
                            ring.append(t2 - t1)  # the sender sleeps in recv by now
                        else:
                            fast.append(t2 - t1)
            rows.append([statistics.median(take), statistics.median(fast), statistics.median(ring)])
        links.comm.send("attention", [torch.tensor(rows, dtype=torch.float64)])  # the timings
        links.comm.recv("attention", timeout=30.0).release()  # the parent's goodbye
    finally:
        links.close()


if __name__ == "__main__":
    serve_peer(sys.argv[1])
