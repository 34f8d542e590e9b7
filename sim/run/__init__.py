"""One workload, simulated or live: its validated config and schema, the
runner that builds requests, the policy, the pools and the servers, and the
live seam.

Rule: may import every floor below it (base, core, cost, results, loop) and
is the only part of sim/ that imports ``policies`` and ``workloads``; never
``reports`` or ``calibrate`` (only ``sim.cli`` does)."""
