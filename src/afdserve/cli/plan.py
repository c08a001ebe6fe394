"""``afdserve plan``: search deployment plans and print / save them.

Examples::

    afdserve plan --model mixtral-8x22b --gpus A800 --slo-ms 150
    afdserve plan --model dbrx --attention-gpus H20,A800 --expert-gpus L40S,A800 --json plans.json --plot plans.png
    afdserve plan --compare-hetero              # every preset: best hetero pair vs best homogeneous
    afdserve plan --list-gpus
    afdserve plan --model deepseek-v3 --gpus H800 --alternatives   # AFD vs wide EP vs TP: winner and why
    afdserve plan --cases | --published     # every built-in case; published findings recomputed
    afdserve plan kv [--model FOLDER] [--kv-cache-gb 1] [--prompt-tokens 4096,32768]   # KV capacity

The main CLI registers this module with ``add_parser(subparsers)`` and dispatches to ``main(args)``;
``main`` also takes an argv list.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from afdserve.cluster.spec import from_plan
from afdserve.errors import AfdServeError, ConfigError
from afdserve.planner import PRESETS, Profile, SearchConfig, compare_hetero, load_model_spec, load_profile, search
from afdserve.planner.catalog import Catalog, GPUSpec, load_catalog
from afdserve.planner.alternatives import FAMILIES, AltConfig
from afdserve.planner.plot import plot_objective_vs_na
from afdserve.planner.published import CASES, Case, findings_table, published_findings, run_case
from afdserve.planner.report import (
    comparison_json,
    cases_summary,
    comparison_table,
    families_table,
    gpu_table,
    model_table,
    pair_matrix,
    plans_json,
    plans_table,
    search_header,
)
from afdserve.planner.roofline import RooflineOptions
from afdserve.planner.search_config import DEFAULT_SEQ_LEN
from afdserve.planner.verdict import compare_families

__all__ = ["add_parser", "build_parser", "main"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not vals:
        raise argparse.ArgumentTypeError("empty list")
    return vals


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("report", nargs="?", choices=["kv"],
                   help="kv: the KV cache's capacity for --model (a model folder; default the demo model): bytes "
                        "per token, tokens per attention worker, context-parallel ranks per prompt length")
    what = p.add_argument_group("what to plan")
    what.add_argument("--model", help=f"preset ({', '.join(PRESETS)}) or a HF config.json / model folder")
    what.add_argument("--gpus", type=_names, help="homogeneous plans on each of these GPUs (comma-separated)")
    what.add_argument("--attention-gpus", type=_names, help="attention GPU candidates (comma-separated)")
    what.add_argument("--expert-gpus", type=_names, help="expert GPU candidates (comma-separated)")
    what.add_argument("--catalog", type=Path, help="TOML file adding GPUs or overriding fields ([gpu.NAME] tables)")
    what.add_argument("--profile", type=Path, help="measured profile (JSON); default: roofline estimate")
    what.add_argument(
        "--compare-hetero",
        action="store_true",
        help="for every preset (or --models): best heterogeneous pair vs best homogeneous plan",
    )
    what.add_argument("--models", type=_names, help="models for --compare-hetero (default: all presets)")
    what.add_argument("--alternatives", action="store_true",
                      help="compare AFD with colocated DP attention + wide EP and with TP: the best plan of each "
                           "family, the winner and the reason")
    what.add_argument("--cases", action="store_true", help="--alternatives on every built-in case")
    what.add_argument("--published", action="store_true",
                      help="published AFD findings recomputed by the planner (a markdown table)")
    what.add_argument("--families", type=_names, help="families for --alternatives (default afd,wide-ep,tp)")
    what.add_argument("--ep-sizes", type=_ints, help="wide-EP sizes (default: powers of 2 dividing E)")
    what.add_argument("--no-tbo", action="store_true", help="wide EP without two-batch overlap only")
    what.add_argument("--list-gpus", action="store_true", help="print the hardware catalog and exit")
    what.add_argument("--list-models", action="store_true", help="print the model presets and exit")

    srch = p.add_argument_group("search")
    srch.add_argument("--slo-ms", type=float, default=150.0, help="time-between-tokens SLO (default 150)")
    srch.add_argument(
        "--seq-len",
        type=float,
        default=DEFAULT_SEQ_LEN,
        help=f"average sequence length during decoding (default {DEFAULT_SEQ_LEN})",
    )
    srch.add_argument("--tp", type=_ints, default=(1, 2, 4, 8), help="TP sizes to try (default 1,2,4,8)")
    srch.add_argument("--max-micro-batches", type=int, default=4, help="N_m (default 4)")
    srch.add_argument(
        "--experts-per-node", type=_ints, help="experts per expert node (default: powers of 2 dividing E)"
    )
    srch.add_argument("--na-radius", type=int, default=2, help="n_a neighbours of the balance point (default 2)")
    srch.add_argument(
        "--objective",
        choices=["auto", "cost", "gpu", "watt"],
        default="auto",
        help="rank by throughput per cost / GPU / watt (auto: cost when all GPUs are priced)",
    )
    srch.add_argument("--strict", action="store_true", help="keep only plans meeting constraints (2) and (3)")
    srch.add_argument(
        "--fill-with-roofline",
        action="store_true",
        help="with --profile: estimate configurations the profile does not cover",
    )
    srch.add_argument(
        "--link-latency-us",
        type=float,
        default=0.0,
        help="per-message latency for the estimated Util curve (default 0: ideal)",
    )

    kv = p.add_argument_group("plan kv")
    kv.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache per attention worker, GiB (default 1.0)")
    kv.add_argument("--num-kv-blocks", type=int, help="blocks per attention worker (overrides --kv-cache-gb)")
    kv.add_argument("--block-size", type=int, default=16)
    kv.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="the model's dtype, which its KV cache is stored in (default float32; presets bfloat16)")
    kv.add_argument("--kv-cache-dtype", type=_names, default=None,
                    help="KV dtypes to report, comma-separated (default: --dtype and fp8_e4m3, alias fp8)")
    kv.add_argument("--prompt-tokens", type=_ints, default=(4096, 32768, 131072, 1048576),
                    help="prompt lengths to report CP ranks for (default 4096,32768,131072,1048576)")
    kv.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="tokens of a step (with sliding windows: what a sequence holds beyond its window)")

    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="plans to print (default 10)")
    out.add_argument("--matrix", action="store_true", help="also print the best value for every GPU pair")
    out.add_argument("--json", type=Path, help="write the ranked plans as JSON")
    out.add_argument("--plot", type=Path, help="PNG: objective against n_a for each m, at the best plan")
    out.add_argument("--write-deployment", type=Path, metavar="FILE",
                     help="write the best plan as a deployment spec (TOML) for `afdserve serve --deployment FILE`")
    return p


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``plan`` on the main CLI's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="search deployment plans (performance model, Algorithm 1)",
        description="Search disaggregated-expert-parallel deployment plans and rank them.",
    )
    _configure(p)
    p.set_defaults(func=main)
    return p


def build_parser() -> argparse.ArgumentParser:
    return _configure(argparse.ArgumentParser(prog="afdserve plan", description="Search deployment plans."))


def _config(args: argparse.Namespace) -> SearchConfig:
    return SearchConfig(
        slo_s=args.slo_ms / 1e3,
        seq_len=args.seq_len,
        tp_choices=tuple(args.tp),
        max_micro_batches=args.max_micro_batches,
        na_radius=args.na_radius,
        experts_per_node=tuple(args.experts_per_node) if args.experts_per_node else None,
        require_overlap=args.strict,
        allow_roofline_fallback=args.fill_with_roofline,
        link_latency_s=args.link_latency_us * 1e-6,
        objective=args.objective,
        roofline=RooflineOptions(),
    )


def _gpus(cat: Catalog, names: Sequence[str] | None) -> list[GPUSpec] | None:
    return None if names is None else [cat.get(n) for n in names]


def run_kv(args: argparse.Namespace) -> int:
    """``afdserve plan kv``: the report of ``planner.kv_capacity``."""
    from afdserve.engine.builder import resolve_model
    from afdserve.model.config import ModelConfig
    from afdserve.config import KV_CACHE_DTYPES
    from afdserve.planner.kv_capacity import KVShape, capacity_table, kv_capacity

    if args.model in PRESETS:
        shape = KVShape.of(load_model_spec(args.model))
    else:  # a model folder (or its config.json); none: the demo model
        path = None if args.model is None else Path(args.model)
        folder = resolve_model(None if path is None else str(path.parent if path.name == "config.json" else path))
        shape = KVShape.of(ModelConfig.from_pretrained(folder), str(folder))
    dtypes = [KV_CACHE_DTYPES.get(d, d) for d in args.kv_cache_dtype or
              [args.dtype or ("bfloat16" if args.model in PRESETS else "float32"), "fp8_e4m3"]]
    caps = [kv_capacity(shape, d, args.block_size, args.kv_cache_gb, args.num_kv_blocks, args.max_num_batched_tokens)
            for d in dtypes]
    print(capacity_table(caps, list(args.prompt_tokens)))
    if args.json:
        rows = [{"dtype": c.dtype, "bytes_per_token": c.bytes_per_token, "bytes_per_block": c.bytes_per_block,
                 "blocks_per_worker": c.num_blocks, "tokens_per_worker": c.tokens_per_worker,
                 "scale_bytes_per_token": c.scale_bytes_per_token,
                 "cp_ranks": {str(n): c.cp_ranks(n) for n in args.prompt_tokens}} for c in caps]
        args.json.write_text(json.dumps({"model": shape.name, "block_size": args.block_size, "kv": rows}, indent=2)
                             + "\n")
        print(f"wrote {args.json}")
    return 0


def run_alternatives(args: argparse.Namespace, cat: Catalog, cfg: SearchConfig) -> int:
    """``--alternatives`` / ``--cases`` / ``--published`` (planner.verdict, planner.published)."""
    if args.profile:
        raise ConfigError("--alternatives/--cases/--published compare roofline estimates; drop --profile")
    if args.published:
        found = published_findings(cat)
        print(findings_table(found))
        if args.json:
            rows = [{**asdict(f), "gap": f.gap, "reproduced": f.reproduced} for f in found]
            args.json.write_text(json.dumps({"findings": rows}, indent=2) + "\n")
            print(f"wrote {args.json}")
        return 0
    alt = AltConfig(families=tuple(args.families or FAMILIES), ep_sizes=args.ep_sizes,
                    tbo=(False,) if args.no_tbo else (False, True))
    if args.cases:
        runs = [(c, run_case(c, cat, alt)) for c in CASES]
    else:
        if not args.model:
            raise ConfigError("--alternatives needs --model (or use --cases)")
        if args.gpus and (args.attention_gpus or args.expert_gpus):
            raise ConfigError("use either --gpus or --attention-gpus/--expert-gpus")
        gpus = _gpus(cat, args.gpus or args.attention_gpus) or [g for g in cat if g.price is not None]
        # as the AFD search: --gpus is homogeneous, otherwise every attention x expert pair
        exp = None if args.gpus else (_gpus(cat, args.expert_gpus) or gpus)
        case = Case("", args.model, tuple(g.name for g in gpus), None if exp is None else tuple(g.name for g in exp),
                    cfg.slo_s * 1e3, cfg.seq_len)
        runs = [(case, compare_families(load_model_spec(args.model), gpus, cfg, alt, expert_gpus=exp))]
    for case, comp in runs:
        exp = "" if case.expert_gpus is None else f" (AFD experts on {','.join(case.expert_gpus)})"
        print(f"{(case.name + ': ') if case.name else ''}{comp.model} on {','.join(case.gpus)}{exp}; "
              f"SLO {case.slo_ms:g} ms, seq_len {case.seq_len:g}; roofline ESTIMATE"
              + (f" -- {case.about}" if case.about else ""))
        print(families_table(comp))
        print()
    if len(runs) > 1:
        print(cases_summary([(c.name, comp) for c, comp in runs]))
    if args.json:
        out = [{"case": c.name, "gpus": list(c.gpus), "slo_ms": c.slo_ms, "seq_len": c.seq_len, **comp.to_json()}
               for c, comp in runs]
        args.json.write_text(json.dumps({"comparisons": out}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(comp.best for _, comp in runs) else 1


def run(args: argparse.Namespace) -> int:
    if getattr(args, "report", None) == "kv":
        return run_kv(args)
    cat = load_catalog(args.catalog)
    if args.alternatives or args.cases or args.published:
        return run_alternatives(args, cat, _config(args))
    if args.list_gpus:
        print(gpu_table(cat))
        return 0
    if args.list_models:
        print(model_table(PRESETS.values()))
        return 0
    cfg = _config(args)
    profile: Profile | None = load_profile(args.profile) if args.profile else None

    if args.compare_hetero:
        names = args.models or list(PRESETS)
        specs = [load_model_spec(n) for n in names]
        gpus = _gpus(cat, args.gpus) or [g for g in cat if g.price is not None] or list(cat)
        rows = compare_hetero(specs, gpus, cfg, profile)
        if args.matrix:
            for row in rows:
                if row.result is not None:
                    print(f"{row.model}:")
                    print(pair_matrix(row.result))
                    print()
        print(
            f"GPUs: {', '.join(g.name for g in gpus)}; SLO {cfg.slo_s * 1e3:g} ms, seq_len {cfg.seq_len:g}; "
            f"constants: {'profile ' + str(args.profile) if profile else 'roofline ESTIMATE (not measured)'}"
        )
        print(comparison_table(rows))
        if args.json:
            args.json.write_text(json.dumps(comparison_json(rows), indent=2) + "\n")
            print(f"wrote {args.json}")
        return 0

    if not args.model:
        print("error: --model is required (or use --compare-hetero / --list-gpus / --list-models)", file=sys.stderr)
        return 2
    spec = load_model_spec(args.model)
    if args.gpus and (args.attention_gpus or args.expert_gpus):
        print("error: use either --gpus or --attention-gpus/--expert-gpus", file=sys.stderr)
        return 2
    if args.gpus:
        result = search(spec, _gpus(cat, args.gpus) or [], None, cfg, profile)
    else:
        default = [g for g in cat if g.price is not None] or list(cat)
        att = _gpus(cat, args.attention_gpus) or (_gpus(cat, args.expert_gpus) or default)
        exp = _gpus(cat, args.expert_gpus) or (_gpus(cat, args.attention_gpus) or default)
        result = search(spec, att, exp, cfg, profile)

    print(search_header(spec, cfg, args.profile, result.estimate))
    print(f"ranked by throughput per {result.objective}; {len(result.plans)} feasible plans")
    for n in result.notes:
        print(f"note: {n}")
    if result.plans:
        print(plans_table(result.plans, args.top))
        if args.matrix:
            print()
            print(pair_matrix(result))
    if args.json:
        meta = {
            "model": spec.name,
            "slo_ms": cfg.slo_s * 1e3,
            "seq_len": cfg.seq_len,
            "constants": "roofline-estimate" if result.estimate else "profile",
        }
        args.json.write_text(json.dumps(plans_json(result, meta=meta), indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.write_deployment and result.best is not None:
        from_plan(result.best, num_experts=spec.num_experts).write(args.write_deployment)
        print(f"wrote {args.write_deployment}")
    if args.plot and result.best is not None:
        b = result.best
        plot_objective_vs_na(
            args.plot,
            spec,
            b,
            cat.get(b.attention_gpu),
            cat.get(b.expert_gpu),
            result.objective,
            cfg,
            profile,
            estimate=result.estimate,
        )
        print(f"wrote {args.plot}")
    return 0 if result.plans else 1


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Entry point: an argparse Namespace from the main CLI, or an argv list (standalone)."""
    if not isinstance(args, argparse.Namespace):
        argv = list(sys.argv[1:] if args is None else args)
        if argv and argv[0] == "plan":
            argv = argv[1:]
        args = build_parser().parse_args(argv)
    try:
        return run(args)
    except AfdServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
