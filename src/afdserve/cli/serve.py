"""``afdserve serve``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from afdserve.cli.deployment import add_engine_args, engine_config

if TYPE_CHECKING:
    from afdserve.planner.autoscale import AutoscaleConfig


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /v1/jobs, /tokenize, /detokenize, /version, /health, /ready, /metrics; /admin/* with "
                    "--admin-token or --admin-port). Default deployment: the "
                    "built-in demo model (random weights: its text is gibberish; --model serves a real Hugging Face "
                    "folder), disaggregated on this machine (1 attention worker + 1 expert worker, 2 micro-batches); "
                    "--expert-workers 0 serves it colocated in this process.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model argument, or 'demo')")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests that may queue beyond the running capacity (max-num-seqs per attention "
                        "worker); more are refused with 429 and Retry-After")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--rebalance-interval", type=float, default=None, metavar="SECONDS",
                   help="re-plan the expert placement from the recent load this often (default: only on "
                        "POST /admin/rebalance or `afdserve rebalance`)")
    e = p.add_argument_group("admin endpoints and limits")
    e.add_argument("--admin-token", default=None, metavar="TOKEN",
                   help="serve /admin/* on the public port to clients that send 'Authorization: Bearer TOKEN' "
                        "(default: $AFDSERVE_ADMIN_TOKEN; prefer it: a flag shows in ps). Without a token and "
                        "without --admin-port there are no admin endpoints")
    e.add_argument("--admin-port", type=int, default=None, metavar="PORT",
                   help="serve /admin/* on 127.0.0.1:PORT instead of the public port (with --admin-token, "
                        "behind the token there too)")
    e.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, metavar="N",
                   help="larger request bodies get 413")
    e.add_argument("--shutdown-grace", type=float, default=5.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, requests in flight get this long to finish; then streams end "
                        "with an error event and [DONE]")
    e.add_argument("--job-ttl", type=float, default=3600.0, metavar="SECONDS",
                   help="a finished job's result (POST /v1/jobs) is kept this long")
    e.add_argument("--max-jobs", type=int, default=1024, metavar="N",
                   help="jobs kept at once (running and finished); more are refused with 429")
    t = p.add_argument_group("chat and tool calling")
    t.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file (default: the tokenizer_config.json's chat_template)")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice 'auto': read tool calls out of the generated text with --tool-call-parser")
    t.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how the model writes tool calls: 'hermes' (<tool_call>{\"name\": ..., \"arguments\": "
                        "...}</tool_call>, Hermes 2 Pro, Qwen 2.5 and later)")
    a = p.add_argument_group("autoscaling (the attention and expert pools resized by a policy while serving)")
    a.add_argument("--autoscale", action="store_true",
                   help="resize the pools from the live signals (queue, KV usage, TPOT/TTFT against the SLO, busy "
                        "fractions) within --autoscale-attention / --autoscale-experts; every decision is logged "
                        "and counted in /metrics (afdserve_autoscale_*)")
    a.add_argument("--autoscale-attention", default=None, metavar="MIN:MAX",
                   help="bounds of the attention pool (default: its starting size, fixed)")
    a.add_argument("--autoscale-experts", default=None, metavar="MIN:MAX",
                   help="bounds of the expert pool (default: its starting size, fixed)")
    a.add_argument("--slo-tpot-ms", type=float, default=100.0, help="time-per-output-token SLO")
    a.add_argument("--slo-ttft-ms", type=float, default=None, help="time-to-first-token SLO (default: none)")
    a.add_argument("--autoscale-window", type=float, default=10.0, metavar="SECONDS",
                   help="a pressure (up or down) must hold this long before the pools change")
    a.add_argument("--autoscale-cooldown", type=float, default=30.0, metavar="SECONDS",
                   help="no resize sooner than this after the last one (applied or failed)")
    a.add_argument("--autoscale-interval", type=float, default=1.0, metavar="SECONDS",
                   help="sample the signals this often")
    a.add_argument("--autoscale-profile", default=None, metavar="PROFILE",
                   help="a profile of this machine (afdserve profile): the planner's local model then predicts "
                        "which pool to grow and whether a smaller deployment still meets the SLO (default: the "
                        "measured busy fractions choose)")
    a.add_argument("--autoscale-timeline", default=None, metavar="PATH",
                   help="append every sample (signals, decision, pool sizes) to this file as JSON lines")
    add_engine_args(p)
    p.set_defaults(expert_workers=1, micro_batches=2)
    return p


def autoscale_config(args: argparse.Namespace) -> "AutoscaleConfig | None":
    """The policy's configuration from the flags (None without --autoscale); ConfigError on bad bounds."""
    from afdserve.errors import ConfigError
    from afdserve.planner.autoscale import AutoscaleConfig, parse_bounds

    bounds = {"attention": args.autoscale_attention, "experts": args.autoscale_experts}
    if not args.autoscale:
        if any(bounds.values()) or args.autoscale_profile:
            raise ConfigError("--autoscale-attention / --autoscale-experts / --autoscale-profile need --autoscale")
        return None
    if not any(bounds.values()):
        raise ConfigError("--autoscale needs --autoscale-attention MIN:MAX and/or --autoscale-experts MIN:MAX")
    if args.expert_workers < 1:
        raise ConfigError("--autoscale needs a disaggregated deployment (--expert-workers >= 1): the colocated "
                          "engine has no pools to resize")
    start = {"attention": args.attention_workers, "experts": args.expert_workers}
    lo_hi = {pool: parse_bounds(text, f"--autoscale-{pool}") if text else (start[pool], start[pool])
             for pool, text in bounds.items()}
    for pool, (lo, hi) in lo_hi.items():
        if not lo <= start[pool] <= hi:
            raise ConfigError(f"the {pool} pool starts at {start[pool]} workers, outside --autoscale-{pool} "
                              f"{lo}:{hi}")
    if lo_hi["attention"][0] < (cp := getattr(args, "context_parallel_size", 1)):
        raise ConfigError(f"--autoscale-attention {lo_hi['attention'][0]}:{lo_hi['attention'][1]} would go below "
                          f"--context-parallel-size {cp}")
    return AutoscaleConfig.from_bounds(lo_hi["attention"], lo_hi["experts"], slo_tpot_s=args.slo_tpot_ms / 1e3,
                                       slo_ttft_s=None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3,
                                       window_s=args.autoscale_window, cooldown_s=args.autoscale_cooldown)


def main(args: argparse.Namespace) -> int:
    from afdserve.serving.edge import ADMIN_TOKEN_ENV
    from afdserve.serving.server import ServerOptions, serve

    try:  # ps/top show "afdserve: frontend" (the workers show their role)
        import setproctitle

        setproctitle.setproctitle("afdserve: frontend")
    except Exception:
        pass
    serve(engine_config(args), ServerOptions(host=args.host, port=args.port, served_model_name=args.served_model_name,
                                             rebalance_interval_s=args.rebalance_interval,
                                             max_waiting_requests=args.max_waiting_requests,
                                             log_level=args.log_level, access_log=args.access_log,
                                             chat_template=args.chat_template,
                                             enable_auto_tool_choice=args.enable_auto_tool_choice,
                                             tool_call_parser=args.tool_call_parser,
                                             admin_token=args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None,
                                             admin_port=args.admin_port, max_body_bytes=args.max_body_bytes,
                                             shutdown_grace_s=args.shutdown_grace, job_ttl_s=args.job_ttl,
                                             max_jobs=args.max_jobs, autoscale=autoscale_config(args),
                                             autoscale_interval_s=args.autoscale_interval,
                                             autoscale_timeline=args.autoscale_timeline,
                                             autoscale_profile=args.autoscale_profile))
    return 0
