"""What a run produced: RunResult, metrics, the compact requests table,
vLLM benchmark JSON, run folders, the second process that writes them, the
Chrome trace.

Rule: imports only ``sim.base``, ``sim.core`` and ``sim.cost``; runs nothing
(no SimPy, no policy, no workload)."""
