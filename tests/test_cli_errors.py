"""Bad input: one clear line (file, field, expected, fix), exit 2, no traceback,
nothing half-written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import WORKLOADS

from sim.cli import main

GOOD = """
name: t
num_requests: 20
arrivals: {kind: poisson, rate: 5}
lengths: {kind: fixed, prompt_tokens: 100, output_tokens: 10}
policy: {kind: vllm}
"""


def run_cli(tmp_path: Path, text: str | None, *extra: str, capsys=None, name: str = "w.yaml"):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    out = tmp_path / "out"
    rc = main(["run", str(path), "--out", str(out), "--quiet", *extra])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err, out


def test_good_file_runs_and_writes_outputs(tmp_path, capsys):
    rc, out, err, outdir = run_cli(tmp_path, GOOD, capsys=capsys)
    assert rc == 0, err
    assert "TTFT" in out and "ITL" in out
    for f in ("requests.csv", "steps.csv", "tokens.npz", "summary.json", "meta.json"):
        assert (outdir / f).is_file()
    s = json.loads((outdir / "summary.json").read_text())
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "p90_tpot_ms", "p95_itl_ms",
                "p50_e2el_ms", "request_throughput", "output_throughput", "total_token_throughput",
                "request_goodput", "num_preemptions", "mean_kv_utilization"):
        assert key in s


@pytest.mark.parametrize("text, expect", [
    ("name: [unclosed", "invalid YAML at line 1"),
    (GOOD.replace("kind: vllm", "kind: fifo"), "'policy.kind' must be one of static, dynamic, orca, vllm, sarathi"),
    (GOOD + "colour: red\n", "unknown field 'colour'; allowed:"),
    (GOOD.replace("rate: 5", "rate: -1"), "'arrivals.rate' must be > 0, got -1"),
    (GOOD.replace("rate: 5", "rate: 0"), "'arrivals.rate' must be > 0, got 0"),
    (GOOD.replace("{kind: vllm}", "{kind: vllm, max_num_seqs: many}"), "'policy.max_num_seqs' expected an integer"),
    (GOOD.replace("{kind: vllm}", "{kind: vllm, max_num_seqz: 4}"), "unknown field 'policy.max_num_seqz'"),
    (GOOD.replace("prompt_tokens: 100, ", ""), "'lengths.prompt_tokens' is required for lengths.kind fixed"),
    (GOOD + "server: {num_blocks: 4, max_model_len: 4096}\n", "fewer than one request of max_model_len 4096"),
    (GOOD + "profile: {model: llama-3.1-70b, gpu: l40s}\n", "weights do not fit"),
    (GOOD + "profile: {model: gpt-7, gpu: h100-sxm}\n", "gpt-7"),
    (GOOD + "profile: {path: nowhere.yaml}\n", "profile file not found"),
    (GOOD + "profile: {path: p.yaml, model: llama-2-7b}\n", "gives both a path and model"),
    ("- a\n- b\n", "expected a mapping"),
    # The engines' own start-up checks.
    (GOOD.replace("{kind: vllm}", "{kind: vllm, max_num_batched_tokens: 1024}") + "server: {max_model_len: 2048}\n",
     "max_num_batched_tokens (1024) is smaller than max_model_len (2048)"),
    (GOOD.replace("{kind: vllm}", "{kind: sarathi, max_num_batched_tokens: 64, max_num_seqs: 128}"),
     "max_num_batched_tokens (64) must be >= max_num_seqs (128)"),
    (GOOD.replace("{kind: vllm}", "{kind: vllm_v1, max_num_batched_tokens: 64, max_num_seqs: 128}"),
     "max_num_batched_tokens (64) must be >= max_num_seqs (128)"),
    (GOOD.replace("{kind: vllm}", "{kind: vllm_v1, long_prefill_token_threshold: 4096}") + "server: {max_model_len: 2048}\n",
     "long_prefill_token_threshold (4096) cannot exceed max_model_len (2048)"),
])
def test_bad_workload_files(tmp_path, capsys, text, expect):
    rc, out, err, outdir = run_cli(tmp_path, text, capsys=capsys)
    assert rc == 2
    assert expect in err, err
    assert "Traceback" not in err
    assert str(tmp_path / "w.yaml") in err or "invalid YAML" in err
    assert not (outdir / "summary.json").exists()


def test_missing_file(tmp_path, capsys):
    rc, out, err, _ = run_cli(tmp_path, None, capsys=capsys)
    assert rc == 2 and "file not found" in err


def test_bad_override(tmp_path, capsys):
    rc, out, err, _ = run_cli(tmp_path, GOOD, "--set", "arrivals.rate", capsys=capsys)
    assert rc == 2 and "expected key=value" in err


TRACE_WL = """
name: t
arrivals: {kind: trace, path: trace.csv}
lengths: {kind: trace}
"""


@pytest.mark.parametrize("csv, expect", [
    ("arrival_time_s,prompt_tokens\n0,10\n", "missing column(s) output_tokens"),
    ("when,prompt_tokens,output_tokens\n0,10,5\n", "missing column(s) arrival_time_s"),
    ("arrival_time_s,prompt_tokens,output_tokens\n0,10,5\n1,ten,5\n", "column 'prompt_tokens' row 3"),
    ("arrival_time_s,prompt_tokens,output_tokens\n0,10,5\n1,-4,5\n", "non-negative integer"),
    ("arrival_time_s,prompt_tokens,output_tokens\n", "no rows"),
    ("", "empty"),
])
def test_malformed_traces(tmp_path, capsys, csv, expect):
    (tmp_path / "trace.csv").write_text(csv)
    rc, out, err, outdir = run_cli(tmp_path, TRACE_WL, capsys=capsys)
    assert rc == 2, err
    assert expect in err and "trace.csv" in err
    assert not (outdir / "summary.json").exists()


def test_over_context_requests_are_rejected_and_counted(tmp_path, capsys):
    text = GOOD.replace("prompt_tokens: 100", "prompt_tokens: 3000") + "server: {max_model_len: 2048}\n"
    rc, out, err, outdir = run_cli(tmp_path, text, capsys=capsys)
    assert rc == 0
    assert "20 of 20 requests were rejected" in err and "max_model_len 2048" in err
    s = json.loads((outdir / "summary.json").read_text())
    assert s["failed"] == 20 and s["completed"] == 0
    rc, out, err, _ = run_cli(tmp_path, text, "--strict", "--overwrite", capsys=capsys)
    assert rc == 2 and "--strict" in err


def test_every_example_workload_validates():
    from sim.config import load_workload
    for path in WORKLOADS.glob("*.yaml"):
        if path.name.startswith(("sweep_", "plan_")):
            continue
        load_workload(path)


def test_readme_custom_model_example_runs(tmp_path, capsys):
    """The HF-fields example in the README, verbatim."""
    import re
    readme = (WORKLOADS.parent / "README.md").read_text()
    block = re.search(r"```yaml\n(profile:\n  model: \{hidden_size.*?)```", readme, re.S).group(1)
    text = GOOD + block
    rc, out, err, _ = run_cli(tmp_path, text, capsys=capsys)
    assert rc == 0, err
    assert "a100-80gb-tp2" in out


def test_rejections_are_counted_per_reason(tmp_path, capsys):
    """A 110-token request needs ceil(110 / 16) = 7 blocks; a pool of 10 with
    watermark 0.4 keeps int(0.4 x 10) = 4 free, so 6 are usable: every request
    is rejected for the KV pool, not for a prompt limit."""
    text = GOOD.replace("output_tokens: 10", "output_tokens: 10}\nserver: {num_blocks: 10, max_model_len: 160, "
                        "watermark: 0.4").replace("{kind: vllm}", "{kind: sarathi, max_num_seqs: 8}")
    rc, out, err, outdir = run_cli(tmp_path, text, capsys=capsys)
    assert rc == 0, err
    assert "20 of 20 requests were rejected (20 with more KV blocks than the pool holds above the watermark)" in err
    s = json.loads((outdir / "summary.json").read_text())
    assert s["failed_by_reason"] == {"kv_pool": 20}


@pytest.mark.parametrize("text, expect", [
    (GOOD + "polcy: {kind: vllm}\n", "unknown field 'polcy' (did you mean 'policy'?)"),
    (GOOD.replace("{kind: vllm}", "{kind: vllm, max_num_seq: 4}"), "(did you mean 'max_num_seqs'?)"),
    (GOOD.replace("{kind: vllm}", "{kind: sarathy}"), "got 'sarathy' (did you mean 'sarathi'?)"),
    ("base: azure_conv.yaml\nvary: {arrivals.rate: [1, 2]}\n", "field 'base' belongs to a sweep file; run it with `sim sweep"),
    ("base: azure_conv.yaml\ntarget_rate: 5\n", "field 'base' belongs to a plan file; run it with `sim plan"),
])
def test_did_you_mean_and_the_right_command(tmp_path, capsys, text, expect):
    rc, out, err, _ = run_cli(tmp_path, text, capsys=capsys)
    assert rc == 2 and expect in err and "Traceback" not in err, err


def test_version(capsys):
    from importlib import metadata
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"batchsim {metadata.version('batchsim')}"
