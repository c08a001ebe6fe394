"""``afdserve autoscale-day``: the autoscaling policy over a simulated diurnal day against the best
fixed deployment (``afdserve.planner.autoscale_day``)."""

from __future__ import annotations

import argparse
import json
import sys

from afdserve.planner.autoscale_day import DayConfig, run_day, with_overrides


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d = DayConfig()
    p = sub.add_parser(
        "autoscale-day", help="simulate a diurnal day: the autoscaling policy vs the best fixed deployment",
        description="Replays a day-long diurnal decode-demand trace (a sinusoid with --peak-trough, seeded noise) "
                    "on the planner's capacity model of --model on --gpu, driving the same autoscaling policy as "
                    "`afdserve serve --autoscale`, and compares its worker-hours with the cheapest fixed "
                    "deployment whose SLO attainment is at least the autoscaled day's.")
    p.add_argument("--model", default=d.model, help="a planner preset")
    p.add_argument("--gpu", default=d.gpu, help="a catalog GPU (both pools)")
    p.add_argument("--tp-attention", type=int, default=d.tp_a, dest="tp_a")
    p.add_argument("--tp-experts", type=int, default=d.tp_e, dest="tp_e")
    p.add_argument("--micro-batches", type=int, default=d.micro_batches)
    p.add_argument("--slo-tpot-ms", type=float, default=d.slo_tpot_s * 1e3)
    p.add_argument("--slo-ttft-ms", type=float, default=d.slo_ttft_s * 1e3)
    p.add_argument("--max-attention", type=int, default=d.max_attention,
                   help="the attention pool's bounds are 1..N (the expert pool's: the sizes that hold the experts)")
    p.add_argument("--peak-trough", type=float, default=d.peak_trough, help="peak / trough demand")
    p.add_argument("--noise", type=float, default=d.noise, help="relative noise per tick (standard deviation)")
    p.add_argument("--peak-fraction", type=float, default=d.peak_fraction,
                   help="peak demand / the largest deployment's capacity at the SLO")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", default=None, metavar="PATH", help="write the report (with every resize) as JSON "
                                                                "('-': stdout)")
    return p


def main(args: argparse.Namespace) -> int:
    cfg = with_overrides(DayConfig(), model=args.model, gpu=args.gpu, tp_a=args.tp_a, tp_e=args.tp_e,
                         micro_batches=args.micro_batches, slo_tpot_s=args.slo_tpot_ms / 1e3,
                         slo_ttft_s=args.slo_ttft_ms / 1e3, max_attention=args.max_attention,
                         peak_trough=args.peak_trough, noise=args.noise, peak_fraction=args.peak_fraction,
                         seed=args.seed)
    rep = run_day(cfg)
    if args.json == "-":
        json.dump(rep.to_json(), sys.stdout, indent=1)
        print()
        return 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.to_json(), f, indent=1)
    a, f = rep.autoscaled, rep.fixed
    print(f"{cfg.model} on {cfg.gpu} (tp {cfg.tp_a}/{cfg.tp_e}, m={cfg.micro_batches}), TPOT SLO "
          f"{cfg.slo_tpot_s * 1e3:g} ms, TTFT SLO {cfg.slo_ttft_s * 1e3:g} ms; {cfg.hours:g} h diurnal trace, "
          f"peak/trough {cfg.peak_trough:g}, peak {rep.peak_tok_s:.0f} decode tok/s, noise {cfg.noise:g}, "
          f"seed {cfg.seed}")
    print(f"autoscaled: {a.worker_hours:.1f} worker-hours ({a.gpu_hours:.1f} GPU-hours), SLO attainment "
          f"{a.attainment:.2%}, {a.resizes} resizes")
    if f is None:
        print("no fixed deployment within the bounds reaches the autoscaled day's SLO attainment")
        return 0
    print(f"best fixed ({f.attention} attention + {f.experts} expert workers): {f.worker_hours:.1f} worker-hours "
          f"({f.gpu_hours:.1f} GPU-hours), SLO attainment {f.attainment:.2%}")
    print(f"worker-hours saved: {rep.saved:.1%}")
    return 0
