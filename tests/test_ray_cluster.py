"""Workers as Ray actors on a local two-node Ray cluster (``ray.cluster_utils.Cluster``).

Node A has one ``attention_node``; node B has one ``attention_node``, two ``expert_node`` and the
label ``afdserve-pool=experts``. A spec
asking for two attention workers with ``{attention_node: 1}`` and two expert workers with
``{expert_node: 1}`` (and that label) therefore puts one attention worker on each node and both expert workers on
B: the attention worker on B reaches the experts over shared memory, the one on A over TCP.
"""

import json
import random
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from afdserve import LLM, SamplingParams  # noqa: E402
from afdserve.errors import WorkerError  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

SPEC = """
micro_batches = 2
gate = "attention"
strategy = "PACK"

[attention]
workers = 2
num_cpus = 1
threads = 1
resources = { attention_node = 1 }

[expert]
workers = 2
num_cpus = 1
threads = 1
resources = { expert_node = 1 }
labels = { afdserve-pool = "experts" }
expert_split = [2, 4]
"""


def _prompts():
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, 256) for _ in range(n)]} for n in (3, 9, 17, 30)]


def _alive_actors() -> list:
    from ray._private import state

    return [a for a in state.actors().values() if a["State"] != "DEAD"]


def _live_placement_groups() -> list:
    from ray.util.placement_group import placement_group_table

    return [p for p in placement_group_table().values() if p["state"] != "REMOVED"]


def _wait_clean(timeout: float = 15.0) -> tuple[list, list]:
    deadline = time.monotonic() + timeout
    while True:
        actors, pgs = _alive_actors(), _live_placement_groups()
        if (not actors and not pgs) or time.monotonic() > deadline:
            return actors, pgs
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"attention_node": 1}, "include_dashboard": False})
    node_b = cluster.add_node(num_cpus=3, resources={"attention_node": 1, "expert_node": 2},
                              labels={"afdserve-pool": "experts"})
    try:
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        ids = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        yield cluster, node_b.node_id, ids
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("ray") / "deployment.toml"
    p.write_text(SPEC)
    return p


@pytest.fixture(scope="module")
def local_reference(tiny_mixtral, spec_file):
    """The same deployment as local worker processes."""
    with LLM(str(tiny_mixtral), num_kv_blocks=64, deployment=str(spec_file)) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]


def test_placement_transports_outputs_death_and_cleanup(ray_cluster, tiny_mixtral, spec_file, local_reference):
    cluster, node_b, resources = ray_cluster
    llm = LLM(str(tiny_mixtral), num_kv_blocks=64, cluster="ray", deployment=str(spec_file))
    try:
        front = llm.engine
        placed = {n: {"node_id": w.node_id, "ip": w.node_ip} for n, w in front.workers.items()}
        # where the spec says: attention workers on attention nodes (one per node: each has one
        # attention_node), expert workers on the node with expert_node
        for name, info in placed.items():
            assert resources[info["node_id"]].get("attention_node" if name.startswith("attention") else "expert_node")
        assert {placed["attention0"]["node_id"], placed["attention1"]["node_id"]} == set(resources)
        assert placed["expert0"]["node_id"] == placed["expert1"]["node_id"] == node_b
        assert len(_live_placement_groups()) == 1

        outs = llm.generate(_prompts(), GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == local_reference

        # M2N transport per pair: shared memory within a Ray node, TCP across nodes
        stats = front.worker_stats()
        seen = set()
        for name, st in stats.items():
            for peer, transport in st.transports.items():
                same = placed[name]["node_id"] == placed[peer]["node_id"]
                assert transport == ("shm" if same else "tcp"), (name, peer, transport)
                seen.add(transport)
        assert seen == {"shm", "tcp"}

        # a worker that dies is replaced by a new Ray actor in its bundle (same node kind); requests go on
        victim = front.workers["expert1"]
        ray.kill(victim.actor, no_restart=True)
        ray.wait([victim.ref], timeout=10)
        assert [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)] == local_reference
        front.settle(120)
        assert front.failed is None and front.membership.restarts == {"expert1": 1}
        new = front.workers["expert1"]
        assert new.actor != victim.actor and new.node_id == node_b
        assert len(_live_placement_groups()) == 1
    finally:
        llm.shutdown()
    actors, pgs = _wait_clean()
    assert actors == [] and pgs == []
    assert ray.is_initialized()  # the test's own connection is left alone


def test_unplaceable_spec_fails_fast_naming_the_resource(ray_cluster, tiny_mixtral, tmp_path):
    p = tmp_path / "too_many.toml"
    p.write_text(SPEC.replace("workers = 2\nnum_cpus = 1\nthreads = 1\nresources = { expert_node = 1 }",
                              "workers = 3\nnum_cpus = 1\nthreads = 1\nresources = { expert_node = 1 }")
                 .replace("expert_split = [2, 4]", ""))
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as e:
        LLM(str(tiny_mixtral), num_kv_blocks=64, cluster="ray", deployment=str(p))
    assert time.monotonic() - t0 < 20
    assert "needs 3 bundles of {'expert_node': 1, 'CPU': 1}" in str(e.value)
    assert "the cluster has 2 'expert_node'" in str(e.value)

    q = tmp_path / "no_gpu_nodes.toml"
    q.write_text(SPEC.replace("resources = { expert_node = 1 }", "resources = { gpu_expert_node = 1 }"))
    with pytest.raises(WorkerError, match="has no 'gpu_expert_node' resource"):
        LLM(str(tiny_mixtral), num_kv_blocks=64, cluster="ray", deployment=str(q))
    r = tmp_path / "no_such_label.toml"
    r.write_text(SPEC.replace('afdserve-pool = "experts"', 'afdserve-pool = "gpus"'))
    with pytest.raises(WorkerError, match=r"no node of the cluster has the labels \{'afdserve-pool': 'gpus'\}"):
        LLM(str(tiny_mixtral), num_kv_blocks=64, cluster="ray", deployment=str(r))
    assert _wait_clean() == ([], [])


def test_resources_held_elsewhere_time_out_with_what_is_free(ray_cluster, tiny_mixtral, tmp_path):
    from ray.util.placement_group import placement_group, remove_placement_group

    hog = placement_group([{"expert_node": 2}])
    ray.get(hog.ready(), timeout=30)
    try:
        p = tmp_path / "short.toml"
        p.write_text("placement_timeout_s = 2\n" + SPEC)
        with pytest.raises(WorkerError) as e:
            LLM(str(tiny_mixtral), num_kv_blocks=64, cluster="ray", deployment=str(p))
        assert "not ready after 2 s" in str(e.value) and "'expert_node'" in str(e.value)
    finally:
        remove_placement_group(hog)
    assert _wait_clean() == ([], [])


def test_cli_generate_joins_the_cluster_by_address(ray_cluster, tiny_mixtral, spec_file, tmp_path):
    cluster, _, _ = ray_cluster
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "-m", "afdserve.cli.main", "generate", "--model", str(tiny_mixtral),
                        "--cluster", "ray", "--ray-address", cluster.address, "--deployment", str(spec_file),
                        "--prompt", "hello world", "--prompt", "attention nodes", "--max-tokens", "6",
                        "--ignore-eos", "--json", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    with LLM(str(tiny_mixtral), num_kv_blocks=64) as llm:  # colocated: the same greedy tokens
        ref = llm.generate(["hello world", "attention nodes"], SamplingParams(max_tokens=6, temperature=0,
                                                                             ignore_eos=True))
    assert [g["token_ids"] for g in got] == [o.outputs[0].token_ids for o in ref]
    assert _wait_clean() == ([], [])


def test_server_over_ray(ray_cluster, tiny_mixtral, spec_file):
    """``afdserve serve --cluster ray --deployment FILE`` builds the same front end over Ray actors."""
    import httpx

    from afdserve.config import EngineConfig
    from afdserve.serving.server import BackgroundServer, ServerOptions, build_app

    cfg = EngineConfig(model=str(tiny_mixtral), num_kv_blocks=64, cluster="ray", deployment=str(spec_file))
    app = build_app(cfg, ServerOptions(served_model_name="tiny"))
    server = BackgroundServer(app)
    url = server.start()
    try:
        assert {w.node_id for w in app.state.engine.engine.workers.values()} == \
            {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello world", "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
    finally:
        server.stop()
    with LLM(str(tiny_mixtral), num_kv_blocks=64) as llm:
        want = llm.generate(["hello world"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert text == want[0].outputs[0].text
    assert _wait_clean() == ([], [])
