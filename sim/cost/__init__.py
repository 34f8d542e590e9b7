"""What a step costs: Profile (step_time_s of a batch shape), its curves, the
analytic roofline, collectives and the GPU and model presets.

Rule: imports only ``sim.base`` and ``sim.core``; never a policy (the cost
model sees batch shapes, never policy names)."""
