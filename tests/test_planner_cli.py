"""The ``afdserve plan`` command (called through ``afdserve.cli.plan.main``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from afdserve.cli.plan import add_parser, main
from afdserve.planner import fit, save_profile


def test_homogeneous_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "mixtral-8x22b", "--gpus", "A800", "--slo-ms", "150", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "roofline ESTIMATE" in out and "ranked by throughput per cost" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 3 and all(r[1:3] == ["A800", "A800"] for r in rows)


def test_hetero_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js, png = tmp_path / "plans.json", tmp_path / "plot.png"
    rc = main(
        [
            "--model",
            "dbrx",
            "--attention-gpus",
            "H20,A800",
            "--expert-gpus",
            "L40S,A800",
            "--tp",
            "1,2,4",
            "--json",
            str(js),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    doc = json.loads(js.read_text())
    keys = [
        "attention_gpu",
        "expert_gpu",
        "tp_a",
        "tp_e",
        "n_a",
        "n_e",
        "micro_batches",
        "batch",
        "tbt_ms",
        "throughput_tok_s",
        "throughput_per_gpu",
        "throughput_per_cost",
        "throughput_per_watt",
    ]
    assert doc["plans"] and all(k in doc["plans"][0] for k in keys)
    per_cost = [p["throughput_per_cost"] for p in doc["plans"]]
    assert per_cost == sorted(per_cost, reverse=True)
    assert {p["attention_gpu"] for p in doc["plans"]} <= {"H20", "A800"}
    assert {p["expert_gpu"] for p in doc["plans"]} <= {"L40S", "A800"}
    assert doc["constants"] == "roofline-estimate"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_hetero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "cmp.json"
    argv = ["--compare-hetero", "--models", "dbrx,demo", "--gpus", "H20,L40S", "--tp", "1,2", "--json", str(js)]
    assert main([*argv, "--matrix"]) == 0
    out = capsys.readouterr().out
    assert "hetero/homog" in out and "dbrx" in out and "demo" in out
    assert out.count("best tok/s/cost") == 2 and "attn H20" in out and "exp L40S" in out
    doc = json.loads(js.read_text())
    assert [c["model"] for c in doc["comparisons"]] == ["dbrx", "demo"]


def test_profile_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = fit(
        "demo",
        attention_samples=[(b, s, 1e-6 * b + 1e-9 * b * s + 1e-4) for b in (1, 8, 64) for s in (64, 512)],
        expert_samples=[(b, 5e-7 * b + 2e-4) for b in (4, 64, 256)],
        network_samples=[(n, 2e-5 + n / 5e9) for n in (1024, 65536, 1 << 20)],
        gpu="H20",
    )
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert main(["--model", "demo", "--gpus", "H20", "--profile", str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert f"constants: profile {path}" in out


def test_listings_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list-gpus"]) == 0 and "L40S" in capsys.readouterr().out
    assert main(["--list-models"]) == 0 and "qwen3-235b-a22b" in capsys.readouterr().out
    assert main(["--model", "dbrx", "--gpus", "NoSuchGPU"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
    assert main(["--gpus", "A800"]) == 2


def test_add_parser_registers_plan() -> None:
    top = argparse.ArgumentParser(prog="afdserve")
    sub = top.add_subparsers(dest="command")
    add_parser(sub)
    args = top.parse_args(["plan", "--list-gpus"])
    assert args.command == "plan" and args.func is main
    assert main(args) == 0


def test_python_dash_m(tmp_path: Path) -> None:
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, "-m", "afdserve.cli.main", "plan", "--list-models"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0 and "mixtral-8x22b" in r.stdout
