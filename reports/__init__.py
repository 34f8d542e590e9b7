"""Sweeps, capacity planning, plots and HTML/Markdown reports.

Modules: ``spec`` (sweep files), ``pool`` (local process pool / Dask),
``sweep`` (``sim sweep``), ``capacity`` (SLO checks, rate bisection),
``planspec`` and ``plan`` (``sim plan``), ``plots`` and ``runplots``
(figures from DataFrames), ``render`` (Markdown + HTML documents) and
``report`` and ``planreport`` (``sim report DIR``); ``validation`` holds the
live-vs-simulated comparison tables.
"""
