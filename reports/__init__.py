"""Sweeps, capacity planning, plots and HTML/Markdown reports.

Modules: ``spec`` (sweep files), ``pool`` (local process pool / Dask),
``sweep`` (``sim sweep``), ``capacity`` (SLO checks, rate bisection),
``planspec`` and ``plan`` (``sim plan``), ``terminal`` (what sweep and plan
print), ``plots``, ``runplots`` and ``sweepplots`` (figures from DataFrames),
``knee`` (knee and Pareto arithmetic), ``render`` (Markdown + HTML documents)
and ``report``, ``sweepreport`` and ``planreport`` (``sim report DIR``);
``validation`` holds the live-vs-simulated comparison tables and reports.
"""
