"""Figures on hand-built DataFrames, slot assignment arithmetic, and `sim report` on real run dirs."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from reports.presentation import plots, runplots, sweepplots
from reports.presentation.report import regenerate
from sim.run.config import ConfigError


def sweep_table() -> pd.DataFrame:
    rows = []
    for kind in ("vllm", "sarathi"):
        for budget in (256, 1024, 4096):
            for rate in (1.0, 2.0, 4.0):
                for rep in (0, 1):
                    rows.append({"policy.kind": kind, "policy.max_num_batched_tokens": budget, "arrivals.rate": rate,
                                 "repetition": rep, "output_throughput": 100 * rate + rep,
                                 "request_throughput": rate, "p99_ttft_ms": 50 * rate * 1024 / budget + rep,
                                 "p99_itl_ms": 10 + budget / 100, "p99_tpot_ms": 9.0})
    return pd.DataFrame(rows)


def texts(fig) -> str:
    parts = [fig._suptitle.get_text() if fig._suptitle else ""]
    for ax in fig.axes:
        parts += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        legend = ax.get_legend()
        if legend:
            parts += [t.get_text() for t in legend.get_texts()]
    for legend in fig.legends:                 # series legends placed under the panels
        parts += [t.get_text() for t in legend.get_texts()]
    return " | ".join(parts)


def test_sweep_figures_have_titles_units_and_legends(tmp_path: Path) -> None:
    table = sweep_table()
    fig = sweepplots.latency_throughput(table, rate_col="arrivals.rate",
                                        group_cols=["policy.kind", "policy.max_num_batched_tokens"],
                                        limits={"p99_ttft_ms": 200, "p99_itl_ms": 50})
    t = texts(fig)
    assert "tokens/s" in t and "p99 TTFT (ms)" in t and "sarathi, max_num_batched_tokens=1024" in t
    assert fig.axes[0].get_yscale() == "log"
    paths = plots.save_figure(fig, tmp_path / "lt")
    assert [p.suffix for p in paths] == [".png", ".svg"] and all(p.stat().st_size > 1000 for p in paths)
    assert not list(tmp_path.glob(".*tmp"))                  # written atomically, nothing left behind

    fig = sweepplots.ttft_itl_tradeoff(table, budget_col="policy.max_num_batched_tokens", group_cols=["arrivals.rate"])
    assert "p99 inter-token latency (ms)" in texts(fig)
    assert len(fig.axes[0].texts) == 3 * 3                   # every (rate, budget) point is annotated
    fig = sweepplots.metric_vs_param(table, param_col="policy.max_num_batched_tokens", group_cols=["policy.kind"])
    assert fig.axes[0].get_xscale() == "log"                 # 256..4096: powers of two on a log2 axis


def test_plan_figures(tmp_path: Path) -> None:
    ranked = pd.DataFrame({"candidate": ["a", "b"], "capacity_rps": [10.0, 3.0], "replicas": [5, 17],
                           "cost_per_hour": [15.0, 20.0], "meets_slo": [True, False]})
    assert "($/hour)" in texts(plots.capacity_bars(ranked, target_rate=50))
    evals = pd.DataFrame({"candidate": ["a"] * 3, "rate_rps": [1.0, 2.0, 4.0], "passed": [True, True, False],
                          "p99_ttft_ms": [10.0, 20.0, 900.0], "p99_itl_ms": [5.0, 6.0, 50.0]})
    fig = plots.search_curves(evals, slo_ttft_ms=100, slo_itl_ms=20)
    assert "offered rate, one replica (req/s)" in texts(fig)
    reps = pd.DataFrame({"replica": [0, 1], "completed": [10, 11], "output_throughput": [5.0, 6.0],
                         "p99_ttft_ms": [1.0, 2.0]})
    plots.save_figure(plots.replica_balance(reps, title="x"), tmp_path / "reps")
    # every request refused at every rate tried: no latency to plot; the figure still saves (its
    # log x axis once took its limits from the SLO line alone, [-0.055, 0.055], and failed)
    refused = pd.DataFrame({"candidate": ["a"], "rate_rps": [0.05], "passed": [False],
                            "p99_ttft_ms": [np.nan], "p99_itl_ms": [np.nan]})
    fig = plots.search_curves(refused, slo_ttft_ms=2000, slo_itl_ms=100)
    notes = [t.get_text() for ax in fig.axes[:2] for t in ax.texts]
    assert notes == ["nothing measured: no request completed\nat any rate tried (all refused?)"] * 2
    assert all(ax.get_xlim()[0] > 0 for ax in fig.axes[:2])
    plots.save_figure(fig, tmp_path / "refused")


def test_itl_gaps_are_per_request() -> None:
    tokens = pd.DataFrame({"req_id": [1, 0, 1, 0, 0], "t_s": [0.5, 0.0, 0.7, 0.1, 0.4]})
    # request 0: 0.0 -> 0.1 -> 0.4 gives 0.1, 0.3; request 1: 0.5 -> 0.7 gives 0.2
    assert sorted(np.round(runplots.itl_s(tokens), 9)) == [0.1, 0.2, 0.3]


def requests_frame(rows: list[tuple[int, float, float, float]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["req_id", "first_scheduled_s", "first_token_s", "finished_s"]).assign(
        replica=0, status="finished")


def test_static_batch_holds_slots_until_its_last_request_returns() -> None:
    # A batch of 2 starts at t=0; request 0 produces its last token at 1.0, request 1 at 3.0; both return at 3.0.
    # Request 2 starts at 3.0 and refills slot 0 (lowest free).
    req = requests_frame([(0, 0.0, 0.1, 3.0), (1, 0.0, 0.1, 3.0), (2, 3.0, 3.1, 4.0)])
    tokens = pd.DataFrame({"req_id": [0, 0, 1, 1, 2], "t_s": [0.1, 1.0, 0.1, 3.0, 4.0]})
    iv = runplots.slot_intervals(req, tokens, holds_until_batch_end=True).set_index("req_id")
    assert iv.loc[0, "done_s"] == 1.0 and iv.loc[0, "held_until_s"] == 3.0     # 2 s held idle
    assert list(iv["slot"]) == [0, 1, 0]


def test_continuous_batching_refills_a_freed_slot_at_once() -> None:
    req = requests_frame([(0, 0.0, 0.1, 1.0), (1, 0.0, 0.1, 3.0), (2, 1.0, 1.1, 2.0), (3, 1.5, 1.6, 2.5)])
    iv = runplots.slot_intervals(req, holds_until_batch_end=False).set_index("req_id")
    assert list(iv["slot"]) == [0, 1, 0, 2]                  # 2 takes 0's slot at t=1; 3 needs a third slot
    assert (iv["held_until_s"] == iv["done_s"]).all()        # nothing is held after its last token


def small_run(tmp_path: Path, kind: str, name: str):
    from sim.run.config import workload_from_dict
    from sim.results.folder import write_run
    from sim.run.runner import run_workload
    policy = {"kind": kind, "batch_size": 4} if kind == "static" else {"kind": kind, "max_num_seqs": 4}
    cfg = workload_from_dict({"name": name, "seed": 2, "num_requests": 24, "arrivals": {"kind": "poisson", "rate": 8.0},
                              "lengths": {"kind": "uniform", "prompt_min": 16, "prompt_max": 128, "output_min": 4,
                                          "output_max": 32}, "policy": policy, "slo": {"ttft_ms": 500}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_workload(cfg, num_replicas=2 if kind == "vllm" else 1, router="least_requests")
    return result, write_run(result, tmp_path / name)


def test_run_figures_on_real_runs(tmp_path: Path) -> None:
    static, _ = small_run(tmp_path, "static", "static")
    vllm, _ = small_run(tmp_path, "vllm", "vllm")
    fig = runplots.slot_occupancy({"static": (static.requests, static.tokens, "static"),
                                   "vllm": (vllm.requests, vllm.tokens, "vllm")}, max_requests=10)
    assert "of held slot-time is idle" in fig.axes[0].get_title()        # static keeps finished slots
    assert "idle" not in fig.axes[1].get_title()                         # continuous batching refills them
    fig = runplots.run_timeline(vllm.steps, title="t")
    assert [ax.get_ylabel() for ax in fig.axes] == ["tokens computed\nper second",
                                                    "requests\n(mean over steps;\nwaiting: at each step's end)",
                                                    "KV cache used\n(% of blocks)"]
    fig = runplots.latency_cdfs({"a": (vllm.requests, vllm.tokens)}, slo_ttft_ms=500)
    assert "time to first token (ms)" in texts(fig)


def test_report_regenerates_a_run_dir_from_files_alone(tmp_path: Path) -> None:
    _, run_dir = small_run(tmp_path, "vllm", "fleet")
    written = regenerate(run_dir)
    names = {p.name for p in written}
    assert {"report.md", "report.html", "run_cdf.png", "run_timeline.svg", "replicas.png"} <= names
    html = (run_dir / "report.html").read_text()
    assert "data:image/png;base64," in html and "Per replica" in html
    md = (run_dir / "report.md").read_text()
    for rel in [line.split("](")[1].split(")")[0] for line in md.splitlines() if line.startswith("![")]:
        assert (run_dir / rel).is_file()


def test_report_of_an_unknown_directory_says_what_it_expected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a sweep, plan or run directory"):
        regenerate(tmp_path)


def test_a_cdf_draws_at_most_ecdf_points_steps_each_exact() -> None:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    values = np.arange(100_000, 0, -1, dtype=float)        # 100,000 .. 1 ms, unsorted
    assert runplots._ecdf(ax, values, "x", "C0") == 100_000   # the count is of every value
    x, y = ax.lines[0].get_data()
    assert len(x) == runplots.ECDF_POINTS
    # sorted, rank r holds r + 1 ms at fraction (r + 1) / 100,000: every drawn step is on the true
    # CDF, and the smallest and largest values are drawn
    assert x[0] == 1.0 and y[0] == 1e-5 and x[-1] == 100_000.0 and y[-1] == 1.0
    np.testing.assert_allclose(y * 100_000, x, rtol=1e-12)
    # fewer values than that: every one
    ax.clear()
    runplots._ecdf(ax, np.array([3.0, 1.0, 2.0]), "x", "C0")
    assert ax.lines[0].get_data()[0].tolist() == [1.0, 2.0, 3.0]
    plt.close(fig)


def test_report_of_a_run_without_steps(tmp_path: Path, capsys) -> None:
    # every request longer than max_model_len 8: all refused, no step ran; the report says so in its
    # table and CDF titles and has no time line (it used to fail as "damaged" and leave figures/ half done)
    from sim.cli import main
    (tmp_path / "w.yaml").write_text("name: t\nnum_requests: 5\narrivals: {kind: poisson, rate: 4}\n"
                                     "lengths: {kind: fixed, prompt_tokens: 10, output_tokens: 5}\n"
                                     "server: {max_model_len: 8}\n")
    rc = main(["run", str(tmp_path / "w.yaml"), "--out", str(tmp_path / "o"), "--quiet", "--report"])
    err = capsys.readouterr().err
    assert rc == 0 and "5 of 5 requests were rejected" in err, err
    assert (tmp_path / "o" / "report.html").is_file()
    assert sorted(p.stem for p in (tmp_path / "o" / "figures").glob("*.png")) == ["run_cdf", "run_slots"]


def test_a_log_axis_within_one_decade_gets_readable_ticks() -> None:
    # ITL from 9 to 15.3 ms on a log axis: ticks at 1-9 x 10^k gave only 9 and 10 to read the bulk
    # of the curve by; under a decade the ticks are evenly spaced numbers instead
    import matplotlib.pyplot as plt
    fig, (narrow, wide) = plt.subplots(1, 2)
    narrow.plot([9.0, 15.3], [0.0, 1.0])
    narrow.set_xscale("log")
    wide.plot([1.0, 1000.0], [0.0, 1.0])
    wide.set_xscale("log")
    plots.plain_log_ticks(fig)
    fig.canvas.draw()
    ticks = [t for t in narrow.get_xticks() if 9.0 <= t <= 15.3]
    assert len(ticks) >= 4 and all(t == round(t, 1) for t in ticks)           # e.g. 10.5, 12, 13.5, 15
    assert {1.0, 10.0, 100.0, 1000.0} <= set(wide.get_xticks())               # decades: the log ticks stay
    plt.close(fig)
