"""Every bad number refused early: one line naming file and field, exit 2, no
traceback, no run directory that looks complete. Table-driven."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

import sim.results.folder
from sim.cli import main
from sim.run.config import workload_from_dict
from sim.results.runfiles import RunFilesProcess
from workloads.generate import generate

GOOD = {
    "name": "t", "num_requests": 20,
    "arrivals": {"kind": "poisson", "rate": 5},
    "lengths": {"kind": "fixed", "prompt_tokens": 100, "output_tokens": 10},
    "policy": {"kind": "vllm"},
}
NAN, INF = float("nan"), float("inf")


def with_(path: str, value):
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    node = data
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return data


def run(tmp_path: Path, data, capsys, *extra: str, name: str = "w.yaml"):
    wl = tmp_path / name
    wl.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    out = tmp_path / "out"
    rc = main(["run", str(wl), "--out", str(out), "--quiet", *extra])
    err = capsys.readouterr().err
    return rc, err, out


WORKLOAD_CASES = [
    (with_("arrivals.rate", NAN), "field 'arrivals.rate' must be a finite number, got nan"),
    (with_("arrivals.rate", INF), "field 'arrivals.rate' must be a finite number, got inf"),
    (with_("arrivals", {"kind": "gamma", "rate": 5, "cv": NAN}), "field 'arrivals.cv' must be a finite number"),
    (with_("lengths", {"kind": "lognormal", "prompt_mean": 100, "output_mean": 10, "sigma": INF}),
     "field 'lengths.sigma' must be a finite number"),
    (with_("slo", {"ttft_ms": NAN}), "field 'slo.ttft_ms' must be a finite number"),
    (with_("slo", {"tpot_ms": -INF}), "field 'slo.tpot_ms' must be a finite number"),
    (with_("duration_s", INF), "field 'duration_s' must be a finite number"),
    (with_("max_tokens", NAN), "field 'max_tokens' must be a finite number"),
    (with_("max_tokens", 10**15), "field 'max_tokens' must be at most 2,147,483,647"),
    (with_("arrivals.rate", 1e300), "field 'arrivals.rate' must be in [1e-06, 1e+06] requests per second, got 1e+300"),
    (with_("arrivals.rate", 1e-300), "field 'arrivals.rate' must be in [1e-06, 1e+06]"),
    (with_("arrivals", {"kind": "gamma", "rate": 4, "cv": 1e-300}), "field 'arrivals.cv' must be in [0.001, 100]"),
    (with_("arrivals", {"kind": "gamma", "rate": 4, "cv": 1e6}), "field 'arrivals.cv' must be in [0.001, 100]"),
    (with_("server", {"gpu_memory_utilization": NAN}), "server.gpu_memory_utilization"),
    (with_("name", None), "field 'name' must be a string"),
    (with_("seed", -1), "field 'seed' must be >= 0, got -1"),
    (with_("policy", {"kind": [1, 2]}), "field 'policy.kind' must be one of"),
    (with_("num_requests", 10**12), "field 'num_requests' asks for about 1e+12 requests"),
    (with_("duration_s", 1e9) | {"num_requests": None}, "field 'duration_s' asks for about"),   # 5e9 requests
    (with_("duration_s", 1e15) | {"num_requests": None}, "field 'duration_s' must be at most 1e+09 s (31 years)"),
]


@pytest.mark.parametrize("data, expect", WORKLOAD_CASES)
def test_bad_workload_numbers(tmp_path, capsys, data, expect):
    rc, err, out = run(tmp_path, data, capsys)
    assert rc == 2, err
    assert expect in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(tmp_path / "w.yaml") in err
    assert not (out / "summary.json").exists()


TRACE_CASES = [
    ("0,10,5\n1,99999999999999999999999,5\n", "column 'prompt_tokens' row 3: expected a non-negative integer"),
    ("0,10,5\n1,10,1e40\n", "column 'output_tokens' row 3"),
    ("0,10,5\ninf,10,5\n", "column 'arrival_time_s' row 3: expected a finite number, got 'inf'"),
    ("0,10,5\nnan,10,5\n", "column 'arrival_time_s' row 3: expected a finite number"),
    ("0,nan,5\n", "column 'prompt_tokens' row 2"),
    ("0,10\n", "column 'output_tokens' row 2: expected a non-negative integer token count up to 2147483647, "
                "got no number (an empty, NA or NaN cell, a short row or a missing key)"),
]


@pytest.mark.parametrize("rows, expect", TRACE_CASES)
def test_bad_trace_cells(tmp_path, capsys, rows, expect):
    (tmp_path / "trace.csv").write_text("arrival_time_s,prompt_tokens,output_tokens\n" + rows)
    data = {"name": "t", "arrivals": {"kind": "trace", "path": "trace.csv"}, "lengths": {"kind": "trace"}}
    rc, err, out = run(tmp_path, data, capsys)
    assert rc == 2 and expect in err and "trace.csv" in err, err
    assert not (out / "summary.json").exists()


def test_trace_repeat_beyond_memory_is_refused(tmp_path, capsys):
    (tmp_path / "trace.csv").write_text("arrival_time_s,prompt_tokens,output_tokens\n0,10,5\n1,10,5\n")
    data = {"name": "t", "arrivals": {"kind": "trace", "path": "trace.csv", "repeat": 10**13},
            "lengths": {"kind": "trace"}}
    rc, err, _ = run(tmp_path, data, capsys)
    assert rc == 2 and "field 'arrivals.repeat' asks for about 2e+13 requests" in err, err


def test_a_huge_repeat_builds_only_the_copies_num_requests_takes(tmp_path):
    # 3 rows at 0, 1, 2 s: copy k is shifted by k x (2 + 2 / 2) = 3k s. num_requests 7 takes copies
    # 0, 1 and the first row of copy 2: 0 1 2 3 4 5 6 s, not a billion copies (which ran out of memory).
    (tmp_path / "trace.csv").write_text("arrival_time_s,prompt_tokens,output_tokens\n0,10,5\n1,11,5\n2,12,5\n")

    def specs(**arrivals):
        return generate(workload_from_dict({"name": "t", "num_requests": 7, "lengths": {"kind": "trace"}, "arrivals": {
            "kind": "trace", "path": str(tmp_path / "trace.csv"), "repeat": 10**9, **arrivals}}))
    s = specs()
    assert s.arrival_s.tolist() == [0, 1, 2, 3, 4, 5, 6] and s.prompt_tokens.tolist() == [10, 11, 12, 10, 11, 12, 10]
    # from start_s 7.5 (copies 0 and 1 end at 2 and 5 s, unbuilt): 8, 9, ..., 14 s of copies 2-4, minus 7.5
    assert specs(start_s=7.5).arrival_s.tolist() == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5]


# ---- profile files ---------------------------------------------------------------------------
SHIPPED = ROOT / "calibrate" / "profiles" / "cpu" / "tiny-llama" / "float32.yaml"


def profile_with(edit) -> dict:
    data = yaml.safe_load(SHIPPED.read_text())
    edit(data)
    return data


def _set(path: str, value):
    def edit(d):
        *parents, leaf = path.split(".")
        node = d
        for k in parents:
            node = node[k] if not k.isdigit() else node[int(k)]
        node[int(leaf) if leaf.isdigit() else leaf] = value
    return edit


def _del(path: str):
    def edit(d):
        *parents, leaf = path.split(".")
        node = d
        for k in parents:
            node = node[k]
        del node[leaf]
    return edit


def _decrease(d):
    ys = d["curves"]["linear"]["seconds"]
    ys[-1] = ys[0] / 2


PROFILE_CASES = [
    (_del("curves.overhead_s"), "field 'curves.overhead_s' is missing"),
    (_set("curves.overhead_s", -0.001), "field 'curves.overhead_s' must be a finite number >= 0"),
    (_set("curves.linear.seconds.1", NAN), "field 'curves.linear.seconds' must be a finite number"),
    (_set("curves.linear.seconds.0", -1e-4), "field 'curves.linear.seconds' must be a finite number >= 0"),
    (_decrease, "field 'curves.linear.seconds' decreases along 'tokens'"),
    (_set("curves.attn_decode.seqs", [4, 2, 8]), "field 'curves.attn_decode.seqs' must be strictly increasing"),
    (_set("curves.attn_prefill.seconds.0.0", INF), "field 'curves.attn_prefill.seconds' must be a finite number"),
    (_set("memory.kv_bytes_per_token", -8), "field 'memory.kv_bytes_per_token' must be a whole number >= 1"),
    (_set("memory.weight_bytes", -1), "field 'memory.weight_bytes' must be a whole number >= 0"),
    (_set("model.max_position_embeddings", 0), "field 'model.max_position_embeddings' must be a whole number >= 1"),
    # text, bools, fractions and absurd sizes are refused, not converted (int("4"), True -> 1, 256.5 -> 256)
    (_set("model.num_layers", "4"), "field 'model.num_layers' must be a whole number >= 1, got '4'"),
    (_set("model.hidden_size", 256.5), "field 'model.hidden_size' must be a whole number >= 1, got 256.5"),
    (_set("memory.kv_bytes_per_token", True), "field 'memory.kv_bytes_per_token' must be a whole number >= 1"),
    (_set("memory.memory_bytes_per_gpu", 1e300), "field 'memory.memory_bytes_per_gpu' must be a whole number >= 1 "
                                                 "and <= 1.1259e+15"),
    (_set("tensor_parallel", 0), "field 'tensor_parallel' must be a whole number >= 1"),
    (_set("tensor_parallel", "one"), "field 'tensor_parallel' must be a whole number >= 1 and <= 1024, got 'one'"),
    (_set("curves.overhead_s", 1e300), "field 'curves.overhead_s' must be a finite number >= 0 and <= 1e+06"),
    (_set("curves.linear.seconds.1", 1e308), "field 'curves.linear.seconds' must be a finite number >= 0 and <= 1e+06"),
    (_set("fit_error", {"holdout_mape_pct": "low"}), "field 'fit_error.holdout_mape_pct' must be a number, got 'low'"),
    (_set("provenance", [1, 2]), "field 'provenance' must be a mapping, got [1, 2]"),
    (_set("model.name", [1]), "field 'model.name' must be text, got [1]"),
    (_del("format_version"), "field 'format_version' is missing (expected 1)"),
]


@pytest.mark.parametrize("edit, expect", PROFILE_CASES)
def test_bad_profile_files(tmp_path, capsys, edit, expect):
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(profile_with(edit), sort_keys=False))
    data = with_("profile", {"path": "p.yaml"}) | {"server": {"num_blocks": 512, "max_model_len": 512}}
    rc, err, out = run(tmp_path, data, capsys)
    assert rc == 2, err
    assert expect in err and "p.yaml" in err, err
    assert "Traceback" not in err
    assert not (out / "summary.json").exists()


def test_binary_garbage_profile(tmp_path, capsys):
    (tmp_path / "p.yaml").write_bytes(bytes(range(256)) * 4)
    rc, err, _ = run(tmp_path, with_("profile", {"path": "p.yaml"}), capsys)
    assert rc == 2 and "p.yaml: not a text file" in err, err


# ---- outputs ----------------------------------------------------------------------------------
def test_unwritable_out_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    import sim.run.runner

    def never(*args, **kwargs):
        raise AssertionError("the simulation ran before --out was checked")
    monkeypatch.setattr(sim.run.runner, "run_workload", never)
    blocker = tmp_path / "file"
    blocker.write_text("")
    wl = tmp_path / "w.yaml"
    wl.write_text(yaml.safe_dump(GOOD))
    rc = main(["run", str(wl), "--out", str(blocker / "sub"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot write there" in err and "Traceback" not in err, err


def test_full_disk_leaves_no_tmp_and_no_summary(tmp_path, capsys, monkeypatch):
    def no_space(path, *args, **kwargs):
        Path(path).write_bytes(b"half an archive")          # the disk fills up part way
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(sim.results.folder, "write_tokens_npz", no_space)
    # tokens.npz in process (a second process's failure: test_runfiles.py)
    monkeypatch.setattr(RunFilesProcess, "start", lambda self, *a: False)
    rc, err, out = run(tmp_path, GOOD, capsys)
    assert rc == 2 and "tokens.npz: cannot write (No space left on device)" in err, err
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize("key", ["itl_ms", "attainment"])
def test_plan_only_slo_keys_are_refused_in_a_workload(tmp_path, capsys, key):
    # ITL is per token gap and attainment a share: a plan's targets; goodput counts requests.
    rc, err, _ = run(tmp_path, {**GOOD, "slo": {"ttft_ms": 500, key: 0.5}}, capsys)
    assert rc == 2 and f"field 'slo.{key}' is a plan's target" in err and "Traceback" not in err, err


@pytest.mark.parametrize("arrivals, lengths, expect", [
    ({"kind": "poisson", "rate": 5, "cv": 3}, None,
     "arrivals.cv (read by kind gamma) not used by arrivals.kind poisson (ignored)"),
    ({"kind": "constant", "rate": 5, "time_scale": 2, "repeat": 3}, None,
     "arrivals.time_scale (read by kind trace), arrivals.repeat (read by kind trace) not used by "
     "arrivals.kind constant"),
    ({"kind": "poisson", "rate": 5}, {"kind": "fixed", "prompt_tokens": 10, "output_tokens": 5, "alpha": 2},
     "lengths.alpha (read by kind zipf) not used by lengths.kind fixed (ignored)"),
    ({"kind": "poisson", "rate": 5}, {"kind": "uniform", "prompt_max": 10, "output_max": 5, "sigma": 0.5},
     "lengths.sigma (read by kind lognormal) not used by lengths.kind uniform"),
])
def test_a_field_another_kind_reads_is_flagged(tmp_path, capsys, arrivals, lengths, expect):
    # Set away from its default under a kind that never reads it, a field is a slip (cv on
    # poisson looks like burstiness but changes nothing): a warning, as for another policy's
    # knob, so a sweep over kinds still runs; the run goes on.
    data = {"name": "t", "num_requests": 5, "arrivals": arrivals,
            "lengths": lengths or {"kind": "fixed", "prompt_tokens": 10, "output_tokens": 5}}
    rc, err, out = run(tmp_path, data, capsys)
    assert rc == 0, err
    assert f"warning: {tmp_path / 'w.yaml'}: {expect}" in err, err
    assert (out / "summary.json").exists()


def test_a_default_value_or_a_reading_kind_is_not_flagged(tmp_path, capsys):
    data = {"name": "t", "num_requests": 5, "arrivals": {"kind": "gamma", "rate": 5, "cv": 3},
            "lengths": {"kind": "lognormal", "prompt_mean": 10, "output_mean": 5, "prompt_max": 40,
                        "alpha": 1.2}}       # alpha at its default: nothing to say
    rc, err, out = run(tmp_path, data, capsys)
    assert rc == 0 and "warning" not in err, err
