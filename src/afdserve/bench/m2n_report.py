"""The M2N benchmark's results: a table and a plot (latency and throughput against message size, and
against M = N)."""

from __future__ import annotations

from typing import Sequence


def fmt_size(n: int) -> str:
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


def format_table(rows: Sequence[dict]) -> str:
    head = (f"{'transport':<10} {'M':>2} {'N':>2} {'size':>7} {'median us':>10} {'p99 us':>10} {'GB/s':>8} "
            f"{'cpu shared':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        shared = f"{100 * r['cpu_shared']:.0f}%" if "cpu_shared" in r else "-"
        lines.append(f"{r['transport']:<10} {r['senders']:>2} {r['receivers']:>2} {fmt_size(r['size_bytes']):>7} "
                     f"{r['median_us']:>10.1f} {r['p99_us']:>10.1f} {r['throughput_gbps']:>8.2f} {shared:>10}")
    return "\n".join(lines)


def plot(report: dict, path: str, m: int, n: int, scale_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    names = [t for t in dict.fromkeys(r["transport"] for r in rows) if t != "memcpy"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    metrics = (("median_us", "median latency (us)"), ("p99_us", "p99 latency (us)"),
               ("throughput_gbps", "throughput (GB/s)"))
    for col, (key, label) in enumerate(metrics):
        ax = axes[0][col]
        for t in names + ["memcpy"]:
            pts = sorted((r["size_bytes"], r[key]) for r in rows
                         if r["transport"] == t and r["senders"] == m and r["receivers"] == n)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if t == "memcpy" else "-o", label=t)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"message size (bytes), M={m} N={n}")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax = axes[1][col]
        for t in names:
            pts = sorted((r["senders"], r[key]) for r in rows
                         if r["transport"] == t and r["size_bytes"] == scale_size and r["senders"] == r["receivers"])
            if len(pts) > 1:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=t)
        ax.set_xlabel(f"M = N (message {fmt_size(scale_size)})")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    for ax in (axes[0][0], axes[1][0]):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    mach = report["machine"]
    fig.suptitle(f"afdserve M2N — {mach['cpu']}, {mach['cores']} cores, memcpy {mach['memcpy_gbps']:.1f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
