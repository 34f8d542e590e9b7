"""Capacity planning: SLO judgement, monotone capacity and replica counts, the plan report, bad plan files."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml
from hypothesis import given, settings, strategies as st

from reports.capacity import SearchSettings, Slo, find_capacity, judge, replicas_for, sweep_capacity
from reports.plan import CandidateTask, run_plan_file, simulate
from reports.planspec import Verify, parse_plan
from reports.report import regenerate
from sim.config import ConfigError

WORKLOAD = {"name": "tiny", "seed": 5, "num_requests": 80, "arrivals": {"kind": "poisson", "rate": 4.0},
            "lengths": {"kind": "uniform", "prompt_min": 64, "prompt_max": 1024, "output_min": 16, "output_max": 128},
            "policy": {"kind": "vllm"}}
CANDIDATES = [{"name": "h100", "profile": {"gpu": "h100-sxm"}, "price_per_gpu_hour": 3.0},
              {"name": "a100", "profile": {"gpu": "a100-80gb"}, "price_per_gpu_hour": 1.8}]
PLAN = {"base": "tiny.yaml", "target_rate": 60, "slo": {"ttft_ms": 500, "itl_ms": 60},
        "search": {"num_requests": 80, "max_runs": 9, "rel_tol": 0.1},
        "verify": {"num_requests_per_replica": 40, "max_extra_replicas": 2},
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


@given(capacity=st.floats(0.01, 100.0), target=st.floats(0.1, 1000.0), more=st.floats(0.0, 1000.0))
def test_replicas_cover_the_target_and_never_shrink_as_it_grows(capacity: float, target: float, more: float) -> None:
    n = replicas_for(target, capacity)
    assert n * capacity >= target * (1 - 1e-9) and (n - 1) * capacity < target
    assert replicas_for(target + more, capacity) >= n
    assert replicas_for(target, 0.0) is None


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
                             Verify(), str(tmp_path / "runs"))
        cap, _, _ = find_capacity(lambda r, t=task: simulate(t, r, s.num_requests)[1], s, start_rate=8.0)
        caps.append(cap)
    assert caps == sorted(caps, reverse=True) and caps[0] > 0, caps


def test_plan_writes_a_ranked_self_contained_report(tmp_path: Path) -> None:
    out = run_plan_file(write_plan(tmp_path), out=tmp_path / "out", jobs=1, progress=False)
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
        pytest.skip("/usr/bin/chromium is not installed")
    out = run_plan_file(write_plan(tmp_path, candidates=CANDIDATES[:1], policies=["vllm"]), out=tmp_path / "out",
                        jobs=1, progress=False)
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
    ({"target_rate": -5}, "field 'target_rate' must be a number > 0"),
    ({"slo": {"ttft_ms": 500, "p99": 1}}, "field 'slo.p99' is unknown"),
    ({"slo": {"attainment": 0.9}}, "field 'slo' sets no threshold"),
    ({"slo": {"ttft_ms": 500, "attainment": 1.5}}, "field 'slo.attainment' must be in"),
    ({"candidates": []}, "field 'candidates' must be a non-empty list"),
    ({"candidates": [{"profile": {"gpu": "h100-sxm"}}]}, "field 'candidates\\[0\\].price_per_gpu_hour' is missing"),
    ({"candidates": [{"profile": {"gpu": "h100-sxm"}, "price_per_gpu_hour": 2, "cost": 1}]},
     "candidates\\[0\\].cost' is unknown"),
    ({"candidates": [{"profile": {"gpu": "tpu-v9"}, "price_per_gpu_hour": 2}]}, "candidates\\[0\\], policy vllm"),
    ({"policies": [{"kind": "sarathi", "chunk": 512}]}, "unknown field 'policy.chunk'"),
    ({"search": {"num_requests": 0}}, "field 'search.num_requests' must be an integer >= 1"),
    ({"router": "random"}, "field 'router' must be one of"),
    ({"base": "missing.yaml"}, "field 'base' names 'missing.yaml', which does not exist"),
])
def test_bad_plan_files_name_the_field(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_plan(write_plan(tmp_path, **changes))
    assert "plan.yaml" in str(info.value)


def test_example_files_parse() -> None:
    root = Path(__file__).resolve().parent.parent / "workloads"
    spec = parse_plan(root / "plan_azure_conv.yaml")
    assert spec.target_rate == 50 and len(spec.candidates) == 8
    from reports.spec import expand, parse_sweep
    assert len(expand(parse_sweep(root / "sweep_sarathi_knee.yaml"))) == 6 * 5



def test_capacity_band_and_close_calls_by_hand() -> None:
    """Capacity 10 req/s from a profile 6% off: 9.4-10.6. Two verified fleets at
    $9.00 and $9.90 per hour differ by 10%, less than 6% + 6% = 12%: a close
    call; at $9.00 and $11.00 (22%) they do not."""
    from reports.planreport import capacity_band, close_calls
    assert capacity_band(10.0, 6.0) == "9.4-10.6 (±6%)"
    assert capacity_band(10.0, None) == "unchecked profile"
    ranked = pd.DataFrame({"candidate": ["a", "b"], "meets_slo": [True, True], "cost_per_hour": [9.0, 9.9],
                           "profile_error_pct": [6.0, 6.0]})
    (warning,) = close_calls(ranked)
    assert warning.startswith("a and b differ by 10% in cost per hour")
    assert close_calls(ranked.assign(cost_per_hour=[9.0, 11.0])) == []
