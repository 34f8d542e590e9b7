"""The scheduler's world and its contract: Request, Batch, the KV block pool,
SchedulerState (the one mutator of token counts), the step and token logs,
and the Policy protocol with its PolicyContext.

Rule: imports only ``sim.base``. Policies (``policies/``) may import only
``sim.base`` and ``sim.core``."""
