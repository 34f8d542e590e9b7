"""What prompts hold (``workloads.generate.Contents``): prefix_repetition's
shared prefixes and traces' hash ids, down to the runs of each request."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from conftest import MOONCAKE_ROWS

from sim.run.config import ConfigError, workload_from_dict
from workloads.generate import (REPEAT_OUTPUT, REPEAT_PREFIX, REPEAT_SUFFIX, TRACE_OUTPUT, TRACE_OWN, generate,
                                key_space)
from workloads.traces import load_trace

ROOT = Path(__file__).resolve().parents[2]
MOONCAKE = ROOT / "workloads" / "traces" / "mooncake_fast25_synthetic_trace.jsonl"


def _contents(specs) -> list[tuple[int, ...]]:
    return [specs.contents.content(i) for i in range(len(specs))]


def _repetition(**lengths):
    return workload_from_dict({"name": "p", "seed": 0, "num_requests": 5, "arrivals": {"kind": "poisson", "rate": 2.0},
                               "lengths": {"kind": "prefix_repetition", "prefix_len": 40, "suffix_len": 8,
                                           "num_prefixes": 2, **lengths}})


def test_key_spaces_are_apart():
    assert key_space(0) == 0 and key_space(1) == 1 << 56
    spaces = [TRACE_OWN, TRACE_OUTPUT, REPEAT_PREFIX, REPEAT_SUFFIX, REPEAT_OUTPUT]
    assert [s >> 56 for s in spaces] == [8, 9, 10, 11, 12]
    assert max(spaces) + (1 << 56) <= 1 << 61          # below sim.core.prefix's own spaces


def test_prefix_repetition_contents_by_hand():
    with pytest.warns(UserWarning, match=r"num_requests 5 is not a multiple of lengths.num_prefixes 2: the first 1 "
                                         r"prefixes get 3 requests, the others 2 \(vllm bench serve would send "
                                         r"only 4, 2 each\)"):
        specs = generate(_repetition())
    # 5 requests over 2 prefixes: 5 // 2 = 2 each, the 5 % 2 = 1 left over to prefix 0, so prefix 0
    # has 3 requests and prefix 1 has 2; listed [0, 0, 0, 1, 1], then shuffled by the seed-0 prompt
    # stream into the order below. Each prompt: its prefix (40 tokens), then its own suffix (8).
    order = [1, 1, 0, 0, 0]
    assert sorted(order) == [0, 0, 0, 1, 1]
    assert _contents(specs) == [(REPEAT_OUTPUT + i, REPEAT_PREFIX + p, 40, REPEAT_SUFFIX + i, 8)
                                for i, p in enumerate(order)]
    assert specs.prompt_tokens.tolist() == [48] * 5             # 40 + 8, exactly
    assert specs.output_tokens.tolist() == [128] * 5            # output_len's default, vLLM's 128


def test_prefix_repetition_leaves_arrivals_alone_and_shuffles_by_seed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = generate(_repetition())
        fixed = generate(workload_from_dict({**_repetition().raw, "lengths": {"kind": "fixed", "prompt_tokens": 48,
                                                                             "output_tokens": 128}}))
        other = generate(workload_from_dict({**_repetition().raw, "num_requests": 40, "seed": 1}))
    assert np.array_equal(a.arrival_s, fixed.arrival_s) and fixed.contents is None
    prefixes = other.contents.keys[0::2] - REPEAT_PREFIX
    assert np.bincount(prefixes).tolist() == [20, 20]           # 40 // 2 each
    assert np.any(np.diff(prefixes) != 0) and not np.all(prefixes[:20] == 0)     # shuffled, not in blocks


def test_prefix_repetition_checks(tmp_path):
    base = {"name": "p", "num_requests": 5, "arrivals": {"kind": "poisson", "rate": 1.0}}
    with pytest.raises(ConfigError, match=r"field 'lengths.num_prefixes' \(10\) is more than num_requests \(5\)"):
        workload_from_dict({**base, "lengths": {"kind": "prefix_repetition"}})
    with pytest.raises(ConfigError, match=r"field 'lengths.suffix_len' must be > 0, got 0"):
        workload_from_dict({**base, "lengths": {"kind": "prefix_repetition", "suffix_len": 0, "num_prefixes": 1}})
    with pytest.raises(ConfigError, match=r"field 'lengths.prefix_len' expected an integer, got 2.5"):
        workload_from_dict({**base, "lengths": {"kind": "prefix_repetition", "prefix_len": 2.5}})
    with pytest.warns(UserWarning, match=r"lengths.prefix_len \(read by kind prefix_repetition\) not used by "
                                         r"lengths.kind fixed"):
        workload_from_dict({**base, "lengths": {"kind": "fixed", "prompt_tokens": 1, "output_tokens": 1,
                                                "prefix_len": 64}})
    # A trace of 3 rows gives 3 requests: too few for 4 prefixes, found when the trace is read.
    p = tmp_path / "t.csv"
    p.write_text("arrival_time_s,prompt_tokens,output_tokens\n0,1,1\n1,1,1\n2,1,1\n")
    cfg = workload_from_dict({"name": "p", "arrivals": {"kind": "trace", "path": str(p)},
                              "lengths": {"kind": "prefix_repetition", "num_prefixes": 4}}, "w.yaml", tmp_path)
    with pytest.raises(ConfigError, match=r"'lengths.num_prefixes' \(4\) is more than the 3 requests to make"):
        generate(cfg)


ROWS = MOONCAKE_ROWS            # a small Mooncake-style trace (tests/conftest.py)
# Its contents by hand: id k covers tokens 512k .. min(512(k + 1), input_length) - 1.
RUNS = [
    (1, 512, 2, 512, 3, 76),            # 1100 = 512 + 512 + 76: a partial last block has an id too
    (1, 512, 5, 188),                   # 700 = 512 + 188
    (1, 512, 2, 512, 3, 26),            # 1050 = 512 + 512 + 26: id 3 again, 26 of its tokens
    (1, 512, 9, 20),                    # 532 = 512 + 20
    (1, 512, 9, 88),                    # 600 = 512 + 88 needs ceil(600 / 512) = 2 ids: id 10 is dropped
    (1, 512, TRACE_OWN + 5, 688),       # 1200 - 512 = 688 tokens past the only id: request 5's own
]


def _mooncake(tmp_path: Path, rows=ROWS, **arrivals):
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return workload_from_dict({"name": "m", "arrivals": {"kind": "trace", "path": str(p), **arrivals},
                               "lengths": {"kind": "trace"}}, str(tmp_path / "w.yaml"), tmp_path)


def _generate_quietly(cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return generate(cfg)


def test_mooncake_hash_ids_become_runs_by_hand(tmp_path):
    with pytest.warns(UserWarning) as seen:
        specs = generate(_mooncake(tmp_path))
    assert _contents(specs) == [(TRACE_OUTPUT + i, *runs) for i, runs in enumerate(RUNS)]
    messages = [str(w.message) for w in seen]
    # Row 5 (600 tokens, 3 ids) holds 3 - 2 = 1 surplus id; row 6 (1200 tokens, 1 id) needs ceil(1200 / 512) = 3.
    assert any("1 rows of arrivals.path hold more hash_ids than their prompt needs at lengths.hash_block_tokens "
               "512 (ceil(prompt / 512)); their 1 surplus ids were dropped" in m for m in messages), messages
    assert any("1 rows of arrivals.path hold fewer hash_ids than their prompt needs" in m for m in messages)


def test_hash_block_tokens_sets_what_an_id_covers(tmp_path):
    # 16 tokens per id (Alibaba's traces): 40 tokens = 16 + 16 + 8.
    p = tmp_path / "a.csv"
    p.write_text('arrival_time_s,prompt_tokens,output_tokens,hash_ids\n0,40,1,"7,8,9"\n')
    cfg = workload_from_dict({"name": "a", "arrivals": {"kind": "trace", "path": str(p)},
                              "lengths": {"kind": "trace", "hash_block_tokens": 16}}, "w.yaml", tmp_path)
    assert _contents(generate(cfg)) == [(TRACE_OUTPUT, 7, 16, 8, 16, 9, 8)]


@pytest.mark.parametrize("cells", [
    ['"1 2 3"', '"1 5"', '"1,2,3"', '"[1, 9]"', '"1, 9, 10"', "1"],      # spaces, commas, JSON lists, one id
    ['"[1,2,3]"', '" 1  5 "', '"1 ,2, 3"', '"1 9"', '"[1,9,10]"', '"[1]"'],
])
def test_csv_hash_ids_in_any_spelling_match_the_jsonl(tmp_path, cells):
    p = tmp_path / "m.csv"
    p.write_text("timestamp,input_length,output_length,hash_ids\n" + "".join(
        f"{r['timestamp']},{r['input_length']},{r['output_length']},{c}\n" for r, c in zip(ROWS, cells)))
    cfg = workload_from_dict({"name": "m", "arrivals": {"kind": "trace", "path": str(p), "time_unit": "ms"},
                              "lengths": {"kind": "trace"}}, "w.yaml", tmp_path)
    assert _contents(_generate_quietly(cfg)) == [(TRACE_OUTPUT + i, *runs) for i, runs in enumerate(RUNS)]


def test_unquoted_commas_in_a_last_hash_ids_column_are_more_ids(tmp_path):
    p = tmp_path / "u.csv"
    p.write_text("arrival_time_s,prompt_tokens,output_tokens,hash_ids\n0,40,1,7,8,9\n1,20,1,7\n2,40,1,7, 8 ,10\n")
    t = load_trace(p, need_arrivals=True)
    assert t.hash_ids.tolist() == [7, 8, 9, 7, 7, 8, 10] and t.hash_starts.tolist() == [0, 3, 4, 7]
    assert t.prompt_tokens.tolist() == [40, 20, 40]
    # Elsewhere a first row longer than the header would shift every column by one (pandas
    # reads its first field as a row label): refused.
    p.write_text("arrival_time_s,prompt_tokens,output_tokens\n0,40,1,\n1,20,1,\n")
    with pytest.raises(ConfigError, match=r"u.csv: row 2 has more fields than the header's 3 \(arrival_time_s, "
                                          r"prompt_tokens, output_tokens\); quote a field that holds the separator"):
        load_trace(p, need_arrivals=True)


def test_rows_without_ids_and_dropped_rows_stay_aligned(tmp_path):
    # Row 2 has an empty cell (no ids: all 30 tokens its own); row 3 has a zero output and is
    # dropped, so row 4 becomes request 2 and keeps its own ids.
    p = tmp_path / "e.csv"
    p.write_text("arrival_time_s,prompt_tokens,output_tokens,hash_ids\n0,20,1,4\n1,30,1,\n2,10,0,5\n3,20,1,6\n")
    cfg = workload_from_dict({"name": "e", "arrivals": {"kind": "trace", "path": str(p)},
                              "lengths": {"kind": "trace", "hash_block_tokens": 32}}, "w.yaml", tmp_path)
    assert _contents(_generate_quietly(cfg)) == [(TRACE_OUTPUT, 4, 20), (TRACE_OUTPUT + 1, TRACE_OWN + 1, 30),
                                                 (TRACE_OUTPUT + 2, 6, 20)]


def test_repeat_start_and_num_requests_keep_contents_aligned(tmp_path):
    # Six rows one second apart: period = span + span / (rows - 1) = 5 + 1 = 6 s. The second copy's
    # requests are serials 6..11; they replay the same ids, but own tokens and outputs are new.
    specs = _generate_quietly(_mooncake(tmp_path, repeat=2))
    contents = _contents(specs)
    assert len(contents) == 12
    assert [c[1:] for c in contents[6:]] == [c[1:] for c in contents[:5]] + [(1, 512, TRACE_OWN + 11, 688)]
    assert [c[0] for c in contents] == [TRACE_OUTPUT + i for i in range(12)]
    # start_s 2.5 skips rows 0..2 (t = 0, 1, 2 s); num_requests 2 keeps rows 3 and 4.
    cut = _generate_quietly(_mooncake(tmp_path, start_s=2.5, num_requests=2))
    assert _contents(cut) == [(TRACE_OUTPUT + 3, *RUNS[3]), (TRACE_OUTPUT + 4, *RUNS[4])]
    # start_s 8.5 in two copies: copy 1's rows at 6 + 3 = 9 s and later: serials 9, 10, 11.
    late = _generate_quietly(_mooncake(tmp_path, repeat=2, start_s=8.5))
    assert _contents(late) == [(TRACE_OUTPUT + 9, *RUNS[3]), (TRACE_OUTPUT + 10, *RUNS[4]),
                               (TRACE_OUTPUT + 11, 1, 512, TRACE_OWN + 11, 688)]


def test_length_files_carry_hash_ids(tmp_path):
    p = tmp_path / "l.csv"
    p.write_text('prompt_tokens,output_tokens,hash_ids\n20,1,"4 5"\n40,2,"4 6 7"\n')
    cfg = workload_from_dict({"name": "l", "num_requests": 3, "arrivals": {"kind": "poisson", "rate": 1.0},
                              "lengths": {"kind": "empirical", "path": str(p), "sample": "sequential",
                                          "hash_block_tokens": 16}}, "w.yaml", tmp_path)
    # rows 0, 1, 0: 20 = 16 + 4; 40 = 16 + 16 + 8; the third request repeats row 0's ids.
    assert _contents(generate(cfg)) == [(TRACE_OUTPUT, 4, 16, 5, 4), (TRACE_OUTPUT + 1, 4, 16, 6, 16, 7, 8),
                                        (TRACE_OUTPUT + 2, 4, 16, 5, 4)]
    renamed = tmp_path / "r.csv"
    renamed.write_text('prompt_tokens,output_tokens,blocks\n20,1,"4 5"\n')
    cfg = workload_from_dict({"name": "l", "num_requests": 1, "arrivals": {"kind": "poisson", "rate": 1.0},
                              "lengths": {"kind": "empirical", "path": str(renamed), "hash_block_tokens": 16,
                                          "columns": {"hash_ids": "blocks"}}}, "w.yaml", tmp_path)
    assert _contents(generate(cfg)) == [(TRACE_OUTPUT, 4, 16, 5, 4)]


def test_a_trace_without_hash_ids_or_read_for_arrivals_only_has_no_contents(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("arrival_time_s,prompt_tokens,output_tokens\n0,5,1\n")
    cfg = workload_from_dict({"name": "t", "arrivals": {"kind": "trace", "path": str(p)},
                              "lengths": {"kind": "trace"}}, "w.yaml", tmp_path)
    assert generate(cfg).contents is None
    fixed = workload_from_dict({**_mooncake(tmp_path).raw, "lengths": {"kind": "fixed", "prompt_tokens": 5,
                                                                       "output_tokens": 1}}, "w.yaml", tmp_path)
    assert generate(fixed).contents is None           # the lengths are not the trace's: neither are its ids


@pytest.mark.parametrize("cell, expect", [
    ('"1 x 3"', r"row 3: expected hash ids .*got '1 x 3': 'x' is not a non-negative integer"),
    ('"1 -2"', r"row 3: .*'-2' is not a non-negative integer"),
    ('"[1, 2"', r"row 3: .*cannot parse as a JSON list"),
    ('"[1, 2.5]"', r"row 3: .*2.5 is not an integer"),
    ('"1.5"', r"row 3: .*'1.5' is not a non-negative integer"),
    ('"72057594037927936"', r"row 3: .*72057594037927936 is outside 0 .. 2\^56 - 1"),
])
def test_malformed_csv_hash_ids_name_row_and_column(tmp_path, cell, expect):
    p = tmp_path / "bad.csv"
    p.write_text(f'arrival_time_s,prompt_tokens,output_tokens,hash_ids\n0,5,1,"1 2"\n1,5,1,{cell}\n')
    with pytest.raises(ConfigError, match=r"bad.csv: column 'hash_ids' " + expect):
        load_trace(p, need_arrivals=True)


def test_malformed_jsonl_hash_ids_name_the_line(tmp_path):
    for ids, expect in (([1, "a"], r"line 2: .*'a' is not an integer"), ([True], r"line 2: .*True is not an integer"),
                        ({"a": 1}, r"line 2: .*expected a list of ids, got dict")):
        p = tmp_path / "bad.jsonl"
        p.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({**ROWS[1], "hash_ids": ids}) + "\n")
        with pytest.raises(ConfigError, match=r"bad.jsonl: column 'hash_ids' " + expect):
            load_trace(p, need_arrivals=True)


def test_hash_block_tokens_is_checked():
    base = {"name": "m", "arrivals": {"kind": "trace", "path": "x.jsonl"}}
    with pytest.raises(ConfigError, match=r"field 'lengths.hash_block_tokens' must be > 0, got 0"):
        workload_from_dict({**base, "lengths": {"kind": "trace", "hash_block_tokens": 0}})
    with pytest.warns(UserWarning, match=r"lengths.hash_block_tokens \(read by kind trace / empirical\) not used"):
        workload_from_dict({"name": "m", "num_requests": 1, "arrivals": {"kind": "poisson", "rate": 1.0},
                            "lengths": {"kind": "fixed", "prompt_tokens": 1, "output_tokens": 1,
                                        "hash_block_tokens": 16}})


def test_bundled_mooncake_trace_upper_bound_of_prefix_reuse():
    """The share of prompt tokens an unbounded cache could serve: requests in
    arrival order; a token (key, offset) of a run counts if an earlier
    request's run of that key covered that offset (the runs of key space 0 are
    the trace's ids; a partial last block counts the tokens it shares). Ids are
    prefix hashes, so an id seen earlier has its whole prefix seen too; no
    block rounding, no cap at the last token."""
    cfg = workload_from_dict({"name": "m", "arrivals": {"kind": "trace", "path": str(MOONCAKE)},
                              "lengths": {"kind": "trace"}})
    specs = generate(cfg)                               # no warning: every row has ceil(input / 512) ids
    c = specs.contents
    covered: dict[int, int] = {}
    hits = 0
    for i in range(len(specs)):
        runs = list(zip(c.keys[c.starts[i]:c.starts[i + 1]].tolist(), c.lengths[c.starts[i]:c.starts[i + 1]].tolist()))
        for key, n in runs:
            hits += min(n, covered.get(key, 0))
        for key, n in runs:
            covered[key] = max(n, covered.get(key, 0))
    total = int(specs.prompt_tokens.sum())
    assert len(specs) == 3993 and total == 61_194_628
    assert all(k < 1 << 56 for k in covered)            # every token is a trace id's: no own tokens
    assert hits == 39_852_661                           # 39,852,661 / 61,194,628 = 65.12 %
    assert hits / total == pytest.approx(0.6512, abs=5e-5)
