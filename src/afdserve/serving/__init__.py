"""The OpenAI-compatible HTTP server (``afdserve serve``).

* ``app`` -- FastAPI routes and OpenAI-shaped errors; ``generation`` -- completions and chat
  completions, JSON or server-sent events; ``protocol`` -- request/response models; ``chat`` --
  chat templates; ``errors`` -- error bodies; ``tools`` / ``tool_parsers`` -- tool calling;
  ``tokenization`` -- ``/tokenize`` and ``/detokenize``; ``jobs`` / ``jobs_api`` -- async jobs
  (``/v1/jobs``); ``progress`` -- a request's prefill progress (jobs, ``include_progress`` streams)
* ``async_engine`` -- the engine thread between the event loop and a (non thread-safe) engine;
  ``engine_stats`` -- what a deployment reports; ``metrics`` -- Prometheus metrics
* ``server`` -- building and running a server

The load generator and the serving benchmark (``afdserve bench serve``) are in ``afdserve.bench``.
"""
