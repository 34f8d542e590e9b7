"""Disaggregated plan candidates: parsing and expansion, the xPyD cost by hand, the pool that gets
the next replica, the side-by-side reason, and a small end-to-end plan."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import ROOT

from reports.experiments.pdplan import binding_pool, pd_cost
from reports.experiments.planspec import parse_plan
from reports.presentation.layouts import binding, layout_comparison
from sim.cli import main
from sim.run.config import ConfigError, Slo

WORKLOAD = {"name": "tiny", "seed": 5, "num_requests": 80, "arrivals": {"kind": "poisson", "rate": 4.0},
            "lengths": {"kind": "uniform", "prompt_min": 64, "prompt_max": 1024, "output_min": 16, "output_max": 128},
            "policy": {"kind": "vllm_v1"}}
H100 = {"profile": {"gpu": "h100-sxm"}}
PD = {"disaggregation": {"prefill": H100, "decode": {**H100, "price_per_gpu_hour": 2.5}}}
PLAN = {"base": "tiny.yaml", "target_rate": 30, "slo": {"ttft_ms": 500, "itl_ms": 30},
        "search": {"num_requests": 80, "max_runs": 7, "rel_tol": 0.15},
        "verify": {"min_duration_s": 1, "min_requests": 150, "max_extra_replicas": 2},
        "policies": ["vllm_v1"], "candidates": [{"name": "h100", **H100}, PD]}


def write_plan(tmp_path: Path, **changes) -> Path:
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(WORKLOAD))
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in {**PLAN, **changes}.items() if v is not None}))
    return path


def pd_candidate(**section) -> list[dict]:
    return [{"disaggregation": {**PD["disaggregation"], **section}}]


@pytest.mark.parametrize("candidates, message", [
    (pd_candidate(prefill={**H100, "replicas": 2}),
     "field 'candidates\\[0\\].disaggregation.prefill.replicas' is set by the plan: it searches the prefill and "
     "decode replica counts"),
    (pd_candidate(decode={**H100, "routr": "least_tokens"}),
     "field 'candidates\\[0\\].disaggregation.decode.routr' is unknown \\(did you mean 'router'\\?\\)"),
    ([{"disaggregation": {"prefill": H100, "decode": H100, "lnk": {"kind": "rdma-400g"}}}],
     "field 'candidates\\[0\\].disaggregation.lnk' is unknown \\(did you mean 'link'\\?\\)"),
    (pd_candidate(prefill=[]), "field 'candidates\\[0\\].disaggregation.prefill' must be a pool mapping or a "
                               "non-empty list of them, got \\[\\]"),
    ([{"disaggregation": {"prefill": H100}}], "field 'candidates\\[0\\].disaggregation.decode' is missing"),
    (pd_candidate(decode=[H100, {"profile": {"gpu": "h100-sx"}}]),
     "field 'candidates\\[0\\].disaggregation.decode\\[1\\].profile.gpu' is 'h100-sx', not a GPU preset "
     "\\(did you mean 'h100-sxm'\\?\\)"),
    (pd_candidate(prefill={**H100, "price_per_gpu_hour": -1}),
     "field 'candidates\\[0\\].disaggregation.prefill.price_per_gpu_hour' must be a finite number > 0"),
    (pd_candidate(decode={**H100, "gpus_per_replica": 0}),
     "field 'candidates\\[0\\].disaggregation.decode.gpus_per_replica' must be an integer >= 1"),
    (pd_candidate(decode={**H100, "policy": {"kind": "sarathi"}}), "decode.policy.kind' is sarathi"),
    (pd_candidate(link={"kind": "rdma-401g"}), "did you mean 'rdma-400g'"),
    (pd_candidate(prefill={**H100, "router": "least_token"}),
     "field 'candidates\\[0\\].disaggregation.prefill.router' is 'least_token' \\(did you mean 'least_tokens'\\?\\)"),
    ([{**PD, "profile": {"gpu": "h100-sxm"}}], "field 'candidates\\[0\\].profile' cannot go with a disaggregation"),
    ([{**PD, "policies": ["vllm"]}], "field 'candidates\\[0\\].policies' cannot go with a disaggregation"),
    ([{"disaggregation": [H100]}], "field 'candidates\\[0\\].disaggregation' must be a mapping"),
    ([{"disagregation": PD["disaggregation"]}],
     "field 'candidates\\[0\\].disagregation' is unknown \\(did you mean 'disaggregation'\\?\\)"),
])
def test_bad_disaggregated_candidates_name_the_field(tmp_path: Path, candidates: list, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_plan(write_plan(tmp_path, candidates=candidates))
    assert "plan.yaml" in str(info.value)


def test_a_bad_candidate_exits_nonzero_without_a_traceback_before_any_run(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    rc = main(["plan", str(write_plan(tmp_path, candidates=pd_candidate(prefill={**H100, "replicas": 1}))),
               "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert rc != 0 and "prefill.replicas' is set by the plan" in err and "Traceback" not in err
    assert not out.exists()


def test_lists_expand_into_the_product_of_prefill_and_decode_options(tmp_path: Path) -> None:
    prefill = [H100, {"profile": {"gpu": "h100-sxm", "tensor_parallel": 2}}]
    decode = [H100, {"profile": {"gpu": "h200"}}, {"profile": {"gpu": "a100-80gb"}, "price_per_gpu_hour": 1.5}]
    spec = parse_plan(write_plan(tmp_path, candidates=[{"name": "pd", "disaggregation": {"prefill": prefill,
                                                                                      "decode": decode}}]))
    # 2 prefill options x 3 decode options = 6 candidates
    assert [c.name for c in spec.candidates] == [
        f"pd: P {p} / D {d}" for p in ("h100-sxm", "h100-sxm x2") for d in ("h100-sxm", "h200", "a100-80gb")]
    assert {c.layout for c in spec.candidates} == {"disaggregated"}
    tp2 = spec.candidates[3]
    assert tp2.pools["prefill"]["gpus_per_replica"] == 2 and tp2.pools["decode"]["gpus_per_replica"] == 1
    assert spec.candidates[2].pools["decode"]["price_per_gpu_hour"] == 1.5
    assert spec.candidates[2].pools["decode"]["price_source"] == "given"
    assert spec.candidates[0].pools["prefill"]["price_source"].startswith("default: preset h100-sxm")
    # The pools' profiles are their own; the plan sets their replica counts.
    section = tp2.raw["disaggregation"]
    assert section["prefill"]["profile"] == {"gpu": "h100-sxm", "tensor_parallel": 2}
    assert section["prefill"]["replicas"] == section["decode"]["replicas"] == 1


def test_xpyd_cost_by_hand() -> None:
    pools = {"prefill": {"gpus_per_replica": 2, "price_per_gpu_hour": 2.5},
             "decode": {"gpus_per_replica": 1, "price_per_gpu_hour": 3.0}}
    per_hour_p, per_hour_d, per_mtok = pd_cost(2, 3, pools, output_tokens_per_s=1000.0)
    assert per_hour_p == pytest.approx(10.0)          # 2 prefill replicas x 2 GPUs x $2.50 = $10/h
    assert per_hour_d == pytest.approx(9.0)           # 3 decode replicas x 1 GPU x $3.00 = $9/h
    # $19/h over 1,000 tokens/s x 3,600 s = 3.6 M tokens an hour: 19 / 3.6 = $5.2778 per M tokens
    assert per_mtok == pytest.approx(19.0 / 3.6)


def _requests(ttft_s, prefill_queue_s, prefill_s, decode_queue_s) -> pd.DataFrame:
    n = len(ttft_s)
    return pd.DataFrame({"arrival_s": np.arange(n, dtype=float), "ttft_s": ttft_s, "prefill_queue_s": prefill_queue_s,
                         "prefill_s": prefill_s, "transfer_wait_s": [0.0] * n, "transfer_s": [0.01] * n,
                         "decode_queue_s": decode_queue_s, "decode_first_step_s": [0.02] * n})


def test_the_next_replica_goes_to_the_pool_that_binds() -> None:
    slo = Slo(ttft_ms=500, itl_ms=30)
    # An ITL miss: the decode steps set the gaps, whatever the TTFT did.
    assert binding_pool({"itl_attainment": 0.95, "ttft_attainment": 0.5}, _requests([1.0], [0.9], [0.05], [0.0]),
                        slo)[0] == "decode"
    # Late requests (TTFT 0.9 s > 500 ms) spent 0.7 + 0.1 s in the prefill queue and prefill, 0.01 + 0.05 + 0.02
    # on the decode side: +1 prefill. The on-time one (0.1 s) is not counted.
    reqs = _requests([0.9, 0.9, 0.1], [0.7, 0.7, 0.0], [0.1, 0.1, 0.05], [0.05, 0.05, 0.0])
    side, why = binding_pool({"itl_attainment": 1.0, "ttft_attainment": 1 / 3}, reqs, slo)
    assert side == "prefill" and "91%" in why           # 2 x 0.8 / (2 x 0.8 + 2 x 0.08) = 0.909
    # The same late TTFTs spent in the decode queue: +1 decode.
    reqs = _requests([0.9, 0.9, 0.1], [0.0, 0.0, 0.0], [0.05, 0.05, 0.05], [0.8, 0.8, 0.0])
    assert binding_pool({"itl_attainment": 1.0, "ttft_attainment": 1 / 3}, reqs, slo)[0] == "decode"
    # Every SLO met but a queue growing in the prefill pool (its wait rises 0.1 s per s): +1 prefill.
    t = np.arange(30, dtype=float)
    reqs = _requests([0.1] * 30, 0.1 * t, [0.05] * 30, [0.0] * 30)
    assert binding_pool({"itl_attainment": 1.0, "ttft_attainment": 1.0}, reqs, slo)[0] == "prefill"


RESULTS = [
    {"name": "agg", "layout": "aggregated", "capacity_rps": 2.1, "trials": [
        {"rate_rps": 1.0, "passed": True, "reasons": []},
        {"rate_rps": 4.0, "passed": False, "reasons": ["ITL within 50 ms for 90.0% < 99%"]},
        {"rate_rps": 2.1, "passed": True, "reasons": []},
        # the lowest failing rate above the capacity bounds it; an SLO miss is named before the backlog
        {"rate_rps": 2.4, "passed": False, "reasons": ["unstable: 6.0% of requests still waiting at the last "
                                                       "arrival (> 5%)", "ITL within 50 ms for 98.2% < 99%"]}]},
    {"name": "pd", "layout": "disaggregated", "capacity_rps": 1.7, "capacity_decode_rps": 3.4,
     "capacity_prefill_rps": 5.0, "prefill_replicas": 1, "decode_replicas": 2, "prefill_replicas_estimate": 1,
     "decode_replicas_estimate": 2, "cost_per_hour_prefill": 3.0, "cost_per_hour_decode": 6.0, "trials": [
        {"pool": "decode", "rate_rps": 3.4, "passed": True, "reasons": []},
        {"pool": "decode", "rate_rps": 3.7, "passed": False, "reasons": ["ITL within 50 ms for 98.0% < 99%"]},
        {"pool": "prefill", "rate_rps": 5.5, "passed": False, "reasons": ["TTFT within 2000 ms for 97.0% < 99%"]}]},
]
PLAN_RECORD = {"target_rate": 4, "target_utilization": 0.8, "slo": {"ttft_ms": 2000, "itl_ms": 50},
               "slo_text": "p99 TTFT <= 2000 ms, ITL <= 50 ms"}


def _ranked(agg_cost: float, pd_cost_: float) -> pd.DataFrame:
    rows = [{"candidate": "agg", "layout": "aggregated", "replicas": 3, "gpus": 3, "cost_per_hour": agg_cost,
             "capacity_rps": 2.1, "meets_slo": True, "fleet_p99_ttft_ms": 300.0, "fleet_p99_itl_ms": 45.0,
             "ttft_attainment": 1.0, "itl_attainment": 0.995, "tpot_attainment": None},
            {"candidate": "pd", "layout": "disaggregated", "replicas": 3, "prefill_replicas": 1, "decode_replicas": 2,
             "gpus": 3, "cost_per_hour": pd_cost_, "capacity_rps": 1.7, "meets_slo": True,
             "fleet_p99_ttft_ms": 400.0, "fleet_p99_itl_ms": 20.0, "ttft_attainment": 1.0, "itl_attainment": 1.0,
             "tpot_attainment": None}]
    return pd.DataFrame(sorted(rows, key=lambda r: r["cost_per_hour"]))


def test_the_reason_is_the_slo_that_binds_the_loser() -> None:
    assert binding(RESULTS[0]["trials"], 2.1) == {"metric": "ITL", "reason": "ITL within 50 ms for 98.2% < 99%",
                                                  "rate_rps": 2.4}
    side = layout_comparison(_ranked(9.0, 6.0), RESULTS, PLAN_RECORD)
    assert side["winner"] == "disaggregated"
    assert side["reason"].startswith("disaggregated wins at $6.00/h against $9.00/h: aggregated is ITL-bound")
    assert ("each replica holds 2.1 req/s under ITL 50 ms (ITL within 50 ms for 98.2% < 99% at 2.4 req/s), "
            "against 3.4 req/s for a decode replica and 5 for a prefill replica.") in side["reason"]
    table = side["table"].set_index("")
    assert table.loc["replicas", "disaggregated"] == "1P2D" and table.loc["replicas", "aggregated"] == "3 replicas"
    assert table.loc["$/hour", "aggregated"] == "9.00"
    assert table.loc["SLO attained", "aggregated"] == "TTFT 100.0% ITL 99.5%"
    # The disaggregated plan loses: its decode pool costs it more ($6 of $9), and its ITL binds there.
    side = layout_comparison(_ranked(6.0, 9.0), RESULTS, PLAN_RECORD)
    assert side["winner"] == "aggregated"
    assert ("disaggregated is ITL-bound in its decode pool" in side["reason"]
            and "each decode replica holds 3.4 req/s under ITL 50 ms" in side["reason"]
            and "it takes 2 of them (ceil(4 / (3.4 x 0.8)) = 2; $6.00 of its $9.00/h)" in side["reason"])
    # Only one layout in the plan: no block.
    assert layout_comparison(_ranked(6.0, 9.0).iloc[:1], RESULTS, PLAN_RECORD) is None


def test_a_small_disaggregated_plan_end_to_end(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    candidates = [{"name": "h100", **H100},
                  {"disaggregation": {"prefill": {"profile": {"gpu": "h100-sxm", "tensor_parallel": 2},
                                                  "price_per_gpu_hour": 2.0},
                                      "decode": {**H100, "price_per_gpu_hour": 3.0}}}]
    assert main(["plan", str(write_plan(tmp_path, candidates=candidates)), "--out", str(out), "-j", "1",
                 "--quiet"]) == 0
    printed = capsys.readouterr().out
    ranked = pd.read_csv(out / "ranked.csv")
    assert set(ranked["layout"]) == {"aggregated", "disaggregated"}
    pd_ = ranked[ranked["layout"] == "disaggregated"].iloc[0]
    agg = ranked[ranked["layout"] == "aggregated"].iloc[0]
    assert pd.isna(agg["prefill_replicas"]) and pd.isna(agg["decode_replicas"])
    x, y = int(pd_["prefill_replicas"]), int(pd_["decode_replicas"])
    assert pd_["replicas"] == x + y and pd_["gpus"] == 2 * x + y
    assert pd_["cost_per_hour"] == pytest.approx(x * 2 * 2.0 + y * 1 * 3.0)      # x TP-2 at $2, y TP-1 at $3
    result = next(r for r in json.loads((out / "plan.json").read_text())["results"] if r["layout"] == "disaggregated")
    assert {t["pool"] for t in result["trials"]} == {"prefill", "decode"}
    assert result["capacity_prefill_rps"] > 0 and result["capacity_decode_rps"] > 0
    assert x >= 30 / (result["capacity_prefill_rps"] * 0.8) - 1e-9 or not result["verified"]
    assert "aggregated vs disaggregated:" in printed and " wins " in printed and f"{x}P{y}D" in printed
    html = (out / "report.html").read_text()
    assert "Aggregated vs disaggregated" in html and "prefill pool: h100-sxm x2" in html
    _check_in_chromium(tmp_path, out / "report.html")


def _check_in_chromium(tmp_path: Path, page: Path) -> None:
    """The report loads in headless Chromium without a page error (where Chromium is installed)."""
    chromium = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if os.path.exists(p)), None)
    if chromium is None:
        return
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([chromium, *flags, "--enable-logging=stderr", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert not [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert "Aggregated vs disaggregated" in dom.stdout


def test_the_bundled_plan_parses() -> None:
    spec = parse_plan(ROOT / "workloads" / "plan_pd.yaml", out=Path("/tmp/never-written"))
    assert [c.layout for c in spec.candidates] == ["aggregated", "disaggregated"]
