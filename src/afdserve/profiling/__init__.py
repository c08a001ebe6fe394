"""Profiling: measures this machine and the parts of the runtime (through their public APIs) and
fits the planner's profile -- ``afdserve profile``.

* :func:`run_profile` -- everything, fitted into an :class:`afdserve.planner.Profile` (:mod:`.run`)
* :mod:`.grid` -- what to measure (:class:`ProfileGrid`, :data:`DEFAULT_GRID`, :data:`QUICK_GRID`)
* harnesses, one per part: :func:`measure_attention`, :func:`measure_expert`,
  :func:`measure_transport` (+ :mod:`.transport_peer`), :func:`measure_step`, :func:`measure_corun`
  (+ :mod:`.corun_partner`)
* :mod:`.parts` -- the runtime's parts built from public pieces; :mod:`.loopback` -- links without
  expert workers; :mod:`.timers`, :mod:`.cache_flusher`, :mod:`.probes` -- timing hygiene and the host
"""

from afdserve.profiling.cache_flusher import CacheFlusher
from afdserve.profiling.corun import measure_corun
from afdserve.profiling.grid import DEFAULT_GRID, QUICK_GRID, ProfileGrid
from afdserve.profiling.harness_attention import measure_attention
from afdserve.profiling.harness_expert import measure_expert
from afdserve.profiling.harness_step import measure_step
from afdserve.profiling.harness_transport import measure_transport
from afdserve.profiling.probes import cpu_cores, idle_fraction
from afdserve.profiling.run import run_profile

__all__ = ["CacheFlusher", "DEFAULT_GRID", "QUICK_GRID", "ProfileGrid", "cpu_cores", "idle_fraction",
           "measure_attention", "measure_corun", "measure_expert", "measure_step", "measure_transport", "run_profile"]
