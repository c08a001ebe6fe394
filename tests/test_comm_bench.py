"""`afdserve bench m2n`: argument handling and the JSON/PNG outputs (a tiny run, not a timing test)."""

from __future__ import annotations

import argparse
import json

import pytest

from afdserve.bench.m2n_report import fmt_size
from afdserve.cli.bench_m2n import add_parser, parse_size


def test_parse_size():
    assert parse_size("2KiB") == 2048 and parse_size("8MiB") == 8 << 20 and parse_size("100") == 100
    assert parse_size("1.5KiB") == 1536 and parse_size("2kb") == 2000
    assert fmt_size(256 << 10) == "256KiB" and fmt_size(100) == "100B"
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


def test_bench_m2n_cli_writes_json_and_plot(tmp_path, capsys):
    root = argparse.ArgumentParser(prog="afdserve")
    bench = root.add_subparsers(dest="cmd").add_parser("bench")
    add_parser(bench.add_subparsers(dest="what"))
    out, png = tmp_path / "m2n.json", tmp_path / "m2n.png"
    args = root.parse_args(["bench", "m2n", "--transports", "shm,torch_raw", "--sizes", "2KiB,64KiB",
                            "--senders", "1", "--receivers", "1", "--iters", "10", "--scale", "",
                            "--json", str(out), "--plot", str(png)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["machine"]["memcpy_gbps"] > 0
    rows = report["results"]
    keys = {"transport", "senders", "receivers", "size_bytes", "median_us", "p99_us", "throughput_gbps"}
    assert all(keys <= set(r) for r in rows)
    got = {(r["transport"], r["senders"], r["receivers"], r["size_bytes"]) for r in rows}
    for t in ("shm", "torch_raw"):
        assert {(t, 1, 1, 2048), (t, 1, 1, 65536)} <= got
    assert all(r["median_us"] > 0 and r["p99_us"] >= r["median_us"] and r["throughput_gbps"] > 0 for r in rows)
    assert png.stat().st_size > 10_000
    assert "median us" in capsys.readouterr().out


def test_bench_m2n_layer_mode(tmp_path):
    """--layer: a layer's dispatch + combine per transport at M = N = 1 and 2, as the runtime plans
    it (a tiny run); bad input is refused with a message."""
    root = argparse.ArgumentParser(prog="afdserve")
    bench = root.add_subparsers(dest="cmd").add_parser("bench")
    add_parser(bench.add_subparsers(dest="what"))
    out = tmp_path / "layer.json"
    args = root.parse_args(["bench", "m2n", "--layer", "--transports", "shm,torch", "--scale", "1,2", "--tokens", "16",
                            "--hidden", "64", "--experts", "8", "--top-k", "2", "--iters", "5", "--json", str(out)])
    assert args.func(args) == 0
    rows = json.loads(out.read_text())["results"]
    assert {(r["transport"], r["M"], r["N"]) for r in rows} == {("shm", 1, 1), ("torch", 1, 1), ("shm", 2, 2),
                                                                ("torch", 2, 2)}
    assert all(r["median_us"] > 0 and r["p99_us"] >= r["median_us"] and r["layers_per_s"] > 0 and r["gbps"] > 0
               for r in rows)
    bad = root.parse_args(["bench", "m2n", "--layer", "--transports", "torch_raw"])
    assert bad.func(bad) == 2
    for argv in (["--layer", "--transports", "cuda_ipc"],  # its slots live on a GPU: needs --device cuda
                 ["--transports", "cuda_ipc", "--scale", ""]):  # and the size sweep's payloads are host tensors
        bad = root.parse_args(["bench", "m2n", *argv])
        assert bad.func(bad) == 2
