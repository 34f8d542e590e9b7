"""What `sim run` leaves behind: run folders that never clobber, --report,
vllm_bench.json (vllm bench serve's result format), trace.json (Perfetto),
and the printed summary's offered rate and overload line."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from conftest import WORKLOADS

import sim.results.folder
import sim.run.runner
import sim.results.vllm_bench
from calibrate.serving.measured import bench_run, read_bench_json
from sim.results.chrome_trace import first_steps, trace_chunks
from sim.cli import main
from sim.run.config import ConfigError
from sim.results.folder import RUN_FILES, prepare_run_dir, write_json
from sim.results.metrics import add_request_metrics, summarize
from sim.results.result import RunResult
from policies.config import policy_knobs
from sim.results.vllm_bench import PerRequest, bench_result, offered_load, parse_percentiles, peak_second

MIXED = str(WORKLOADS / "mixed_lengths.yaml")
SMALL = ["--set", "num_requests=30", "--quiet"]


def sim_run(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["run", MIXED, *SMALL, *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def never_run(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the simulation ran although the command should have stopped first")
    monkeypatch.setattr(sim.run.runner, "run_workload", refuse)


# ---- run folders -------------------------------------------------------------------------------
def test_default_folder_is_numbered_instead_of_overwritten(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert sim_run(capsys)[0] == 0
    first = (tmp_path / "runs/mixed-lengths/summary.json").read_text()
    rc, out, _ = sim_run(capsys, "--seed", "1")
    assert rc == 0
    assert "runs/mixed-lengths/ already holds a run, so this one went to runs/mixed-lengths-2/" in out
    assert sim_run(capsys, "--seed", "2")[0] == 0
    # the first run is untouched; each later one has its own complete folder
    assert (tmp_path / "runs/mixed-lengths/summary.json").read_text() == first
    seeds = [json.loads((tmp_path / f"runs/{d}/meta.json").read_text())["seed"]
             for d in ("mixed-lengths", "mixed-lengths-2", "mixed-lengths-3")]
    assert seeds == [0, 1, 2]


@pytest.mark.parametrize("artefact", [*RUN_FILES, "figures"])
def test_any_artefact_marks_a_folder_taken(tmp_path, artefact):
    base = tmp_path / "runs" / "w"
    base.mkdir(parents=True)
    (base / artefact).mkdir() if artefact == "figures" else (base / artefact).write_text("")
    assert prepare_run_dir(None, base)[:2] == (base.with_name("w-2"), base)


def test_a_folder_without_run_files_is_used(tmp_path):
    base = tmp_path / "w"
    base.mkdir()
    (base / "notes.txt").write_text("mine")          # not batchsim's: does not make it a run
    assert prepare_run_dir(None, base)[:2] == (base, None)
    assert prepare_run_dir(None, base, overwrite=True)[:2] == (base, None)


def test_out_holding_a_run_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    assert sim_run(capsys, "--out", str(out))[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    never_run(monkeypatch)
    rc, out_text, err = sim_run(capsys, "--out", str(out))
    assert rc == 2 and out_text == ""
    assert err == (f"error: --out {out}: already holds a run; pass --overwrite to replace it, or choose "
                   f"another --out\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_overwrite_removes_the_stale_report_and_keeps_foreign_files(tmp_path, capsys):
    out = tmp_path / "out"
    assert sim_run(capsys, "--out", str(out), "--report", "--trace")[0] == 0
    assert (out / "report.html").is_file() and list((out / "figures").glob("*.png"))
    (out / "notes.txt").write_text("mine")
    (out / "figures" / "sketch.txt").write_text("mine too")
    rc, text, _ = sim_run(capsys, "--out", str(out), "--overwrite", "--seed", "3")
    assert rc == 0
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert left == ["figures", "figures/sketch.txt", "meta.json", "notes.txt", "requests.csv", "steps.csv",
                    "summary.json", "tokens.npz", "vllm_bench.json"]
    assert json.loads((out / "meta.json").read_text())["seed"] == 3


def test_report_flag_builds_the_report_in_one_go(tmp_path, capsys):
    out = tmp_path / "out"
    rc, text, _ = sim_run(capsys, "--out", str(out), "--report")
    assert rc == 0
    assert f"wrote {out / 'report.html'}" in text.splitlines()
    assert "<html" in (out / "report.html").read_text().lower()


# ---- vllm_bench.json ----------------------------------------------------------------------------
VLLM_KEYS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
             "latencies", "queue_times", "rtfx"}     # vLLM 0.32 keeps these three without --save-detailed
DETAILED_KEYS = {"input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors"}
EXTRA_KEYS = {"policy", "policy_knobs", "num_replicas", "router", "simulated"}


def latency_keys(percentiles: list[str]) -> set[str]:
    return {f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
            for stat in ("mean", "median", "std", *(f"p{p}" for p in percentiles))}


def test_vllm_bench_has_vllms_keys_and_units_and_agrees_with_the_summary(tmp_path, capsys):
    out = tmp_path / "out"
    assert sim_run(capsys, "--out", str(out), "--metric-percentiles", "50,90,99,99.9")[0] == 0
    bench = json.loads((out / "vllm_bench.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert set(bench) == VLLM_KEYS | latency_keys(["50", "90", "99", "99.9"]) | EXTRA_KEYS
    assert bench["request_rate"] == 20.0 and bench["burstiness"] == 1.0 and bench["max_concurrency"] is None
    assert bench["num_prompts"] == 30 and bench["duration"] == summary["duration_s"]
    for m in ("ttft", "tpot", "itl", "e2el"):
        for ours, theirs in (("mean", "mean"), ("median", "median"), ("std", "std"), ("p50", "p50"),
                             ("p90", "p90"), ("p99", "p99")):
            assert bench[f"{theirs}_{m}_ms"] == pytest.approx(summary[f"{ours}_{m}_ms"], rel=1e-12), (m, ours)
    assert bench["p99.9_ttft_ms"] >= bench["p99_ttft_ms"]
    # static batching at 20 req/s: the whole batch is in flight at once
    assert bench["max_concurrent_requests"] >= 2


def test_vllm_bench_detailed_arrays_are_seconds_and_read_back_by_measured(tmp_path, capsys):
    out = tmp_path / "out"
    assert sim_run(capsys, "--out", str(out), "--save-detailed", "--set", "policy.kind=vllm")[0] == 0
    bench = json.loads((out / "vllm_bench.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert set(bench) == VLLM_KEYS | DETAILED_KEYS | latency_keys(["99"]) | EXTRA_KEYS
    assert len(bench["itls"]) == 30 and all(isinstance(gaps, list) for gaps in bench["itls"])
    # ttfts in seconds, median_ttft_ms in ms
    assert np.median(bench["ttfts"]) * 1e3 == pytest.approx(bench["median_ttft_ms"], rel=1e-9)
    # round trip: the reader of `sim validate --measured` takes batchsim's file like vLLM's
    measured = bench_run(read_bench_json(out / "vllm_bench.json")).summary
    for key in ("median_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "median_e2el_ms", "mean_tpot_ms", "duration_s",
                "completed", "total_output_tokens"):
        assert measured[key] == pytest.approx(summary[key], rel=1e-9), key


def test_resolved_policy_knobs_are_recorded_never_null(tmp_path, capsys):
    out = tmp_path / "out"
    assert sim_run(capsys, "--out", str(out), "--set", "policy.kind=vllm", "--set", "server.max_model_len=4096")[0] == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["config"]["policy"]["max_num_batched_tokens"] is None        # as the file gave it
    # vLLM v0 without chunked prefill: max(max_model_len, 2048) = max(4096, 2048) = 4096
    assert meta["policy_knobs"] == {"kind": "vllm", "max_num_seqs": 256, "max_num_batched_tokens": 4096}
    assert json.loads((out / "vllm_bench.json").read_text())["policy_knobs"] == meta["policy_knobs"]


def test_peak_second_of_a_run_a_trillion_seconds_long():
    # hand_run with request 3 moved 1e12 s later (arrival 1e12 + 3.0, tokens 1e12 + 3.5 and 3.8):
    # one array bucket per second would take 8 TB; the occupied buckets are 0, 2 and 1e12 + 3.
    # Tokens: bucket 0 holds 0.10 0.15 0.25 0.70 -> 4; bucket 2 holds 2.30 2.40 -> 2; the last 2.
    # In flight: requests 0 and 1 in bucket 0 -> 2; request 2 alone in bucket 2; request 3 alone.
    run = hand_run()
    req, tok = run.requests.copy(), run.tokens.copy()
    for col in ("arrival_s", "first_scheduled_s", "first_token_s", "finished_s"):
        req.loc[3, col] += 1e12
    tok.loc[tok["req_id"] == 3, "t_s"] += 1e12
    assert peak_second(req, [(tok["req_id"].to_numpy(), tok["t_s"].to_numpy())]) == (4.0, 2)
    # the same with four tokens of request 3 in its second: the token peak moves there
    extra = pd.DataFrame({"req_id": [3, 3], "t_s": [1e12 + 3.6, 1e12 + 3.7]})
    tok = pd.concat([tok, extra], ignore_index=True)
    assert peak_second(req, [(tok["req_id"].to_numpy(), tok["t_s"].to_numpy())]) == (4.0, 2)
    extra = pd.DataFrame({"req_id": [3], "t_s": [1e12 + 3.65]})
    tok = pd.concat([tok, extra], ignore_index=True)
    assert peak_second(req, [(tok["req_id"].to_numpy(), tok["t_s"].to_numpy())]) == (5.0, 2)


def requests_frame(rows: list[tuple]) -> pd.DataFrame:
    """(arrival, first token, finished, output tokens, status) rows as a requests table."""
    req = pd.DataFrame(rows, columns=["arrival_s", "first_token_s", "finished_s", "output_tokens", "status"])
    req.insert(0, "req_id", range(len(req)))
    req["replica"], req["prompt_tokens"], req["num_preemptions"] = 0, 10, 0
    req["first_scheduled_s"] = req["arrival_s"]
    req["reject_reason"] = np.where(req["status"] == "finished", "", "context")
    return add_request_metrics(req)


def test_duration_runs_from_the_first_arrival_to_the_last_return():
    # vLLM's benchmark_duration runs until every request has returned, a failed one too. A request
    # refused at -1.0 s counts for the start (vLLM's clock starts before the first send); one that
    # failed at 9.0 s counts for the end: duration = 9.0 - (-1.0) = 10 s; 2 completed -> 2 / 10
    # req/s; output 2 + 3 = 5 tokens / 10 s. Without the late failure, 3.8 - (-1.0) = 4.8 s.
    req = requests_frame([(-1.0, np.nan, 9.0, 4, "rejected"), (0.0, 0.1, 0.25, 2, "finished"),
                          (3.0, 3.5, 3.8, 3, "finished")])
    tokens = pd.DataFrame({"req_id": [1, 1, 2, 2, 2], "t_s": [0.1, 0.25, 3.5, 3.6, 3.8]})
    steps = pd.DataFrame({c: pd.Series(dtype=float) for c in ("replica", "duration_s", "batch_size", "kv_used_blocks")})
    s = summarize(req, tokens, steps)
    assert s["duration_s"] == pytest.approx(10.0) and s["completed"] == 2 and s["failed"] == 1
    assert s["request_throughput"] == pytest.approx(2 / 10) and s["output_throughput"] == pytest.approx(5 / 10)
    req.loc[0, "finished_s"] = np.nan      # a measured failure without a return time: no end of its own
    s = summarize(req, tokens, steps)
    assert s["duration_s"] == pytest.approx(4.8) and s["request_throughput"] == pytest.approx(2 / 4.8)


def test_a_one_token_request_has_no_tpot_even_when_its_batch_ends_later():
    # Static batching: a request finishes with its group, so E2E 2.0 s > TTFT 0.5 s even with one
    # token. TPOT = (E2E - TTFT) / (N - 1) only exists for N > 1: NaN here, not (1.5 / 0 =) inf;
    # with a TPOT SLO the request is good (vLLM counts a missing TPOT as 0).
    req = requests_frame([(0.0, 0.5, 2.0, 1, "finished"), (0.0, 0.5, 2.0, 4, "finished")])
    assert np.isnan(req.loc[0, "tpot_s"]) and req.loc[1, "tpot_s"] == pytest.approx(1.5 / 3)
    tokens = pd.DataFrame({"req_id": [0, 1, 1, 1, 1], "t_s": [0.5, 0.5, 1.0, 1.5, 2.0]})
    steps = pd.DataFrame({c: pd.Series(dtype=float) for c in ("replica", "duration_s", "batch_size", "kv_used_blocks")})
    s = summarize(req, tokens, steps, slo={"tpot_ms": 600})
    # goodput: both good (NaN -> 0 <= 600 ms; 500 ms <= 600 ms) over the 2.0 s duration = 1 req/s
    assert s["request_goodput"] == pytest.approx(1.0) and s["count_tpot"] == 1


def test_bench_peaks_count_from_the_first_finished_arrival_and_from_arrivals():
    # Finished: A arrives 0.0, tokens 1.0 1.1 1.2, done 1.2; B arrives 0.02, token 0.05, done 0.05.
    # A request refused at -0.85 s does not move the buckets: they start at 0.0 (the first finished
    # arrival). Tokens, floor(t - 0.0): B's in bucket 0, A's three in bucket 1 -> 3 tok/s. (From
    # -0.85, A's would land at 1.85 1.95 2.05, split 2 + 1; with ceil, 1.0 -> 1 but 1.1, 1.2 -> 2.)
    # In flight from the arrival's bucket to the finish's: bucket 0 holds A and B -> 2 (from the
    # first token or the finish, A would start in bucket 1, after B, and the peak be 1).
    req = requests_frame([(-0.85, np.nan, np.nan, 5, "rejected"), (0.0, 1.0, 1.2, 3, "finished"),
                          (0.02, 0.05, 0.05, 1, "finished")])
    tokens = pd.DataFrame({"req_id": [2, 1, 1, 1], "t_s": [0.05, 1.0, 1.1, 1.2]})
    assert peak_second(req, [(tokens["req_id"].to_numpy(), tokens["t_s"].to_numpy())]) == (3.0, 2)


def test_bench_traffic_burstiness_and_empty_metrics():
    from sim.results.vllm_bench import traffic
    load = offered_load(requests_frame([(0.0, 0.1, 0.2, 2, "finished"), (1.0, 1.1, 1.2, 2, "finished")]))
    # vllm bench serve: gamma gaps of shape k have CV 1/sqrt(k), so CV 2 is burstiness 1/2^2 = 0.25
    assert traffic({"kind": "gamma", "rate": 4.0, "cv": 2.0}, load)["burstiness"] == 0.25
    assert traffic({"kind": "gamma", "rate": 4.0, "cv": 0.5}, load)["burstiness"] == 4.0
    assert traffic({"kind": "constant", "rate": 4.0}, load)["burstiness"] == "inf"
    assert traffic({"kind": "poisson", "rate": 4.0}, load) == {"request_rate": 4.0, "burstiness": 1.0,
                                                              "max_concurrency": None}
    # every request refused: vLLM reports 0.0 for a metric without values, not NaN or null
    run = hand_run()
    req = run.requests.assign(status="rejected", reject_reason="context")
    for col in ("first_token_s", "finished_s", "ttft_s", "e2e_s", "tpot_s", "queue_s"):
        req[col] = np.nan
    empty = RunResult(req, run.steps, run.tokens.iloc[:0], summarize(req, run.tokens.iloc[:0], run.steps),
                      run.meta)
    b = bench_result(empty, parse_percentiles("50,99"), date="20250101-000000")
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert [b[f"{k}_{metric}_ms"] for k in ("mean", "median", "std", "p50", "p99")] == [0.0] * 5


def test_every_policys_default_knobs_resolve():
    from policies import POLICIES, make_policy
    from cases import KINDS
    for kind in KINDS:
        cfg_cls = POLICIES[kind][0]
        cfg = cfg_cls()
        knobs = policy_knobs(cfg, make_policy(cfg, 4096))
        assert None not in knobs.values(), (kind, knobs)


def hand_run() -> RunResult:
    """Four finished requests and one rejected, times in seconds:
      req  arrival  tokens at            ttft  e2e   tpot = (e2e - ttft) / (n - 1)
      0    0.0      0.10 0.15 0.25       0.1   0.25  0.075
      1    0.5      0.70                 0.2   0.2   - (one token)
      2    2.0      2.30 2.40            0.3   0.4   0.1
      3    3.0      3.50 3.80            0.5   0.8   0.3
      4    4.0      rejected (context)"""
    tok = {0: [0.10, 0.15, 0.25], 1: [0.70], 2: [2.30, 2.40], 3: [3.50, 3.80]}
    arrival = [0.0, 0.5, 2.0, 3.0, 4.0]
    first = [tok[i][0] for i in range(4)] + [np.nan]
    last = [tok[i][-1] for i in range(4)] + [np.nan]
    req = pd.DataFrame({"req_id": range(5), "replica": 0, "arrival_s": arrival, "prompt_tokens": [10, 20, 30, 40, 50],
                        "output_tokens": [3, 1, 2, 2, 5], "status": ["finished"] * 4 + ["rejected"],
                        "reject_reason": ["", "", "", "", "context"], "first_scheduled_s": first,
                        "first_token_s": first, "finished_s": last, "num_preemptions": 0})
    req["queue_s"] = req["first_scheduled_s"] - req["arrival_s"]
    req["ttft_s"] = req["first_token_s"] - req["arrival_s"]
    req["e2e_s"] = req["finished_s"] - req["arrival_s"]
    req["tpot_s"] = (req["e2e_s"] - req["ttft_s"]) / (req["output_tokens"].where(req["output_tokens"] > 1) - 1)
    pairs = sorted((t, i) for i, ts in tok.items() for t in ts)
    tokens = pd.DataFrame({"req_id": [i for _, i in pairs], "t_s": [t for t, _ in pairs]})
    steps = pd.DataFrame({c: pd.Series(dtype=float) for c in ("replica", "duration_s", "batch_size", "kv_used_blocks")})
    meta = {"config": {"name": "hand", "arrivals": {"kind": "poisson", "rate": 1.0}, "policy": {"kind": "vllm"}},
            "profile_name": "toy"}
    return RunResult(req, steps, tokens, summarize(req, tokens, steps), meta)


def test_vllm_bench_numbers_by_hand(tmp_path, monkeypatch):
    b = bench_result(hand_run(), parse_percentiles("50,90,99.9"), detailed=True, date="20250101-000000")
    # TTFT ms sorted [100, 200, 300, 500]; numpy's linear percentile at rank p/100 * (4 - 1):
    # p50 rank 1.5 -> 200 + 0.5 * 100 = 250; p90 rank 2.7 -> 300 + 0.7 * 200 = 440;
    # p99.9 rank 2.997 -> 300 + 0.997 * 200 = 499.4; mean 1100 / 4 = 275;
    # std sqrt(((-175)^2 + (-75)^2 + 25^2 + 225^2) / 4) = sqrt(87500 / 4) = sqrt(21875)
    assert b["p50_ttft_ms"] == pytest.approx(250) and b["median_ttft_ms"] == pytest.approx(250)
    assert b["p90_ttft_ms"] == pytest.approx(440) and b["p99.9_ttft_ms"] == pytest.approx(499.4)
    assert b["mean_ttft_ms"] == pytest.approx(275) and b["std_ttft_ms"] == pytest.approx(math.sqrt(21875))
    # TPOT of the requests with > 1 token, ms [75, 100, 300]: p90 rank 1.8 -> 100 + 0.8 * 200 = 260
    assert b["median_tpot_ms"] == pytest.approx(100) and b["p90_tpot_ms"] == pytest.approx(260)
    # ITL, every gap: [50, 100] + [] + [100] + [300] ms; p90 rank 2.7 -> 100 + 0.7 * 200 = 240
    assert b["median_itl_ms"] == pytest.approx(100) and b["p90_itl_ms"] == pytest.approx(240)
    # E2EL ms sorted [200, 250, 400, 800]: p50 = 325; p90 rank 2.7 -> 400 + 0.7 * 400 = 680
    assert b["median_e2el_ms"] == pytest.approx(325) and b["p90_e2el_ms"] == pytest.approx(680)
    # duration: first arrival 0.0 to last finish 3.8 s; 4 of 5 finished
    assert b["duration"] == pytest.approx(3.8) and (b["completed"], b["failed"]) == (4, 1)
    assert b["request_throughput"] == pytest.approx(4 / 3.8)
    # one-second buckets from t = 0: tokens 0.10 0.15 0.25 0.70 land in the first -> 4 tok/s; requests 0
    # ([0, 0.25]) and 1 ([0.5, 0.7]) are both in flight in it -> 2
    assert (b["max_output_tokens_per_s"], b["max_concurrent_requests"]) == (4.0, 2)
    monkeypatch.setattr(sim.results.vllm_bench, "PEAK_ROWS", 1)      # requests counted one at a time: the same
    run = hand_run()
    assert peak_second(run.requests, run.token_chunks()) == (4.0, 2)
    # only the occupied buckets, merged after every chunk (a run too long for an array): the same
    monkeypatch.setattr(sim.results.vllm_bench, "DENSE_SECONDS", 0)
    monkeypatch.setattr(sim.results.vllm_bench, "MERGE_ROWS", 1)
    assert peak_second(run.requests, run.token_chunks()) == (4.0, 2)
    assert b["request_rate"] == 1.0 and b["num_prompts"] == 5
    assert b["output_lens"] == [3, 1, 2, 2, 0] and b["input_lens"] == [10, 20, 30, 40, 50]
    assert b["ttfts"] == pytest.approx([0.1, 0.2, 0.3, 0.5, 0.0])
    assert b["start_times"] == [0.0, 0.5, 2.0, 3.0, 4.0]          # each request's send: its arrival
    assert [pytest.approx(g) for g in b["itls"]] == [[0.05, 0.1], [], [0.1], [0.3], []]
    assert b["errors"] == ["", "", "", "", "rejected: context"]
    assert b["generated_texts"] == [""] * 5 and b["rtfx"] == 0.0
    # E2E per request in s, a failed one 0.0 (as vLLM fills it); open-loop arrivals wait for no client
    assert b["latencies"].tolist() == pytest.approx([0.25, 0.2, 0.4, 0.8, 0.0])
    assert b["queue_times"].tolist() == [0.0] * 5
    write_json(tmp_path / "chunked.json", b, indent=None)       # the series, chunk by chunk
    monkeypatch.setattr(sim.results.folder, "JSON_ROWS", 2)
    write_json(tmp_path / "two.json", b, indent=None)
    as_lists = {k: v.tolist() if isinstance(v, PerRequest) else v for k, v in b.items()}
    assert (tmp_path / "chunked.json").read_text() == (tmp_path / "two.json").read_text() == json.dumps(as_lists) + "\n"
    b = as_lists
    # read back by `sim validate --measured`'s reader, the percentiles survive
    path = tmp_path / "b.json"
    path.write_text(json.dumps(b))
    again = bench_run(read_bench_json(path)).summary
    assert again["p90_ttft_ms"] == pytest.approx(440) and again["p90_itl_ms"] == pytest.approx(240)


@pytest.mark.parametrize("text, expect", [
    ("abc", "'abc' is not a number"),
    ("50,,90", "'' is not a number"),
    ("0", "0 is outside (0, 100]"),
    ("100.5", "100.5 is outside (0, 100]"),
    ("-5", "-5 is outside (0, 100]"),
    ("nan", "nan is outside (0, 100]"),
])
def test_bad_metric_percentiles_fail_before_the_run(tmp_path, monkeypatch, capsys, text, expect):
    never_run(monkeypatch)
    rc, _, err = sim_run(capsys, "--out", str(tmp_path / "out"), "--metric-percentiles", text)
    assert rc == 2 and err.startswith("error: --metric-percentiles: ") and expect in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_percentiles_parse_like_vllms_flag():
    assert parse_percentiles("50, 90,99.9,50") == (50.0, 90.0, 99.9)
    with pytest.raises(ConfigError):
        parse_percentiles("")


# ---- trace.json ---------------------------------------------------------------------------------
def hand_steps() -> pd.DataFrame:
    """Replica 0: steps [0, 10 ms) and [10 ms, 30 ms); replica 1: [5 ms, 6.5 ms)."""
    return pd.DataFrame({
        "replica": [0, 0, 1], "t_s": [0.0, 0.010, 0.005], "duration_s": [0.010, 0.020, 0.0015],
        "predicted_s": [0.010, 0.020, 0.0015], "batch_size": [5, 4, 1], "num_prefill_tokens": [512, 0, 0],
        "num_decode_tokens": [3, 4, 1], "num_pad_tokens": [0, 0, 0], "num_prefill_seqs": [2, 0, 0],
        "num_waiting": [1, 0, 0], "num_running": [5, 4, 1], "kv_used_blocks": [40, 41, 2], "kv_total_blocks": 100})


def test_trace_events_by_hand():
    trace = json.loads("".join(trace_chunks(hand_steps())))
    assert trace["displayTimeUnit"] == "ms"
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    # ts and dur in microseconds: 10 ms = 10000 us, 1.5 ms = 1500 us
    assert [(e["pid"], e["tid"], e["ts"], e["dur"]) for e in steps] == [
        (0, 0, 0.0, 10000.0), (0, 0, 10000.0, 20000.0), (1, 0, 5000.0, 1500.0)]
    # 2 prefill chunks of 512 tokens in all + 3 decodes = 515 tokens
    assert steps[0]["name"] == "2 prefill + 3 decode, 515 tok"
    assert steps[0]["args"] == {"prefill_chunks": 2, "prefill_tokens": 512, "decodes": 3, "pad_tokens": 0,
                                "batch_size": 5, "kv_used_blocks": 40, "num_waiting": 1, "num_running": 5,
                                "tokens": 515}
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "replica 0"), (1, "replica 1")}


def test_trace_step_never_overlaps_the_next():
    steps = hand_steps()
    steps.loc[1, "t_s"] = 0.00999999       # the clock's float sum put the next start 10 ns early
    ev = [e for e in json.loads("".join(trace_chunks(steps)))["traceEvents"] if e["ph"] == "X"]
    # the first step is cut at the next start: 9999.99 us
    assert ev[0]["dur"] == pytest.approx(9999.99) and ev[0]["ts"] + ev[0]["dur"] <= ev[1]["ts"]


def test_long_runs_trace_their_first_steps_only():
    # the two earliest of t = 0, 10 and 5 ms: replica 0's first step and replica 1's
    kept = first_steps(hand_steps(), max_steps=2)
    assert sorted(zip(kept["replica"], kept["t_s"])) == [(0, 0.0), (1, 0.005)]


def test_trace_from_the_cli_is_valid_and_ordered_per_replica(tmp_path, capsys):
    out = tmp_path / "out"
    rc, text, _ = sim_run(capsys, "--out", str(out), "--trace", "--replicas", "2", "--set", "policy.kind=vllm")
    assert rc == 0 and "trace.json" in text
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    steps = pd.read_csv(out / "steps.csv")
    x = [e for e in events if e["ph"] == "X"]
    assert len(x) == len(steps) and {e["pid"] for e in x} == {0, 1}
    for k in (0, 1):
        mine = [e for e in x if e["pid"] == k]
        ends = [e["ts"] + e["dur"] for e in mine[:-1]]
        assert all(end <= nxt["ts"] + 1e-6 for end, nxt in zip(ends, mine[1:]))
        want_us = steps.loc[steps["replica"] == k].sort_values("t_s")["duration_s"].to_numpy() * 1e6
        assert np.allclose([e["dur"] for e in mine], want_us, atol=1e-3)


# ---- the printed summary ------------------------------------------------------------------------
def test_overload_is_flagged_for_static_batching_at_20_per_s(tmp_path, capsys):
    rc, text, _ = sim_run(capsys, "--out", str(tmp_path / "out"), "--set", "num_requests=200")
    assert rc == 0
    lines = text.splitlines()
    assert any(line.startswith("throughput") and "(offered 20." in line for line in lines)
    assert any(line.startswith("overload:") and "sustained" in line for line in lines), text


def test_no_overload_when_only_the_drain_lowers_throughput(tmp_path, capsys):
    rc, text, _ = sim_run(capsys, "--out", str(tmp_path / "out"), "--set", "num_requests=100",
                          "--set", "arrivals.rate=1")
    assert rc == 0
    s = json.loads((tmp_path / "out/summary.json").read_text())
    load = offered_load(pd.read_csv(tmp_path / "out/requests.csv"))
    # completions over first arrival..last finish fall below 90% of the offered rate only because
    # the last long answers drain after the arrivals stop; TTFT stays flat, so no warning
    assert s["request_throughput"] < 0.9 * load.offered_rps
    assert "overload:" not in text


def test_offered_load_by_hand():
    # 10 arrivals 1 s apart: (10 - 1) / 9 s = 1 req/s offered
    arrival = np.arange(10.0)
    flat = pd.DataFrame({"arrival_s": arrival, "status": "finished", "ttft_s": 0.2})
    assert offered_load(flat).offered_rps == pytest.approx(1.0)
    assert not offered_load(flat).overloaded
    # TTFT = 0.1 + 0.5 t: slope 0.5, so the server sustains 1 / (1 + 0.5) = 0.667 req/s < 0.9
    growing = flat.assign(ttft_s=0.1 + 0.5 * arrival)
    assert offered_load(growing).sustained_rps == pytest.approx(2 / 3) and offered_load(growing).overloaded
    at_once = flat.assign(arrival_s=0.0)
    assert offered_load(at_once).offered_rps is None and not offered_load(at_once).overloaded
    closed = offered_load(flat, {"kind": "concurrency", "max_concurrency": 8})
    assert closed.closed_loop and not closed.overloaded


def test_summary_numbers_have_no_scientific_notation(tmp_path, capsys):
    rc, text, _ = sim_run(capsys, "--out", str(tmp_path / "out"), "--set", "num_requests=200")
    assert rc == 0 and "e+" not in text
    ttft_row = next(line for line in text.splitlines() if line.startswith("TTFT"))
    cells = ttft_row.split()[1:6]
    # static batching at 20 req/s: TTFTs in the tens of seconds, printed as 12,345.67 (two decimals each)
    assert all("," in c and len(c.split(".")[1]) == 2 for c in cells), ttft_row


def test_replicas_and_router_are_shown(tmp_path, capsys):
    rc, text, _ = sim_run(capsys, "--out", str(tmp_path / "out"), "--replicas", "3", "--router", "least_requests")
    assert rc == 0 and "replicas    3 behind router least_requests" in text
