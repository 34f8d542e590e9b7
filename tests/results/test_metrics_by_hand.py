"""Every formula in summary.json, pinned on a run small enough to compute by hand.

Definitions are vLLM's serving benchmark (``vllm bench serve``,
``calculate_metrics``): TTFT = first token - arrival; TPOT = (E2E - TTFT) /
(N - 1) over requests with N > 1 output tokens; ITL = every gap between
consecutive tokens of a request, pooled over all requests; E2E = completion -
arrival; std is numpy's default (population, ddof 0); percentiles are numpy's
linear interpolation; goodput counts completed requests with every metric <=
its threshold (a one-token request's TPOT counts as 0). batchsim adds queue =
first scheduled - arrival, count_*, duration = first arrival -> last
return (a completion or, as in vLLM, a refusal), KV utilisation weighted by
step time, busy fraction, and the capacity plan's backlog verdict
(reports/capacity.py).

Every assertion is exact: equality, or pytest.approx(rel=1e-12) where the
simulator's clock adds float round-off (0.02 + 0.018 is not 0.038).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import linear_profile

from reports.experiments.capacity import judge
from sim.run.config import Slo
from sim.run.config import workload_from_dict
from sim.results.metrics import summarize
from sim.run.runner import run_workload
from sim.results.result import RunResult


def exact(x: float) -> pytest.approx:
    return pytest.approx(x, rel=1e-12)


# ---- a run computed by hand ------------------------------------------------------------------
#
# Profile: every step costs 10 ms + 0.1 ms per token in the batch; attention is free.
# Policy vllm (prefill-only steps when waiting requests fit, else decode-only), max_model_len
# 1024, 64 KV blocks of 16 tokens, watermark 0. Requests (arrival s, prompt, output):
#   R0 (0.000, 100, 4)   R1 (0.005, 50, 1)   R2 (0.012, 30, 3)   R3 (0.015, 2000, 8)   R4 (0.100, 20, 2)
# R3: 2000 + 8 > 1024 tokens -> rejected at arrival, counted as failed.
#
# step  start    work                          cost                     end     blocks after commit
#  1    0.0000   prefill R0 (100)              10 + 100 x 0.1 = 20.0    0.0200  R0 ceil(100/16) = 7      -> 7
#  2    0.0200   prefill R1 (50) + R2 (30)     10 +  80 x 0.1 = 18.0    0.0380  +4 +2, R1 done, frees 4 -> 9
#  3    0.0380   decode R0, R2                 10 +   2 x 0.1 = 10.2    0.0482  R0 101, R2 31 tokens     -> 9
#  4    0.0482   decode R0, R2 (R2's last)     10.2                     0.0584  R2 frees 2               -> 7
#  5    0.0584   decode R0 (R0's last)         10 +   1 x 0.1 = 10.1    0.0685  R0 frees 7               -> 0
#       idle 0.0685 .. 0.1000
#  6    0.1000   prefill R4 (20)               10 +  20 x 0.1 = 12.0    0.1120  ceil(20/16) = 2          -> 2
#  7    0.1120   decode R4 (R4's last)         10.1                     0.1221  frees 2                  -> 0
#
# Output tokens (the end of the step that samples them):
#   R0: 0.0200, 0.0482, 0.0584, 0.0685     R1: 0.0380     R2: 0.0380, 0.0482, 0.0584     R4: 0.1120, 0.1221
#
#            arrival  first sched  first token  finished   queue  TTFT   E2E    TPOT = (E2E - TTFT) / (N - 1)
#   R0       0.000    0.000        0.0200       0.0685     0      20.0   68.5   (68.5 - 20) / 3 = 16.1666..
#   R1       0.005    0.020        0.0380       0.0380     15     33.0   33.0   N = 1: no TPOT
#   R2       0.012    0.020        0.0380       0.0584     8      26.0   46.4   (46.4 - 26) / 2 = 10.2
#   R4       0.100    0.100        0.1120       0.1221     0      12.0   22.1   (22.1 - 12) / 1 = 10.1     (ms)

TRACE = "arrival_time_s,prompt_tokens,output_tokens\n0.000,100,4\n0.005,50,1\n0.012,30,3\n0.015,2000,8\n0.100,20,2\n"


def hand_run(tmp: Path, max_tokens: str = "output") -> RunResult:
    linear_profile(per_token_s=1e-4, overhead_s=1e-2, decode_per_ctx_s=0.0, prefill_per_ctx_s=0.0).save(tmp / "p.yaml")
    (tmp / "trace.csv").write_text(TRACE)
    cfg = workload_from_dict({
        "name": "by-hand", "arrivals": {"kind": "trace", "path": str(tmp / "trace.csv"), "time_unit": "s"},
        "lengths": {"kind": "trace"}, "max_tokens": max_tokens, "policy": {"kind": "vllm"},
        "server": {"max_model_len": 1024, "num_blocks": 64, "watermark": 0.0},
        "profile": {"path": str(tmp / "p.yaml")}, "slo": {"ttft_ms": 40, "tpot_ms": 12}})
    with pytest.warns(UserWarning, match="1 of 5 requests were rejected"):  # R3
        return run_workload(cfg)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return hand_run(tmp_path_factory.mktemp("by_hand"))


def test_requests_frame_by_hand(run: RunResult) -> None:
    r = run.requests.set_index("req_id")
    assert list(r["status"]) == ["finished", "finished", "finished", "rejected", "finished"]
    done = r.loc[[0, 1, 2, 4]]
    assert list(done["first_scheduled_s"]) == [exact(v) for v in (0.0, 0.020, 0.020, 0.100)]
    assert list(done["first_token_s"]) == [exact(v) for v in (0.020, 0.038, 0.038, 0.112)]
    assert list(done["finished_s"]) == [exact(v) for v in (0.0685, 0.038, 0.0584, 0.1221)]
    # queue = first scheduled - arrival (not first token - arrival: that is TTFT)
    assert list(done["queue_s"]) == [exact(v) for v in (0.0, 0.015, 0.008, 0.0)]
    assert list(done["ttft_s"]) == [exact(v) for v in (0.020, 0.033, 0.026, 0.012)]
    assert list(done["e2e_s"]) == [exact(v) for v in (0.0685, 0.033, 0.0464, 0.0221)]
    assert done.loc[[0, 2, 4], "tpot_s"].tolist() == [exact((0.0685 - 0.020) / 3), exact(0.0102), exact(0.0101)]
    assert math.isnan(done.loc[1, "tpot_s"])                     # one output token: no TPOT
    assert r.loc[3, ["queue_s", "ttft_s", "e2e_s", "tpot_s"]].isna().all()
    assert list(r["max_tokens"]) == [4, 1, 3, 8, 2]               # max_tokens: output (= true length)


def test_token_log_and_steps_by_hand(run: RunResult) -> None:
    assert run.tokens["req_id"].tolist() == [0, 1, 2, 0, 2, 0, 2, 0, 4, 4]
    assert run.tokens["t_s"].tolist() == [exact(t) for t in (0.020, 0.038, 0.038, 0.0482, 0.0482, 0.0584,
                                                              0.0584, 0.0685, 0.112, 0.1221)]
    s = run.steps
    assert s["duration_s"].tolist() == [exact(d) for d in (0.020, 0.018, 0.0102, 0.0102, 0.0101, 0.012, 0.0101)]
    assert s["batch_size"].tolist() == [1, 2, 2, 2, 1, 1, 1]
    # KV blocks held while each step runs (before its commit frees finished requests):
    # R0 7; R0 7 + R1 4 + R2 2 = 13; R0 + R2 9; 9; R0 7; R4 2; 2
    assert s["kv_used_blocks"].tolist() == [7, 13, 9, 9, 7, 2, 2]


def test_distributions_by_hand(run: RunResult) -> None:
    s = run.summary
    # TTFT over the 4 completed requests, sorted [12, 20, 26, 33] ms:
    #   mean 91 / 4 = 22.75; median (20 + 26) / 2 = 23; linear percentiles at rank p/100 x (4 - 1):
    #   p90 2.7 -> 26 + 0.7 x 7 = 30.9; p95 2.85 -> 31.95; p99 2.97 -> 32.79
    #   std (population): deviations -10.75, -2.75, 3.25, 10.25 -> squares sum 238.75; sqrt(238.75 / 4)
    #   = 7.7258 (ddof 1 would be sqrt(238.75 / 3) = 8.9209)
    assert s["count_ttft"] == 4
    assert [s[f"{k}_ttft_ms"] for k in ("mean", "median", "p50", "p90", "p95", "p99")] == \
        [exact(v) for v in (22.75, 23.0, 23.0, 30.9, 31.95, 32.79)]
    assert s["std_ttft_ms"] == exact(math.sqrt(238.75 / 4))
    # TPOT over R0, R2, R4 (R1 has one token): [16.1667, 10.2, 10.1] ms
    #   mean (48.5 / 3 + 10.2 + 10.1) / 3 = 12.1556; median 10.2; p90 rank 1.8 -> 10.2 + 0.8 x 5.9667 = 14.9733
    #   ((N - 1) -> N would give [12.125, 6.8, 5.05], mean 7.9917)
    tpots = [48.5 / 3, 10.2, 10.1]
    assert s["count_tpot"] == 3
    assert s["mean_tpot_ms"] == exact(sum(tpots) / 3)
    assert s["median_tpot_ms"] == exact(10.2)
    assert s["p90_tpot_ms"] == exact(10.2 + 0.8 * (48.5 / 3 - 10.2))
    assert s["std_tpot_ms"] == exact(float(np.std(tpots)))
    # ITL: every gap, pooled. R0: 48.2 - 20 = 28.2, 58.4 - 48.2 = 10.2, 68.5 - 58.4 = 10.1; R2: 10.2, 10.2;
    #   R4: 122.1 - 112 = 10.1. Sorted [10.1, 10.1, 10.2, 10.2, 10.2, 28.2]: mean 79 / 6 = 13.1667;
    #   median 10.2; p90 rank 4.5 -> 10.2 + 0.5 x 18 = 19.2; p95 4.75 -> 23.7; p99 4.95 -> 27.3.
    #   (Per-request means would give (16.1667 + 10.2 + 10.1) / 3 = 12.1556: not a distribution over tokens.)
    itl = [28.2, 10.2, 10.1, 10.2, 10.2, 10.1]
    assert s["count_itl"] == 6
    assert [s[f"{k}_itl_ms"] for k in ("mean", "median", "p90", "p95", "p99")] == \
        [exact(v) for v in (79 / 6, 10.2, 19.2, 23.7, 27.3)]
    assert s["std_itl_ms"] == exact(float(np.std(itl)))
    # E2E [68.5, 33, 46.4, 22.1]: mean 170 / 4 = 42.5; sorted [22.1, 33, 46.4, 68.5]; median 39.7;
    #   p90 rank 2.7 -> 46.4 + 0.7 x 22.1 = 61.87
    assert s["count_e2el"] == 4
    assert [s["mean_e2el_ms"], s["median_e2el_ms"], s["p90_e2el_ms"]] == [exact(42.5), exact(39.7), exact(61.87)]
    # queue [0, 15, 8, 0]: mean 23 / 4 = 5.75; sorted [0, 0, 8, 15]: median 4; p99 rank 2.97 -> 8 + 0.97 x 7
    assert s["count_queue"] == 4
    assert [s["mean_queue_ms"], s["median_queue_ms"], s["p99_queue_ms"]] == [exact(5.75), exact(4.0), exact(14.79)]


def test_throughput_goodput_kv_and_busy_by_hand(run: RunResult) -> None:
    s = run.summary
    # duration: first arrival (R0, 0 s) to last completion (R4, 0.1221 s); R3 failed.
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["duration_s"] == exact(0.1221)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (100 + 50 + 30 + 20, 4 + 1 + 3 + 2)
    assert s["request_throughput"] == exact(4 / 0.1221)
    assert s["output_throughput"] == exact(10 / 0.1221)
    assert s["total_token_throughput"] == exact(210 / 0.1221)
    # SLO ttft <= 40 ms and tpot <= 12 ms: R0 fails TPOT (16.17); R1's TPOT counts as 0 (one token),
    # TTFT 33 <= 40: good; R2 (26, 10.2) and R4 (12, 10.1) good -> 3 good of 4.
    assert s["request_goodput"] == exact(3 / 0.1221)
    assert s["slo_attainment"] == 0.75
    # mean batch size: plain mean over steps, (1 + 2 + 2 + 2 + 1 + 1 + 1) / 7
    assert s["num_steps"] == 7 and s["mean_batch_size"] == exact(10 / 7)
    # busy: (20 + 18 + 10.2 + 10.2 + 10.1 + 12 + 10.1) ms = 90.6 ms of 122.1 ms
    assert s["busy_fraction"] == exact(90.6 / 122.1)
    # KV, weighted by step time over busy time: (7 x 20 + 13 x 18 + 9 x 10.2 + 9 x 10.2 + 7 x 10.1
    #   + 2 x 12 + 2 x 10.1) / (90.6 x 64) = 672.5 / 5798.4 (a plain mean would be 49 / 448); peak 13 / 64
    assert s["mean_kv_utilization"] == exact(672.5 / 5798.4)
    assert s["peak_kv_utilization"] == 13 / 64
    assert s["num_preemptions"] == 0


def test_max_tokens_context_is_the_rest_of_the_context(tmp_path: Path, run: RunResult) -> None:
    ctx = hand_run(tmp_path, max_tokens="context")
    # max_tokens: context = max_model_len - prompt: 1024 - 100 = 924, 1024 - 50 = 974, 1024 - 30 = 994,
    # max(1, 1024 - 2000) = 1 (then 2000 + 1 > 1024: still rejected), 1024 - 20 = 1004.
    assert ctx.requests["max_tokens"].tolist() == [924, 974, 994, 1, 1004]
    # The cap only bounds the output (R3's 8 becomes 1, and R3 is rejected anyway); the served
    # requests' lengths, and so every figure in the summary, are unchanged.
    assert ctx.requests["output_tokens"].tolist() == [4, 1, 3, 1, 2]
    assert ctx.summary == run.summary


def test_duration_runs_until_a_late_rejection_returns(tmp_path: Path) -> None:
    # vLLM's benchmark_duration ends when every request has returned, a failed one too.
    # R0 (0 s, prompt 100, 4 tokens): prefill 10 + 100 x 0.1 = 20 ms, then 3 decodes of 10.1 ms:
    # done at 0.0503 s. R1 (0.2 s, 2000 + 8 > 1024) is refused when it arrives, at 0.2 s.
    # duration = 0.2 - 0 (not 0.0503); 1 completed request / 0.2 s = 5 req/s, 4 tokens / 0.2 s = 20 tok/s.
    linear_profile(per_token_s=1e-4, overhead_s=1e-2, decode_per_ctx_s=0.0, prefill_per_ctx_s=0.0).save(tmp_path / "p.yaml")
    (tmp_path / "trace.csv").write_text("arrival_time_s,prompt_tokens,output_tokens\n0.000,100,4\n0.200,2000,8\n")
    cfg = workload_from_dict({
        "name": "late-reject", "arrivals": {"kind": "trace", "path": str(tmp_path / "trace.csv"), "time_unit": "s"},
        "lengths": {"kind": "trace"}, "policy": {"kind": "vllm"},
        "server": {"max_model_len": 1024, "num_blocks": 64, "watermark": 0.0}, "profile": {"path": str(tmp_path / "p.yaml")}})
    with pytest.warns(UserWarning, match="1 of 2 requests were rejected"):
        s = run_workload(cfg).summary
    assert (s["completed"], s["failed"]) == (1, 1)
    assert s["duration_s"] == exact(0.2)
    assert s["request_throughput"] == exact(5.0) and s["output_throughput"] == exact(20.0)
    assert s["busy_fraction"] == exact((20 + 3 * 10.1) / 200)     # busy 50.3 ms of 200 ms


# ---- summarize() on hand-built frames ---------------------------------------------------------
def frames(ttft_s: list[float], tpot_s: list[float], e2e_s: list[float], output_tokens: list[int]):
    n = len(ttft_s)
    requests = pd.DataFrame({
        "req_id": range(n), "status": "finished", "arrival_s": 0.0, "finished_s": e2e_s,
        "prompt_tokens": 10, "output_tokens": output_tokens, "ttft_s": ttft_s, "tpot_s": tpot_s,
        "e2e_s": e2e_s, "queue_s": 0.0, "num_preemptions": 0})
    tokens = pd.DataFrame({"req_id": pd.Series([], dtype=int), "t_s": pd.Series([], dtype=float)})
    steps = pd.DataFrame({"replica": [0], "duration_s": [0.5], "batch_size": [1], "kv_used_blocks": [0]})
    return requests, tokens, steps


def test_percentiles_and_std_on_eleven_values() -> None:
    # TTFT 0, 0.1, ..., 1.0 s, i.e. 0, 100, ..., 1000 ms (11 values, ranks 0..10).
    # linear: p50 rank 5 -> 500; p90 rank 9 -> 900; p95 rank 9.5 -> 950; p99 rank 9.9 -> 990.
    # population std of 0..1000 step 100: 100 x sqrt((11^2 - 1) / 12) = 100 x sqrt(10) = 316.23
    # (ddof 1: 100 x sqrt(11) = 331.66). 'lower' / 'nearest' percentiles would give p95 900 / 1000.
    ttft = [i / 10 for i in range(11)]
    s = summarize(*frames(ttft, [0.01] * 11, [2.0] * 11, [5] * 11))
    assert (s["p50_ttft_ms"], s["p90_ttft_ms"]) == (exact(500.0), exact(900.0))
    assert (s["p95_ttft_ms"], s["p99_ttft_ms"]) == (exact(950.0), exact(990.0))
    assert s["std_ttft_ms"] == exact(100 * math.sqrt(10))
    assert s["mean_ttft_ms"] == exact(500.0) and s["count_ttft"] == 11


def test_goodput_is_inclusive_at_the_threshold() -> None:
    # vLLM: good when slo_ms / 1000 >= value_s for every constrained metric.
    #   A: TTFT exactly 0.0637 s at ttft_ms 63.7 -> good (63.7 / 1000 == 0.0637; note 0.0637 x 1000
    #      = 63.70000000000001 > 63.7, so comparing in ms would call it bad)
    #   B: TTFT one ulp above 0.0161 s at 16.1 ms: bad (in ms it rounds to 16.1 and would pass)
    #   C: TPOT exactly 0.05 s at tpot_ms 50: good; D: one output token, TPOT NaN: counts as 0, good
    #   E: E2E 2.5 s > e2el_ms 2000: bad
    over = float(np.nextafter(0.0161, 1.0))
    assert over * 1e3 <= 16.1 and not over <= 16.1 / 1e3 and not 0.0637 * 1e3 <= 63.7
    reqs, toks, steps = frames([0.0637, over, 0.001, 0.001, 0.001], [0.01, 0.01, 0.05, math.nan, 0.01],
                               [1.0, 1.0, 1.0, 1.0, 2.5], [5, 5, 5, 1, 5])
    limits = [("ttft_ms", 63.7), ("ttft_ms", 16.1), ("tpot_ms", 50), ("tpot_ms", 1.0), ("e2el_ms", 2000)]
    good = [summarize(reqs.iloc[[i]], toks, steps, {key: limit})["slo_attainment"] for i, (key, limit) in
            enumerate(limits)]
    assert good == [1.0, 0.0, 1.0, 1.0, 0.0]
    # Every SLO together: A fails ttft 16.1, so only C, D (ttft 1 ms, tpot <= 50, e2e 1 s) are good.
    s = summarize(reqs, toks, steps, {"ttft_ms": 16.1, "tpot_ms": 50, "e2el_ms": 2000})
    assert s["slo_attainment"] == 2 / 5 and s["request_goodput"] == exact(2 / 2.5)   # duration 0 -> 2.5 s


def test_empty_distributions_and_fleet_busy_fraction() -> None:
    # Only one-token requests: TPOT has no values (None) but its count is there (0), as is ITL's.
    reqs, toks, steps = frames([0.1, 0.2], [math.nan, math.nan], [0.1, 0.2], [1, 1])
    s = summarize(reqs, toks, steps)
    assert (s["count_tpot"], s["mean_tpot_ms"], s["p99_tpot_ms"]) == (0, None, None)
    assert (s["count_itl"], s["median_itl_ms"]) == (0, None)
    assert s["request_goodput"] is None and "slo_attainment" not in s
    # Two replicas, each busy 0.05 s of the 0.2 s run: busy per replica 0.25 (summing them would say 0.5).
    two = pd.DataFrame({"replica": [0, 1], "duration_s": [0.05, 0.05], "batch_size": [1, 3],
                        "kv_used_blocks": [4, 8]})
    s = summarize(reqs, toks, two, kv_total_blocks=16)
    assert s["busy_fraction"] == exact(0.05 * 2 / (2 * 0.2))
    assert s["mean_batch_size"] == 2.0
    assert s["mean_kv_utilization"] == exact((4 / 16 * 0.05 + 8 / 16 * 0.05) / 0.1) and s["peak_kv_utilization"] == 0.5


# ---- the capacity plan's verdict ----------------------------------------------------------------
def plan_frames(first_scheduled_s: list[float], ttft_s: list[float] | None = None):
    """20 requests arriving at 0, 1, ..., 19 s; the last arrival is at 19 s."""
    n = len(first_scheduled_s)
    ttft = ttft_s if ttft_s is not None else [0.1] * n
    requests = pd.DataFrame({"req_id": range(n), "status": "finished", "arrival_s": [float(i) for i in range(n)],
                             "first_scheduled_s": first_scheduled_s, "output_tokens": 2, "ttft_s": ttft,
                             "tpot_s": 0.01})
    tokens = pd.DataFrame({"req_id": [0, 0], "t_s": [0.1, 0.2]})
    return requests, tokens


def test_backlog_verdict_by_hand() -> None:
    on_time = [float(i) for i in range(20)]
    # Request 17 (arrived 17 s) first scheduled at 19.5 s: still waiting at the last arrival (19 s).
    # Backlog 1 / 20 = 0.05 <= max_backlog_fraction 0.05: stable.
    late = on_time[:17] + [19.5] + on_time[18:]
    verdict = judge(*plan_frames(late), Slo(ttft_ms=500))
    assert (verdict["backlog_fraction"], verdict["stable"], verdict["passed"]) == (0.05, True, True)
    # Requests 16 and 17 late: 2 / 20 = 0.10 > 0.05: unstable, and the reason says so.
    later = on_time[:16] + [19.5, 19.5] + on_time[18:]
    verdict = judge(*plan_frames(later), Slo(ttft_ms=500))
    assert (verdict["backlog_fraction"], verdict["stable"], verdict["passed"]) == (0.10, False, False)
    assert verdict["reasons"] == ["unstable: 10.0% of requests still waiting at the last arrival (> 5%)"]
    # The last arrival itself never counts; one first scheduled exactly at 19 s counts as still waiting
    # (started strictly before the last arrival is "started").
    assert judge(*plan_frames(on_time[:19] + [25.0]), Slo(ttft_ms=500))["backlog_fraction"] == 0.0
    at_last = on_time[:17] + [19.0] + on_time[18:]
    assert judge(*plan_frames(at_last), Slo(ttft_ms=500))["backlog_fraction"] == 0.05


def test_attainment_fraction_by_hand() -> None:
    # 20 TTFTs: 19 at 0.5 s (exactly the 500 ms limit: within) and one at 0.75 s: 19 / 20 = 0.95.
    ttft = [0.5] * 19 + [0.75]
    verdict = judge(*plan_frames([float(i) for i in range(20)], ttft), Slo(ttft_ms=500, attainment=0.95))
    assert verdict["ttft_attainment"] == 0.95 and verdict["passed"]
    verdict = judge(*plan_frames([float(i) for i in range(20)], ttft), Slo(ttft_ms=500, attainment=0.99))
    assert not verdict["passed"]
    assert verdict["reasons"] == ["TTFT within 500 ms for 95.0% < 99%"]
