"""The autoscaling policy as a pure object (signals in, decision out, the clock injected): hysteresis,
cool-down, bounds, which pool; the simulated diurnal day against the best fixed deployment; the
serving loop's handling of a resize that fails or never answers."""

import asyncio
import math

import pytest

from afdserve.cli.main import build_parser
from afdserve.cli.main import main as cli
from afdserve.cli.serve import autoscale_config
from afdserve.engine.stats import EngineStats
from afdserve.errors import ConfigError, WorkerError
from afdserve.planner.autoscale import AutoscaleConfig, AutoscalePolicy, Signals, parse_bounds
from afdserve.planner.autoscale_day import DayConfig, run_day
from afdserve.serving.autoscaler import Autoscaler
from afdserve.serving.metrics import ServingMetrics

SLO = 0.1
HOT = Signals(running=8, tpot_s=0.2, throughput_tok_s=100.0, kv_usage=0.3)  # TPOT at 2x the SLO
IDLE = Signals()
MID = Signals(running=4, tpot_s=0.07, throughput_tok_s=50.0, kv_usage=0.6)  # between the thresholds


def policy(a=(1, 3), e=(1, 2), start=(1, 1), model=None, **kw):
    cfg = AutoscaleConfig.from_bounds(a, e, slo_tpot_s=SLO, window_s=10, cooldown_s=30, **kw)
    return AutoscalePolicy(cfg, *start, model=model)


def test_bounds_parse_and_bad_bounds_are_refused():
    assert parse_bounds("1:3", "x") == (1, 3) and parse_bounds("2", "x") == (2, 2)
    for bad in ("0:2", "3:1", "a:b", "1:2:3", "", "-1:2"):
        with pytest.raises(ConfigError, match="bounds"):
            parse_bounds(bad, "attention")
    with pytest.raises(ConfigError, match="outside"):
        policy(start=(4, 1))
    with pytest.raises(ConfigError, match="down_fraction"):
        policy(up_fraction=0.4, down_fraction=0.5)


def test_serve_flags():
    def cfg(*argv):
        return autoscale_config(build_parser().parse_args(["serve", *argv]))

    assert cfg() is None
    c = cfg("--autoscale", "--autoscale-attention", "1:3", "--slo-tpot-ms", "50", "--autoscale-window", "5")
    assert (c.attention_sizes, c.expert_sizes, c.slo_tpot_s, c.window_s) == ((1, 2, 3), (1,), 0.05, 5.0)
    for argv, why in ((["--autoscale"], "needs --autoscale-attention"),
                      (["--autoscale-experts", "1:2"], "need --autoscale"),
                      (["--autoscale-profile", "p.json"], "need --autoscale"),
                      (["--autoscale", "--autoscale-attention", "2:3"], "starts at 1 workers, outside"),
                      (["--autoscale", "--autoscale-attention", "1:x"], "expected MIN:MAX"),
                      (["--autoscale", "--autoscale-attention", "1:2", "--expert-workers", "0"], "disaggregated")):
        with pytest.raises(ConfigError, match=why):
            cfg(*argv)


def test_up_needs_a_sustained_window_then_waits_out_the_cooldown():
    p = policy()
    d = p.decide(HOT, 0.0)
    assert (d.action, d.reason, d.pool) == ("hold", "window", "attention")
    assert p.decide(MID, 5.0).reason == "steady"  # the pressure broke: the window starts again
    assert p.decide(HOT, 6.0).reason == "window"
    assert p.decide(HOT, 15.0).reason == "window"
    d = p.decide(HOT, 16.0)
    assert (d.action, d.reason, d.attention, d.experts) == ("up", "tpot_over_slo", 2, 1)
    p.resized(d.attention, d.experts, 20.0)
    assert p.decide(HOT, 31.0).reason == "window"  # sustained anew after the resize
    d = p.decide(HOT, 45.0)
    assert (d.action, d.reason) == ("hold", "cooldown") and "cool-down" in d.detail
    assert p.decide(HOT, 50.0).action == "up"


def test_hysteresis_band_holds_and_idle_shrinks_to_the_minimum():
    p = policy(start=(3, 2))
    for t in range(0, 100, 5):
        assert p.decide(MID, float(t)).reason == "steady"  # neither threshold: no flapping
    sizes, t = [], 100.0
    while len(sizes) < 3 and t < 1000:
        d = p.decide(IDLE, t)
        if d.action == "down":
            assert d.reason == "underused" and "no tokens" in d.detail
            p.resized(d.attention, d.experts, t)
            sizes.append((d.attention, d.experts))
        t += 1
    assert sizes[-1] == (1, 1) and len(sizes) == 3
    assert p.decide(IDLE, t + 100).reason == "at_min"


def test_at_max_and_a_failed_resize_start_the_cooldown():
    p = policy(a=(1, 1), e=(1, 1))
    assert p.decide(HOT, 0.0).reason == "at_max" and p.decide(HOT, 100.0).action == "hold"
    p = policy()
    assert p.decide(HOT, 0.0).action == "hold" and p.decide(HOT, 10.0).action == "up"
    p.resize_failed(10.0)
    assert (p.attention, p.experts) == (1, 1)
    assert p.decide(HOT, 25.0).reason == "window" and p.decide(HOT, 35.0).reason == "cooldown"
    assert p.decide(HOT, 40.0).action == "up"


def test_which_pool_grows():
    busy_experts = Signals(tpot_s=0.2, throughput_tok_s=1.0, attention_busy=0.3, expert_busy=0.9)
    p = policy()
    p.decide(busy_experts, 0.0)
    assert p.decide(busy_experts, 10.0).pool == "experts"
    kv_full = Signals(kv_usage=0.95, expert_busy=0.9, attention_busy=0.1)
    p = policy()
    p.decide(kv_full, 0.0)
    d = p.decide(kv_full, 10.0)
    assert (d.pool, d.reason) == ("attention", "kv_full")
    queue = Signals(waiting=5)
    p = policy()
    p.decide(queue, 0.0)
    assert p.decide(queue, 10.0).reason == "queue"


class ExpertBound:
    """A model where the expert pool is the bottleneck: TPOT = demand / (100 * min(2 n_a, n_e))."""

    def tpot(self, n_a, n_e, demand):
        cap = 100.0 * min(2 * n_a, n_e)
        return math.inf if demand > cap else 0.01 + 0.09 * demand / cap

    def capacity(self, n_a, n_e):
        return 100.0 * min(2 * n_a, n_e)


def test_the_planner_model_picks_the_pool_and_vetoes_unsafe_shrinks():
    p = policy(a=(1, 4), e=(1, 4), model=ExpertBound())
    hot = Signals(tpot_s=0.2, throughput_tok_s=150.0)
    p.decide(hot, 0.0)
    d = p.decide(hot, 10.0)
    assert (d.action, d.pool, d.experts) == ("up", "experts", 2)
    p = policy(a=(1, 4), e=(1, 4), start=(2, 2), model=ExpertBound())
    low = Signals(tpot_s=0.03, throughput_tok_s=140.0)  # quiet, but one worker less could not serve 140/0.7
    p.decide(low, 0.0)
    d = p.decide(low, 10.0)
    assert (d.action, d.reason) == ("hold", "unsafe_shrink")
    quiet = Signals(tpot_s=0.02, throughput_tok_s=20.0)  # shrink the pool whose removal costs least
    p.decide(quiet, 20.0)
    d = p.decide(quiet, 30.0)
    assert (d.action, d.pool, d.attention, d.experts) == ("down", "attention", 1, 2)


def test_simulated_day_saves_worker_hours_at_equal_slo_attainment(capsys):
    rep = run_day(DayConfig())
    auto, fixed = rep.autoscaled, rep.fixed
    assert fixed is not None and auto.attainment >= rep.config.target_attainment
    assert fixed.attainment >= auto.attainment  # the comparison is at (at least) equal attainment
    assert auto.attainment >= max(r.attainment for r in rep.fixed_candidates if r.worker_hours <= fixed.worker_hours)
    assert rep.saved >= 0.20, rep.to_json()
    actions = {e["action"] for e in auto.timeline}
    assert actions == {"up", "down"} and {e["pool"] for e in auto.timeline} == {"attention", "experts"}
    assert cli(["autoscale-day", "--json", "-"]) == 0
    assert f'"worker_hours_saved": {round(rep.saved, 4)}' in capsys.readouterr().out


class _Engine:
    """What the autoscaling loop uses of an ``AsyncEngine``: stats, call (here: a resize that fails or
    never answers), closing, failed."""

    def __init__(self, resize: str):
        self.resize, self.closing, self.failed, self.calls = resize, False, None, 0
        self.snapshot = EngineStats(running=4, workers={"attention0": "up", "expert0": "up"})

    def stats(self):
        return self.snapshot

    async def call(self, fn):
        self.calls += 1
        if self.resize == "hang":
            await asyncio.get_running_loop().create_future()  # never answers
        raise WorkerError("attention1 died while starting")


@pytest.mark.parametrize("resize", ["fail", "hang"])
def test_the_loop_survives_a_failed_resize_and_retries_after_the_cooldown(resize):
    async def run():
        eng = _Engine(resize)
        metrics = ServingMetrics(eng.stats, lambda: 0)
        now = [0.0]
        pol = AutoscalePolicy(AutoscaleConfig.from_bounds((1, 2), (1, 1), slo_tpot_s=SLO, window_s=0, cooldown_s=30),
                              1, 1)
        scaler = Autoscaler(eng, metrics, pol, resize_timeout_s=0.05, clock=lambda: now[0])
        metrics.between_tokens(0.5, 1)  # TPOT 5x the SLO
        d = await scaler.step()
        assert d.action == "up" and (pol.attention, pol.experts) == (1, 1)
        get = metrics.registry.get_sample_value
        assert get("afdserve_autoscale_resize_failures_total") == 1
        assert get("afdserve_autoscale_pool_workers", {"pool": "attention"}) == 1
        now[0] = 10.0
        metrics.between_tokens(0.5, 1)
        assert (await scaler.step()).reason == "cooldown"
        now[0] = 31.0
        metrics.between_tokens(0.5, 1)
        assert (await scaler.step()).action == "up"  # retried after the cool-down
        assert get("afdserve_autoscale_resize_failures_total") == 2
        assert get("afdserve_autoscale_decisions_total", {"action": "up", "pool": "attention",
                                                          "reason": "tpot_over_slo"}) == 2
        scaler.start()  # the loop stops at once when told (here: while it waits for its next turn)
        await asyncio.wait_for(scaler.stop(), 5)

    asyncio.run(run())
