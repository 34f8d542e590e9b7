"""Multi-turn sessions as generated: what each turn's prompt holds (computed by
hand), the session file and its loader, the Mooncake derivation's rule on a
hand-made trace, and the configuration's one-line errors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sim.cli import main
from sim.run.config import ConfigError, load_workload, workload_from_dict
from workloads.generate import ANSWER_KEYS, USER_KEYS, generate, key_space
from workloads.traces import load_sessions

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "workloads" / "traces" / "mooncake_sessions.csv"
sys.path.insert(0, str(ROOT / "benchmarks"))
import mooncake_sessions  # noqa: E402

K4, K5 = key_space(4), key_space(5)


def sessions_workload(tmp: Path, turns: list[tuple[int, int]] | None = None, **top: Any) -> dict[str, Any]:
    """A raw sessions workload; ``turns``: (user, output) pairs taken in order per turn."""
    data: dict[str, Any] = {"name": "s", "arrivals": {"kind": "sessions", "rate": 2.0, "think_time_s": 1.0},
                            "sessions": {"num_sessions": 2, "num_turns": 3}, "policy": {"kind": "vllm_v1"}}
    if turns is not None:
        (tmp / "turns.csv").write_text("prompt_tokens,output_tokens\n" + "".join(f"{u},{o}\n" for u, o in turns))
        data["lengths"] = {"kind": "empirical", "path": str(tmp / "turns.csv"), "sample": "sequential"}
    for key, value in top.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and key in data else value
    return data


def runs(content: tuple[int, ...]) -> list[tuple[int, int]]:
    """A Request.content's (key, length) runs."""
    return list(zip(content[1::2], content[2::2]))


# ---- what the prompts hold, by hand -----------------------------------------------------------
#
# 2 sessions x 3 turns, system prompt 5 tokens, (user, output) per turn in order:
#   session 0 (requests 0, 1, 2): (10, 3) (4, 5) (6, 2)
#   session 1 (requests 3, 4, 5): (7, 1) (2, 2) (3, 4)
# K4 = 4 << 56 holds the system prompt (K4) and request i's user tokens (K4 + 1 + i); K5 + i is
# request i's answer. Turn k's prompt: system, then user_0, answer_0, ..., user_k:
#   0: 5 + 10                    = 15      3: 5 + 7               = 12
#   1: 15 + 3 + 4                = 22      4: 12 + 1 + 2          = 15
#   2: 22 + 5 + 6                = 33      5: 15 + 2 + 3          = 20
def test_two_sessions_of_three_turns_by_hand(tmp_path: Path) -> None:
    cfg = workload_from_dict(sessions_workload(tmp_path, [(10, 3), (4, 5), (6, 2), (7, 1), (2, 2), (3, 4)],
                                               sessions={"system_prompt_tokens": 5}))
    specs = generate(cfg)
    assert list(specs.sessions) == [0, 3, 6]
    assert list(specs.prompt_tokens) == [15, 22, 33, 12, 15, 20]
    assert list(specs.output_tokens) == [3, 5, 2, 1, 2, 4]
    c = [specs.contents.content(i) for i in range(6)]
    assert [x[0] for x in c] == [K5 + i for i in range(6)]              # each turn's answer key
    assert runs(c[0]) == [(K4, 5), (K4 + 1, 10)]
    assert runs(c[1]) == [(K4, 5), (K4 + 1, 10), (K5, 3), (K4 + 2, 4)]
    assert runs(c[2]) == [(K4, 5), (K4 + 1, 10), (K5, 3), (K4 + 2, 4), (K5 + 1, 5), (K4 + 3, 6)]
    assert runs(c[3]) == [(K4, 5), (K4 + 4, 7)]
    assert runs(c[4]) == [(K4, 5), (K4 + 4, 7), (K5 + 3, 1), (K4 + 5, 2)]
    assert runs(c[5]) == [(K4, 5), (K4 + 4, 7), (K5 + 3, 1), (K4 + 5, 2), (K5 + 4, 2), (K4 + 6, 3)]
    assert [sum(n for _, n in runs(x)) for x in c] == list(specs.prompt_tokens)
    assert (USER_KEYS, ANSWER_KEYS) == (K4, K5)
    # Every turn of a session carries its start (session 0 starts at 0): the earliest it may go.
    assert list(specs.arrival_s[:3]) == [0.0] * 3
    assert specs.arrival_s[3] == specs.arrival_s[4] == specs.arrival_s[5] > 0


def test_without_a_system_prompt_the_first_run_is_the_users(tmp_path: Path) -> None:
    specs = generate(workload_from_dict(sessions_workload(tmp_path, [(10, 3), (4, 5)],
                                                          sessions={"num_sessions": 1, "num_turns": 2})))
    assert runs(specs.contents.content(0)) == [(K4 + 1, 10)]
    assert runs(specs.contents.content(1)) == [(K4 + 1, 10), (K5, 3), (K4 + 2, 4)]
    assert list(specs.prompt_tokens) == [10, 17]                        # 10; 10 + 3 + 4


def test_drawn_turns_start_by_poisson_and_stay_in_range(tmp_path: Path) -> None:
    raw = sessions_workload(tmp_path, sessions={"num_sessions": 400, "num_turns": [2, 5]},
                            lengths={"kind": "uniform", "prompt_min": 10, "prompt_max": 50,
                                     "output_min": 1, "output_max": 20})
    specs = generate(workload_from_dict(raw))
    turns = np.diff(specs.sessions)
    assert turns.min() == 2 and turns.max() == 5 and set(turns) == {2, 3, 4, 5}
    starts = specs.arrival_s[specs.sessions[:-1]]
    assert starts[0] == 0.0 and (np.diff(starts) > 0).all()
    assert (specs.arrival_s == np.repeat(starts, turns)).all()
    # 400 sessions at 2 per second: the mean gap is 0.5 s (within 4 standard errors, 0.1 s)
    assert abs(np.diff(starts).mean() - 0.5) < 4 * 0.5 / np.sqrt(399)
    # Prompts grow turn over turn by the previous answer and at least 10 new user tokens.
    for lo, hi in zip(specs.sessions[:-1], specs.sessions[1:]):
        p, o = specs.prompt_tokens[lo:hi], specs.output_tokens[lo:hi]
        assert (p[1:] - p[:-1] - o[:-1] >= 10).all()
    assert (generate(workload_from_dict(raw)).prompt_tokens == specs.prompt_tokens).all()     # deterministic


def test_duration_keeps_whole_sessions_that_start_within_it(tmp_path: Path) -> None:
    raw = sessions_workload(tmp_path, [(10, 3)], duration_s=20.0, sessions={"num_sessions": None})
    specs = generate(workload_from_dict(raw))
    starts = specs.arrival_s[specs.sessions[:-1]]
    assert starts.max() <= 20.0 and len(starts) > 20                    # ~2 a second for 20 s
    assert len(specs) == 3 * len(starts)                               # 3 turns each, none cut


# ---- the session file ---------------------------------------------------------------------------
def test_session_file_sessions_replay_their_prompts(tmp_path: Path) -> None:
    (tmp_path / "s.csv").write_text("session,turn,user_tokens,output_tokens,gap_s\n"
                                    "7,0,100,5,1.5\n7,1,20,6,\n8,0,50,2,\n9,0,30,4,2\n9,1,8,1,3\n9,2,9,3,\n")
    data = load_sessions(tmp_path / "s.csv")
    assert list(data.starts) == [0, 2, 3, 6] and list(data.num_turns) == [2, 1, 3]
    raw = sessions_workload(tmp_path, sessions={"num_sessions": 4, "num_turns": None},
                            lengths={"kind": "sessions", "path": str(tmp_path / "s.csv"), "sample": "sequential"})
    specs = generate(workload_from_dict(raw))
    # Sessions in file order, then from the top: 7, 8, 9, 7.
    assert list(specs.sessions) == [0, 2, 3, 6, 8]
    # 7: 100; 100 + 5 + 20 = 125 | 8: 50 | 9: 30; 30 + 4 + 8 = 42; 42 + 1 + 9 = 52 | 7 again
    assert list(specs.prompt_tokens) == [100, 125, 50, 30, 42, 52, 100, 125]
    assert list(specs.output_tokens) == [5, 6, 2, 4, 1, 3, 5, 6]
    # num_turns keeps the file's sessions with that many turns: [2, 3] drops session 8.
    raw["sessions"]["num_turns"] = [2, 3]
    specs = generate(workload_from_dict(raw))
    assert list(specs.prompt_tokens) == [100, 125, 30, 42, 52, 100, 125, 30, 42, 52]
    raw["sessions"]["num_turns"] = 4
    with pytest.raises(ConfigError, match=r"'sessions.num_turns' \(4\): no session of lengths.path has that many "
                                          r"turns \(its sessions have 1 to 3\)"):
        generate(workload_from_dict(raw))


@pytest.mark.parametrize("text, expect", [
    ("session,turn,user_tokens\n0,0,5\n", "missing column(s) output_tokens of a session file"),
    ("session,turn,user_tokens,output_tokens\n0,0,5,1\n0,2,5,1\n",
     "column 'turn' row 3: expected turn 1 of session 0"),
    ("session,turn,user_tokens,output_tokens\n0,1,5,1\n", "column 'turn' row 2: expected turn 0 of session 0"),
    ("session,turn,user_tokens,output_tokens\n0,0,5,1\n1,0,5,1\n0,1,5,1\n",
     "column 'turn' row 4: expected turn 0 of session 0"),
    ("session,turn,user_tokens,output_tokens\n0,0,5,1\n1,0,5,1\n0,0,5,1\n",
     "column 'session' row 4: session 0 starts again after other sessions"),
    ("session,turn,user_tokens,output_tokens\n0,0,0,1\n",
     "column 'user_tokens' row 2: expected a positive token count, got 0"),
    ("session,turn,user_tokens,output_tokens\nx,0,5,1\n", "column 'session' row 2: expected a non-negative "
                                                         "integer session id"),
])
def test_bad_session_files_are_named(tmp_path: Path, text: str, expect: str) -> None:
    (tmp_path / "s.csv").write_text(text)
    with pytest.raises(ConfigError) as err:
        load_sessions(tmp_path / "s.csv")
    assert expect in str(err.value) and str(tmp_path / "s.csv") in str(err.value)


def test_bundled_session_file_is_the_derivation_documented() -> None:
    # workloads/traces/README.md: 3,708 sessions of 1-4 turns (3,455 / 225 / 24 / 4), 3,993 turns.
    data = load_sessions(BUNDLED)
    assert list(np.bincount(data.num_turns)) == [0, 3455, 225, 24, 4]
    # Every request of the trace is one turn, its output the trace's (they sum to the trace's 595,432).
    assert len(data.user_tokens) == 3993 and data.output_tokens.sum() == 595_432
    # Replayed, the turns' prompts are the trace's input lengths (which sum to 61,194,628): the
    # prompt of turn k is the user tokens of turns 0..k and the outputs of turns 0..k-1.
    prompts = [int(data.user_tokens[lo:lo + k + 1].sum() + data.output_tokens[lo:lo + k].sum())
               for lo, hi in zip(data.starts[:-1], data.starts[1:]) for k in range(hi - lo)]
    assert sum(prompts) == 61_194_628
    # The trace's fourth request (input 32,140, output 92) starts the fourth session.
    assert (data.user_tokens[3], data.output_tokens[3]) == (32140, 92)


# ---- the Mooncake derivation's rule on a hand-made trace ------------------------------------------
#
# (timestamp ms, input, output, hash ids; 512-token blocks, the last one partial unless input % 512 == 0)
#  r0    0  1000 10 [1, 2]      starts session 0
#  r1 1000  1100 20 [1, 5, 6]   all of r0's ids but its partial last: room 1100 - 1000 - 10 = 90 -> r0
#  r2 2000  1003  5 [1, 7]      r0's prefix too, but 1003 - 1000 - 10 < 1 (another question on the same
#                               document): starts session 1
#  r3 3500  1200  7 [1, 5, 8]   r1 (2 blocks shared: 1200 - 1100 - 20 = 80) beats r0, r2 (1 block) -> r1
#  r4 4000  1050  3 [1, 9]      r0 is continued; r2: 1050 - 1003 - 5 = 42 -> r2
#  r5 5000  1024  4 [20, 21]    starts session 2 (1024 = 2 full blocks)
#  r6 5250  1100  9 [20, 21, 22] all of r5's ids: 1100 - 1024 - 4 = 72 -> r5
#  r7 6000  1100  1 [20, 23, 24] only r5's ids but its last, which is full: no match, session 3
TRACE = [(0, 1000, 10, [1, 2]), (1000, 1100, 20, [1, 5, 6]), (2000, 1003, 5, [1, 7]),
         (3500, 1200, 7, [1, 5, 8]), (4000, 1050, 3, [1, 9]), (5000, 1024, 4, [20, 21]),
         (5250, 1100, 9, [20, 21, 22]), (6000, 1100, 1, [20, 23, 24])]


def test_mooncake_rule_by_hand(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o,
                                                          "hash_ids": h}) + "\n" for t, i, o, h in TRACE))
    mooncake_sessions.main([str(tmp_path / "t.jsonl"), str(tmp_path / "s.csv")])
    assert (tmp_path / "s.csv").read_text().splitlines() == [
        "session,turn,user_tokens,output_tokens,gap_s",
        "0,0,1000,10,1.000", "0,1,90,20,2.500", "0,2,80,7,",         # gaps 1000 - 0, 3500 - 1000 ms
        "1,0,1003,5,2.000", "1,1,42,3,",
        "2,0,1024,4,0.250", "2,1,72,9,",
        "3,0,1100,1,"]
    data = load_sessions(tmp_path / "s.csv")
    assert list(data.num_turns) == [3, 2, 2, 1]


# ---- the configuration: one line, exit 2 ----------------------------------------------------------
GOOD = """
name: s
arrivals: {kind: sessions, rate: 2, think_time_s: 1}
sessions: {num_sessions: 3, num_turns: [2, 3], system_prompt_tokens: 16}
lengths: {kind: fixed, prompt_tokens: 20, output_tokens: 5}
policy: {kind: vllm_v1}
"""


def test_good_sessions_file_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "w.yaml").write_text(GOOD)
    assert main(["run", str(tmp_path / "w.yaml"), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["config"]["sessions"] == {
        "num_sessions": 3, "num_turns": [2, 3], "system_prompt_tokens": 16}


@pytest.mark.parametrize("edit, expect", [
    (("kind: sessions, rate: 2, think_time_s: 1", "kind: poisson, rate: 2"),
     "field 'sessions' applies to arrivals.kind sessions"),
    (("{num_sessions: 3,", "{"), "field 'sessions.num_sessions' is required for arrivals.kind sessions"),
    (("name: s\n", "name: s\nnum_requests: 9\n"), "field 'num_requests' does not apply to arrivals.kind sessions"),
    (("rate: 2, think_time_s: 1", "think_time_s: 1"), "field 'arrivals.rate' is required for arrivals.kind "
                                                       "sessions"),
    (("num_turns: [2, 3], ", ""), "field 'sessions.num_turns' is required"),
    (("[2, 3]", "[3, 2]"), "field 'sessions.num_turns' must be N or [min, max] with 1 <= min <= max <= 1,000, "
                           "got [3, 2]"),
    (("[2, 3]", "[0, 2]"), "with 1 <= min <= max"),
    (("[2, 3]", "1001"), "got 1001"),
    (("[2, 3]", "[1, 2, 3]"), "field 'sessions.num_turns' must be a number or [min, max], got [1, 2, 3]"),
    (("[2, 3]", "[2, x]"), "field 'sessions.num_turns' expected an integer or a list of integers"),
    (("system_prompt_tokens: 16", "system_prompt_tokens: -1"), "field 'sessions.system_prompt_tokens' must be >= 0"),
    (("{kind: fixed, prompt_tokens: 20, output_tokens: 5}", "{kind: trace}"),
     "field 'lengths.kind' is trace but arrivals.kind sessions has no trace file"),
    (("{kind: fixed, prompt_tokens: 20, output_tokens: 5}", "{kind: sessions}"),
     "field 'lengths.path' is required for lengths.kind sessions (a session file"),
    (("name: s\n", "name: s\nmax_tokens: 64\n"), "field 'max_tokens' (64) would cut answers short"),
    (("{kind: vllm_v1}", "{kind: static}"),
     "field 'policy.kind': policy static waits for a full batch (policy.batch_size = 32 requests)"),
    (("kind: sessions, rate: 2, think_time_s: 1", "kind: poisson, rate: 2, think_time_s: 1"),
     "field 'arrivals.think_time_s' needs arrivals.max_concurrency or arrivals.kind sessions"),
])
def test_bad_sessions_values_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, edit: tuple[str, str],
                                          expect: str) -> None:
    old, new = edit
    assert old in GOOD
    (tmp_path / "w.yaml").write_text(GOOD.replace(old, new))
    rc = main(["run", str(tmp_path / "w.yaml"), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert expect in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_session_file_needs_sessions_and_a_duration_needs_a_rate(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="field 'lengths.kind' is sessions .* but arrivals.kind is poisson"):
        workload_from_dict({"num_requests": 5, "arrivals": {"kind": "poisson", "rate": 1},
                            "lengths": {"kind": "sessions", "path": str(BUNDLED)}})
    with pytest.raises(ConfigError, match="field 'duration_s' cannot bound arrivals.kind sessions without "
                                          "arrivals.rate"):
        workload_from_dict(sessions_workload(tmp_path, [(1, 1)], duration_s=5,
                                             arrivals={"rate": None, "max_concurrency": 2}))


def test_the_example_loads() -> None:
    cfg = load_workload(ROOT / "workloads" / "multi_turn.yaml")
    assert (cfg.arrivals.kind, cfg.lengths.kind, cfg.policy.kind) == ("sessions", "sessions", "vllm_v1")


def test_a_prompt_past_the_largest_token_count_is_refused(tmp_path: Path) -> None:
    # 2^31 - 3 system tokens + 1 user token: turn 0 holds 2^31 - 2; turn 1 adds an answer and a user
    # token: 2^31, past the largest count a request's columns hold (2^31 - 1).
    raw = sessions_workload(tmp_path, [(1, 1)], sessions={"num_sessions": 1, "num_turns": 2,
                                                           "system_prompt_tokens": 2**31 - 3})
    with pytest.raises(ConfigError, match="a session's prompt grows to 2,147,483,648 tokens, past 2,147,483,647"):
        generate(workload_from_dict(raw))
