"""Figures say what they show, keep series order and colours fixed, keep legends off the data;
the knee and Pareto arithmetic on hand-made tables; the slot chart for every policy."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from cases import CASES
from matplotlib.colors import to_hex

from reports.experiments import knee

from reports.presentation import plots, runplots, sweepplots
from reports.presentation.runreport import describe_runs

BUDGET, RATE = "policy.max_num_batched_tokens", "arrivals.rate"
CONFIG = {"name": "azure-conv", "profile": {"model": "llama-3.1-8b", "gpu": "h100-sxm", "tensor_parallel": 1},
          "policy": {"kind": "sarathi", "max_num_seqs": 256, "max_num_batched_tokens": 512}}


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plots.plt.close("all")


def suptitle(fig) -> str:
    return fig._suptitle.get_text()


# ----------------------------------------------------------------------------- titles

def test_describe_names_workload_hardware_policy_and_rate() -> None:
    assert plots.describe(CONFIG, rates_rps=[3.75]) == ("azure-conv · llama-3.1-8b on h100-sxm · policy sarathi "
                                                        "(max_num_seqs=256, max_num_batched_tokens=512) · "
                                                        "offered 3.75 req/s")
    measured = {**CONFIG, "profile": {"path": "calibrate/profiles/x.json", "tensor_parallel": 2}}
    text = plots.describe(measured, profile_name="h200/llama-70b", num_replicas=4, rates_rps=[1.0])
    assert "profile: h200/llama-70b, TP 2 · 4 replicas" in text
    # a sweep: the swept knob and the offered rates as ranges (more than 3 values -> lo–hi)
    text = plots.describe(CONFIG, rates_rps=[8.0, 16.0, 24.0, 32.0],
                          varied={BUDGET: [256, 512, 1024, 4096], RATE: [8, 16, 24, 32]})
    assert text.endswith("policy sarathi (max_num_seqs=256); max_num_batched_tokens 256–4096 · offered 8–32 req/s")
    text = plots.describe(CONFIG, varied={"policy.kind": ["static", "vllm", "static"]})
    assert "policies static, vllm" in text


def test_describe_runs_reads_meta_and_offered_rate() -> None:
    # arrivals 0, 0.5, 1.0, 2.0 s: (4 - 1) requests / 2.0 s span = 1.5 req/s
    requests = pd.DataFrame({"arrival_s": [0.0, 0.5, 1.0, 2.0]})
    run = SimpleNamespace(meta={"config": CONFIG, "profile_name": "p", "num_replicas": 1}, requests=requests)
    assert describe_runs({"a": run}).endswith("· offered 1.5 req/s")


def test_every_sweep_figure_title_names_workload_model_gpu_and_rates() -> None:
    table = knee_table_rows()
    subtitle = plots.describe(CONFIG, rates_rps=table["offered_rate"],
                              varied={BUDGET: table[BUDGET], RATE: table[RATE]})
    limits = {"p99_ttft_ms": 1000.0, "p99_tpot_ms": 50.0}
    cells = knee.knee_cells(table, budget_col=BUDGET, rate_col=RATE, limits=limits)
    kt = knee.knee_table(cells, budget_col=BUDGET, rate_col=RATE)
    points = knee.pareto_points(table, grid_cols=[BUDGET, RATE], num_gpus=1)
    figs = [sweepplots.latency_throughput(table, rate_col=RATE, group_cols=[BUDGET], limits=limits, subtitle=subtitle),
            sweepplots.ttft_itl_tradeoff(table, budget_col=BUDGET, group_cols=[RATE], limits=limits, subtitle=subtitle),
            sweepplots.metric_vs_param(table, param_col=BUDGET, group_cols=[RATE], limits=limits, subtitle=subtitle),
            sweepplots.knee_grid(cells, kt, budget_col=BUDGET, rate_col=RATE, limits=limits, headline="h",
                                 subtitle=subtitle),
            sweepplots.pareto(points, knee.pareto_frontier(points), group_cols=[BUDGET], label_cols=[BUDGET, RATE],
                              subtitle=subtitle)]
    for fig in figs:
        title = suptitle(fig).replace("\n", " ")
        for part in ("azure-conv", "llama-3.1-8b", "h100-sxm", "sarathi", "max_num_batched_tokens 256–2048",
                     "offered 1, 2, 3 req/s"):
            assert part in title, (part, title)


# ----------------------------------------------------------------------------- series order, colours, legends

def sweep_rows() -> pd.DataFrame:
    rows = [{BUDGET: b, RATE: r, "output_throughput": 100.0 * r, "p99_ttft_ms": 10.0 * r * 4096 / b,
             "p99_itl_ms": 5 + b / 100, "mean_tpot_ms": 5 + b / 200}
            for b in (8, 16, 24, 128) for r in (1.0, 2.0, 4.0)]
    return pd.DataFrame(rows)


def legend_labels(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def line_colors(fig) -> dict[str, str]:
    legend = fig.legends[0]
    return {t.get_text(): to_hex(h.get_color() if hasattr(h, "get_color") else h.lines[0].get_color())
            for t, h in zip(legend.get_texts(), legend.legend_handles)}


def test_legend_order_is_numeric_and_colours_are_stable() -> None:
    table = sweep_rows()
    shuffled = table.sample(frac=1.0, random_state=3)            # the order workers finish in
    assert list(shuffled[BUDGET].drop_duplicates()) != [8, 16, 24, 128]
    figs = [sweepplots.latency_throughput(t, rate_col=RATE, group_cols=[BUDGET]) for t in (shuffled, table)]
    assert legend_labels(figs[0]) == ["8", "16", "24", "128"]       # not "128" before "16" (string order)
    assert line_colors(figs[0]) == line_colors(figs[1])
    # series i gets palette colour i: 8 -> tab:blue, 128 -> tab:red
    assert line_colors(figs[0])["8"] == to_hex(plots.PALETTE[0]) and line_colors(figs[0])["128"] == to_hex("tab:red")
    # the run figures of a report get the same colour per value
    colors = plots.series_colors(shuffled, [BUDGET])
    assert {k: to_hex(v) for k, v in colors.items()} == {f"max_num_batched_tokens={b}": to_hex(plots.PALETTE[i])
                                                         for i, b in enumerate((8, 16, 24, 128))}


def test_text_values_keep_their_first_listed_order() -> None:
    table = pd.DataFrame({"policy.kind": ["vllm", "static", "vllm", "orca"], "x": [1, 2, 3, 4]})
    assert [v["policy.kind"] for v, _ in plots.ordered_groups(table, ["policy.kind"])] == ["vllm", "static", "orca"]


def assert_legends_clear_of_axes(fig) -> None:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    assert legends
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            if ax.axison:
                assert not box.overlaps(ax.get_window_extent(renderer)), (legend, ax)


def test_no_legend_overlaps_a_data_area() -> None:
    table = sweep_rows()
    limits = {"p99_ttft_ms": 300.0, "p99_itl_ms": 6.0}
    points = knee.pareto_points(table, grid_cols=[BUDGET, RATE], num_gpus=2)
    cells = knee.knee_cells(table, budget_col=BUDGET, rate_col=RATE, limits=limits)
    for fig in [sweepplots.latency_throughput(table, rate_col=RATE, group_cols=[BUDGET], limits=limits),
                sweepplots.ttft_itl_tradeoff(table, budget_col=BUDGET, group_cols=[RATE], limits=limits,
                                             rate_col=RATE, recommended={1.0: 128}),
                sweepplots.metric_vs_param(table, param_col=BUDGET, group_cols=[RATE], limits=limits),
                sweepplots.pareto(points, knee.pareto_frontier(points), group_cols=[BUDGET], label_cols=[BUDGET, RATE]),
                sweepplots.knee_grid(cells, knee.knee_table(cells, budget_col=BUDGET, rate_col=RATE),
                                     budget_col=BUDGET, rate_col=RATE, limits=limits, headline="h")]:
        assert_legends_clear_of_axes(fig)
    run = small_run("vllm")
    assert_legends_clear_of_axes(runplots.latency_cdfs({"a": (run.requests, run.tokens)}, slo_ttft_ms=100))
    assert_legends_clear_of_axes(runplots.run_timeline(run.steps))
    assert_legends_clear_of_axes(runplots.slot_occupancy({"a": (run.requests, run.tokens, "vllm")}))


# ----------------------------------------------------------------------------- knee and Pareto arithmetic

def knee_table_rows() -> pd.DataFrame:
    """p99s by (rate, budget); SLO used below: p99 TTFT <= 1000 ms and p99 TPOT <= 50 ms."""
    rows = [  # rate, budget, ttft, tpot
        (1, 256, 900, 20), (1, 512, 600, 30), (1, 1024, 400, 45), (1, 2048, 300, 55),
        (2, 256, 5000, 20), (2, 512, 1500, 30), (2, 1024, 500, 49), (2, 1024, 1100, 49), (2, 2048, 700, 70),
        (3, 256, 9000, 20), (3, 512, 4000, 30), (3, 1024, 2000, 50), (3, 2048, 1800, 80)]
    table = pd.DataFrame(rows, columns=[RATE, BUDGET, "p99_ttft_ms", "p99_tpot_ms"])
    return table.assign(offered_rate=table[RATE].astype(float), output_throughput=100.0 * table[RATE],
                        p99_itl_ms=table["p99_tpot_ms"], mean_tpot_ms=table["p99_tpot_ms"] / 2)


def test_knee_rule_on_a_hand_made_table() -> None:
    limits = knee.slo_limits({"ttft_ms": 1000, "tpot_ms": 50, "e2el_ms": None}, knee_table_rows().columns)
    assert limits == {"p99_ttft_ms": 1000.0, "p99_tpot_ms": 50.0}
    cells = knee.knee_cells(knee_table_rows(), budget_col=BUDGET, rate_col=RATE, limits=limits)
    kt = knee.knee_table(cells, budget_col=BUDGET, rate_col=RATE).set_index("rate")
    # rate 1: 256 (900, 20), 512 (600, 30), 1024 (400, 45) meet; 2048 fails TPOT 55 > 50.
    #   lowest p99 TTFT among them: 1024 (400 ms)
    assert kt.loc[1, "meeting"] == [256, 512, 1024] and kt.loc[1, "recommended"] == 1024
    # rate 2: 1024's two repetitions have p99 TTFT 500 and 1100: mean 800 <= 1000 meets (one repetition alone
    #   would not); 256 and 512 miss TTFT (5000, 1500), 2048 misses TPOT (70)
    assert kt.loc[2, "meeting"] == [1024] and kt.loc[2, "p99_ttft_ms"] == 800
    # rate 3: 1024 has TPOT 50 <= 50 but TTFT 2000 > 1000; nothing meets
    assert kt.loc[3, "meeting"] == [] and np.isnan(kt.loc[3, "recommended"])
    assert knee.budget_range(kt.loc[1, "meeting"], kt.loc[1, "budgets"]) == "256–1024"
    assert knee.budget_range([256, 1024], [256, 512, 1024, 2048]) == "256, 1024"        # not consecutive
    assert knee.knee_headline(kt.reset_index(), budget_name="budget", rate_text=lambda r: f"{r:g} req/s") == (
        "Knee at 2 req/s: budget 1024 meets the SLO there, recommended 1024; none does at 3 req/s and above")


def test_knee_ties_go_to_the_smaller_budget() -> None:
    table = pd.DataFrame({RATE: [1, 1], BUDGET: [1024, 512], "p99_ttft_ms": [400.0, 400.0], "output_throughput": 1.0})
    cells = knee.knee_cells(table, budget_col=BUDGET, rate_col=RATE, limits={"p99_ttft_ms": 1000.0})
    assert knee.knee_table(cells, budget_col=BUDGET, rate_col=RATE)["recommended"].tolist() == [512]


def test_pareto_frontier_by_hand() -> None:
    points = pd.DataFrame({"name": list("ABCDE"), knee.PER_GPU: [100.0, 200.0, 150.0, 300.0, 250.0],
                           knee.PER_USER: [50.0, 40.0, 30.0, 10.0, 10.0]})
    # From the highest x down, keep a point when its y beats every y seen so far:
    #   D (300, 10) keep, best 10; E (250, 10) 10 is not > 10, drop (D is as fast per user, with more per GPU);
    #   B (200, 40) keep, best 40; C (150, 30) drop (B beats it on both); A (100, 50) keep.
    assert knee.pareto_frontier(points)["name"].tolist() == ["A", "B", "D"]
    # F equal to B on both axes (two policies that schedule alike): both on the frontier, not one
    # of them dropped at random by the sort
    twins = pd.concat([points, pd.DataFrame({"name": ["F"], knee.PER_GPU: [200.0], knee.PER_USER: [40.0]})],
                      ignore_index=True)
    assert sorted(knee.pareto_frontier(twins)["name"].tolist()) == ["A", "B", "D", "F"]


def test_pareto_points_per_gpu_and_per_user() -> None:
    # two repetitions: output 700 and 900 tokens/s -> mean 800; over 2 replicas x TP 2 = 4 GPUs -> 200 per GPU;
    # mean TPOT 20 and 30 ms -> mean 25 ms -> 1000 / 25 = 40 tokens/s per user
    table = pd.DataFrame({BUDGET: [512, 512], "output_throughput": [700.0, 900.0], "mean_tpot_ms": [20.0, 30.0],
                          "num_replicas": [2, 2], "profile.tensor_parallel": [2, 2]})
    num_gpus = table["num_replicas"] * table["profile.tensor_parallel"]
    points = knee.pareto_points(table, grid_cols=[BUDGET], num_gpus=num_gpus)
    assert points[knee.PER_GPU].tolist() == [200.0] and points[knee.PER_USER].tolist() == [40.0]


# ----------------------------------------------------------------------------- run figures

POLICIES = {kind: case.small for kind, case in CASES.items()}    # tests/policies/cases.py


def small_run(kind: str):
    from sim.run.config import workload_from_dict
    from sim.run.runner import run_workload
    cfg = workload_from_dict({"name": kind, "seed": 2, "num_requests": 24, "arrivals": {"kind": "poisson", "rate": 8.0},
                              "lengths": {"kind": "uniform", "prompt_min": 16, "prompt_max": 128, "output_min": 4,
                                          "output_max": 32}, "policy": {"kind": kind, **POLICIES[kind]}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_workload(cfg)


def test_slot_chart_draws_every_policy() -> None:
    runs = {kind: small_run(kind) for kind in POLICIES}
    fig = runplots.slot_occupancy({k: (r.requests, r.tokens, k) for k, r in runs.items()}, max_requests=10)
    assert len(fig.axes) == len(POLICIES)
    for ax, kind in zip(fig.axes, POLICIES):
        assert ax.get_title().startswith(f"{kind}: on average")            # not "no request scheduled"
        assert len(ax.collections) >= 10                                  # a bar per request in the window


def timeline_steps(t_s: list[float], duration_s: list[float], **columns: list[int]) -> pd.DataFrame:
    return pd.DataFrame({"t_s": t_s, "duration_s": duration_s, "num_waiting": 0, "kv_used_blocks": 1,
                         "kv_total_blocks": 10, **columns}).assign(batch_size=lambda f: f["num_running"])


def test_timeline_bins_by_hand() -> None:
    steps = timeline_steps([0.0, 1.0, 1.5, 3.0], [0.5, 0.5, 0.4, 1.0], num_prefill_tokens=[100, 0, 50, 0],
                           num_decode_tokens=[0, 2, 3, 4], num_running=[1, 2, 3, 2])
    bins, width = runplots.timeline_bins(steps, 4)
    # span 0 .. 3.0 + 1.0 = 4 s in 4 bins of 1 s. Steps run in bins 0, 1, 1, 3; none in bin 2 (idle).
    assert width == 1.0
    assert bins["num_prefill_tokens"].tolist() == [100.0, 50.0, 0.0, 0.0]      # tokens / 1 s
    assert bins["num_decode_tokens"].tolist() == [0.0, 5.0, 0.0, 4.0]          # bin 1: 2 + 3
    assert bins["num_running"].tolist()[:2] == [1.0, 2.5] and np.isnan(bins["num_running"][2])
    assert bins["num_running"][3] == 2.0


def test_timeline_spreads_a_long_step_over_its_bins() -> None:
    # the second step runs 1.0 .. 3.0 s with 10 decode tokens: 5 tokens/s in bins 1 and 2 (1 s each);
    # bin 2 has no step start, but that step still runs there, so its running count (3) carries over
    steps = timeline_steps([0.0, 1.0], [0.5, 2.0], num_prefill_tokens=[100, 0], num_decode_tokens=[0, 10],
                           num_running=[1, 3])
    bins, _ = runplots.timeline_bins(steps, 3)
    assert bins["num_decode_tokens"].tolist() == [0.0, 5.0, 5.0]
    assert bins["num_prefill_tokens"].tolist() == [100.0, 0.0, 0.0]
    assert bins["num_running"].tolist() == [1.0, 3.0, 3.0]


def test_timeline_stacks_decode_under_prefill() -> None:
    fig = runplots.run_timeline(small_run("sarathi").steps)
    labels = [c.get_label() for c in fig.axes[0].collections]
    assert labels == ["decode", "prefill"]          # decode at the bottom; no padding outside static batching


def test_timeline_shows_padding_of_static_batches() -> None:
    fig = runplots.run_timeline(small_run("static").steps)
    assert [c.get_label() for c in fig.axes[0].collections][-1].startswith("padding")


def test_slot_panels_average_over_the_shared_window() -> None:
    # Run "early" holds its one slot 0-10 s; run "late" (static waiting to fill a batch) 5-10 s.
    # On the shared 0-10 s axis "late" holds a slot half the time: 0.5 of 1, not 1.0 (its average
    # used to start at its own first request, which made the idlest run look the busiest).
    def run(start: float) -> pd.DataFrame:
        return pd.DataFrame({"req_id": [0], "replica": [0], "first_scheduled_s": [start], "first_token_s": [start + 1],
                             "finished_s": [10.0]})
    fig = runplots.slot_occupancy({"early": (run(0.0), None, "vllm"), "late": (run(5.0), None, "vllm")},
                                  max_requests=10)
    assert [ax.get_title() for ax in fig.axes[:2]] == ["early: on average 1.0 of 1 slots hold a running request",
                                                       "late: on average 0.5 of 1 slots hold a running request"]
