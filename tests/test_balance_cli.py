"""``afdserve expert-load`` (heatmap PNG) and the Prometheus collector."""

from __future__ import annotations

import argparse

from prometheus_client import CollectorRegistry, generate_latest

from afdserve.balance.metrics import ExpertLoadCollector
from afdserve.balance.synthetic import synthetic_snapshot
from afdserve.cli import expert_load as cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_expert_load_via_subparsers(tmp_path, capsys):
    snap = synthetic_snapshot(4, 16, 2, seed=1)
    path = tmp_path / "snap.json"
    snap.save(path)
    parser = argparse.ArgumentParser(prog="afdserve")
    cli.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "load.png"
    args = parser.parse_args(["expert-load", str(path), "--out", str(out)])
    assert args.func(args) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert "4 layers x 16 experts" in capsys.readouterr().out


def test_expert_load_options_and_errors(tmp_path, capsys):
    snap = synthetic_snapshot(6, 8, 2, seed=2)
    path = tmp_path / "snap.json"
    snap.save(path)
    out = tmp_path / "sub" / "rel.png"
    assert cli.run([str(path), "--out", str(out), "--layers", "0-2,5", "--relative", "--coactivation", "1"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert cli.run([str(tmp_path / "missing.json"), "--out", str(out)]) == 1
    assert cli.run([str(path), "--out", str(out), "--layers", "9"]) == 1
    assert "not in the snapshot" in capsys.readouterr().err


def test_prometheus_collector():
    snap = synthetic_snapshot(2, 4, 2, seed=3)
    reg = CollectorRegistry()
    reg.register(ExpertLoadCollector(lambda: snap))
    text = generate_latest(reg).decode()
    assert 'afdserve_expert_tokens_per_step{expert="3",layer="1"}' in text
    assert 'afdserve_expert_load_imbalance{layer="0"}' in text
    assert f"afdserve_expert_load_window_steps {float(snap.steps)}" in text
    empty = CollectorRegistry()
    empty.register(ExpertLoadCollector(lambda: None))
    assert "afdserve_expert" not in generate_latest(empty).decode()
