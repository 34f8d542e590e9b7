"""`sim validate --server / --measured`: the measured run's tables, the verdict,
the vllm bench serve reader, and one end-to-end run against a real vLLM server."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT

from calibrate.serving.measured import bench_run, measured_run, read_bench_json, replay_table
from calibrate.serving.validate_server import output_dir, resolve_knobs
from reports.presentation import validation as rv
from sim.cli import main
from sim.run.config import ConfigError, workload_from_dict
from sim.cost.profile import load_profile
from sim.run.runner import run_workload

PROFILE = ROOT / "calibrate" / "profiles" / "cpu" / "tiny-llama" / "float32.yaml"


# ---- measured run tables ---------------------------------------------------------------------
def hand_run():
    # r0: sent at 0.0, tokens at 0.1, 0.2, 0.4 -> TTFT 100 ms, ITL 100 and 200 ms, TPOT (0.4-0.1)/2 = 150 ms
    # r1: sent at 0.5, tokens at 0.8, 0.9      -> TTFT 300 ms, ITL 100 ms, TPOT 100 ms
    # r2: sent at 1.0, failed after one token  -> counted as failed, its token dropped
    return measured_run([0.0, 0.5, 1.0], [10, 20, 30], [3, 2, 5],
                        [[0.1, 0.2, 0.4], [0.8, 0.9], [1.2]], [True, True, False])


def test_measured_run_tables_follow_the_benchmark_definitions():
    run = hand_run()
    req = run.requests
    assert list(req["status"]) == ["finished", "finished", "failed"]
    assert np.allclose(req["ttft_s"][:2], [0.1, 0.3]) and math.isnan(req["ttft_s"][2])
    assert np.allclose(req["tpot_s"][:2], [0.15, 0.1])
    assert list(run.tokens["req_id"]) == [0, 0, 0, 1, 1]         # time order; the failed request's token dropped
    s = run.summary
    assert (s["completed"], s["failed"]) == (2, 1)
    # duration: first send 0.0 to last completion 0.9 s; 5 output tokens of finished requests
    assert s["duration_s"] == pytest.approx(0.9)
    assert s["output_throughput"] == pytest.approx(5 / 0.9)
    assert s["p50_ttft_ms"] == pytest.approx(200.0)
    assert s["count_itl"] == 3 and s["p50_itl_ms"] == pytest.approx(100.0)
    assert s["mean_itl_ms"] == pytest.approx(400 / 3)
    for key in ("num_steps", "mean_batch_size", "busy_fraction", "peak_kv_utilization", "p99_queue_ms",
                "num_preemptions"):
        assert s[key] is None, key                               # what a client cannot see
    assert s["count_queue"] == 0


def test_client_results_become_chunks_relative_to_the_replay_start():
    from calibrate.serving.client import StreamResult
    from calibrate.serving.measured import client_run

    # perf_counter origin 1000 s; r1 got tokens 2 and 3 in one event (same stamp): one chunk, as vllm bench counts
    results = [StreamResult(0, 1000.0, [1000.1, 1000.2], 10, 2),
               StreamResult(1, 1000.52, [1000.7, 1000.8, 1000.8], 12, 3),
               StreamResult(2, 1001.0, [], 8, 0, error="HTTP 400: too long")]
    run = client_run(results, 1000.0, [0.0, 0.5, 1.0])
    req = run.requests
    assert np.allclose(req["send_lag_s"], [0.0, 0.02, 0.0]) and np.allclose(req["arrival_s"], [0.0, 0.52, 1.0])
    assert list(req["num_chunks"]) == [2, 2, 0] and list(req["output_tokens"]) == [2, 3, 0]
    assert list(req["status"]) == ["finished", "finished", "failed"]
    assert np.allclose(run.tokens["t_s"], [0.1, 0.2, 0.7, 0.8])
    assert run.summary["count_itl"] == 2 and run.summary["failed"] == 1
    # TPOT uses the token count: (0.8 - 0.7) / (3 - 1)
    assert req["tpot_s"][1] == pytest.approx(0.05)


def test_measured_vs_simulated_summary_error_table():
    sim = dict(hand_run().summary, p50_ttft_ms=220.0, output_throughput=5 / 0.9 * 0.96, p99_itl_ms=None)
    table = rv.error_table(hand_run().summary, sim).set_index("metric")
    assert table.loc["p50_ttft_ms", "err_pct"] == pytest.approx(10.0)     # (220 - 200) / 200
    assert table.loc["output_throughput", "err_pct"] == pytest.approx(-4.0)
    assert math.isnan(table.loc["p99_itl_ms", "err_pct"])
    v = rv.verdict(table.reset_index(), rv.parse_targets(None)).set_index("target")
    assert v.loc["throughput", "met"] and v.loc["ttft_p50", "met"] and v.loc["itl_p50", "met"]
    assert not v.loc["itl_p99", "met"]                                      # a missing number never passes


# ---- verdict ---------------------------------------------------------------------------------
def table_with(metric: str, live: float, sim: float) -> pd.DataFrame:
    return pd.DataFrame([{"metric": metric, "unit": "ms", "live": live, "sim": sim,
                          "err_pct": (sim - live) / live * 100.0}])


@pytest.mark.parametrize("target, metric, live, on, over", [
    ("throughput", "output_throughput", 100.0, 105.0, 105.01),
    ("throughput", "output_throughput", 3.7, 3.7 * 0.95, 3.7 * 0.9499),
    ("ttft_p50", "p50_ttft_ms", 41.3, 41.3 * 1.1, 41.3 * 1.1001),
    ("itl_p50", "p50_itl_ms", 7.0, 6.3, 6.2999),
    ("ttft_p99", "p99_ttft_ms", 250.0, 300.0, 300.01),
    ("itl_p99", "p99_itl_ms", 33.3, 33.3 * 0.8, 33.3 * 0.7999),
])
def test_verdict_exactly_on_the_target_passes_just_over_fails(target, metric, live, on, over):
    targets = {target: rv.TARGETS[target][1]}
    assert rv.verdict(table_with(metric, live, on), targets)["met"].all()
    assert not rv.verdict(table_with(metric, live, over), targets)["met"].any()


def test_targets_override_and_bad_targets():
    t = rv.parse_targets("throughput=2.5, ttft_p99=30%,p90_e2el_ms=15")
    assert t["throughput"] == 2.5 and t["ttft_p99"] == 30.0 and t["p90_e2el_ms"] == 15.0
    assert t["itl_p50"] == 10.0                                   # untouched defaults stay
    v = rv.verdict(table_with("p90_e2el_ms", 100.0, 114.0), {"p90_e2el_ms": 15.0})
    assert v["met"].all() and v["metric"][0] == "p90_e2el_ms"
    for bad in ("throughput", "speed=5", "ttft_p50=-1", "ttft_p50=fast", "itl_p99=nan", "",
                "throughput=500,throughput=1"):
        with pytest.raises(ConfigError, match="--targets"):
            rv.parse_targets(bad)
    with pytest.raises(ConfigError, match="throughput is given twice"):
        rv.parse_targets("throughput=500,throughput=1")
    text = rv.format_verdict(rv.verdict(table_with("p50_ttft_ms", 10.0, 12.0), {"ttft_p50": 10.0}))
    assert "MISSED" in text and text.endswith("ttft_p50)")


# ---- prefix-cache hit rate and repeats ------------------------------------------------------------
def test_hit_rate_row_is_in_percent_and_its_error_in_points():
    live = dict(hand_run().summary, prefix_cache_hit_rate=0.70)
    table = rv.error_table(live, dict(live, prefix_cache_hit_rate=0.72)).set_index("metric")
    row = table.loc["prefix_cache_hit_rate"]
    # 70% measured, 72% simulated: +2 points (a relative error would say +2.9%)
    assert (row["unit"], row["live"], row["sim"]) == ("%", 70.0, 72.0)
    assert row["err_pct"] == pytest.approx(2.0)
    assert table.index[-1] == "prefix_cache_hit_rate"                      # after the latencies
    assert "prefix_cache_hit_rate" not in set(rv.error_table(hand_run().summary, hand_run().summary)["metric"])
    assert rv.parse_targets("hit_rate=1")["hit_rate"] == 1.0
    v = rv.verdict(table.reset_index(), {"hit_rate": 3.0}).set_index("target")
    assert v.loc["hit_rate", "metric"] == "prefix_cache_hit_rate" and v.loc["hit_rate", "met"]
    missed = rv.error_table(live, dict(live, prefix_cache_hit_rate=0.7301))      # +3.01 points
    assert not rv.verdict(missed, {"hit_rate": 3.0})["met"].any()
    assert "err    +2.0 pt   limit ±3pt   met" in rv.format_verdict(v.reset_index())
    unknown = rv.error_table(dict(live, prefix_cache_hit_rate=None), live)        # counters unreadable
    assert not rv.verdict(unknown, {"hit_rate": 3.0})["met"].any()


def test_repeats_compare_medians_and_a_target_is_met_inside_the_live_spread():
    lives = [dict(output_throughput=t, p50_ttft_ms=f, prefix_cache_hit_rate=h)
             for t, f, h in ((100.0, 40.0, 0.50), (110.0, 50.0, 0.52), (104.0, 44.0, 0.51))]
    # median throughput 104 (range 100..110, spread (110 - 100) / 104 = 9.62%); sim 109.5: +5.29%,
    # over the 5% limit but inside the range: met. TTFT median 44 (40..50, 22.7%); sim 51: +15.9%,
    # outside: missed. Hit rate median 51% (50..52, 2 points); sim 0.545: +3.5 points, outside: missed.
    table = rv.repeat_table(lives, [dict(output_throughput=109.5, p50_ttft_ms=51.0,
                                         prefix_cache_hit_rate=0.545)]).set_index("metric")
    t = table.loc["output_throughput"]
    assert (t["live"], t["live_min"], t["live_max"], t["sim"]) == (104.0, 100.0, 110.0, 109.5)
    assert t["spread_pct"] == pytest.approx(10 / 104 * 100) and t["err_pct"] == pytest.approx(5.5 / 104 * 100)
    assert table.loc["p50_ttft_ms", "spread_pct"] == pytest.approx(10 / 44 * 100)
    h = table.loc["prefix_cache_hit_rate"]
    assert (h["live"], h["live_min"], h["live_max"]) == pytest.approx((51.0, 50.0, 52.0))
    assert h["spread_pct"] == pytest.approx(2.0) and h["err_pct"] == pytest.approx(3.5)
    v = rv.verdict(table.reset_index(), {"throughput": 5.0, "ttft_p50": 10.0, "hit_rate": 3.0}).set_index("target")
    assert v.loc["throughput", "in_spread"] and v.loc["throughput", "met"]
    assert not v.loc["ttft_p50", "in_spread"] and not v.loc["ttft_p50", "met"]
    assert not v.loc["hit_rate", "met"]
    text = rv.format_verdict(v.reset_index())
    assert "live spread 9.62%, sim inside it   met" in text and "live spread 2pt   MISSED" in text
    assert "spread %" in rv.format_table(table.reset_index())
    one = rv.repeat_table(lives[:1], [lives[1]])                            # one run: the plain table
    assert "live_min" not in one and list(one.columns) == list(rv.error_table(lives[0], lives[1]).columns)
    assert "in_spread" not in rv.verdict(one, {"throughput": 5.0})


def test_simulated_prefix_counts_are_vllms_new_request_counts(tmp_path):
    """Three requests, one second apart, sharing a 32-token prefix (2 blocks of 16) before 8
    tokens of their own: the first hits nothing, the next two the 32 prefix tokens (their
    lookup may take (40 - 1) // 16 = 2 blocks). Queries 3 x 40 = 120, hits 2 x 32 = 64."""
    from calibrate.serving.validate_server import sim_prefix_counts, with_prefix_counts
    from workloads.generate import Contents, RequestSpecs

    contents = Contents(np.array([1, 10, 1, 11, 1, 12], np.int64), np.array([32, 8] * 3, np.int64),
                        np.array([0, 2, 4, 6], np.int64), np.array([20, 21, 22], np.int64))
    specs = RequestSpecs(np.array([0.0, 1.0, 2.0]), np.full(3, 40, np.int64), np.full(3, 4, np.int64),
                         contents=contents)
    cfg = workload_from_dict({"name": "pfx", "num_requests": 3, "arrivals": {"kind": "poisson", "rate": 1},
                              "lengths": {"kind": "fixed", "prompt_tokens": 40, "output_tokens": 4},
                              "policy": {"kind": "vllm_v1"}, "profile": {"path": str(PROFILE)}}, "w.yaml")
    sim = run_workload(cfg, specs=specs)
    assert sim_prefix_counts(sim) == (120, 64)
    # the pool's counters agree with the requests table: hits are the cached tokens of admitted requests
    assert int(sim.table.cols["cached_tokens"].sum()) == 64
    assert with_prefix_counts(sim).summary["prefix_cache_hit_rate"] == pytest.approx(64 / 120)
    off = run_workload(workload_from_dict({**cfg.raw, "policy": {"kind": "vllm_v1", "enable_prefix_caching": False}},
                                          "w.yaml"), specs=specs)
    assert sim_prefix_counts(off) == (120, 0)


def test_repeat_needs_a_server(tmp_path, capsys):
    wl = write(tmp_path, WORKLOAD, "w.yaml")
    bench = write(tmp_path, bench_dict())
    for extra, words in ((["--measured", str(bench), "--repeat", "2"], "only a live replay against a server"),
                         (["--server", "http://127.0.0.1:9", "--repeat", "0"], "--repeat must be >= 1")):
        assert main(["validate", str(wl), "--profile", str(PROFILE), "--out", str(tmp_path / "o"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and err.count("\n") == 1, err


# ---- vllm bench serve --save-result --save-detailed ------------------------------------------
def bench_dict() -> dict:
    """A small file in vLLM 0.32's layout: 3 requests, the last one failed."""
    return {
        "date": "20260101-000000", "backend": "vllm", "model_id": "tiny", "num_prompts": 3,
        "request_rate": 4.0, "burstiness": 1.0, "max_concurrency": None, "duration": 1.5,
        "completed": 2, "failed": 1, "total_input_tokens": 30, "total_output_tokens": 5,
        "request_throughput": 2 / 1.5, "output_throughput": 5 / 1.5,
        "input_lens": [10, 20, 30], "output_lens": [3, 2, 0], "ttfts": [0.1, 0.3, 0.0],
        "itls": [[0.1, 0.2], [0.1], []], "latencies": [0.4, 0.4, 0.0],
        "start_times": [100.0, 100.5, 101.0], "queue_times": [0.0, 0.0, 0.0],
        "generated_texts": ["a b c", "d e", ""], "errors": ["", "", "HTTP 500"],
        "median_ttft_ms": 200.0, "p99_ttft_ms": 298.0, "median_itl_ms": 100.0, "p99_itl_ms": 198.0,
    }


def write(tmp_path: Path, data, name: str = "bench.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_bench_reader_rebuilds_the_clients_timestamps(tmp_path):
    bench = read_bench_json(write(tmp_path, bench_dict()))
    assert len(bench) == 3 and bench.completed == 2 and list(bench.success) == [True, True, False]
    assert bench.request_rate == 4.0 and bench.burstiness == 1.0 and bench.model_id == "tiny"
    run = bench_run(bench)
    # send times relative to the first: 0, 0.5, 1.0; tokens at send + TTFT + cumulative ITL
    assert np.allclose(run.requests["arrival_s"], [0.0, 0.5, 1.0])
    assert np.allclose(run.tokens["t_s"], [0.1, 0.2, 0.4, 0.8, 0.9])
    s = run.summary
    assert s["p50_ttft_ms"] == pytest.approx(200.0) and s["p50_itl_ms"] == pytest.approx(100.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    trace = replay_table(run)
    assert list(trace.columns) == ["arrival_time_s", "prompt_tokens", "output_tokens"] and len(trace) == 2


def test_bench_reader_without_start_times_takes_given_arrivals(tmp_path):
    data = bench_dict()
    del data["start_times"]
    bench = read_bench_json(write(tmp_path, data))
    with pytest.raises(ConfigError, match="start_times"):
        bench_run(bench)
    with pytest.raises(ConfigError, match="3 requests but the workload has 2"):
        bench_run(bench, [0.0, 1.0])
    run = bench_run(bench, [0.0, 2.0, 3.0])
    assert np.allclose(run.requests["first_token_s"][:2], [0.1, 2.3])
    assert run.meta["arrivals_measured"] is False


def test_a_closed_loop_file_without_start_times_is_refused(tmp_path):
    from calibrate.serving.measured import measure_file
    from sim.run.config import workload_from_dict
    data = bench_dict()
    del data["start_times"]
    cfg = workload_from_dict({"name": "c", "num_requests": 3, "arrivals": {"kind": "concurrency", "max_concurrency": 2},
                              "lengths": {"kind": "fixed", "prompt_tokens": 10, "output_tokens": 3}})
    with pytest.raises(ConfigError, match="'start_times' is missing and the workload is closed-loop"):
        measure_file(cfg, str(write(tmp_path, data)))


@pytest.mark.parametrize("edit, expect", [
    (lambda d: d.pop("itls"), "field 'itls' is missing (save the result with vllm bench serve --save-result"),
    (lambda d: d.pop("completed"), "field 'completed' is missing"),
    (lambda d: d.update(output_lens=[3, 2]), "field 'output_lens' has 2 entries but input_lens has 3"),
    (lambda d: d.update(ttfts=[0.1, 0.3]), "field 'ttfts' has 2 entries but input_lens has 3"),
    (lambda d: d.update(itls=[[0.1], []]), "field 'itls' must be a list of 3 lists"),
    (lambda d: d.update(start_times=[1.0, 2.0]), "field 'start_times' has 2 entries"),
    (lambda d: d["ttfts"].__setitem__(1, float("nan")), "field 'ttfts[1]' is nan"),
    (lambda d: d["itls"][0].__setitem__(1, float("nan")), "field 'itls[0][1]' is nan"),
    (lambda d: d["start_times"].__setitem__(2, float("inf")), "field 'start_times[2]' is inf"),
    (lambda d: d["ttfts"].__setitem__(0, -0.5), "field 'ttfts[0]' must be >= 0"),
    (lambda d: d["input_lens"].__setitem__(0, 10.5), "field 'input_lens[0]' must be an integer"),
    (lambda d: d["output_lens"].__setitem__(0, "3"), "field 'output_lens[0]' must be a number"),
    (lambda d: d["itls"].__setitem__(1, 0.1), "field 'itls[1]' must be a list of seconds"),
    (lambda d: d.update(completed=3), "field 'completed' is 3 but 2 requests have a non-zero output_lens"),
    (lambda d: d["ttfts"].__setitem__(0, 0.0), "field 'ttfts[0]' is 0.0 for a completed request"),
    (lambda d: d.update(input_lens=[], output_lens=[], ttfts=[], itls=[], start_times=[], latencies=[],
                        errors=[], completed=0), "field 'input_lens' is empty"),
    (lambda d: d.update(request_rate="fast"), "field 'request_rate' must be a number"),
    (lambda d: d["input_lens"].__setitem__(0, 10**30), "field 'input_lens[0]' is 1e+30, too large for a token count"),
    (lambda d: d["input_lens"].__setitem__(0, 0), "field 'input_lens[0]' is 0 for a completed request"),
    (lambda d: d.update(duration=0), "field 'duration' is 0: the benchmark's wall time must be > 0 s"),
    # duration 1.5 s: anything past 1.5 x 1.01 + 1 = 2.515 s is not from this benchmark
    (lambda d: d["ttfts"].__setitem__(0, 1e300), "field 'ttfts[0]' is 1e+300 s, longer than the file's duration 1.5"),
    (lambda d: d["latencies"].__setitem__(1, 2.6), "field 'latencies[1]' is 2.6 s, longer than the file's duration"),
    (lambda d: d.update(start_times=[0.0, 1e300, 1e300]), "field 'start_times' span 1e+300 s, longer than the file"),
    (lambda d: d.update(request_rate=0), "field 'request_rate' is 0 (expected a number > 0, or \"inf\")"),
    (lambda d: d.update(burstiness=0), "field 'burstiness' is 0"),
    (lambda d: d.update(max_concurrency=0), "field 'max_concurrency' is 0 (expected an integer >= 1, or null)"),
    (lambda d: d.update(max_concurrency=2.5), "field 'max_concurrency' is 2.5"),
])
def test_bench_reader_rejects_malformed_files(tmp_path, edit, expect):
    data = bench_dict()
    edit(data)
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        read_bench_json(path)
    msg = str(err.value)
    assert msg.startswith(str(path)) and expect in msg and "\n" not in msg


@pytest.mark.parametrize("text, expect", [
    ("{not json", "invalid JSON at line 1"),
    (json.dumps(bench_dict()) + "\n" + json.dumps(bench_dict()), "--append-result"),
    ("[1, 2]", "expected a JSON object"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply to be a vllm bench serve result"),
])
def test_bench_reader_rejects_non_results(tmp_path, text, expect):
    with pytest.raises(ConfigError, match=re.escape(expect)):
        read_bench_json(write(tmp_path, text))
    with pytest.raises(ConfigError, match="file not found"):
        read_bench_json(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="is a folder"):
        read_bench_json(tmp_path)


# ---- configuration and files ---------------------------------------------------------------------
WORKLOAD = """
name: srv
seed: 2
num_requests: 3
arrivals: {kind: poisson, rate: 4}
lengths: {kind: fixed, prompt_tokens: 64, output_tokens: 8}
policy: {kind: sarathi, max_num_seqs: 8, max_num_batched_tokens: 256}
server: {max_model_len: 2048}
"""


def test_knobs_come_from_server_then_profile_engine_then_workload():
    import yaml
    cfg = workload_from_dict(yaml.safe_load(WORKLOAD), "w.yaml")
    profile = load_profile(PROFILE)
    profile.engine = {"max_num_seqs": 16, "num_gpu_blocks": 500, "block_size": 32}
    values, sources, notes = resolve_knobs(cfg, profile, {"num_blocks": 900, "max_num_seqs": None,
                                                          "block_size": None, "max_model_len": None,
                                                          "max_num_batched_tokens": None})
    assert values == {"num_blocks": 900, "block_size": 32, "max_model_len": 2048, "max_num_seqs": 16,
                      "max_num_batched_tokens": 256}
    assert sources == {"num_blocks": "server", "block_size": "profile engine", "max_model_len": "workload",
                       "max_num_seqs": "profile engine", "max_num_batched_tokens": "workload"}
    assert notes == ["note: the workload's max_num_seqs 8 is not the server's; 16 (profile engine) is used"]
    bare = workload_from_dict({k: v for k, v in yaml.safe_load(WORKLOAD).items() if k != "server"}, "w.yaml")
    profile.engine = {}
    values, sources, _ = resolve_knobs(bare, profile, None)
    assert (values["block_size"], sources["block_size"]) == (16, "batchsim default")
    assert (values["num_blocks"], sources["num_blocks"]) == (None, "default")      # from the profile's memory


def test_output_dir_never_reuses_a_non_empty_folder(tmp_path):
    base = tmp_path / "runs" / "v"
    assert output_dir(str(base), "w", "x") == base
    base.mkdir(parents=True)
    assert output_dir(str(base), "w", "x") == base                    # empty: fine
    (base / "report.md").write_text("old")
    (tmp_path / "runs" / "v-2").mkdir()
    (tmp_path / "runs" / "v-2" / "f").write_text("old")
    assert output_dir(str(base), "w", "x") == tmp_path / "runs" / "v-3"
    assert output_dir(None, "w", "127.0.0.1:8000") == Path("runs") / "validate-w-127.0.0.1_8000"
    # a workload already named validate-... is not prefixed twice
    assert output_dir(None, "validate-tiny", None) == Path("runs") / "validate-tiny"
    (tmp_path / "bench.json").write_text("{}")                    # a file at --out: refused, not bench.json-2/
    with pytest.raises(ConfigError, match="bench.json: is a file; give a folder for the report"):
        output_dir(str(tmp_path / "bench.json"), "w", None)


def test_validate_measured_end_to_end_without_torch(tmp_path):
    """--measured on a hand-written file: with --check exit 0/1 by the verdict, report files, no torch
    import; without --check the verdict is printed and the exit status is 0."""
    wl = write(tmp_path, WORKLOAD, "w.yaml")
    bench = write(tmp_path, bench_dict())
    out = tmp_path / "out"
    code = (f"import sys; from sim.cli import main; rc = main(['validate', r'{wl}', '--measured', r'{bench}', "
            f"'--profile', r'{PROFILE}', '--out', r'{out}', '--check']); "
            f"assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode in (0, 1), res.stderr
    assert ("verdict: PASS" in res.stdout) == (res.returncode == 0), res.stdout
    for name in ("report.md", "report.json", "report.html", "cdf.png", "cdf.svg", "replayed_requests.csv",
                 "measured/summary.json", "sim/summary.json"):
        assert (out / name).is_file(), name
    body = json.loads((out / "report.json").read_text())
    assert body["policy"]["kind"] == "vllm_v1" and body["passed"] == (res.returncode == 0)
    assert any("sarathi is replaced by vllm_v1" in n for n in body["notes"])
    assert "data:image/png;base64," in (out / "report.html").read_text()
    sim_req = pd.read_csv(out / "sim" / "requests.csv")
    assert list(sim_req["prompt_tokens"]) == [10, 20]                # the file's requests, not the workload's
    plain = subprocess.run([sys.executable, "-m", "sim.cli", "validate", str(wl), "--measured", str(bench),
                            "--profile", str(PROFILE), "--out", str(tmp_path / "plain")],
                           capture_output=True, text=True, cwd=ROOT)
    assert plain.returncode == 0 and "verdict: " in plain.stdout, plain.stderr


def test_an_interrupted_report_leaves_no_folder(tmp_path, monkeypatch, capsys):
    import calibrate.serving.validate_server as vs
    import sim.results.folder
    wl = write(tmp_path, WORKLOAD, "w.yaml")
    bench = write(tmp_path, bench_dict())
    real = sim.results.folder.write_run

    def interrupted(result, out_dir, **kw):        # measured/ is written, then Ctrl-C before sim/
        if Path(out_dir).name == "sim":
            raise KeyboardInterrupt
        return real(result, out_dir, **kw)
    monkeypatch.setattr(sim.results.folder, "write_run", interrupted)
    from sim.cli import main
    assert main(["validate", str(wl), "--measured", str(bench), "--profile", str(PROFILE),
                 "--out", str(tmp_path / "out")]) == 130
    assert not (tmp_path / "out").exists() and vs.output_dir(str(tmp_path / "out"), "w", None) == tmp_path / "out"


def test_calibrate_server_flag_dispatches_to_the_server_calibration(monkeypatch):
    import types
    seen = {}
    fake = types.ModuleType("calibrate.serving.calibrate_server")
    fake.main = lambda args: seen.setdefault("args", args) and 0
    monkeypatch.setitem(sys.modules, "calibrate.serving.calibrate_server", fake)
    assert main(["calibrate", "--server", "http://127.0.0.1:8000", "--out", "p.yaml", "--budget-s", "30",
                 "--seed", "3", "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
                 "--model-config", "config.json", "--quiet"]) == 0
    a = seen["args"]
    assert (a.server, a.out, a.budget_s, a.seed, a.quiet) == ("http://127.0.0.1:8000", "p.yaml", 30.0, 3, True)
    assert (a.max_num_seqs, a.max_num_batched_tokens, a.model_config) == (32, 512, "config.json")


def test_validate_bad_inputs_exit_2(tmp_path, capsys):
    wl = write(tmp_path, WORKLOAD, "w.yaml")
    bad = bench_dict()
    bad["ttfts"][0] = float("nan")
    cases = [["--measured", str(write(tmp_path, bad)), "--profile", str(PROFILE)],
             ["--measured", str(write(tmp_path, bench_dict(), "ok.json"))],                  # no profile
             ["--measured", str(tmp_path / "ok.json"), "--profile", str(PROFILE), "--targets", "ttft=3"],
             ["--server", "http://127.0.0.1:9", "--profile", str(PROFILE)],                   # nobody there
             ["--server", "localhost:8000", "--profile", str(PROFILE)],                       # not a URL
             ["--targets", "ttft_p50=fast"]]                    # torch engine: refused before calibrating
    for extra in cases:
        assert main(["validate", str(wl), "--out", str(tmp_path / "o"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


# ---- against a real vLLM server --------------------------------------------------------------------
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")

if Path(__file__).resolve().parents[1].joinpath("conftest_vllm.py").is_file():
    pytest_plugins = ["conftest_vllm"]     # the shared session server (tiny-llama, 8 seqs, 256 tokens)
else:
    @pytest.fixture(scope="module")
    def vllm_server(tmp_path_factory):
        from calibrate.serving.launch import VllmServer
        from calibrate.serving.tiny_model import write_tiny_llama

        model = write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny")
        with VllmServer(model, max_num_seqs=32, max_num_batched_tokens=512, prefix_caching=True) as server:
            yield server


SERVER_WORKLOAD = """
name: srv-e2e
seed: 4
num_requests: 40
arrivals: {kind: gamma, rate: 4, cv: 2}
lengths: {kind: uniform, prompt_min: 64, prompt_max: 320, output_min: 8, output_max: 48}
policy: {kind: vllm_v1}
"""


@needs_vllm
def test_validate_against_a_real_vllm_server(tmp_path, vllm_server, capsys):
    url = getattr(vllm_server, "url", vllm_server)
    wl = write(tmp_path, SERVER_WORKLOAD, "w.yaml")
    out = tmp_path / "report"
    rc = main(["validate", str(wl), "--server", url, "--profile", str(PROFILE), "--out", str(out), "--quiet",
               "--check"])
    printed = capsys.readouterr().out
    assert rc in (0, 1)
    assert ("verdict: PASS" in printed) == (rc == 0) and ("verdict: FAIL" in printed) == (rc == 1)
    for name in ("report.md", "report.json", "report.html", "cdf.png", "cdf.svg", "measured/tokens.npz",
                 "sim/summary.json"):
        assert (out / name).is_file(), name
    body = json.loads((out / "report.json").read_text())
    assert body["passed"] == (rc == 0) and body["completed"]["live"] == 40
    assert body["knobs"]["num_blocks"]["source"] == "server" and body["knobs"]["block_size"]["source"] == "server"
    for row in body["table"]:
        assert all(isinstance(row[k], float) and math.isfinite(row[k]) for k in ("live", "sim", "err_pct")), row
    load = body["load"]
    assert len(load["before_1_5_15min"]) == 3 and len(load["after_1_5_15min"]) == 3
    measured = pd.read_csv(out / "measured" / "requests.csv")
    assert (measured["status"] == "finished").all() and (measured["send_lag_s"] >= -1e-9).all()


def max_in_flight(requests: pd.DataFrame) -> int:
    """Most requests between send (arrival_s) and last token (finished_s) at any instant."""
    events = sorted([(t, 1) for t in requests["arrival_s"]] + [(t, -1) for t in requests["finished_s"]],
                    key=lambda e: (e[0], e[1]))                  # a finish at t frees its slot before a send at t
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


@needs_vllm
def test_validate_closed_loop_against_a_real_vllm_server(tmp_path, vllm_server):
    """arrivals.kind concurrency replays as vllm bench serve --max-concurrency: never more than N in flight
    on the server, and the simulated twin is a closed loop of the same N clients."""
    url = getattr(vllm_server, "url", vllm_server)
    wl = write(tmp_path, SERVER_WORKLOAD.replace("arrivals: {kind: gamma, rate: 4, cv: 2}",
                                                 "arrivals: {kind: concurrency, max_concurrency: 3}")
               .replace("num_requests: 40", "num_requests: 12"), "w.yaml")
    out = tmp_path / "report"
    assert main(["validate", str(wl), "--server", url, "--profile", str(PROFILE), "--out", str(out),
                 "--quiet"]) == 0                                 # no --check: 0 whatever the verdict
    measured = pd.read_csv(out / "measured" / "requests.csv")
    simulated = pd.read_csv(out / "sim" / "requests.csv")
    assert len(measured) == len(simulated) == 12 and (measured["status"] == "finished").all()
    assert max_in_flight(measured) == 3 and max_in_flight(simulated) == 3
    body = json.loads((out / "report.json").read_text())
    assert any("at most 3 requests in flight" in n for n in body["notes"])


def shared_prefix_and_session_specs():
    """Five requests (prompts in blocks of 128, the server's): r0-r2 share a 256-token prefix
    before 64 tokens of their own, 0.6 s apart; r3 is a session's first turn (200 tokens, 100
    outputs) and r4 its next turn: r3's prompt, its 100 outputs, 40 new tokens (arrival 9.9 s,
    a placeholder: it is sent 0.2 s after r3's reply)."""
    from workloads.generate import Contents, RequestSpecs

    keys = [1, 11, 1, 12, 1, 13, 2, 2, 103, 3]
    lengths = [256, 64, 256, 64, 256, 64, 200, 200, 100, 40]
    contents = Contents(np.array(keys, np.int64), np.array(lengths, np.int64),
                        np.array([0, 2, 4, 6, 7, 10], np.int64), np.array([100, 101, 102, 103, 104], np.int64))
    return RequestSpecs(np.array([0.0, 0.6, 1.2, 1.8, 9.9]), np.array([320, 320, 320, 200, 340], np.int64),
                        np.array([4, 4, 4, 100, 4], np.int64), contents=contents)


@needs_vllm
def test_server_hit_rate_matches_hand_count_and_the_simulation_over_repeats(vllm_server):
    """Hits by hand (128-token blocks, lookups capped at (tokens - 1) // 128 blocks): r1 and r2
    hit the 2 prefix blocks (256 each); r4 hits r3's 2 full blocks (r3 computed 200 + 99 = 299
    tokens), the second holding r3's first 56 outputs, so only with the ids the server generated
    (the simulator's would hit 128). Hits 3 x 256 = 768 of queries 3 x 320 + 200 + 340 = 1500:
    51.2%, in each of two replays (a fresh salt each: the second does not hit the first's blocks)."""
    from calibrate.serving.validate_server import validate_server

    url = getattr(vllm_server, "url", vllm_server)
    cfg = workload_from_dict({"name": "pfx-live", "num_requests": 5, "arrivals": {"kind": "poisson", "rate": 1},
                              "lengths": {"kind": "fixed", "prompt_tokens": 320, "output_tokens": 4},
                              "policy": {"kind": "vllm_v1"}}, "w.yaml")
    v = validate_server(cfg, profile=str(PROFILE), server=url, specs=shared_prefix_and_session_specs(),
                        repeat=2, think_time_s=0.2, sim_on_sends=True)
    assert v.prefix_caching["server"] is True and v.prefix_caching["simulated"] is True
    assert v.prefix_caching["live"] == [{"queries": 1500, "hits": 768, "hit_rate": 0.512}] * 2
    assert v.prefix_caching["sim"] == [{"queries": 1500, "hits": 768, "hit_rate": 0.512}] * 2
    row = v.table.set_index("metric").loc["prefix_cache_hit_rate"]
    assert (row["live"], row["sim"], row["err_pct"], row["spread_pct"]) == pytest.approx((51.2, 51.2, 0.0, 0.0))
    assert v.verdict.set_index("target").loc["hit_rate", "met"]
    req = v.measurement.run.requests
    assert req.loc[4, "arrival_s"] >= req.loc[3, "finished_s"] + 0.2 - 1e-6      # sent after r3's reply
    body = v.body()
    assert body["repeat"] == 2 and [r["prefix_cache_hits"] for r in body["live_runs"]] == [768, 768]
    assert any("1 requests are next turns" in n for n in v.notes)


@needs_vllm
def test_validate_repeat_from_the_command_line(tmp_path, vllm_server, capsys):
    """--repeat 2: the table shows the live spread, report.json each run, measured-2/ the second;
    the workload's random prompts share nothing, so both sides hit 0% of the server's cache. The
    workload turns prefix caching off, the server has it on: the simulation follows the server."""
    url = getattr(vllm_server, "url", vllm_server)
    wl = write(tmp_path, SERVER_WORKLOAD.replace("num_requests: 40", "num_requests: 10")
               .replace("rate: 4, cv: 2", "rate: 8, cv: 1")
               .replace("policy: {kind: vllm_v1}", "policy: {kind: vllm_v1, enable_prefix_caching: false}"), "w.yaml")
    out = tmp_path / "report"
    assert main(["validate", str(wl), "--server", url, "--profile", str(PROFILE), "--out", str(out), "--quiet",
                 "--repeat", "2"]) == 0
    printed = capsys.readouterr().out
    assert "live spread" in printed and "spread %" in printed and "prefix_cache_hit_rate (%)" in printed
    body = json.loads((out / "report.json").read_text())
    assert body["repeat"] == 2 and len(body["live_runs"]) == 2 and (out / "measured-2" / "requests.csv").is_file()
    rows = {r["metric"]: r for r in body["table"]}
    lo, hi = rows["output_throughput"]["live_min"], rows["output_throughput"]["live_max"]
    assert lo <= rows["output_throughput"]["live"] <= hi
    assert sorted(r["output_throughput"] for r in body["live_runs"]) == pytest.approx([lo, hi])
    assert (rows["prefix_cache_hit_rate"]["live"], rows["prefix_cache_hit_rate"]["sim"]) == (0.0, 0.0)
    assert [r["prefix_cache_hits"] for r in body["live_runs"]] == [0, 0]
    assert body["policy"]["enable_prefix_caching"] is True
    assert body["prefix_caching"]["server"] is True and body["prefix_caching"]["simulated"] is True
    assert any("the server has prefix caching on, the workload's policy off; the simulation follows the "
               "server" in n for n in body["notes"])
