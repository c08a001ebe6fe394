"""Benchmark clients: serving load generators, the ShareGPT loader, the soak test and the M2N benchmark harness.

* ``sharegpt``, ``workload`` -- the requests; ``loadgen`` -- the open-loop load generator;
  ``serve_report`` -- its results; ``serve`` -- ``afdserve bench serve``; ``soak`` -- a soak run
* ``m2n``, ``m2n_worker``, ``m2n_report`` -- ``afdserve bench m2n``
"""
