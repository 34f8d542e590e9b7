"""Capacity planning: SLO judgement, monotone capacity and replica counts, the plan report, bad plan files."""

from __future__ import annotations

import dataclasses
import json

import math
import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml
from hypothesis import given, settings, strategies as st
from conftest import ROOT

from reports.experiments.capacity import (SearchSettings, find_capacity, judge, queue_trend, replicas_for, sweep_capacity,
                               utilization)
from reports.experiments.plan import CandidateTask, check_queue, plan_candidate, run_plan_file, simulate
from reports.experiments.planspec import Verify, parse_plan, spec_summary
from reports.presentation.report import regenerate
from sim.cli import main
from sim.cost.presets import GPU_PRESETS
from sim.run.config import ConfigError, Slo

WORKLOAD = {"name": "tiny", "seed": 5, "num_requests": 80, "arrivals": {"kind": "poisson", "rate": 4.0},
            "lengths": {"kind": "uniform", "prompt_min": 64, "prompt_max": 1024, "output_min": 16, "output_max": 128},
            "policy": {"kind": "vllm"}}
CANDIDATES = [{"name": "h100", "profile": {"gpu": "h100-sxm"}, "price_per_gpu_hour": 3.0},
              {"name": "a100", "profile": {"gpu": "a100-80gb"}, "price_per_gpu_hour": 1.8}]
PLAN = {"base": "tiny.yaml", "target_rate": 60, "slo": {"ttft_ms": 500, "itl_ms": 60},
        "search": {"num_requests": 80, "max_runs": 9, "rel_tol": 0.1},
        "verify": {"min_duration_s": 1, "min_requests": 120, "max_extra_replicas": 2},
        "policies": ["vllm", {"kind": "sarathi", "max_num_batched_tokens": 512}], "candidates": CANDIDATES}


def write_plan(tmp_path: Path, **changes) -> Path:
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(WORKLOAD))
    plan = {**PLAN, **changes}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in plan.items() if v is not None}))
    return path


def test_judge_counts_attainment_as_stated() -> None:
    # 4 requests: TTFTs 0.1, 0.2, 0.9 s and one rejected; ITL gaps 10, 10, 50, 10 ms.
    requests = pd.DataFrame({"req_id": [0, 1, 2, 3], "status": ["finished"] * 3 + ["rejected"],
                             "arrival_s": [0.0, 0.1, 0.2, 0.3], "first_scheduled_s": [0.0, 0.1, 0.2, float("nan")],
                             "ttft_s": [0.1, 0.2, 0.9, float("nan")], "tpot_s": [0.01, 0.02, 0.03, float("nan")],
                             "output_tokens": [3, 2, 2, 5]})
    tokens = pd.DataFrame({"req_id": [0, 0, 0, 1, 1, 2, 2], "t_s": [0.1, 0.11, 0.12, 0.3, 0.35, 1.1, 1.11]})
    v = judge(requests, tokens, Slo(ttft_ms=500, itl_ms=20, attainment=0.5))
    assert v["ttft_attainment"] == 2 / 4               # the rejected request is a miss
    assert v["itl_attainment"] == 3 / 4                # 10, 10, 10 ms within 20; 50 ms not
    assert v["passed"] and v["stable"]
    v = judge(requests, tokens, Slo(ttft_ms=500, attainment=0.99))
    assert not v["passed"] and "TTFT within 500 ms for 50.0% < 99%" in v["reasons"][0]


@settings(max_examples=60, deadline=None)
@given(threshold=st.floats(0.1, 500.0), tighter=st.floats(0.05, 1.0), start=st.floats(0.05, 1000.0))
def test_bisection_on_a_monotone_system(threshold: float, tighter: float, start: float) -> None:
    s = SearchSettings(min_rate=0.05, max_rate=2000.0, rel_tol=0.05, max_runs=40)
    cap, trials, note = find_capacity(lambda r: {"passed": r <= threshold}, s, start)
    assert cap <= threshold and cap >= threshold / 1.05 - 1e-9, note
    tight, _, _ = find_capacity(lambda r: {"passed": r <= threshold * tighter}, s, start)
    assert tight <= cap + 1e-9                        # a tighter SLO never raises capacity


@given(capacity=st.floats(0.01, 100.0), target=st.floats(0.1, 1000.0), more=st.floats(0.0, 1000.0),
       u=st.floats(0.3, 1.0))
def test_replicas_cover_the_target_and_never_shrink_as_it_grows(capacity: float, target: float, more: float,
                                                                 u: float) -> None:
    n = replicas_for(target, capacity, u)
    assert n * capacity * u >= target * (1 - 1e-9) and (n - 1) * capacity * u < target
    assert utilization(target, capacity, n) <= u * (1 + 1e-9)
    assert replicas_for(target + more, capacity, u) >= n and replicas_for(target, capacity) <= n
    assert replicas_for(target, 0.0) is None


def test_headroom_by_hand() -> None:
    # capacity 10 req/s per replica, target 19 req/s. At 100%: ceil(19 / 10) = 2 replicas running at
    # 19 / (2 x 10) = 95%. At 80%: ceil(19 / (10 x 0.8)) = ceil(2.375) = 3 replicas at 19 / 30 = 63.3%.
    assert replicas_for(19, 10) == 2 and utilization(19, 10, 2) == pytest.approx(0.95)
    assert replicas_for(19, 10, 0.8) == 3 and utilization(19, 10, 3) == pytest.approx(19 / 30)
    # target 16: 16 / (10 x 0.8) = 2.0 exactly: 2 replicas at exactly 80% (the target is inclusive).
    assert replicas_for(16, 10, 0.8) == 2 and utilization(16, 10, 2) == pytest.approx(0.8)


def test_queue_trend_by_hand() -> None:
    """Arrivals at t = 0..9 s: the span is 9 s, so the middle third is 3 <= t < 6 and the last 6 <= t <= 9."""
    t = [0.0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    # Growing: every arrival waits 0.1 s longer per s -- a fleet offered 1.1x what it serves.
    growing = queue_trend(t, [0.1 * x for x in t])
    assert growing["queue_slope"] == pytest.approx(0.1)
    assert growing["queue_middle_ms"] == pytest.approx(400)        # (0.3 + 0.4 + 0.5) / 3 s
    assert growing["queue_last_ms"] == pytest.approx(750)          # (0.6 + 0.7 + 0.8 + 0.9) / 4 s
    # Flat once warm: a warm-up climb in the first third, then high, low, low, high in the last third:
    # deviations from t = 7.5 are -1.5, -0.5, 0.5, 1.5 and from the mean 0.2 s are +0.1, -0.1, -0.1, +0.1:
    # sum of products -0.15 + 0.05 - 0.05 + 0.15 = 0, so the slope is 0.
    flat = queue_trend(t, [0.0, 0.1, 0.2, 0.3, 0.1, 0.3, 0.3, 0.1, 0.1, 0.3])
    assert flat["queue_slope"] == pytest.approx(0.0, abs=1e-12)
    assert flat["queue_middle_ms"] == pytest.approx(700 / 3) and flat["queue_last_ms"] == pytest.approx(200)
    # A rejected request has no queue delay: it is left out (of the last third here: 0.6, 0.8, 0.9 remain).
    partial = queue_trend(t, [0.1 * x for x in t[:7]] + [float("nan"), 0.8, 0.9])
    assert partial["queue_slope"] == pytest.approx(0.1) and partial["queue_last_ms"] == pytest.approx(2300 / 3)


def test_a_growing_queue_fails_verification() -> None:
    t = [0.0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    requests = pd.DataFrame({"arrival_s": t, "queue_s": [0.011 * x for x in t]})   # slope 11 ms per s
    ok = {"passed": True, "reasons": []}
    failed = check_queue(ok, requests, max_slope=0.01)
    assert not failed["passed"] and not failed["queue_stable"]
    assert failed["reasons"] == ["queue growing: the wait rises 11 ms per s of traffic (> 10)"]
    assert check_queue(ok, requests, max_slope=0.012)["passed"]
    assert not check_queue({"passed": False, "reasons": ["TTFT"]}, requests, max_slope=0.012)["passed"]


def test_default_headroom_adds_replicas_where_capacity_sizing_runs_at_95_percent(tmp_path: Path) -> None:
    """Measure one replica's capacity c on the tiny workload, then ask for 0.95 x 2 x c req/s.
    Sized at capacity: ceil(1.9 c / c) = 2 replicas at 1.9 / 2 = 95%. With the default target
    utilisation 0.8: ceil(1.9 c / 0.8 c) = ceil(2.375) = 3 replicas at 1.9 / 3 = 63.3%."""
    spec = parse_plan(write_plan(tmp_path, candidates=CANDIDATES[:1], policies=["vllm"]), out=tmp_path / "out")
    assert spec.target_utilization == 0.8                            # the default

    def plan_at(target_rate: float, target_utilization: float) -> dict:
        verify = Verify(min_duration_s=0.01, min_requests=40, max_extra_replicas=0)   # 40 requests
        return plan_candidate(CandidateTask(spec.candidates[0], str(spec.base_path), str(spec.base_path.parent),
                                            target_rate, spec.slo, spec.router, spec.search, verify,
                                            str(tmp_path / "runs"), target_utilization))

    c = plan_at(1.0, 1.0)["capacity_rps"]
    assert c > 1.0
    today = plan_at(0.95 * 2 * c, 1.0)
    assert today["capacity_rps"] == c and today["replicas_estimate"] == 2
    assert today["utilization"] == pytest.approx(0.95)
    headroom = plan_at(0.95 * 2 * c, spec.target_utilization)
    assert headroom["replicas_estimate"] == headroom["replicas"] == 3
    assert headroom["utilization"] == pytest.approx(1.9 / 3)
    attempt = headroom["attempts"][0]
    assert attempt["num_requests"] == 40 and {"queue_slope", "queue_stable", "queue_last_ms"} <= set(attempt)
    # The same 40 requests, served by 2 or 3 replicas: the same tokens at the same rate, so $/Mtok
    # scales as $/hour (3 / 2), whatever each fleet's drain after the last arrival
    assert headroom["served_output_tokens_per_s"] == today["served_output_tokens_per_s"]
    assert headroom["cost_per_hour"] / today["cost_per_hour"] == 3 / 2
    assert headroom["cost_per_mtok"] / today["cost_per_mtok"] == pytest.approx(3 / 2, rel=1e-12)


def test_sweep_capacity_needs_every_lower_rate_to_pass() -> None:
    # vllm passes at 1 and 2, fails at 4 (p99 TTFT 900 > 500) and passes again at 8 (a fluke): capacity 2.
    table = pd.DataFrame({"policy.kind": ["vllm"] * 4 + ["orca"] * 4, "arrivals.rate": [1, 2, 4, 8] * 2,
                          "p99_ttft_ms": [100, 200, 900, 300, 600, 700, 800, 900], "offered_rate": [1, 2, 4, 8] * 2})
    caps = sweep_capacity(table, rate_col="arrivals.rate", group_cols=["policy.kind"], slo_ms={"ttft": 500})
    assert caps.set_index("policy.kind")["max_rate"].to_dict() == {"vllm": 2, "orca": pytest.approx(float("nan"),
                                                                                                  nan_ok=True)}


def test_tighter_slos_never_raise_simulated_capacity(tmp_path: Path) -> None:
    spec = parse_plan(write_plan(tmp_path), out=tmp_path / "out")
    cand = spec.candidates[0]
    s = SearchSettings(num_requests=80, rel_tol=0.1, max_runs=10)
    caps = []
    for slo in (Slo(ttft_ms=2000, itl_ms=200), Slo(ttft_ms=500, itl_ms=60), Slo(ttft_ms=150, itl_ms=30)):
        task = CandidateTask(cand, str(spec.base_path), str(spec.base_path.parent), 10.0, slo, "round_robin", s,
                             Verify(), str(tmp_path / "runs"), 1.0)
        cap, _, _ = find_capacity(lambda r, t=task: simulate(t, r, s.num_requests)[1], s, start_rate=8.0)
        caps.append(cap)
    assert caps == sorted(caps, reverse=True) and caps[0] > 0, caps


def test_plan_writes_a_ranked_self_contained_report(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")          # a pipe gets plain text even where colour is forced
    out = tmp_path / "out"
    assert main(["plan", str(write_plan(tmp_path)), "--out", str(out), "-j", "1", "--quiet"]) == 0
    printed = capsys.readouterr().out
    ranked = pd.read_csv(out / "ranked.csv")
    assert len(ranked) == 4 and ranked["meets_slo"].any()
    ok = ranked[ranked["meets_slo"]]
    assert list(ok["cost_per_hour"]) == sorted(ok["cost_per_hour"])
    for row in ok.itertuples():
        price = 3.0 if row.hardware == "h100" else 1.8
        assert row.cost_per_hour == pytest.approx(row.replicas * price)
        assert row.replicas >= math.ceil(60 / row.capacity_rps - 1e-9)
    html = (out / "report.html").read_text()
    assert "Recommendation" in html and "Candidates, ranked" in html and "<table>" in html
    assert html.count("data:image/png;base64,") >= 3 and "src=\"figures" not in html
    assert "Target utilisation 80%" in html and "queue stable" in html
    # The terminal: the answer first, then the ranked table as a Markdown table, then the files.
    best = ranked[ranked["meets_slo"]].iloc[0]
    assert printed.splitlines()[1].startswith(f"Recommended: {best.replicas} x {best.hardware} running "
                                              f"{best.policy}: ${best.cost_per_hour:,.2f}/h")
    assert f"at {100 * 60 / (best.replicas * best.capacity_rps):.0f}% utilisation" in printed
    assert "| # | candidate" in printed and f"report: {out / 'report.html'}" in printed
    assert "\x1b" not in printed and not any("\u2500" <= ch <= "\u257f" for ch in printed)   # no escapes, frames
    assert "analytic-roofline" in html and "Definitions" in html
    # every candidate states its profile's error: a preset's held-out error on its GPU (h100-sxm TP1
    # in the public vLLM table), as a capacity band in the ranked table
    assert ranked["profile_error_pct"].notna().any() and "capacity band (profile error)" in html
    md = (out / "report.md").read_text()
    images = [line.split("](")[1].split(")")[0] for line in md.splitlines() if line.startswith("![")]
    assert images and all((out / rel).is_file() for rel in images)
    (out / "report.html").unlink()
    assert out / "report.html" in regenerate(out)     # `sim report` rebuilds it from the files alone


def test_plan_report_opens_in_headless_chromium(tmp_path: Path) -> None:
    chromium = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if os.path.exists(p)), None)
    if chromium is None:
        if os.environ.get("BATCHSIM_REQUIRE_CHROMIUM") == "1":      # .ci/run: a real dependency
            pytest.fail("BATCHSIM_REQUIRE_CHROMIUM=1 but /usr/bin/chromium is not installed")
        pytest.skip("/usr/bin/chromium is not installed")
    out = run_plan_file(write_plan(tmp_path, candidates=CANDIDATES[:1], policies=["vllm"]), out=tmp_path / "out",
                        jobs=1, progress=False)
    regenerate(out)
    shot = tmp_path / "shot.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([chromium, *flags, "--enable-logging=stderr", "--dump-dom", (out / "report.html").as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    page_errors = [line for line in dom.stderr.splitlines()
                   if "CONSOLE" in line or "Uncaught" in line or "Failed to load resource" in line]
    assert not page_errors, page_errors
    assert "Candidates, ranked" in dom.stdout and dom.stdout.count("<img") >= 3
    shot_run = subprocess.run([chromium, *flags, f"--screenshot={shot}", "--window-size=1280,2000",
                               (out / "report.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert shot_run.returncode == 0 and shot.stat().st_size > 10_000, shot_run.stderr[-2000:]


@pytest.mark.parametrize("changes, message", [
    ({"target_rate": None}, "field 'target_rate' is missing"),
    ({"target_rate": -5}, "field 'target_rate' must be a finite number > 0, got -5"),
    ({"target_rate": float("nan")}, "field 'target_rate' must be a finite number > 0, got nan"),
    ({"target_rate": float("inf")}, "field 'target_rate' must be a finite number > 0, got inf"),
    ({"verify": {"min_duration_s": float("inf")}}, "field 'verify.min_duration_s' must be a finite number"),
    ({"candidates": [{"profile": {"gpu": "h100-sxm"}, "price_per_gpu_hour": float("nan")}]},
     "candidates\\[0\\].price_per_gpu_hour' must be a finite number"),
    ({"candidates": [{"profile": {"gpu": "h100-sxm"}, "price_per_gpu_hour": 2, "server": [1, 2]}]},
     "candidates\\[0\\].server' must be a mapping of server fields, got \\[1, 2\\]"),
    ({"target_utilization": 1e-9}, "field 'target_utilization' must be in \\[0.05, 1\\], got 1e-09"),
    ({"out": 5}, "field 'out' must be a folder path, got 5"),
    ({"slo": {"ttft_ms": 500, "p99": 1}}, "field 'slo.p99' is unknown"),
    ({"slo": {"attainment": 0.9}}, "field 'slo' sets no threshold"),
    ({"slo": {"ttft_ms": 500, "attainment": 1.5}}, "field 'slo.attainment' must be in"),
    ({"candidates": []}, "field 'candidates' must be a non-empty list"),
    ({"candidates": [{"profile": {"path": str(ROOT / "calibrate" / "profiles" / "cpu" / "tiny-llama" / "float32.yaml")}}]},
     "field 'candidates\\[0\\].price_per_gpu_hour' is missing and GPU 'AMD EPYC' has no preset price"),
    ({"candidates": [{"profile": {"gpu": "h100-sxm"}, "price_per_gpu_hour": 2, "cost": 1}]},
     "candidates\\[0\\].cost' is unknown"),
    ({"candidates": [{"profile": {"gpu": "tpu-v9"}, "price_per_gpu_hour": 2}]}, "candidates\\[0\\], policy vllm"),
    ({"policies": [{"kind": "sarathi", "chunk": 512}]}, "unknown field 'policy.chunk'"),
    ({"search": {"num_requests": 0}}, "field 'search.num_requests' must be an integer >= 1"),
    ({"router": "random"}, "field 'router' must be one of"),
    ({"base": "missing.yaml"}, "field 'base' names 'missing.yaml', which does not exist"),
    ({"set": {"arrivals.max_concurrency": 8}}, "field 'base' caps concurrency"),
    ({"set": {"arrivals.kind": "sessions"}}, "field 'base' has arrivals.kind sessions: each session sends its next "
                                            "turn after its reply"),
    ({"policies": []}, "field 'policies' must be a non-empty list of policies, got \\[\\]"),
    ({"candidates": [{"profile": {"gpu": "h100-sxm"}, "price_per_gpu_hour": 2, "policies": []}]},
     "field 'candidates\\[0\\].policies' must be a non-empty list"),
    ({"name": ["a", "b"]}, "field 'name' must be a text, got \\['a', 'b'\\]"),
    # found before any search, not as every candidate's failure after them
    ({"target_rate": 1e9}, "field 'target_rate' must be in \\[1e-06, 1e\\+06\\] requests per second, got 1e\\+09"),
    ({"search": {"max_rate": 1e9}}, "field 'search.max_rate' must be in \\[1e-06, 1e\\+06\\]"),
    ({"search": {"min_rate": 1e-9}}, "field 'search.min_rate' must be in"),
    ({"search": {"rel_tol": 1e9}}, "field 'search.rel_tol' must be in \\(0, 1\\], got 1e\\+09"),
    ({"search": {"max_backlog_fraction": 50}}, "field 'search.max_backlog_fraction' must be in \\(0, 1\\]"),
    ({"verify": {"min_requests": 10**12}}, "field 'verify.min_requests' asks for about 1e\\+12 requests"),
    ({"search": {"num_requests": 10**12}}, "field 'search.num_requests' asks for about 1e\\+12 requests"),
])
def test_bad_plan_files_name_the_field(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_plan(write_plan(tmp_path, **changes))
    assert "plan.yaml" in str(info.value)


def test_set_overrides_the_plan_and_the_base_traffic(tmp_path: Path) -> None:
    spec = parse_plan(write_plan(tmp_path), overrides={"target_rate": 80, "target_utilization": 0.7, "seed": 9,
                                                       "verify.min_duration_s": 30, "server.max_model_len": 4096})
    assert spec.target_rate == 80 and spec.target_utilization == 0.7 and spec.verify.min_duration_s == 30
    assert all(c.raw["server"]["max_model_len"] == 4096 and c.raw["seed"] == 9 for c in spec.candidates)
    # Verification traffic: max(min_requests 120, ceil(30 s x 80 req/s) = 2400) = 2400 requests.
    assert spec.verify.num_requests(spec.target_rate) == 2400


@pytest.mark.parametrize("overrides, message", [
    ({"policy.max_num_seqs": 64}, "--set policy.max_num_seqs: the plan sets 'policy' itself"),
    ({"arrivals.rate": 5}, "--set arrivals.rate: the plan sets 'arrivals.rate' itself.*--set target_rate=N"),
    ({"num_requests": 5}, "--set num_requests: the plan sets 'num_requests' itself"),
    ({"candidates": []}, "--set candidates: 'candidates' can only be edited in the file"),
    ({"target_utilization": 1.2}, "field 'target_utilization' must be in \\[0.05, 1\\], got 1.2"),
    ({"target_utilization": 0}, "field 'target_utilization' must be a finite number > 0"),
    ({"verify.num_requests_per_replica": 400}, "field 'verify.num_requests_per_replica' is unknown; fix: use one "
                                               "of: min_duration_s, min_requests"),
])
def test_bad_overrides_of_a_plan_name_the_fix(tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_plan(write_plan(tmp_path), overrides=overrides)


def test_a_plan_for_another_question_goes_next_to_the_first(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = write_plan(tmp_path)
    spec = parse_plan(path)
    assert spec.out == Path("runs/plan") and spec.kept_out_of is None
    spec.out.mkdir(parents=True)
    (spec.out / "plan.json").write_text(json.dumps({"plan": spec_summary(spec), "results": []}))
    assert parse_plan(path).out == Path("runs/plan")                 # the same question: its folder
    what_if = parse_plan(path, overrides={"target_rate": 80})
    assert what_if.out == Path("runs/plan-2") and what_if.kept_out_of == Path("runs/plan")
    with pytest.raises(ConfigError, match="--out runs/plan holds a plan for another question"):
        parse_plan(path, out=Path("runs/plan"), overrides={"target_rate": 80})


def test_a_plans_own_set_cannot_touch_what_the_plan_decides(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="field 'set.policy': the plan sets 'policy' itself"):
        parse_plan(write_plan(tmp_path, set={"policy": "sarathi"}))


def test_example_files_parse() -> None:
    root = Path(__file__).resolve().parents[2] / "workloads"
    spec = parse_plan(root / "plan_azure_conv.yaml")
    assert spec.target_rate == 50 and len(spec.candidates) == 8 and spec.target_utilization == 0.8
    assert spec.verify.num_requests(50) == 9000                    # max(2000, 180 s x 50 req/s)
    from reports.experiments.spec import expand, parse_sweep
    assert len(expand(parse_sweep(root / "sweep_sarathi_knee.yaml"))) == 6 * 5



def test_capacity_band_and_close_calls_by_hand() -> None:
    """Capacity 10 req/s from a profile 6% off: 9.4-10.6. Two verified fleets at
    $9.00 and $9.90 per hour differ by 10%, less than 6% + 6% = 12%: a close
    call; at $9.00 and $11.00 (22%) they do not."""
    from reports.presentation.planreport import capacity_band, close_calls
    assert capacity_band(10.0, 6.0) == "9.4-10.6 (±6%)"
    assert capacity_band(10.0, None) == "unchecked profile"
    ranked = pd.DataFrame({"candidate": ["a", "b"], "meets_slo": [True, True], "cost_per_hour": [9.0, 9.9],
                           "profile_error_pct": [6.0, 6.0]})
    (warning,) = close_calls(ranked)
    assert warning.startswith("a and b differ by 10% in cost per hour")
    assert close_calls(ranked.assign(cost_per_hour=[9.0, 11.0])) == []


def test_plan_warnings_by_hand() -> None:
    """A fleet verified on 10 s of traffic with p99 E2E 5 s: 10 < 5 x 5 = 25 s, too short; the trace held
    100 of the 200 requests asked for; and the 2 replicas sized for 80% failed, so it took 3."""
    from reports.presentation.planreport import plan_warnings
    first = {"reasons": ["TTFT within 500 ms for 90.0% < 99%"]}
    last = {"reasons": [], "num_requests": 100, "arrival_span_s": 10.0, "p99_e2el_ms": 5000.0}
    result = {"name": "x", "hardware": "h", "policy": "vllm", "capacity_rps": 4.0, "replicas_estimate": 2,
              "replicas": 3, "verified": True, "attempts": [first, last]}
    assert plan_warnings([result], {"target_utilization": 0.8, "verify_requests": 200}) == [
        "x: the 2 replicas sized for 80% utilisation failed verification (TTFT within 500 ms for 90.0% < 99%) "
        "and it took 3: its capacity estimate is optimistic for this traffic.",
        "x: the base traffic holds 100 of the 200 verification requests asked for: the fleet was verified on "
        "10 s of traffic.",
        "x: verified on 10 s of traffic, under 5x the fleet's p99 E2E latency (5 s): too short to show a growing "
        "queue; raise verify.min_duration_s."]


def test_capacity_never_exceeds_what_a_saturated_replica_completes(tmp_path: Path) -> None:
    # SLOs no run can miss (a TTFT of 1e9 ms): a short trial of vllm, which admits up to 256
    # requests into its batch, shows no queue and no backlog however fast requests come, so the
    # doubling went on to max_rate. The saturation probe (every request at once) measures what one
    # replica completes per second: no rate above it passes, and the capacity stays below it.
    spec = parse_plan(write_plan(tmp_path, candidates=CANDIDATES[:1], policies=["vllm"], slo={"ttft_ms": 1e9}),
                      out=tmp_path / "out")
    verify = Verify(min_duration_s=0.01, min_requests=40, max_extra_replicas=0)
    out = plan_candidate(CandidateTask(spec.candidates[0], str(spec.base_path), str(spec.base_path.parent), 1.0,
                                       spec.slo, spec.router, spec.search, verify, str(tmp_path / "runs"), 0.8))
    saturated = out["saturation_rps"]
    assert 0 < out["capacity_rps"] <= saturated
    over = [t for t in out["trials"] if t["rate_rps"] > saturated]
    assert over and all(not t["passed"] and t["reasons"][-1].startswith("offered ") for t in over)
    assert all(t["passed"] for t in out["trials"] if t["rate_rps"] <= saturated)


def test_a_candidate_without_a_price_takes_its_gpu_presets(tmp_path: Path) -> None:
    # No price_per_gpu_hour: the GPU preset's assumed price, labelled as the default in plan.json
    # and in the report's prices table; a given price is "given".
    cands = [{"name": "h200", "profile": {"gpu": "h200"}}, {"name": "a100", "profile": {"gpu": "a100-80gb"},
                                                            "price_per_gpu_hour": 1.5}]
    spec = parse_plan(write_plan(tmp_path, candidates=cands, policies=["vllm"]), out=tmp_path / "out")
    h200, a100 = spec.candidates
    assert h200.price_per_gpu_hour == GPU_PRESETS["h200"].price_per_gpu_hour
    assert h200.price_source.startswith("default: preset h200")
    assert (a100.price_per_gpu_hour, a100.price_source) == (1.5, "given")
    assert spec_summary(spec)["candidates"][0]["price_source"] == h200.price_source


def test_a_profile_files_tensor_parallel_sets_the_gpus_it_is_priced_for(tmp_path: Path) -> None:
    # A profile given by path cannot also carry tensor_parallel: the file states it. A TP-2 file
    # simulates two GPUs per replica, so a replica costs 2 x the GPU price (1 GPU before).
    shipped = yaml.safe_load((ROOT / "calibrate" / "profiles" / "cpu" / "tiny-llama" / "float32.yaml").read_text())
    (tmp_path / "tp2.yaml").write_text(yaml.safe_dump({**shipped, "tensor_parallel": 2}))
    (tmp_path / "tp1.yaml").write_text(yaml.safe_dump(shipped))
    cands = [{"name": "two", "profile": {"path": str(tmp_path / "tp2.yaml")}, "price_per_gpu_hour": 1.0},
             {"name": "one", "profile": {"path": str(tmp_path / "tp1.yaml")}, "price_per_gpu_hour": 1.0},
             {"name": "said", "profile": {"path": str(tmp_path / "tp2.yaml")}, "price_per_gpu_hour": 1.0,
              "gpus_per_replica": 4}]
    spec = parse_plan(write_plan(tmp_path, candidates=cands, policies=["vllm"]), out=tmp_path / "out")
    assert [c.gpus_per_replica for c in spec.candidates] == [2, 1, 4]


def test_a_plan_with_other_traffic_settings_is_another_question(tmp_path: Path, capsys) -> None:
    # --set seed=6 (or a server knob) changes every run of the plan: it may not land on the first
    # plan's folder (--out: refused) nor overwrite its default folder (goes to <folder>-2).
    path = write_plan(tmp_path, candidates=CANDIDATES[:1], policies=["vllm"])
    first = parse_plan(path, out=tmp_path / "out")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "plan.json").write_text(json.dumps({"plan": spec_summary(first), "results": []}))
    assert parse_plan(path, out=tmp_path / "out").out == tmp_path / "out"           # the same question
    with pytest.raises(ConfigError, match="holds a plan for another question"):
        parse_plan(path, out=tmp_path / "out", overrides={"seed": 6})       # the base has seed 5
    with pytest.raises(ConfigError, match="holds a plan for another question"):
        parse_plan(path, out=tmp_path / "out", overrides={"server.max_model_len": 4096})


def test_a_max_rate_above_ten_thousand_still_probes_within_the_rate_limit(tmp_path: Path) -> None:
    # The saturation probe offers 100 x max_rate: at max_rate 20,000 that was 2e6 req/s, past a
    # workload's 1e6 limit, and every candidate failed after its workers started. It is capped.
    spec = parse_plan(write_plan(tmp_path, candidates=CANDIDATES[:1], policies=["vllm"],
                                 search={"num_requests": 40, "max_rate": 20000, "max_runs": 3}), out=tmp_path / "out")
    verify = Verify(min_duration_s=0.01, min_requests=40, max_extra_replicas=0)
    out = plan_candidate(CandidateTask(spec.candidates[0], str(spec.base_path), str(spec.base_path.parent), 1.0,
                                       spec.slo, spec.router, spec.search, verify, str(tmp_path / "runs"), 0.8))
    assert out["saturation_rps"] > 0 and len(out["trials"]) == 2       # max_runs 3, the probe included


def test_a_search_cut_by_max_runs_says_which_way_it_was_going() -> None:
    # Doubling from 1 req/s while every run passes: 1, 2, 4 -> a lower bound, not "fails at inf".
    s = SearchSettings(max_runs=3, min_rate=0.01, max_rate=1000.0)
    cap, trials, note = find_capacity(lambda r: {"passed": True}, s, 1.0)
    assert (cap, len(trials)) == (4.0, 3)
    assert note == "stopped after 3 runs (max_runs) still passing: capacity is at least 4 req/s (raise search.max_runs)"
    # Halving from 1 while every run fails: 1, 0.5 -> min_rate 0.01 never tried; not "no rate met the SLOs".
    cap, trials, note = find_capacity(lambda r: {"passed": False}, dataclasses.replace(s, max_runs=2), 1.0)
    assert cap == 0.0 and "still failing, down to 0.5 req/s; search.min_rate 0.01 was not reached" in note


def test_an_attainment_just_below_the_target_is_not_rounded_up_to_it() -> None:
    from reports.experiments.capacity import _below
    # 395.9 of 400 = 98.975%: "99.0% < 99%" read as a contradiction; rounded down it shows the miss
    assert _below(0.98975, 0.99) == "98.9" and _below(0.95, 0.99) == "95.0"
    assert _below(0.989999, 0.99) == "98.9" and _below(0.9899999, 0.99) == "98.9"
