"""Trace loaders: providers' own formats, rescaling, determinism."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sim.run.config import ConfigError, workload_from_dict
from workloads.generate import generate
from workloads.traces import load_trace


def test_azure_original_format_with_datetimes(tmp_path):
    p = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6813580,374,44\n"
                 "2023-11-16 18:15:50.9959370,396,109\n")
    t = load_trace(p, need_arrivals=True)
    assert t.arrival_s.tolist() == pytest.approx([0.0, 4.314579])
    assert t.prompt_tokens.tolist() == [374, 396]


def test_vidur_and_burstgpt_columns(tmp_path):
    p = tmp_path / "v.csv"
    p.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,10,3\n1.5,20,4\n")
    t = load_trace(p, need_arrivals=True)
    assert t.arrival_s.tolist() == [0.0, 1.0]
    b = tmp_path / "burst.csv"
    b.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,100,20,120,Conversation log\n6,ChatGPT,80,0,80,Conversation log\n"
                 "9,GPT-4,50,10,60,API log\n")
    t = load_trace(b, need_arrivals=True)
    assert t.num_dropped == 1                        # a failed call (0 response tokens)
    assert t.arrival_s.tolist() == [0.0, 4.0]


def test_mooncake_jsonl_in_milliseconds(tmp_path):
    p = tmp_path / "m.jsonl"
    rows = [{"timestamp": 0, "input_length": 9000, "output_length": 5, "hash_ids": [1]},
            {"timestamp": 25000, "input_length": 100, "output_length": 7, "hash_ids": [2]}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    t = load_trace(p, need_arrivals=True)
    assert t.arrival_s.tolist() == [0.0, 25.0]


def test_unsorted_trace_is_sorted_stably(tmp_path):
    p = tmp_path / "u.csv"
    p.write_text("arrival_time_s,prompt_tokens,output_tokens\n3,1,1\n1,2,2\n1,3,3\n")
    t = load_trace(p, need_arrivals=True)
    assert t.prompt_tokens.tolist() == [2, 3, 1]


def test_custom_column_names(tmp_path):
    p = tmp_path / "c.csv"
    p.write_text("t,in,out\n0,5,6\n2,7,8\n")
    cfg = workload_from_dict({"name": "c", "arrivals": {"kind": "trace", "path": str(p),
                                                         "columns": {"arrival": "t", "prompt": "in", "output": "out"}},
                              "lengths": {"kind": "trace"}}, str(tmp_path / "w.yaml"), tmp_path)
    specs = generate(cfg)
    assert specs.output_tokens.tolist() == [6, 8]
    bad = workload_from_dict({**cfg.raw, "arrivals": {**cfg.raw["arrivals"], "columns": {"arrival": "x"}}},
                             "w.yaml", tmp_path)
    with pytest.raises(ConfigError, match="column 'x'"):
        generate(bad)


def _conv(**arrivals):
    return workload_from_dict({"name": "a", "arrivals": {"kind": "trace", "path": "azure_llm_2023_conv.csv",
                                                          **arrivals}, "lengths": {"kind": "trace"}})


def test_bundled_trace_rescaling_and_repeat():
    base = generate(_conv())
    assert len(base) == 19366 and base.arrival_s[0] == 0.0
    faster = generate(_conv(rate_scale=2.0))
    assert faster.arrival_s[-1] == pytest.approx(base.arrival_s[-1] / 2)
    rated = generate(_conv(rate=10.0))
    assert (len(rated) - 1) / rated.arrival_s[-1] == pytest.approx(10.0)
    twice = generate(_conv(repeat=2))
    assert len(twice) == 2 * len(base) and np.all(np.diff(twice.arrival_s) >= 0)


def test_synthetic_arrivals_and_lengths_are_deterministic_and_have_the_asked_rate():
    d = {"name": "s", "seed": 3, "num_requests": 20000, "arrivals": {"kind": "gamma", "rate": 8.0, "cv": 3.0},
         "lengths": {"kind": "lognormal", "prompt_mean": 500, "output_mean": 100, "sigma": 0.8}}
    a, b = generate(workload_from_dict(d)), generate(workload_from_dict(d))
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens, b.prompt_tokens)
    gaps = np.diff(a.arrival_s)
    assert 1 / gaps.mean() == pytest.approx(8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.1)
    assert a.prompt_tokens.mean() == pytest.approx(500, rel=0.05)
    # changing the length model leaves the arrival times alone (independent streams)
    c = generate(workload_from_dict({**d, "lengths": {"kind": "fixed", "prompt_tokens": 1, "output_tokens": 1}}))
    assert np.array_equal(a.arrival_s, c.arrival_s)


def test_duration_limits_synthetic_requests():
    specs = generate(workload_from_dict({"name": "d", "duration_s": 100, "arrivals": {"kind": "poisson", "rate": 5},
                                         "lengths": {"kind": "uniform", "prompt_max": 10, "output_max": 5}}))
    assert specs.arrival_s[-1] <= 100 and 400 < len(specs) < 600


def test_per_request_max_tokens_column_caps_output(tmp_path):
    from sim.run.runner import run_workload
    p = tmp_path / "m.csv"
    p.write_text("arrival_time_s,prompt_tokens,output_tokens,max_tokens\n0,10,50,20\n1,10,5,100\n")
    cfg = workload_from_dict({"name": "m", "arrivals": {"kind": "trace", "path": str(p)},
                              "lengths": {"kind": "trace"}}, "w.yaml", tmp_path)
    r = run_workload(cfg)
    # request 0 stops at its max_tokens (20 < 50); request 1 at its true length (5 < 100)
    assert r.requests["max_tokens"].tolist() == [20, 100]
    assert r.summary["total_output_tokens"] == 20 + 5


def test_trace_rate_applies_to_the_replayed_sample():
    d = {"name": "a", "num_requests": 600,
         "arrivals": {"kind": "trace", "path": "azure_llm_2023_conv.csv", "rate": 20.0},
         "lengths": {"kind": "trace"}}
    specs = generate(workload_from_dict(d))
    assert len(specs) == 600
    assert (len(specs) - 1) / specs.arrival_s[-1] == pytest.approx(20.0)


def test_a_trace_shorter_than_asked_or_without_a_span_says_so(tmp_path):
    (tmp_path / "t.csv").write_text("arrival_time_s,prompt_tokens,output_tokens\n0,10,5\n1,12,5\n")
    d = {"name": "a", "num_requests": 5, "arrivals": {"kind": "trace", "path": str(tmp_path / "t.csv")},
         "lengths": {"kind": "trace"}}
    # 5 asked of 2 rows: the 2 are replayed, and repeat: ceil(5 / 2) = 3 is the way to get 5+
    with pytest.warns(UserWarning, match="num_requests is 5 but the trace holds 2 requests; replaying those 2 "
                                         "\\(arrivals.repeat: 3"):
        assert len(generate(workload_from_dict(d))) == 2
    (tmp_path / "t.csv").write_text("arrival_time_s,prompt_tokens,output_tokens\n7,10,5\n")
    d = {**d, "num_requests": None, "arrivals": {**d["arrivals"], "rate": 5.0}}
    with pytest.warns(UserWarning, match="arrivals.rate has no effect"):
        assert generate(workload_from_dict(d)).arrival_s.tolist() == [0.0]


def test_datetime_unit_on_a_numeric_column_is_refused(tmp_path):
    # pandas would read 1.5 as 1.5 ns past 1970 and the whole trace would arrive within nanoseconds
    with pytest.raises(ConfigError, match="column 'arrival_time_s' holds numbers \\(first .*\\), but "
                                          "arrivals.time_unit is datetime"):
        _arrivals(tmp_path / "t.csv", "arrival_time_s,prompt_tokens,output_tokens\n0,10,5\n1.5,12,5\n",
                  time_unit="datetime")


def _arrivals(path, text, **kw):
    path.write_text(text) if isinstance(text, str) else path.write_bytes(text)
    return load_trace(path, need_arrivals=True, **kw).arrival_s.tolist()


def test_azure_2024_datetimes_with_microseconds_and_offsets(tmp_path):
    # Azure's 2024 traces write 6 fractional digits and +00:00, which pandas parses at microsecond
    # resolution: the arrivals must still be seconds (10 and 30 s after the first), not 1,000x less.
    text = ("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00.009930+00:00,100,10\n"
            "2024-05-10 00:00:10.009930+00:00,200,20\n2024-05-10 00:00:30.509930+00:00,300,30\n")
    assert _arrivals(tmp_path / "az24.csv", text) == [0.0, 10.0, 30.5]
    # whole seconds, Z and another offset: 00:00:00Z, 02:00:05+02:00 (= 00:00:05Z), 00:00:07Z
    text = ("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10T00:00:00Z,1,1\n"
            "2024-05-10T02:00:05+02:00,1,1\n2024-05-10T00:00:07Z,1,1\n")
    assert _arrivals(tmp_path / "z.csv", text) == [0.0, 5.0, 7.0]


def test_numeric_time_units_by_format_and_magnitude(tmp_path):
    # BurstGPT: integer seconds from the start, even a day in (86,400 s): gaps of 10 and 20 s
    burst = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
             "86400,ChatGPT,100,10,110,Conversation log\n86410,ChatGPT,200,20,220,Conversation log\n"
             "86430,GPT-4,300,30,330,API log\n")
    assert _arrivals(tmp_path / "burst.csv", burst) == [0.0, 10.0, 30.0]
    # Mooncake: milliseconds from the start, even when the trace is short (6,000 ms = 6 s)
    mooncake = "".join(json.dumps({"timestamp": t, "input_length": 5, "output_length": 2}) + "\n"
                       for t in (0, 2000, 6000))
    assert _arrivals(tmp_path / "mc.jsonl", mooncake) == [0.0, 2.0, 6.0]
    # Epoch times in any column, told apart by magnitude: 1715299200 s = 1.7e9 (seconds),
    # x1e3 (ms), x1e9 (ns); each trace's rows are 2 and 6 s after its first.
    for scale in (1, 1000, 10**9):
        text = "arrival_time,prompt_len,output_len\n" + "".join(
            f"{(1715299200 + d) * scale},1,1\n" for d in (0, 2, 6))
        assert _arrivals(tmp_path / f"epoch{scale}.csv", text) == [0.0, 2.0, 6.0]
    # an explicit unit wins: the same small numbers read as ns are 2e-9 s apart
    assert _arrivals(tmp_path / "ns.csv", "t,prompt_tokens,output_tokens\n0,1,1\n2,1,1\n",
                     columns={"arrival": "t"}, time_unit="ns") == [0.0, 2e-9]


def test_times_of_day_cross_midnight_in_file_order(tmp_path):
    # 23:59:50.5 -> 23:59:59 (+8.5 s) -> 00:00:10.5 the next day (+11.5 s: 20 s after the first)
    text = "time,prompt_tokens,output_tokens\n23:59:50.5,1,1\n23:59:59,2,2\n00:00:10.5,3,3\n"
    assert _arrivals(tmp_path / "tod.csv", text) == [0.0, 8.5, 20.0]


def test_ambiguous_dates_are_read_in_one_format_or_refused(tmp_path):
    # 12/05 is read month-first from the first row; 13/05 then cannot be, and is refused (not read
    # day-first behind the user's back, which reorders rows)
    p = tmp_path / "d.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n12/05/2024 23:59:50,1,1\n13/05/2024 00:00:01,2,2\n")
    with pytest.raises(ConfigError, match=r"d.csv: column 'TIMESTAMP' row 3: cannot parse timestamp '13/05/2024"):
        load_trace(p, need_arrivals=True)


def test_json_arrays_bom_gzip_and_separators(tmp_path):
    import gzip
    rows = [{"timestamp": 0, "input_length": 5, "output_length": 2},
            {"timestamp": 1500, "input_length": 6, "output_length": 3}]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    assert _arrivals(tmp_path / "a.json", json.dumps(rows, indent=2)) == [0.0, 1.5]     # an array
    assert _arrivals(tmp_path / "b.jsonl", "\ufeff" + lines) == [0.0, 1.5]              # a byte-order mark
    assert _arrivals(tmp_path / "c.JSONL.gz", gzip.compress(lines.encode())) == [0.0, 1.5]
    assert _arrivals(tmp_path / "d.ndjson", lines) == [0.0, 1.5]
    tsv = "arrival_time_s\tprompt_tokens\toutput_tokens\n0\t5\t2\n1.5\t6\t3\n"
    assert _arrivals(tmp_path / "e.tsv", tsv) == [0.0, 1.5]
    assert _arrivals(tmp_path / "f.csv", tsv.replace("\t", ";")) == [0.0, 1.5]


def test_json_errors_name_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n\n'
                 '{"timestamp": 1, "input_length": -4, "output_length": 3}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl: column 'input_length' line 3: expected a non-negative"):
        load_trace(p, need_arrivals=True)
    p.write_text('{"timestamp": 0, "input_length": 5}\n{"timestamp": 1, oops}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl: line 2: cannot parse as JSON"):
        load_trace(p, need_arrivals=True)
    p.write_text("[1, 2, 3]")                       # an array, but of numbers: its first item is named
    with pytest.raises(ConfigError, match=r"bad.jsonl: item 1: expected a JSON object \(one request.*got the number 1"):
        load_trace(p, need_arrivals=True)


@pytest.mark.parametrize("name, text, columns, expect", [
    # JSON true/false are no numbers (pandas read true as 1 token and as a timestamp)
    ("b.jsonl", '{"timestamp": 0, "input_length": true, "output_length": 2}\n', None,
     r"column 'input_length' line 1: expected a non-negative integer token count, got true"),
    ("c.jsonl", '{"timestamp": 5, "input_length": 3, "output_length": 2}\n'
                '{"timestamp": false, "input_length": 3, "output_length": 2}\n', None,
     r"column 'timestamp' line 2: expected a timestamp, got false"),
    # a column named twice: pandas took the first (or, differing in case, the last) in silence
    ("d.csv", "arrival_time_s,prompt_tokens,output_tokens,prompt_tokens\n0,10,5,11\n", None,
     r"the header names one column twice: 'prompt_tokens'"),
    ("e.csv", "arrival_time_s,Prompt_Tokens,output_tokens,prompt_tokens\n0,10,5,11\n", None,
     r"the header names one column twice: 'Prompt_Tokens' and 'prompt_tokens'"),
    ("f.jsonl", '{"t": 0, "Prompt_Tokens": 3, "prompt_tokens": 4, "output_tokens": 2}\n', None,
     r"names one column twice: 'Prompt_Tokens' and 'prompt_tokens'"),
    # one column for two roles
    ("g.csv", "t,in,out\n0,5,6\n", {"arrival": "t", "prompt": "in", "output": "in"},
     r"column 'in' would serve as both prompt and output"),
])
def test_ambiguous_trace_columns_and_json_booleans_are_refused(tmp_path, name, text, columns, expect):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ConfigError, match=expect):
        load_trace(p, need_arrivals=True, columns=columns)


def test_a_trace_rate_with_a_scale_says_the_scale_is_ignored(tmp_path):
    # arrivals.rate rescales the replayed trace to its own mean rate: a rate_scale beside it changed
    # nothing in silence
    p = tmp_path / "t.csv"
    p.write_text("arrival_time_s,prompt_tokens,output_tokens\n0,5,6\n2,7,8\n")
    with pytest.warns(UserWarning, match="arrivals.rate_scale ignored: arrivals.rate rescales the replayed trace"):
        cfg = workload_from_dict({"name": "r", "arrivals": {"kind": "trace", "path": str(p), "rate": 1.0,
                                                             "rate_scale": 2.0}})
    assert generate(cfg).arrival_s.tolist() == [0.0, 1.0]         # (2 - 1) / 1 req/s: the rate's, not 2x


def test_column_mappings_are_checked_and_length_files_take_them(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("t,in,out\n0,5,6\n2,7,8\n")
    with pytest.raises(ConfigError, match=r"field 'arrivals.columns.arrivals' is unknown \(did you mean 'arrival'"):
        workload_from_dict({"name": "c", "arrivals": {"kind": "trace", "path": str(p),
                                                       "columns": {"arrivals": "t"}}})
    lengths = tmp_path / "l.csv"
    lengths.write_text("in,out\n5,0\n7,3\n9,4\n")
    cfg = workload_from_dict({"name": "e", "num_requests": 4, "arrivals": {"kind": "constant", "rate": 1.0},
                              "lengths": {"kind": "empirical", "path": str(lengths), "sample": "sequential",
                                          "columns": {"prompt": "in", "output": "out"}}})
    with pytest.warns(UserWarning, match="1 rows of lengths.path with a zero token count were dropped"):
        specs = generate(cfg)
    assert specs.prompt_tokens.tolist() == [7, 9, 7, 9]           # the kept rows in turn
    bad = workload_from_dict({**cfg.raw, "lengths": {**cfg.raw["lengths"], "columns": {"prompt": "x"}}})
    with pytest.raises(ConfigError, match=r"column 'x' \(lengths.columns.prompt\) not found"):
        generate(bad)


def test_a_missing_file_in_the_users_folder_is_not_replaced_by_a_bundled_one(tmp_path):
    cfg = workload_from_dict({"name": "m", "arrivals": {"kind": "trace", "path": "mydata/azure_llm_2023_conv.csv"},
                              "lengths": {"kind": "trace"}}, str(tmp_path / "w.yaml"), tmp_path)
    with pytest.raises(ConfigError, match="mydata/azure_llm_2023_conv.csv: trace file not found"):
        generate(cfg)
    assert len(generate(_conv())) == 19366          # a bare name still finds the bundled trace
