"""Multi-turn sessions run closed per session and open across
(``sim.loop.feed.SessionFeed``), with hand-computed runs.

Every hand run uses a profile whose steps all cost 10 ms (no per-token or
attention cost), so a step's end is its start + 0.010 s, under vllm_v1
(a lone request's prefill step samples its first token, each decode step one
more). A turn is sent ``think_time_s`` after the previous turn's reply (the
end of the step that sampled its last token, or its refusal); its
``arrival_s`` is that send time. With prefix caching, a turn finds cached
the full blocks of the previous turn's prompt and answer that were computed:
all of them but the answer's last token, whose KV no step computes.
"""

from __future__ import annotations


from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from cases import KINDS
from conftest import WORKLOADS, linear_profile

import sim.loop.server
import sim.loop.stretch
from sim.run.config import load_yaml_mapping, workload_from_dict
from sim.run.runner import run_workload
from sim.results.result import RunResult
from sim.results.vllm_bench import offered_load
from workloads.generate import generate


def exact(x: float) -> pytest.approx:
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def workload(tmp: Path, turns: list[tuple[int, int]], sessions: dict[str, Any], arrivals: dict[str, Any],
             **server: Any) -> dict[str, Any]:
    """A raw sessions workload on the 10-ms-per-step profile; ``turns``: each turn's
    (user tokens, output tokens), taken in order."""
    profile = linear_profile(per_token_s=0.0, overhead_s=0.010, decode_per_ctx_s=0.0, prefill_per_ctx_s=0.0)
    profile.save(tmp / "p.yaml")
    (tmp / "turns.csv").write_text("prompt_tokens,output_tokens\n" + "".join(f"{u},{o}\n" for u, o in turns))
    return {"name": "sessions", "arrivals": {"kind": "sessions", **arrivals}, "sessions": sessions,
            "lengths": {"kind": "empirical", "path": str(tmp / "turns.csv"), "sample": "sequential"},
            "policy": {"kind": "vllm_v1"},
            "server": {"max_model_len": 1024, "num_blocks": 256, "block_size": 16, **server},
            "profile": {"path": str(tmp / "p.yaml")}}


def run(raw: dict[str, Any], **kw: Any) -> RunResult:
    return run_workload(workload_from_dict(raw), **kw)


def cached(res: RunResult) -> list[int]:
    return res.table.cols["cached_tokens"].tolist()


# ---- one session by hand ---------------------------------------------------------------------
#
# 1 session, 3 turns, think 0.5 s, blocks of 4 tokens; (user, output): (10, 2) (4, 3) (6, 1).
#   T0 prompt 10, sent 0:        steps 0-0.01 (token 1), 0.01-0.02 (token 2): done 0.02
#   T1 prompt 10 + 2 + 4 = 16, sent 0.02 + 0.5 = 0.52, done after 3 steps at 0.55;
#      cached: T0 computed 10 + 2 - 1 = 11 tokens, 2 full blocks: 8 (cap 16 - 1 = 15)
#   T2 prompt 16 + 3 + 6 = 25, sent 0.55 + 0.5 = 1.05, done after 1 step at 1.06;
#      cached: T1 computed 16 + 3 - 1 = 18 tokens, 4 full blocks: 16 (cap 24)
def test_one_session_by_hand(tmp_path: Path) -> None:
    res = run(workload(tmp_path, [(10, 2), (4, 3), (6, 1)], {"num_sessions": 1, "num_turns": 3},
                       {"rate": 1.0, "think_time_s": 0.5}, block_size=4))
    r = res.requests
    assert list(r["prompt_tokens"]) == [10, 16, 25]
    assert list(r["arrival_s"]) == [exact(t) for t in (0.0, 0.52, 1.05)]
    assert list(r["first_token_s"]) == [exact(t) for t in (0.01, 0.53, 1.06)]
    assert list(r["finished_s"]) == [exact(t) for t in (0.02, 0.55, 1.06)]
    # Each later turn is sent think_time_s after the previous reply: the very same float sum.
    for k in (1, 2):
        assert r.loc[k, "arrival_s"] == r.loc[k - 1, "finished_s"] + 0.5
    assert list(r["ttft_s"]) == [exact(0.01)] * 3                     # TTFT counts from the send
    assert cached(res) == [0, 8, 16]
    assert res.client_queue_s is None                                  # no clients to wait for
    # Without prefix caching nothing is found cached; the timing is the same (every step costs 10 ms).
    off = run(workload(tmp_path, [(10, 2), (4, 3), (6, 1)], {"num_sessions": 1, "num_turns": 3},
                       {"rate": 1.0, "think_time_s": 0.5}, block_size=4) | {"policy": {
                           "kind": "vllm_v1", "enable_prefix_caching": False}})
    assert "cached_tokens" not in off.table.cols          # no cache: the column is not kept
    assert list(off.requests["finished_s"]) == list(r["finished_s"])


# ---- prefix hits by hand -----------------------------------------------------------------------
#
# Blocks of 16 tokens, a pool of 256 (nothing is evicted). 1 session; (user, output): (20, 12) (5, 7) (40, 3).
#   T0 prompt 20: nothing cached.
#   T1 prompt 20 + 12 + 5 = 37. T0 computed 20 + 12 - 1 = 31 tokens (its last token's KV never is):
#      1 full block, 16 cached. (Prompt + answer is 32, two blocks, but the second is not full of KV.)
#   T2 prompt 37 + 7 + 40 = 84. T1 computed 37 + 7 - 1 = 43: 2 full blocks, 32 cached (cap 83).
def test_a_turn_finds_the_previous_prompt_and_answer_cached(tmp_path: Path) -> None:
    res = run(workload(tmp_path, [(20, 12), (5, 7), (40, 3)], {"num_sessions": 1, "num_turns": 3},
                       {"rate": 1.0, "think_time_s": 0.5}))
    assert list(res.requests["prompt_tokens"]) == [20, 37, 84]
    assert cached(res) == [0, 16, 32]


# 2 sessions of 2 turns behind 1 client (max_concurrency 1, no rate: each session starts when
# the one before it is done), system prompt 40, blocks of 16; (user, output):
#   s0: (10, 4) (6, 2)    s1: (8, 3) (5, 5)
#   id 0: prompt 40 + 10 = 50, sent 0, 4 steps: done 0.04; nothing cached
#   id 1: prompt 50 + 4 + 6 = 60, sent 0.04 + 0.5 = 0.54, 2 steps: done 0.56;
#         cached: id 0 computed 50 + 4 - 1 = 53: 3 blocks, 48 (cap 59)
#   id 2: prompt 40 + 8 = 48, sent at id 1's reply, 0.56 (a new session does not think), done 0.59;
#         cached: the system prompt's 2 full blocks, 32 (its third block holds user tokens)
#   id 3: prompt 48 + 3 + 5 = 56, sent 0.59 + 0.5 = 1.09, done 1.14;
#         cached: id 2 computed 48 + 3 - 1 = 50: 3 blocks, 48 (cap 55)
def test_sessions_behind_one_client_and_a_shared_system_prompt(tmp_path: Path) -> None:
    res = run(workload(tmp_path, [(10, 4), (6, 2), (8, 3), (5, 5)],
                       {"num_sessions": 2, "num_turns": 2, "system_prompt_tokens": 40},
                       {"max_concurrency": 1, "think_time_s": 0.5}))
    r = res.requests
    assert list(r["prompt_tokens"]) == [50, 60, 48, 56]
    assert list(r["arrival_s"]) == [exact(t) for t in (0.0, 0.54, 0.56, 1.09)]
    assert list(r["finished_s"]) == [exact(t) for t in (0.04, 0.56, 0.59, 1.14)]
    assert r.loc[2, "arrival_s"] == r.loc[1, "finished_s"]
    assert cached(res) == [0, 48, 32, 48]
    # The wait for a client, by request id: session 1 could start at 0, its client was free at 0.56.
    assert list(res.client_queue_s) == [0.0, 0.0, exact(0.56), 0.0]


# ---- a turn longer than the context ------------------------------------------------------------
#
# max_model_len 64; (user, output): (20, 10) (30, 10) (5, 3), think 0.5 s, 10 ms a step.
# Under a policy that refuses prompt + max_tokens > max_model_len (sarathi, as vLLM v0):
#   T0 prompt 20 + 10 = 30 <= 64: 10 steps, done 0.10
#   T1 prompt 20 + 10 + 30 = 60, + max_tokens 10 = 70 > 64: refused when sent, 0.60
#   T2 prompt 60 + 10 + 5 = 75: longer still, refused when sent, 0.60 + 0.5 = 1.10
# The session is not cut: its later turns are sent, and refused, as a real server refuses them.
def test_turns_past_the_context_are_refused_one_after_another(tmp_path: Path) -> None:
    raw = workload(tmp_path, [(20, 10), (30, 10), (5, 3)], {"num_sessions": 1, "num_turns": 3},
                   {"rate": 1.0, "think_time_s": 0.5}, max_model_len=64)
    raw["policy"] = {"kind": "sarathi"}
    with pytest.warns(UserWarning, match=r"2 of 3 requests were rejected \(2 with prompt \+ max_tokens > "
                                         r"max_model_len 64\)"):
        res = run(raw)
    r = res.requests
    assert list(r["status"]) == ["finished", "rejected", "rejected"]
    assert list(r["reject_reason"]) == ["", "context", "context"]
    assert list(r["arrival_s"]) == [exact(t) for t in (0.0, 0.60, 1.10)]
    assert list(r["finished_s"]) == [exact(t) for t in (0.10, 0.60, 1.10)]


# Under vllm_v1, as vLLM 0.32's OpenAI server: T1's max_tokens 10 is cut to 64 - 60 = 4; it runs
# 4 steps (its prefill samples the first token), done 0.60 + 0.04 = 0.64; T2's prompt,
# 60 + 10 + 5 = 75 >= 64, leaves no room for one token: refused when sent, 0.64 + 0.5 = 1.14.
# (Sessions plan each prompt when the trace is made, from the planned answer of 10 tokens; a live
# replay sends the 4 the server returned, 60 + 4 + 5 = 69, refused all the same.)
def test_a_turn_past_the_context_is_cut_under_vllm_v1(tmp_path: Path) -> None:
    with pytest.warns(UserWarning) as warned:
        res = run(workload(tmp_path, [(20, 10), (30, 10), (5, 3)], {"num_sessions": 1, "num_turns": 3},
                           {"rate": 1.0, "think_time_s": 0.5}, max_model_len=64))
    said = [str(w.message) for w in warned]
    assert any("1 of 3 requests were rejected (1 with prompt >= max_model_len 64" in m for m in said), said
    assert any("1 of 3 requests asked for more tokens than the context leaves" in m for m in said), said
    r = res.requests
    assert list(r["prompt_tokens"]) == [20, 60, 75]
    assert list(r["status"]) == ["finished", "finished", "rejected"]
    assert list(r["reject_reason"]) == ["", "", "model_len"]
    assert list(r["output_tokens"]) == [10, 4, 3] and list(r["max_tokens"])[:2] == [10, 4]
    assert list(r["arrival_s"]) == [exact(t) for t in (0.0, 0.60, 1.14)]
    assert list(r["finished_s"]) == [exact(t) for t in (0.10, 0.64, 1.14)]
    assert res.meta["num_max_tokens_clamped"] == 1


# ---- open across sessions, on a real preset --------------------------------------------------------
def preset_sessions(**sessions: Any) -> dict[str, Any]:
    return {"name": "open", "seed": 1,
            "arrivals": {"kind": "sessions", "rate": 4.0, "think_time_s": 0.7},
            "sessions": {"num_sessions": 40, "num_turns": [2, 5], "system_prompt_tokens": 300, **sessions},
            "lengths": {"kind": "uniform", "prompt_min": 20, "prompt_max": 400, "output_min": 10,
                        "output_max": 300},
            "policy": {"kind": "vllm_v1"}, "profile": {"model": "llama-3.1-8b", "gpu": "h100-sxm"}}


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_sessions_open_across_closed_within(num_replicas: int) -> None:
    cfg = workload_from_dict(preset_sessions())
    specs = generate(cfg)
    res = run_workload(cfg, num_replicas=num_replicas)
    r = res.requests
    arrival, finished = r["arrival_s"].to_numpy(), r["finished_s"].to_numpy()
    first = specs.sessions[:-1]
    later = np.setdiff1d(np.arange(len(r)), first)
    assert (arrival[first] == specs.arrival_s[first]).all()             # first turns at the drawn starts
    assert (arrival[later] == finished[later - 1] + 0.7).all()          # later ones a think after the reply
    assert (r["status"] == "finished").all()
    # Open across: sessions overlap (a first turn sent while another session's turn is in flight).
    in_flight = [((arrival < t) & (finished > t)).sum() for t in arrival[first]]
    assert max(in_flight) >= 2
    if num_replicas == 2:                                              # round robin, in send order
        order = np.argsort(arrival, kind="stable")
        assert (r["replica"].to_numpy()[order][:10] == np.arange(10) % 2).all()


# ---- the fast path on sessions ---------------------------------------------------------------------
# 30 of the example's sessions include the trace's longest (past 128K tokens), refused turn by turn:
# the refusal path is stepped through too.
@pytest.mark.filterwarnings("ignore:.*requests were rejected")
@pytest.mark.parametrize("policy", [k for k in KINDS if k != "static"])      # static refuses sessions
def test_fast_path_and_check_mode_on_sessions(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = WORKLOADS / "multi_turn.yaml"
    # The fast path is the synchronous loop's (a pipelined loop, vLLM's async scheduling or SGLang's
    # overlap, steps every iteration).
    from policies import POLICIES
    knob_name = POLICIES[policy][1].pipelined_knob
    sync = {knob_name: POLICIES[policy][1].pipelined_off} if knob_name else {}
    data = {**load_yaml_mapping(path), "policy": {"kind": policy, **sync}}
    data["sessions"] = {**data["sessions"], "num_sessions": 30}
    make = lambda: workload_from_dict(data, str(path), path.parent)    # noqa: E731
    checked = {"n": 0}
    original = sim.loop.stretch._step_through

    def counting(*args: Any):
        checked["n"] += 1
        return (yield from original(*args))

    monkeypatch.setattr(sim.loop.stretch, "_step_through", counting)
    check = run_workload(make(), check_stretch=True)                   # raises StretchMismatch on a wrong step
    assert checked["n"] > 0                                             # stretches were planned, then stepped
    results = [check]
    for fast in (False, True):
        sim.loop.server.FAST_PATH = fast
        try:
            results.append(run_workload(make()))
        finally:
            sim.loop.server.FAST_PATH = True
    for other in results[1:]:                                          # stepped, fast: identical to checked
        for name in ("requests", "steps", "tokens"):
            pd.testing.assert_frame_equal(getattr(other, name), getattr(check, name), check_exact=True, obj=name)
        assert other.summary == check.summary
    assert check.summary["completed"] > 0


def test_capped_sessions_report_the_requests_they_sent() -> None:
    # 4 sessions per second behind 3 clients: the offered request rate is what was sent, (n - 1) /
    # span of the send times, not arrivals.rate (which counts sessions).
    raw = preset_sessions()
    raw["arrivals"] = {**raw["arrivals"], "max_concurrency": 3}
    res = run_workload(workload_from_dict(raw))
    arrival = res.requests["arrival_s"].to_numpy()
    load = offered_load(res.requests, res.meta["config"]["arrivals"])
    assert load.offered_rps == exact((len(arrival) - 1) / (arrival.max() - arrival.min()))
    assert load.offered_rps != 4.0 and load.max_concurrency == 3
    # At most 3 sessions, so at most 3 requests, in flight at any send.
    finished = res.requests["finished_s"].to_numpy()
    assert max(((arrival <= t) & (finished > t)).sum() for t in arrival) <= 3
    first = generate(workload_from_dict(raw)).sessions[:-1]
    waits = res.client_queue_s
    assert (waits[np.setdiff1d(np.arange(len(arrival)), first)] == 0).all() and waits[first].max() > 0
