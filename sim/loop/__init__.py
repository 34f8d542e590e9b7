"""The SimPy clock: Server (schedule -> execute -> commit), the executors,
feeds and routers, and the fast path that runs the repeated steps a policy
describes (``sim.loop.stretch``).

Rule: imports only ``sim.base``, ``sim.core`` and ``sim.cost``; never
``policies``, ``workloads`` or ``sim.run`` (a policy reaches the loop only
through the ``sim.core.policy.Policy`` protocol)."""
