"""Closed-loop load (``arrivals: {kind: concurrency, max_concurrency: N}``), a
rate or trace capped at N in flight, and vLLM's ``enable_chunked_prefill``
flag, with hand-computed runs.

Every hand run uses a profile whose steps all cost 10 ms (no per-token or
attention cost), so a step's end is its start + 0.010 s. A client sends its
next request when the reply comes (the end of the step that finished the
previous one); the server has already picked the step that starts then, so
the new request waits for the next step (``sim.loop.feed.feed_capped``).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from conftest import WORKLOADS, linear_profile

from policies.sarathi import SarathiConfig
from policies.vllm import VllmConfig
from policies.vllm_v1 import VllmV1Config
from sim.cli import main
from sim.run.config import ConfigError, load_workload, workload_from_dict
from sim.run.runner import run_workload
from sim.results.result import RunResult
from sim.results.vllm_bench import bench_result


def exact(x: float) -> pytest.approx:
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def workload(tmp: Path, arrivals: dict[str, Any], lengths: list[tuple[int, int]] | dict[str, Any],
             engine: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    """A raw workload on the 10-ms-per-step profile (``engine``: the measured
    server's facts); ``lengths`` as (prompt, output) pairs are taken in order
    from a length file."""
    profile = linear_profile(per_token_s=0.0, overhead_s=0.010, decode_per_ctx_s=0.0, prefill_per_ctx_s=0.0)
    dataclasses.replace(profile, engine=engine or {}).save(tmp / "p.yaml")
    if isinstance(lengths, list):
        (tmp / "lengths.csv").write_text("prompt_tokens,output_tokens\n"
                                         + "".join(f"{p},{o}\n" for p, o in lengths))
        lengths = {"kind": "empirical", "path": str(tmp / "lengths.csv"), "sample": "sequential"}
    data = {"name": "closed", "arrivals": arrivals, "lengths": lengths, "policy": {"kind": "vllm"},
            "server": {"max_model_len": 1024, "num_blocks": 256, "watermark": 0.0},
            "profile": {"path": str(tmp / "p.yaml")}}
    return {**data, **top}


def run(tmp: Path, *args: Any, num_replicas: int = 1, router: str = "round_robin", **top: Any) -> RunResult:
    return run_workload(workload_from_dict(workload(tmp, *args, **top)), num_replicas=num_replicas,
                        router=router)


def in_flight_at_arrivals(req: pd.DataFrame) -> np.ndarray:
    """At each request's send time t: requests with arrival <= t < finish."""
    arr, fin = req["arrival_s"].to_numpy(), req["finished_s"].to_numpy()
    return np.array([int(((arr <= t) & (fin > t)).sum()) for t in arr])


# ---- closed loops by hand --------------------------------------------------------------------
#
# 2 clients, 5 requests (prompt, output): R0 (10, 2)  R1 (10, 4)  R2 (10, 1)  R3 (10, 3)  R4 (10, 2).
# Policy vllm: a prefill-only step when waiting requests fit, else a decode-only step.
#
# step  start  work                  tokens after (of output)   replies -> sends
#  1    0.00   prefill R0, R1        R0 1/2, R1 1/4             (R0, R1 sent at 0)
#  2    0.01   decode R0, R1         R0 2/2 done, R1 2/4        R0 at 0.02 -> R2 sent 0.02
#  3    0.02   decode R1             R1 3/4                     (R2 was sent after step 3 was picked)
#  4    0.03   prefill R2            R2 1/1 done                R2 at 0.04 -> R3 sent 0.04
#  5    0.04   decode R1             R1 4/4 done                R1 at 0.05 -> R4 sent 0.05
#  6    0.05   prefill R3            R3 1/3
#  7    0.06   prefill R4            R4 1/2
#  8    0.07   decode R3, R4         R3 2/3, R4 2/2 done        (all 5 sent)
#  9    0.08   decode R3             R3 3/3 done at 0.09
def test_closed_loop_by_hand(tmp_path: Path) -> None:
    res = run(tmp_path, {"kind": "concurrency", "max_concurrency": 2},
              [(10, 2), (10, 4), (10, 1), (10, 3), (10, 2)], num_requests=5)
    r = res.requests.set_index("req_id")
    assert list(r["arrival_s"]) == [exact(t) for t in (0.0, 0.0, 0.02, 0.04, 0.05)]
    assert list(r["first_scheduled_s"]) == [exact(t) for t in (0.0, 0.0, 0.03, 0.05, 0.06)]
    assert list(r["first_token_s"]) == [exact(t) for t in (0.01, 0.01, 0.04, 0.06, 0.07)]
    assert list(r["finished_s"]) == [exact(t) for t in (0.02, 0.05, 0.04, 0.09, 0.08)]
    # Each later request is sent the instant the request it replaces gets its reply
    # (the very same float: no clock round-off between them).
    for new, old in ((2, 0), (3, 2), (4, 1)):
        assert r.loc[new, "arrival_s"] == r.loc[old, "finished_s"]
    # TTFT counts from the send: R2 0.04 - 0.02, R3 0.06 - 0.04, R4 0.07 - 0.05
    assert list(r["ttft_s"]) == [exact(t) for t in (0.01, 0.01, 0.02, 0.02, 0.02)]
    assert len(res.steps) == 9
    # TTFT mean (10 + 10 + 20 + 20 + 20) / 5 = 16 ms; duration 0 -> 0.09 s: 5 / 0.09 req/s
    assert res.summary["mean_ttft_ms"] == exact(16.0)
    assert res.summary["request_throughput"] == exact(5 / 0.09)
    assert res.meta["config"]["arrivals"]["max_concurrency"] == 2
    # vLLM's client_queue_time (vllm_bench.json's queue_times): send - drawn arrival (0 in a closed
    # loop): R2 0.02, R3 0.04, R4 0.05
    assert list(res.client_queue_s) == [exact(t) for t in (0.0, 0.0, 0.02, 0.04, 0.05)]
    assert bench_result(res, [99])["queue_times"].tolist() == list(res.client_queue_s)


# 1 client, think 0.5 s, R (10, 2) x 3: each takes a prefill and a decode step, 0.02 s.
#   R0 sent 0.00, done 0.02; R1 sent 0.02 + 0.5 = 0.52, done 0.54; R2 sent 1.04, done 1.06
def test_think_time_by_hand(tmp_path: Path) -> None:
    res = run(tmp_path, {"kind": "concurrency", "max_concurrency": 1, "think_time_s": 0.5},
              {"kind": "fixed", "prompt_tokens": 10, "output_tokens": 2}, num_requests=3)
    r = res.requests
    assert list(r["arrival_s"]) == [exact(t) for t in (0.0, 0.52, 1.04)]
    assert list(r["finished_s"]) == [exact(t) for t in (0.02, 0.54, 1.06)]


# A rate capped at 1 in flight (vllm bench serve --request-rate R --max-concurrency 1), R (10, 2):
# each request takes 0.02 s.
#   100 req/s: drawn 0, 0.01, 0.02, 0.03 -> sent at max(drawn, previous done): 0, 0.02, 0.04, 0.06
#    10 req/s: drawn 0, 0.1, 0.2, 0.3, each after the previous is done -> sent as drawn
@pytest.mark.parametrize("rate, sent", [(100.0, (0.0, 0.02, 0.04, 0.06)), (10.0, (0.0, 0.1, 0.2, 0.3))])
def test_capped_rate_by_hand(tmp_path: Path, rate: float, sent: tuple[float, ...]) -> None:
    res = run(tmp_path, {"kind": "constant", "rate": rate, "max_concurrency": 1},
              {"kind": "fixed", "prompt_tokens": 10, "output_tokens": 2}, num_requests=4)
    assert list(res.requests["arrival_s"]) == [exact(t) for t in sent]
    assert list(res.requests["finished_s"]) == [exact(t + 0.02) for t in sent]
    # the wait for the client, send - drawn: 100 req/s 0, 0.01, 0.02, 0.03; 10 req/s none
    drawn = [k / rate for k in range(4)]
    assert list(res.client_queue_s) == [pytest.approx(t - d, abs=1e-15) for t, d in zip(sent, drawn)]


# A trace capped at 1: drawn 0, 0.005, 0.1; R (10, 2) takes 0.02 s.
#   R0 sent 0; R1 waits for R0's reply: sent 0.02, done 0.04; R2 sent as drawn, 0.1
def test_capped_trace_by_hand(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("arrival_time_s,prompt_tokens,output_tokens\n0,10,2\n0.005,10,2\n0.1,10,2\n")
    res = run(tmp_path, {"kind": "trace", "path": str(tmp_path / "t.csv"), "max_concurrency": 1},
              {"kind": "trace"})
    assert list(res.requests["arrival_s"]) == [exact(t) for t in (0.0, 0.02, 0.1)]


# 1 client; R0 (2000, 2) is longer than max_model_len 1024: refused at 0, which frees the client.
#   R0 refused 0; R1 (10, 2) sent 0, done 0.02; R2 (10, 2) sent 0.02, done 0.04
def test_refused_request_frees_its_client(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="1 of 3 requests were rejected"):
        res = run(tmp_path, {"kind": "concurrency", "max_concurrency": 1}, [(2000, 2), (10, 2), (10, 2)],
                  num_requests=3)
    r = res.requests
    assert list(r["status"]) == ["rejected", "finished", "finished"]
    assert list(r["arrival_s"]) == [exact(t) for t in (0.0, 0.0, 0.02)]
    assert list(r["finished_s"]) == [exact(t) for t in (0.0, 0.02, 0.04)]


# A measured server's per-request overhead of 0.005 s (send -> engine queue): 1 client, R (10, 2).
#   R0 sent 0, queued 0.005, prefill to 0.015, decode to 0.025; R1 sent 0.025, queued 0.030, done 0.050
# TTFT still counts from the send: R0 0.015, R1 0.040 - 0.025 = 0.015
def test_request_overhead_delays_the_queue_not_the_send(tmp_path: Path) -> None:
    res = run(tmp_path, {"kind": "concurrency", "max_concurrency": 1},
              {"kind": "fixed", "prompt_tokens": 10, "output_tokens": 2}, num_requests=2,
              engine={"request_overhead_s": 0.005})
    r = res.requests
    assert list(r["arrival_s"]) == [exact(0.0), exact(0.025)]
    assert list(r["first_scheduled_s"]) == [exact(0.005), exact(0.030)]
    assert list(r["finished_s"]) == [exact(0.025), exact(0.050)]
    assert list(r["ttft_s"]) == [exact(0.015), exact(0.015)]


def test_fewer_requests_than_clients(tmp_path: Path) -> None:
    # 8 clients, 3 requests: all 3 go at t = 0 (one prefill step, then one decode step)
    res = run(tmp_path, {"kind": "concurrency", "max_concurrency": 8, "num_requests": 3},
              {"kind": "fixed", "prompt_tokens": 10, "output_tokens": 2})
    assert list(res.requests["arrival_s"]) == [0.0, 0.0, 0.0]
    assert list(res.requests["finished_s"]) == [exact(0.02)] * 3
    assert res.summary["completed"] == 3


# ---- the cap, on bigger random runs ---------------------------------------------------------
RANDOM = {"kind": "lognormal", "prompt_mean": 300, "output_mean": 60, "prompt_max": 800, "output_max": 120}


def test_cap_is_never_exceeded_and_always_full(tmp_path: Path) -> None:
    # vllm_v1 on a pool of 60 blocks x 16 = 960 tokens (a request is at most 800 + 120 = 920):
    # 8 clients' requests do not all fit, so there are preemptions too. With no think time the
    # loop is saturated: at every send exactly 8 requests are in flight (the new one in, the one
    # it replaces just out).
    res = run(tmp_path, {"kind": "concurrency", "max_concurrency": 8}, RANDOM, num_requests=300, seed=3,
              policy={"kind": "vllm_v1", "max_num_seqs": 16, "max_num_batched_tokens": 512},
              server={"max_model_len": 960, "num_blocks": 60})       # (vllm_v1 keeps no server.watermark)
    r = res.requests
    assert (r["status"] == "finished").all() and len(r) == 300
    assert res.summary["num_preemptions"] > 0
    assert (in_flight_at_arrivals(r) == 8).all()
    later = r["arrival_s"].to_numpy()[8:]
    assert np.isin(later, r["finished_s"].to_numpy()).all()      # each sent at some reply
    assert (np.diff(r["arrival_s"].to_numpy()) >= 0).all()       # in order


@pytest.mark.parametrize("router", ["round_robin", "least_requests"])
def test_cap_is_over_all_replicas(tmp_path: Path, router: str) -> None:
    # 6 clients over 3 replicas: 6 in flight in all (not 6 per replica), and every replica serves.
    res = run(tmp_path, {"kind": "concurrency", "max_concurrency": 6}, RANDOM, num_requests=120, seed=5,
              num_replicas=3, router=router)
    r = res.requests
    assert (in_flight_at_arrivals(r) == 6).all()
    per_replica = r.groupby("replica").size()
    assert sorted(per_replica.index) == [0, 1, 2]
    if router == "round_robin":
        assert list(per_replica) == [40, 40, 40]                # 120 / 3
    assert res.summary["completed"] == 120


# ---- bad input: one line, exit 2 ------------------------------------------------------------
GOOD = """
name: c
num_requests: 20
arrivals: {kind: concurrency, max_concurrency: 4}
lengths: {kind: fixed, prompt_tokens: 100, output_tokens: 10}
policy: {kind: vllm}
"""


def cli(tmp_path: Path, text: str, capsys: pytest.CaptureFixture, *extra: str) -> tuple[int, str]:
    (tmp_path / "w.yaml").write_text(text)
    rc = main(["run", str(tmp_path / "w.yaml"), "--out", str(tmp_path / "out"), "--quiet", *extra])
    return rc, capsys.readouterr().err


def test_good_concurrency_file_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc, err = cli(tmp_path, GOOD, capsys)
    assert rc == 0, err
    req = pd.read_csv(tmp_path / "out" / "requests.csv")
    assert len(req) == 20 and (in_flight_at_arrivals(req) == 4).all()


@pytest.mark.parametrize("edit, expect", [
    (("max_concurrency: 4", "max_concurrency: 0"), "field 'arrivals.max_concurrency' must be > 0, got 0"),
    (("max_concurrency: 4", "max_concurrency: -3"), "field 'arrivals.max_concurrency' must be > 0, got -3"),
    (("max_concurrency: 4", "max_concurrency: 2.5"), "field 'arrivals.max_concurrency' expected int"),
    (("max_concurrency: 4", "max_concurrency: true"), "field 'arrivals.max_concurrency' expected int"),
    ((", max_concurrency: 4", ""), "field 'arrivals.max_concurrency' is required for arrivals.kind concurrency"),
    (("num_requests: 20\n", ""), "field 'num_requests' is required for arrivals.kind concurrency"),
    (("num_requests: 20\n", "duration_s: 60\n"), "field 'num_requests' is required"),
    (("num_requests: 20\n", "num_requests: 20\nduration_s: 60\n"), "field 'duration_s' cannot bound"),
    (("max_concurrency: 4", "max_concurrency: 4, rate: 5"),
     "field 'arrivals.rate' does not apply to arrivals.kind concurrency"),
    (("max_concurrency: 4", "max_concurrency: 4, think_time_s: -1"), "field 'arrivals.think_time_s' must be >= 0"),
    (("kind: concurrency, max_concurrency: 4", "kind: poisson, rate: 5, think_time_s: 1"),
     "field 'arrivals.think_time_s' needs arrivals.max_concurrency"),
    (("max_concurrency: 4", "max_concurrency: 4, num_requests: 30"),
     "fields 'num_requests' (20) and 'arrivals.num_requests' (30) disagree"),
    (("max_concurrency: 4", "max_concurrency: 4, num_requests: 0"),
     "field 'arrivals.num_requests' must be > 0"),
    (("{kind: fixed, prompt_tokens: 100, output_tokens: 10}", "{kind: trace}"),
     "'lengths.kind' is trace but arrivals.kind concurrency has no trace file"),
    (("{kind: vllm}", "{kind: vllm_v1, enable_chunked_prefill: false}"),
     "'policy.enable_chunked_prefill' false is not modelled for policy vllm_v1"),
    (("{kind: vllm}", "{kind: sarathi, enable_chunked_prefill: false}"),
     "'policy.enable_chunked_prefill' false is not modelled for policy sarathi"),
    (("{kind: vllm}", "{kind: orca, enable_chunked_prefill: true}"),
     "'policy.enable_chunked_prefill' applies to policy.kind vllm, sarathi or vllm_v1, not 'orca'"),
    (("{kind: vllm}", "{kind: vllm, enable_chunked_prefill: 1}"),
     "'policy.enable_chunked_prefill' expected true or false, got 1"),
])
def test_bad_values_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, edit: tuple[str, str],
                                 expect: str) -> None:
    old, new = edit
    assert old in GOOD
    rc, err = cli(tmp_path, GOOD.replace(old, new), capsys)
    assert rc == 2
    assert expect in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# ---- enable_chunked_prefill -------------------------------------------------------------------
def policy_of(tmp_path: Path, policy: dict[str, Any]) -> Any:
    # (the server section without the watermark vLLM v0 reads: vllm_v1 refuses server.watermark)
    return workload_from_dict(workload(tmp_path, {"kind": "poisson", "rate": 5}, RANDOM, num_requests=10,
                                       policy=policy, server={"max_model_len": 1024, "num_blocks": 256})).policy


def test_vllm_with_chunked_prefill_is_sarathi(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="simulated as policy.kind sarathi"):
        pol = policy_of(tmp_path, {"kind": "vllm", "enable_chunked_prefill": True, "max_num_seqs": 64,
                                   "max_num_batched_tokens": 1024})
    assert pol == SarathiConfig(max_num_seqs=64, max_num_batched_tokens=1024)
    with pytest.warns(UserWarning, match="simulated as policy.kind sarathi"):
        assert policy_of(tmp_path, {"kind": "vllm", "enable_chunked_prefill": True}) == SarathiConfig()


def test_the_flag_where_it_changes_nothing(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # no note: nothing was mapped
        assert policy_of(tmp_path, {"kind": "vllm", "enable_chunked_prefill": False,
                                    "max_num_seqs": 64}) == VllmConfig(max_num_seqs=64)
        assert policy_of(tmp_path, {"kind": "vllm_v1", "enable_chunked_prefill": True}) == VllmV1Config()
        assert policy_of(tmp_path, {"kind": "sarathi", "enable_chunked_prefill": True}) == SarathiConfig()


def test_chunked_prefill_override_runs_as_sarathi(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # --set policy.enable_chunked_prefill=true on a vllm file gives exactly the sarathi run.
    text = GOOD.replace("kind: concurrency, max_concurrency: 4", "kind: poisson, rate: 20")
    rc, err = cli(tmp_path, text, capsys, "--set", "policy.enable_chunked_prefill=true")
    assert rc == 0 and "simulated as policy.kind sarathi" in err
    chunked = pd.read_csv(tmp_path / "out" / "requests.csv")
    (tmp_path / "s.yaml").write_text(text.replace("{kind: vllm}", "{kind: sarathi}"))
    assert main(["run", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "s"), "--quiet"]) == 0
    pd.testing.assert_frame_equal(chunked, pd.read_csv(tmp_path / "s" / "requests.csv"))
    with pytest.raises(ConfigError, match="false is not modelled for policy vllm_v1"):
        load_workload(tmp_path / "w.yaml", {"policy.kind": "vllm_v1", "policy.enable_chunked_prefill": "false"})


def test_static_batching_that_a_closed_loop_can_never_fill_is_refused(tmp_path, capsys):
    """4 clients can never fill a static batch of 32: the run would stall, so it is refused
    before it starts; 32 clients fill it (one batch per round trip) and the run completes."""
    from sim.cli import main
    wl = str(WORKLOADS / "mixed_lengths.yaml")                   # static, batch_size 32
    args = ["run", wl, "--set", "num_requests=64", "--quiet"]
    assert main([*args, "--set", "arrivals.max_concurrency=4", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "field 'arrivals.max_concurrency'" in err and ">= 32" in err
    assert not (tmp_path / "a" / "summary.json").exists()
    # two replicas need 2 x 32 clients
    assert main([*args, "--set", "arrivals.max_concurrency=32", "--replicas", "2", "--out", str(tmp_path / "b")]) == 2
    assert ">= 64" in capsys.readouterr().err
    assert main([*args, "--set", "arrivals.max_concurrency=32", "--out", str(tmp_path / "c")]) == 0
