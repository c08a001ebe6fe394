"""Deployment spec files, placement diagnostics, the machine-identity override and the flags of
``--cluster ray``: everything of the Ray support that needs no Ray."""

import argparse
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from afdserve.cluster import resolve_deployment
from afdserve.cluster.placement import Demand, Node, why_unplaceable
from afdserve.cluster.spec import DeploymentSpec, RoleSpec, from_plan, load_deployment
from afdserve.comm import CommConfig, Communicator
from afdserve.config import EngineConfig
from afdserve.errors import ConfigError

SPEC = """
micro_batches = 2
gate = "expert"
strategy = "SPREAD"
comm_transport = "auto"
placement_timeout_s = 30

[attention]
workers = 2
num_cpus = 2
threads = 2
resources = { attention_node = 1 }
labels = { "afdserve/role" = "attention" }

[expert]
workers = 3
num_cpus = 0.5
resources = { expert_node = 0.25, "accelerator_type:L40S" = 0.001 }
expert_split = [1, 2, 3]
"""


def test_spec_file_round_trip(tmp_path):
    p = tmp_path / "d.toml"
    p.write_text(SPEC)
    s = load_deployment(p)
    assert (s.attention.workers, s.expert.workers, s.micro_batches, s.gate, s.strategy) == (2, 3, 2, "expert", "SPREAD")
    assert s.attention.bundle() == {"attention_node": 1.0, "CPU": 2.0}
    assert s.expert.bundle() == {"expert_node": 0.25, "accelerator_type:L40S": 0.001, "CPU": 0.5}
    assert s.attention.labels == {"afdserve/role": "attention"} and s.attention.threads == 2
    assert s.expert_split == [1, 2, 3] and s.placement_timeout_s == 30
    q = tmp_path / "again.toml"
    s.write(q)
    t = load_deployment(q)
    for f in ("attention", "expert", "micro_batches", "gate", "expert_split", "strategy", "comm_transport",
              "placement_timeout_s"):
        assert getattr(t, f) == getattr(s, f), f


def test_defaults_select_attention_and_expert_nodes(tmp_path):
    p = tmp_path / "d.toml"
    p.write_text("[attention]\nworkers = 1\n[expert]\nworkers = 2\n")
    s = load_deployment(p)
    assert s.attention.bundle() == {"attention_node": 0.001, "CPU": 1.0}
    assert s.expert.bundle() == {"expert_node": 0.001, "CPU": 1.0}
    assert (s.micro_batches, s.gate, s.strategy, s.expert_split) == (1, "attention", "PACK", None)


@pytest.mark.parametrize("text,needle", [
    ("[attention]\nworkers = 0\n[expert]\nworkers = 1\n", "attention.workers"),
    ("[attention]\nworkers = 1\n", "missing table [expert]"),
    ("[attention]\nworkers = 1\n[expert]\nworkers = 1\ncolour = 1\n", "unknown key(s) in [expert]: colour"),
    ("replicas = 2\n[attention]\nworkers = 1\n[expert]\nworkers = 1\n", "unknown key(s) replicas"),
    ("strategy = 'FAR'\n[attention]\nworkers = 1\n[expert]\nworkers = 1\n", "strategy"),
    ("gate = 'router'\n[attention]\nworkers = 1\n[expert]\nworkers = 1\n", "gate"),
    ("[attention]\nworkers = 1\n[expert]\nworkers = 2\nexpert_split = [3]\n", "expert.expert_split"),
    ("[attention]\nworkers = 1\nresources = { CPU = 2 }\n[expert]\nworkers = 1\n", "num_cpus"),
    ("[attention]\nworkers = 1\nresources = { a = -1 }\n[expert]\nworkers = 1\n", "attention.resources"),
    ("[attention]\nworkers = 1\nnum_cpus = 0\nresources = {}\n[expert]\nworkers = 1\n", "reserve something"),
    ("[attention]\nworkers = 1\n[expert]\nworkers = 1\nthreads = 0\n", "expert.threads"),
    ("[attention\nworkers = 1\n", "not valid TOML"),
])
def test_bad_spec_files_name_the_key(tmp_path, text, needle):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_deployment(p)
    assert needle in str(e.value) and str(p) in str(e.value)


def test_missing_spec_file():
    with pytest.raises(ConfigError, match="cannot read deployment spec"):
        load_deployment("/nonexistent/spec.toml")


def test_engine_config_takes_the_spec(tmp_path):
    p = tmp_path / "d.toml"
    p.write_text(SPEC)
    cfg = resolve_deployment(EngineConfig(deployment=str(p), attention_workers=7, expert_workers=1, micro_batches=1))
    assert (cfg.attention_workers, cfg.expert_workers, cfg.micro_batches, cfg.gate, cfg.expert_split) == \
        (2, 3, 2, "expert", [1, 2, 3])
    spec = load_deployment(p)
    wc = spec.worker_config("attention", cfg)
    assert wc.num_threads == 2 and wc.deployment is None and wc.attention_workers == 2
    assert spec.worker_config("expert", cfg).num_threads == cfg.num_threads  # no threads given: the engine's


def test_cluster_options_are_validated():
    with pytest.raises(ConfigError, match=r"invalid cluster='k8s'"):
        EngineConfig(cluster="k8s", expert_workers=1)
    with pytest.raises(ConfigError, match=r"invalid expert_workers=0.*cluster='ray'"):
        EngineConfig(cluster="ray")
    with pytest.raises(ConfigError, match=r"invalid ray_address"):
        EngineConfig(ray_address="10.0.0.1:6379", expert_workers=1)
    with pytest.raises(ConfigError, match=r"invalid ray_address='ray://h:10001': Ray Client is not supported"):
        EngineConfig(cluster="ray", ray_address="ray://h:10001", expert_workers=1)
    cfg = EngineConfig(cluster="ray", ray_address="10.0.0.1:6379", expert_workers=2)
    assert (cfg.cluster, cfg.ray_address) == ("ray", "10.0.0.1:6379")
    assert EngineConfig().cluster == "local"


def test_cli_flags(tmp_path):
    from afdserve.cli.deployment import add_engine_args, engine_config

    p = tmp_path / "d.toml"
    p.write_text(SPEC)
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    args = ap.parse_args(["--cluster", "ray", "--ray-address", "10.1.2.3:6379", "--deployment", str(p)])
    cfg = engine_config(args)
    assert (cfg.cluster, cfg.ray_address, cfg.deployment) == ("ray", "10.1.2.3:6379", str(p))
    assert (cfg.attention_workers, cfg.expert_workers) == (2, 3)
    assert engine_config(ap.parse_args([])).cluster == "local"


def test_serve_command_accepts_the_flags(tmp_path):
    from afdserve.cli.deployment import engine_config
    from afdserve.cli.main import build_parser

    p = tmp_path / "d.toml"
    p.write_text(SPEC)
    args = build_parser().parse_args(["serve", "--cluster", "ray", "--ray-address", "auto", "--deployment", str(p)])
    cfg = engine_config(args)
    assert (cfg.cluster, cfg.ray_address, cfg.expert_workers, cfg.micro_batches) == ("ray", "auto", 3, 2)


def test_ray_is_not_imported_by_the_rest():
    """Ray stays optional: the package, the runtime and the spec code load without it."""
    import subprocess

    code = ("import sys, afdserve, afdserve.runtime, afdserve.cluster, afdserve.cluster.spec, "
            "afdserve.cluster.placement, afdserve.cli.main; afdserve.cli.main.build_parser(); "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plan_writes_a_deployment_the_server_reads(tmp_path):
    from afdserve.cli.plan import main as plan_main
    from afdserve.planner import load_model_spec

    out = tmp_path / "plan.toml"
    js = tmp_path / "plans.json"
    assert plan_main(["--model", "mixtral-8x22b", "--gpus", "A800", "--top", "1", "--json", str(js),
                      "--write-deployment", str(out)]) == 0
    import json

    best = json.loads(js.read_text())["plans"][0]
    s = load_deployment(out)
    assert (s.attention.workers, s.expert.workers, s.micro_batches) == (best["n_a"], best["n_e"], best["micro_batches"])
    assert s.plan["tbt_ms"] == pytest.approx(best["tbt_ms"])
    E = load_model_spec("mixtral-8x22b").num_experts
    if best["n_e"] * best["experts_per_node"] == E:
        assert s.expert_split == [best["experts_per_node"]] * best["n_e"]
    cfg = resolve_deployment(EngineConfig(deployment=str(out)))
    assert (cfg.attention_workers, cfg.expert_workers) == (best["n_a"], best["n_e"])


def test_from_plan_skips_a_split_that_does_not_cover_the_model():
    class P:
        n_a, n_e, experts_per_node, micro_batches = 3, 2, 2, 2

        def to_json(self):
            return {"n_a": 3, "tbt_ms": 50.0, "attention_gpu": "H20", "cost": None}

    s = from_plan(P(), num_experts=8)
    assert s.expert_split is None and s.plan == {"n_a": 3, "tbt_ms": 50.0, "attention_gpu": "H20"}
    assert from_plan(P(), num_experts=4).expert_split == [2, 2]


# ---- placement diagnostics ---------------------------------------------------------------------
def _nodes():
    return [Node("a" * 56, "10.0.0.1", {"CPU": 2.0, "attention_node": 1.0}, {"role": "attention"}),
            Node("b" * 56, "10.0.0.2", {"CPU": 4.0, "expert_node": 2.0}, {"role": "expert"})]


def test_placeable_specs_pass():
    d = [Demand("attention", 1, {"CPU": 1.0, "attention_node": 1.0}), Demand("expert", 2, {"CPU": 1.0, "expert_node": 1.0})]
    assert why_unplaceable(d, _nodes()) is None
    assert why_unplaceable(d, _nodes(), "STRICT_SPREAD") is not None  # 3 workers, 2 nodes
    d2 = [Demand("attention", 1, {"CPU": 1.0}, {"role": "attention"}), Demand("expert", 1, {"CPU": 1.0}, {"role": "expert"})]
    assert why_unplaceable(d2, _nodes(), "STRICT_SPREAD") is None


def test_more_workers_than_resources_names_the_resource():
    d = [Demand("attention", 1, {"CPU": 1.0, "attention_node": 1.0}), Demand("expert", 3, {"CPU": 1.0, "expert_node": 1.0})]
    msg = why_unplaceable(d, _nodes())
    assert msg == ("needs 3 bundles of {'CPU': 1, 'expert_node': 1} for the 3 expert workers (3 'expert_node') "
                   "but the cluster has 2 'expert_node'")


def test_absent_resource_and_labels():
    msg = why_unplaceable([Demand("expert", 1, {"gpu_node": 1.0})], _nodes())
    assert "has no 'gpu_node' resource" in msg and "ray start --resources='{\"gpu_node\": 1}'" in msg
    msg = why_unplaceable([Demand("expert", 1, {"CPU": 1.0}, {"role": "gpu"})], _nodes())
    assert "labels {'role': 'gpu'}" in msg
    msg = why_unplaceable([Demand("expert", 1, {"CPU": 1.0, "expert_node": 1.0}, {"role": "attention"})], _nodes())
    assert "no 'expert_node' resource on those nodes" in msg


def test_label_selectors():
    from afdserve.cluster.placement import label_matches

    assert label_matches("expert", "expert") and not label_matches("attention", "expert")
    assert label_matches("attention", "!expert") and label_matches(None, "!expert")
    assert label_matches("b", "in(a, b)") and not label_matches(None, "in(a,b)") and label_matches("c", "!in(a,b)")
    d = [Demand("expert", 1, {"CPU": 1.0}, {"role": "in(expert, gpu)"})]
    assert why_unplaceable(d, _nodes()) is None
    assert why_unplaceable([Demand("expert", 2, {"CPU": 3.0}, {"role": "!attention"})], _nodes()) is not None


def test_shared_cpus_and_fragmentation():
    d = [Demand("attention", 2, {"CPU": 1.0}), Demand("expert", 5, {"CPU": 1.0})]
    assert why_unplaceable(d, _nodes()) == "needs 7 'CPU' in all (2 x 1 (attention) + 5 x 1 (expert)) but the cluster has 6 'CPU'"
    assert "no node of the cluster has more than 4 'CPU'" in why_unplaceable([Demand("expert", 1, {"CPU": 5.0})], _nodes())
    # totals suffice, but bundles of 3 CPUs fit once on the 4-CPU node and never on the 2-CPU one
    d = [Demand("expert", 2, {"CPU": 3.0})]
    assert "do not fit on the nodes of the cluster together" in why_unplaceable(d, _nodes())
    assert "STRICT_PACK" in why_unplaceable([Demand("attention", 1, {"attention_node": 1.0}),
                                             Demand("expert", 1, {"expert_node": 1.0})], _nodes(), "STRICT_PACK")
    assert why_unplaceable(d, []) == "the cluster has no alive nodes"


# ---- machine identity: what makes the M2N library pick TCP between Ray nodes -------------------
def _pair(machine_a, machine_b):
    store = dist.HashStore()
    out, errs = {}, []

    def mk(name, machine, **kw):
        try:
            cfg = CommConfig(slot_bytes=1 << 12, num_slots=2, connect_timeout_s=20, machine_id=machine)
            out[name] = Communicator(name, store, cfg, group="mid").connect(**kw)
        except BaseException as e:  # pragma: no cover
            errs.append(e)

    ts = [threading.Thread(target=mk, args=("a", machine_a), kwargs={"send_to": ["b"]}),
          threading.Thread(target=mk, args=("b", machine_b), kwargs={"recv_from": ["a"]})]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    if errs:
        raise errs[0]
    return out["a"], out["b"]


@pytest.mark.parametrize("ids,expect", [(("ray-node:1", "ray-node:2"), "tcp"), (("ray-node:1", "ray-node:1"), "shm"),
                                        ((None, None), "shm")])
def test_machine_id_decides_shm_or_tcp(ids, expect):
    import platform

    if expect == "shm" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("shared memory transport needs x86-64")
    a, b = _pair(*ids)
    try:
        assert a.transport("b") == expect and b.transport("a", "recv") == expect
        a.send("b", [torch.arange(5.0)])
        with b.recv("a", timeout=5) as m:
            assert m.tensors[0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    finally:
        a.close()
        b.close()


def test_machine_id_validation():
    with pytest.raises(ConfigError, match="machine_id"):
        CommConfig(machine_id="")


def test_spec_dataclass_direct():
    s = DeploymentSpec(attention=RoleSpec(1, resources={"a": 1}), expert=RoleSpec(2, resources={"e": 1}))
    assert s.engine_overrides() == {"attention_workers": 1, "expert_workers": 2, "micro_batches": 1,
                                    "gate": "attention", "expert_split": None}
    with pytest.raises(ConfigError, match="expert.workers"):
        DeploymentSpec(expert=RoleSpec(0))
