"""Runs with prompt contents: what vLLM v1's prefix cache finds in
prefix_repetition and hash-id traces, request by request, and the bundled
examples that show it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from conftest import MOONCAKE_ROWS

from sim.cli import main
from sim.run.config import load_workload, workload_from_dict
from sim.run.runner import run_workload
from workloads.generate import REPEAT_PREFIX, generate

ROOT = Path(__file__).resolve().parents[2]
V1 = {"policy": {"kind": "vllm_v1"}, "profile": {"engine": "vllm-v1"}}


def _quiet_run(cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_workload(cfg)


def test_prefix_repetition_hits_by_hand():
    # Block size 16 (the default), prefix 40 tokens: the first 40 // 16 = 2 blocks (32 tokens) are
    # the prefix's alone; block 3 (tokens 32..47) holds 8 prefix and 8 suffix tokens, so it is never
    # shared. A request after the first of its prefix finds 32 tokens cached; the pool (28k blocks)
    # holds every block, so nothing is evicted.
    cfg = workload_from_dict({"name": "p", "num_requests": 6, "arrivals": {"kind": "all_at_once"},
                              "lengths": {"kind": "prefix_repetition", "prefix_len": 40, "suffix_len": 8,
                                          "num_prefixes": 2, "output_len": 4}, **V1})
    prefixes = (generate(cfg).contents.keys[0::2] - REPEAT_PREFIX).tolist()
    assert prefixes == [1, 1, 0, 0, 0, 1]            # the seed-0 shuffle: prefix 1 first at 0, prefix 0 at 2
    r = _quiet_run(cfg)
    assert r.table.cols["cached_tokens"].tolist() == [0, 32, 0, 32, 32, 32]


def test_prefix_caching_cuts_ttft_on_shared_prefixes():
    # 200 requests over 4 prefixes of 2,048 tokens = 128 whole blocks: all but the first request
    # of each prefix find the whole prefix cached, (200 - 4) x 2,048 = 401,408 tokens, and
    # prefill only their 64-token suffix.
    data = {"name": "p", "seed": 0, "num_requests": 200, "arrivals": {"kind": "poisson", "rate": 20.0},
            "lengths": {"kind": "prefix_repetition", "prefix_len": 2048, "suffix_len": 64, "num_prefixes": 4,
                        "output_len": 16}, **V1}
    on = _quiet_run(workload_from_dict(data))
    off = _quiet_run(workload_from_dict({**data, "policy": {"kind": "vllm_v1", "enable_prefix_caching": False}}))
    assert int(on.table.cols["cached_tokens"].sum()) == 401_408
    # Without a cache the column is not kept, so requests.csv is what it was before prefix caching.
    assert "cached_tokens" not in off.table.cols and "num_cached_tokens" not in off.requests.columns
    assert "prefix_cache_hit_rate" not in off.summary
    assert on.summary["prefix_cache_hits"] == 401_408
    assert on.summary["mean_ttft_ms"] < 0.2 * off.summary["mean_ttft_ms"]     # ~12 ms against ~340 ms


def test_hash_id_trace_hits_by_hand(tmp_path):
    """The simulator's blocks of 48 tokens (512 = 10 x 48 + 32: they do not line up
    with the trace's) see equal tokens exactly where the trace's ids agree."""
    rows = MOONCAKE_ROWS  # one second apart: each request is done before the next arrives
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = workload_from_dict({"name": "m", "arrivals": {"kind": "trace", "path": str(p)}, "lengths": {"kind": "trace"},
                              "server": {"block_size": 48}, **V1}, str(tmp_path / "w.yaml"), tmp_path)
    r = _quiet_run(cfg)
    assert r.table.cols["cached_tokens"].tolist() == [
        0,      # the first
        480,    # shares id 1 (tokens 0..511) with request 0: 512 // 48 = 10 whole blocks, 480 tokens
        1008,   # its 1,050 tokens are request 0's first 1,050 (id 3's first 26): 1049 // 48 = 21 blocks
        480,    # id 1 only (id 9 is new): 10 blocks
        528,    # ids 1 and 9 with request 3, which holds 20 tokens of id 9: 532 shared, 532 // 48 = 11 blocks
        480,    # id 1, then 688 tokens of its own
    ]


def test_bundled_prefix_examples_run(tmp_path, capsys):
    # The Mooncake example replays 3,993 requests (~10-20 s here); its first 300 show the same.
    for name, extra in (("prefix_repetition", []), ("mooncake_prefix", ["--set", "num_requests=300"])):
        out = tmp_path / name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rc = main(["run", str(ROOT / "workloads" / f"{name}.yaml"), "--out", str(out), "--quiet", *extra])
        assert rc == 0, capsys.readouterr().err
        assert json.loads((out / "summary.json").read_text())["completed"] > 0


def test_mooncake_hits_match_the_trace_ids_while_nothing_is_evicted():
    """The first 300 requests of the bundled Mooncake example, on a pool (8M tokens) that
    holds all of them: each request's hit is what its hash ids promise, computed from the
    file alone: the leading ids seen before (an id covers 512 tokens, a partial last one
    the rest, shared up to the most an earlier request's same id covered), capped at
    prompt - 1 tokens and cut to whole 16-token blocks. A request longer than the
    model's 131,072-token context is rejected: no hit, and nothing of it cached."""
    cfg = load_workload(ROOT / "workloads" / "mooncake_prefix.yaml", {"num_requests": 300})
    path = ROOT / "workloads" / "traces" / "mooncake_fast25_synthetic_trace.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[:300]]
    covered: dict[int, int] = {}
    expect = []
    for row in rows:
        n = row["input_length"]
        if n + row["output_length"] > 131_072:
            expect.append(0)
            continue
        spans = [(h, min(512, n - 512 * k)) for k, h in enumerate(row["hash_ids"])]
        shared = 0
        for h, tokens in spans:
            shared += min(tokens, covered.get(h, 0))
            if covered.get(h, 0) < tokens:
                break
        expect.append(min(shared, n - 1) // 16 * 16)
        for h, tokens in spans:
            covered[h] = max(tokens, covered.get(h, 0))
    r = _quiet_run(cfg)
    assert r.table.cols["cached_tokens"].tolist() == expect
    assert r.summary["failed"] == 1                  # one prompt of 134,773 tokens: over the context
    assert sum(expect) == 187_920                    # 4.88% of these 300 prompts' 3,853,165 tokens


@pytest.mark.parametrize("name", ["prefix_repetition", "mooncake_prefix"])
def test_prefix_examples_use_vllm_v1_with_caching_on(name):
    cfg = load_workload(ROOT / "workloads" / f"{name}.yaml")
    assert cfg.policy.kind == "vllm_v1" and cfg.policy.enable_prefix_caching


def test_prefix_caching_on_a_policy_without_a_cache_names_those_with_one():
    # The list comes from the policies' own declarations (Policy.prefix_switch), not from prose.
    from policies.config import policy_config
    from sim.base.strict import ConfigError
    with pytest.raises(ConfigError, match=r"w.yaml: field 'policy.enable_prefix_caching': policy orca has no "
                                          r"prefix cache \(policy.kind vllm_v1, tensorrt_llm, tgi, lmdeploy or "
                                          r"sglang have one\); remove it or set it false"):
        policy_config({"kind": "orca", "enable_prefix_caching": True}, "w.yaml")
    assert policy_config({"kind": "orca", "enable_prefix_caching": False}, "w.yaml").kind == "orca"
