"""Profiles: least-squares fits of k1..k4 and Util, and the file format."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from afdserve.errors import ConfigError
from afdserve.planner import (
    AttentionCost,
    ExpertCost,
    NetworkProfile,
    Profile,
    WireFormat,
    fit,
    fit_attention,
    fit_expert,
    fit_network,
    load_profile,
    save_profile,
)


def _att_samples(
    k1_tok: float, k1_ctx: float, k2: float, noise: float = 0.0, seed: int = 0
) -> list[tuple[float, float, float]]:
    rng = random.Random(seed)
    out = []
    for b in (1, 4, 16, 64, 256):
        for s in (128, 512, 2048):
            t = (k1_tok + k1_ctx * s) * b + k2
            out.append((b, s, t * (1 + rng.gauss(0, noise))))
    return out


def test_fit_attention_recovers_constants() -> None:
    c = fit_attention(_att_samples(2e-6, 3e-9, 4e-4), tp=1, gpu="cpu")
    assert c.k1_tok == pytest.approx(2e-6, rel=1e-6)
    assert c.k1_ctx == pytest.approx(3e-9, rel=1e-6)
    assert c.k2 == pytest.approx(4e-4, rel=1e-6)
    assert c.n_samples == 15 and c.rmse_s == pytest.approx(0, abs=1e-12)
    assert c.seq_len_range == (128, 2048)
    assert c.k1(1000) == pytest.approx(2e-6 + 3e-6)


def test_fit_attention_with_noise() -> None:
    c = fit_attention(_att_samples(2e-6, 3e-9, 4e-4, noise=0.02, seed=3))
    assert c.k1_tok == pytest.approx(2e-6, rel=0.25)
    assert c.k1_ctx == pytest.approx(3e-9, rel=0.1)
    assert c.k2 == pytest.approx(4e-4, rel=0.1)


def test_fit_attention_single_seq_len() -> None:
    samples = [(b, 650, 1e-6 * b + 2e-4) for b in (1, 8, 32)]
    c = fit_attention(samples)
    assert c.k1_ctx == 0 and c.k1_tok == pytest.approx(1e-6) and c.k2 == pytest.approx(2e-4)


def test_fit_keeps_coefficients_nonnegative() -> None:
    # a constant that least squares would make negative is clamped to 0
    samples = [(b, 100, 1e-6 * b - 1e-7 + (1e-8 if b % 2 else 0)) for b in (1, 2, 3, 4, 5, 6)]
    c = fit_attention(samples)
    assert c.k2 >= 0 and c.k1_tok > 0


def test_fit_expert_recovers_constants() -> None:
    c = fit_expert([(b, 5e-7 * b + 3e-4) for b in (8, 64, 512, 2048)], experts_per_node=4)
    assert (c.k3, c.k4) == (pytest.approx(5e-7), pytest.approx(3e-4))
    assert c.experts_per_node == 4
    # (batch, seq_len, time) samples are accepted too
    c3 = fit_expert([(b, 650, 5e-7 * b + 3e-4) for b in (8, 64)])
    assert c3.k3 == pytest.approx(5e-7)


def test_fit_network_and_util() -> None:
    lat, bw = 20e-6, 10e9
    samples = [(s, lat + s / bw) for s in (1024, 16384, 262144, 4 << 20)]
    net = fit_network(samples, nominal_Bps=12.5e9)
    assert net.latency_s == pytest.approx(lat, rel=1e-6)
    assert net.bandwidth_Bps == pytest.approx(bw, rel=1e-6)
    u = net.util_curve()
    # Util(s) = achieved / nominal bandwidth
    for s in (4096, 196608, 8 << 20):
        assert u(s) == pytest.approx(s / (lat + s / bw) / 12.5e9)
    assert net.message_time(1 << 20) == pytest.approx(lat + (1 << 20) / bw)
    # no nominal: Util tends to 1 for large messages
    assert fit_network(samples).util_curve()(1e12) == pytest.approx(1.0, rel=1e-4)


@pytest.mark.parametrize(
    "fn,bad",
    [
        (fit_attention, [(1, 1, 1.0)]),
        (fit_attention, [(2, 1, 1.0), (2, 5, 2.0)]),
        (fit_expert, [(1, 1.0), (1, 2.0)]),
        (fit_network, [(10, 1.0), (10, 2.0)]),
        (fit_network, [(10, 1.0), (20, 0.5)]),
    ],
)
def test_fit_rejects_unusable_samples(fn, bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        fn(bad)


def test_fit_builds_profile_and_roundtrips(tmp_path: Path) -> None:
    prof = fit(
        "demo",
        attention_samples=_att_samples(2e-6, 3e-9, 4e-4),
        expert_samples=[(b, 5e-7 * b + 3e-4) for b in (8, 64, 512)],
        network_samples=[(s, 2e-5 + s / 1e10) for s in (1024, 65536, 1 << 20)],
        gpu="cpu",
        experts_per_node=2,
        wire=WireFormat(act_bytes=4, dispatch="pairs"),
        device="test box",
    )
    assert not prof.estimate and prof.model == "demo" and prof.device == "test box"
    assert prof.attention_cost("CPU", 1) is not None and prof.attention_cost("cpu", 2) is None
    assert prof.expert_cost("cpu", 1, 2) is not None and prof.expert_cost("cpu", 1, 4) is None
    path = tmp_path / "p.json"
    save_profile(prof, path)
    data = json.loads(path.read_text())
    assert data["format"] == "afdserve-planner-profile" and data["version"] == 1
    assert set(data["samples"]) == {"attention", "expert", "network"}
    back = load_profile(path)
    assert back.attention == prof.attention and back.expert == prof.expert
    assert back.network == prof.network and back.wire == prof.wire
    # re-fitting one part keeps the others
    prof2 = fit(
        "demo", expert_samples=[(b, 1e-6 * b + 1e-4) for b in (8, 64)], gpu="cpu", experts_per_node=2, base=back
    )
    assert prof2.attention == back.attention and prof2.expert_cost("cpu", 1, 2).k3 == pytest.approx(1e-6)
    assert len(prof2.expert) == 1


def test_wildcard_gpu_and_manual_profile() -> None:
    p = Profile(model="m", attention=(AttentionCost(1e-6, 0.0, 1e-4, tp=2),), expert=(ExpertCost(1e-6, 1e-4, tp=1),))
    assert p.attention_cost("H20", 2) is not None and p.expert_cost("anything", 1, 1) is not None
    n = NetworkProfile(latency_s=1e-5, bandwidth_Bps=1e9)
    assert n.nominal == 1e9


@pytest.mark.parametrize(
    "doc",
    [
        {"format": "other"},
        {"format": "afdserve-planner-profile", "version": 9},
        {"format": "afdserve-planner-profile", "version": 1, "attention": [{"k1_tok": 1}]},
        {"format": "afdserve-planner-profile", "version": 1, "wire": {"dispatch": "carrier-pigeon"}},
    ],
)
def test_bad_profiles(tmp_path: Path, doc: dict) -> None:  # type: ignore[type-arg]
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(ConfigError):
        load_profile(f)


def test_fit_nondecreasing() -> None:
    from afdserve.planner import fit_nondecreasing

    # pool adjacent violators: a dip is averaged with what it undercuts (here every earlier point);
    # monotone data is kept
    def flat(points):  # type: ignore[no-untyped-def]
        return [v for p in points for v in p]

    assert flat(fit_nondecreasing([(1, 1.3), (4, 1.3), (8, 1.4), (16, 1.1), (24, 1.6)])) == pytest.approx(
        [1, 1.275, 4, 1.275, 8, 1.275, 16, 1.275, 24, 1.6])
    assert flat(fit_nondecreasing([(2, 1.0), (1, 2.0)])) == pytest.approx([1, 1.5, 2, 1.5])
    assert fit_nondecreasing([(1, 1.0), (2, 2.0)]) == ((1.0, 1.0), (2.0, 2.0))
