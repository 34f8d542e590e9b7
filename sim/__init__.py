"""batchsim's simulator, in floors; each floor imports only the floors below it.

    cli.py      the one parser: the only module that imports reports/ or calibrate/
    run/        one workload, simulated or live; the only floor that imports policies/ and workloads/
    loop/       the SimPy clock: servers, feeds and routers, the fast path
    results/    what a run produced: result types, metrics, tables, files
    cost/       what a step costs: profiles, curves, the roofline, presets
    core/       the scheduler's world and its contract (request, batch, KV, state, logs, Policy)
    base/       stdlib-only helpers

``tests/test_layers.py`` holds the rules as code, counting type-only imports too.
"""
