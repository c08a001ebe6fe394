"""Automatic prefix caching: time to first token (TTFT) with and without cached prefixes.

Four parts, each on the demo model by default (its context holds 4,096 tokens), engines driven
through ``EngineClient`` in this process (greedy decoding):

* ``pair`` — two requests sharing a ``--prefix``-token prefix (1,500): the second's TTFT over the
  first's, colocated and disaggregated (1 attention + 1 expert worker); every output is compared
  with the same request on an engine without the cache. Each round uses a fresh prefix; medians.
* ``restart`` — prefixes are cached, the engine shuts down (its cached blocks go to the disk tier),
  a new engine starts on the same directory: TTFT of a prefix from disk against a cold prefill of a
  fresh prefix, alternating. Then a directory written with another dtype, and files of it renamed to
  the keys this model looks up, must serve nothing (outputs still identical).
* ``chat`` — multi-turn conversations (each turn extends the previous turn's prompt and answer):
  hit rate and TTFT per turn, cached against uncached (alternating conversations).
* ``mixed`` — ``--duration`` seconds of requests over shared and fresh prefixes with a small KV
  cache, host tier and disk tier (so all three evict); at the end device blocks, host memory and
  disk use must be back within their bounds.

    python benchmarks/prefix_cache.py [--parts pair,restart,chat,mixed] [--rounds 5] [--duration 300]
                                      [--json out/prefix_cache.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

from afdserve import SamplingParams
from afdserve.cluster import build_client
from afdserve.config import EngineConfig
from afdserve.engine.builder import prefix_config, resolve_model
from afdserve.kvcache.disk import tier_dir
from afdserve.kvcache.prefix import block_hashes

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def run(client, prompt: list[int], params: SamplingParams = GREEDY) -> dict:
    """One request alone: its TTFT, tokens and cached-token count."""
    t0 = time.perf_counter()
    rid = client.add_request({"prompt_token_ids": prompt}, params)
    ttft = None
    while True:
        for o in client.get_outputs(timeout=0.001):
            if o.request_id != rid:
                continue
            if ttft is None and o.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            if o.finished:
                return {"ttft": ttft, "tokens": list(o.outputs[0].token_ids),
                        "cached": o.num_cached_tokens or 0}


class Prompts:
    def __init__(self, vocab: int, seed: int = 0):
        self.rng, self.vocab = random.Random(seed), vocab

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def part_pair(args, base: dict, ref, gen: Prompts) -> dict:
    out = {}
    for name, extra in (("colocated", {}), ("disaggregated", {"expert_workers": 1, "micro_batches": 2})):
        client = build_client(EngineConfig(**base, **extra))
        run(client, gen(64))  # warm-up
        firsts, seconds, ratios, same, cached = [], [], [], True, []
        for _ in range(args.rounds):
            prefix = gen(args.prefix)
            a, b = prefix + gen(args.suffix), prefix + gen(args.suffix)
            r1, r2 = run(client, a), run(client, b)
            firsts.append(r1["ttft"]), seconds.append(r2["ttft"]), ratios.append(r2["ttft"] / r1["ttft"])
            cached.append(r2["cached"])
            same &= r1["tokens"] == run(ref, a)["tokens"] and r2["tokens"] == run(ref, b)["tokens"]
        client.shutdown()
        out[name] = {"first_ttft_s": _med(firsts), "second_ttft_s": _med(seconds), "ratio": _med(ratios),
                     "ratios": ratios, "second_cached_tokens": _med(cached), "identical_to_uncached": same,
                     "target_ratio": 0.25, "pass": _med(ratios) <= 0.25 and same}
        print(f"pair/{name:13s} first {out[name]['first_ttft_s'] * 1e3:8.1f} ms  second "
              f"{out[name]['second_ttft_s'] * 1e3:8.1f} ms  ratio {out[name]['ratio']:.3f} (<= 0.25)  "
              f"cached {out[name]['second_cached_tokens']:.0f}  identical {same}")
    return out


def part_restart(args, base: dict, ref, gen: Prompts, cache_dir: Path) -> dict:
    opts = dict(base, prefix_cache_dir=str(cache_dir / "ok"), prefix_cache_disk_gb=args.disk_gb)
    prompts = [gen(args.prefix) + gen(args.suffix) for _ in range(args.rounds)]
    writer = build_client(EngineConfig(**opts))
    for p in prompts:
        run(writer, p)
    writer.shutdown()  # the cached blocks go to disk
    client = build_client(EngineConfig(**opts))  # the restart
    run(client, gen(64))
    cold, disk, ratios, same, hit = [], [], [], True, []
    for p in prompts:  # alternating: a cold prompt, then one cached before the restart
        c = run(client, gen(args.prefix) + gen(args.suffix))
        d = run(client, p)
        cold.append(c["ttft"]), disk.append(d["ttft"]), ratios.append(d["ttft"] / c["ttft"])
        hit.append(d["cached"])
        same &= d["tokens"] == run(ref, p)["tokens"]
    stats = client.engine.prefix_stats()
    client.shutdown()
    # another dtype writes its own directory; this model never reads it, even renamed to its keys
    other = build_client(EngineConfig(**dict(opts, dtype="bfloat16", prefix_cache_dir=str(cache_dir / "foreign"))))
    foreign_prompt = gen(args.prefix) + gen(args.suffix)
    run(other, foreign_prompt)
    other.shutdown()
    mine_cfg = EngineConfig(**dict(opts, prefix_cache_dir=str(cache_dir / "foreign")))
    salt = prefix_config(mine_cfg, resolve_model(args.model)).salt
    src = sorted((cache_dir / "foreign").rglob("*.kv"))
    mine_dir = tier_dir(cache_dir / "foreign", salt)
    mine_dir.mkdir(parents=True, exist_ok=True)
    for f, key in zip(src, block_hashes(foreign_prompt, mine_cfg.block_size, salt)):  # planted under this model's keys
        (mine_dir / (key.hex() + ".kv")).write_bytes(f.read_bytes())
    mine = build_client(mine_cfg)
    f = run(mine, foreign_prompt)
    fstats = mine.engine.prefix_stats()
    mine.shutdown()
    foreign_ok = f["cached"] == 0 and fstats.disk_hit_tokens == 0 and f["tokens"] == run(ref, foreign_prompt)["tokens"]
    res = {"cold_ttft_s": _med(cold), "disk_ttft_s": _med(disk), "ratio": _med(ratios), "ratios": ratios,
           "disk_cached_tokens": _med(hit), "disk_hit_tokens": stats.disk_hit_tokens,
           "disk_restore_bytes_per_s": stats.disk_restore_bytes_per_s, "identical_to_uncached": same,
           "foreign_files_planted": len(src), "foreign_files_rejected": fstats.invalid_disk_files,
           "foreign_never_used": foreign_ok, "target_ratio": 0.5,
           "pass": _med(ratios) <= 0.5 and same and foreign_ok}
    print(f"restart        cold {res['cold_ttft_s'] * 1e3:8.1f} ms  from disk {res['disk_ttft_s'] * 1e3:8.1f} ms  "
          f"ratio {res['ratio']:.3f} (<= 0.5)  cached {res['disk_cached_tokens']:.0f}  identical {same}  "
          f"foreign files rejected {fstats.invalid_disk_files}/{len(src)}, never used {foreign_ok}")
    return res


def part_chat(args, base: dict, ref, gen: Prompts) -> dict:
    client = build_client(EngineConfig(**base))
    before = client.engine.prefix_stats()
    ttft = {"cached": [[] for _ in range(args.turns)], "uncached": [[] for _ in range(args.turns)]}
    same = True
    for conv in range(args.rounds):
        order = (("cached", client), ("uncached", ref)) if conv % 2 == 0 else (("uncached", ref), ("cached", client))
        system = gen(args.chat_system)
        turns = [gen(args.chat_turn) for _ in range(args.turns)]
        answers: dict[str, list] = {}
        for name, c in order:
            prompt, got = list(system), []
            for t in range(args.turns):
                prompt += turns[t]
                r = run(c, prompt)
                ttft[name][t].append(r["ttft"])
                got.append(r["tokens"])
                prompt += r["tokens"]
            answers[name] = got
        same &= answers["cached"] == answers["uncached"]
    after = client.engine.prefix_stats()
    client.shutdown()
    hit = (after.hit_tokens - before.hit_tokens) / max(1, after.query_tokens - before.query_tokens)
    rows = [{"turn": t + 1, "cached_ttft_s": _med(ttft["cached"][t]), "uncached_ttft_s": _med(ttft["uncached"][t])}
            for t in range(args.turns)]
    print(f"chat           hit rate {hit:.3f}  identical {same}")
    for r in rows:
        print(f"  turn {r['turn']:2d}  cached {r['cached_ttft_s'] * 1e3:8.1f} ms  uncached {r['uncached_ttft_s'] * 1e3:8.1f} ms"
              f"  ratio {r['cached_ttft_s'] / r['uncached_ttft_s']:.3f}")
    return {"hit_rate": hit, "turns": rows, "identical_to_uncached": same}


def part_mixed(args, base: dict, gen: Prompts, cache_dir: Path) -> dict:
    opts = dict(base, num_kv_blocks=args.mixed_blocks, max_model_len=args.mixed_blocks * base["block_size"] // 2,
                prefix_cache_host_gb=args.mixed_host_mb / 1024, prefix_cache_dir=str(cache_dir / "mixed"),
                prefix_cache_disk_gb=args.mixed_disk_mb / 1024)
    client = build_client(EngineConfig(**opts))
    eng = client.engine
    max_len = opts["max_model_len"]
    shared = [gen(random.Random(i).randrange(32, max_len // 2)) for i in range(args.mixed_prefixes)]
    rng, rss0, n_req = random.Random(1), _rss_mb(), 0
    t_end = time.monotonic() + args.duration
    while time.monotonic() < t_end:
        batch = []
        for _ in range(rng.randrange(1, 6)):
            head = rng.choice(shared) if rng.random() < 0.7 else gen(rng.randrange(8, max_len // 2))
            p = head + gen(rng.randrange(1, 64))
            batch.append((p[: max_len - 16], SamplingParams(max_tokens=rng.randrange(1, 16), temperature=0,
                                                             ignore_eos=True)))
        ids = {client.add_request({"prompt_token_ids": p}, sp) for p, sp in batch}
        if rng.random() < 0.1:  # some aborted mid-way
            client.abort(next(iter(ids)))
        while client.has_unfinished():
            client.get_outputs(timeout=0.001)
        n_req += len(batch)
    s = eng.prefix_stats()
    disk_files = sum(f.stat().st_size for f in (cache_dir / "mixed").rglob("*.kv"))
    blocks = eng.blocks
    ok = (blocks.num_free == blocks.num_blocks and sum(blocks.refs) == 0 and not blocks.tables
          and s.host_bytes <= s.host_bytes_limit and s.disk_bytes <= s.disk_bytes_limit
          and disk_files <= s.disk_bytes_limit)
    client.shutdown()
    res = {"duration_s": args.duration, "requests": n_req, "device_free_blocks": blocks.num_free,
           "device_blocks": blocks.num_blocks, "device_evictions": s.device_evictions,
           "host_evictions": s.host_evictions, "disk_evictions": s.disk_evictions, "host_bytes": s.host_bytes,
           "host_bytes_limit": s.host_bytes_limit, "disk_bytes": s.disk_bytes, "disk_files_bytes": disk_files,
           "disk_bytes_limit": s.disk_bytes_limit, "hit_rate": s.hit_rate, "restored_blocks": s.restored_blocks,
           "recomputed_blocks": s.recomputed_blocks, "rss_mb_start": rss0, "rss_mb_end": _rss_mb(),
           "pass": ok}
    print(f"mixed          {n_req} requests in {args.duration:.0f} s  evictions device/host/disk "
          f"{s.device_evictions}/{s.host_evictions}/{s.disk_evictions}  free blocks {blocks.num_free}/{blocks.num_blocks}"
          f"  host {s.host_bytes}/{s.host_bytes_limit} B  disk {disk_files}/{s.disk_bytes_limit} B  hit rate "
          f"{s.hit_rate:.3f}  RSS {rss0:.0f} -> {res['rss_mb_end']:.0f} MB  within bounds {ok}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the demo model)")
    ap.add_argument("--parts", default="pair,restart,chat,mixed")
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds (fresh prefixes) per measurement")
    ap.add_argument("--prefix", type=int, default=1500, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=32, help="tokens after the shared prefix")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--chat-system", type=int, default=200, help="tokens of a conversation's first prompt")
    ap.add_argument("--chat-turn", type=int, default=100, help="tokens a user adds per turn")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of the mixed workload")
    ap.add_argument("--mixed-blocks", type=int, default=64)
    ap.add_argument("--mixed-prefixes", type=int, default=12)
    ap.add_argument("--mixed-host-mb", type=float, default=1.0)
    ap.add_argument("--mixed-disk-mb", type=float, default=4.0)
    ap.add_argument("--kv-cache-gb", type=float, default=0.25, help="KV cache of each engine")
    ap.add_argument("--disk-gb", type=float, default=2.0)
    ap.add_argument("--cache-dir", default=None, help="where the disk tiers go (default: a new temporary folder)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default="out/prefix_cache.json")
    args = ap.parse_args()
    parts = args.parts.split(",")
    base = dict(model=args.model, dtype="float32", block_size=16, num_threads=args.threads,
                max_num_batched_tokens=2048, kv_cache_gb=args.kv_cache_gb)
    cache_dir = Path(args.cache_dir or tempfile.mkdtemp(prefix="afdserve-prefix-"))
    ref = build_client(EngineConfig(**base, enable_prefix_caching=False))
    gen = Prompts(ref.vocab_size)
    run(ref, gen(64))
    results: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
                     "model": args.model or "demo", "prefix_tokens": args.prefix, "rounds": args.rounds}
    if "pair" in parts:
        results["pair"] = part_pair(args, base, ref, gen)
    if "restart" in parts:
        results["restart"] = part_restart(args, base, ref, gen, cache_dir)
    if "chat" in parts:
        results["chat"] = part_chat(args, base, ref, gen)
    ref.shutdown()
    del ref
    if "mixed" in parts:
        results["mixed"] = part_mixed(args, base, gen, cache_dir)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
