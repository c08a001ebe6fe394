"""Hardware catalog: Table 3 values, data-sheet entries, user TOML files."""

from __future__ import annotations

from pathlib import Path

import pytest

from afdserve.errors import ConfigError
from afdserve.planner.catalog import BUILTIN_GPUS, TABLE3_GPUS, load_catalog


def test_table3_values() -> None:
    t3 = {  # price, GB, GB/s, TFLOPS
        "L20": (1.00, 48, 864, 119.5),
        "H800": (5.28, 80, 3430.4, 989),
        "A800": (2.26, 80, 2039, 312),
        "H20": (1.85, 96, 4096, 148),
        "L40S": (1.08, 48, 864, 362),
    }
    assert set(TABLE3_GPUS) == set(t3)
    for name, (price, gb, bw, tf) in t3.items():
        g = BUILTIN_GPUS[name]
        assert (g.price, g.memory_gb, g.mem_bw_gbs, g.tflops) == (price, gb, bw, tf)


@pytest.mark.parametrize(
    "name,per_gb,per_bw,per_tf",
    [
        ("L20", 48, 864, 119.5),
        ("H800", 15.2, 649.7, 187.3),
        ("A800", 35.4, 902.2, 138.1),
        ("H20", 51.9, 2214.1, 80.0),
        ("L40S", 44.4, 800.0, 335.2),
    ],
)
def test_table3_per_cost_columns(name: str, per_gb: float, per_bw: float, per_tf: float) -> None:
    g = BUILTIN_GPUS[name]
    assert g.price is not None
    assert g.memory_gb / g.price == pytest.approx(per_gb, abs=0.06)
    assert g.mem_bw_gbs / g.price == pytest.approx(per_bw, abs=0.06)
    assert g.tflops / g.price == pytest.approx(per_tf, abs=0.06)


def test_paper_power_and_network() -> None:
    assert BUILTIN_GPUS["H20"].power_w == 500 and BUILTIN_GPUS["L40S"].power_w == 350  # §4.3
    assert BUILTIN_GPUS["A800"].net_Bps == pytest.approx(200e9 / 8)  # 200 Gb/s per GPU (§7.1)
    for name in ("A100", "H100", "H200", "B200"):
        g = BUILTIN_GPUS[name]
        assert g.price is None and g.source and g.power_w > 0 and g.net_gbps > 0


def test_every_entry_is_sourced() -> None:
    for g in BUILTIN_GPUS.values():
        assert len(g.source) > 20, g.name


def test_toml_adds_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "gpus.toml"
    f.write_text(
        "[gpu.MI300X]\nmemory_gb = 192\nmem_bw_gbs = 5300\ntflops = 1307\npower_w = 750\nnet_gbps = 400\n"
        'intra_node_gbs = 896\nprice = 3.1\nsource = "test"\n\n[gpu.h100]\nprice = 4.5\n'
    )
    cat = load_catalog(f)
    assert cat.get("mi300x").tflops == 1307
    assert cat.get("H100").price == 4.5 and cat.get("H100").tflops == 989
    assert "L20" in cat and len(cat) == len(BUILTIN_GPUS) + 1


@pytest.mark.parametrize(
    "text",
    ["[gpu.X]\nmemory_gb = 1\n", "[gpu.H100]\nfoo = 1\n", "[gpu.H100]\nprice = -1\n", "not toml ===", "a = 1\n"],
)
def test_toml_errors(tmp_path: Path, text: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError):
        load_catalog(f)


def test_unknown_gpu() -> None:
    with pytest.raises(ConfigError, match="unknown GPU"):
        load_catalog().get("TPUv9")
