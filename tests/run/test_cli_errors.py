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
    (GOOD + "server: {max_model_len: 200000}\n", "'server.max_model_len' (200,000) is longer than the model's "
                                                  "context (llama-3.1-8b: max_position_embeddings 131,072)"),
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
    # a bad value from --set is blamed on --set, not only on the file that does not hold it
    rc, out, err, _ = run_cli(tmp_path, GOOD, "--set", "arrivals.rate=-1", capsys=capsys)
    assert rc == 2 and err.strip().endswith("got -1.0 (the value comes from --set arrivals.rate=-1)"), err


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
    assert not outdir.exists()        # the folder the run made is gone again: no empty run folder


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
    from sim.run.config import load_workload
    for path in WORKLOADS.glob("*.yaml"):
        if path.name.startswith(("sweep_", "plan_")):
            continue
        load_workload(path)


def test_readme_custom_model_example_runs(tmp_path, capsys):
    """The HF-fields example of docs/profiles.md, verbatim."""
    import re
    readme = (WORKLOADS.parent / "docs" / "profiles.md").read_text()
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


def test_yaml_numbers_with_exponents_and_duplicate_keys(tmp_path, capsys):
    # YAML 1.1 reads 2e1 as a string; batchsim reads it as YAML 1.2 does: 20 requests at 5 req/s
    rc, out, err, outdir = run_cli(tmp_path, GOOD.replace("num_requests: 20", "num_requests: 2e1")
                                   .replace("rate: 5", "rate: 5e0"), capsys=capsys)
    assert rc == 0, err
    assert json.loads((outdir / "summary.json").read_text())["completed"] == 20
    # a key given twice is an error at its second line, not the last one silently winning
    rc, out, err, outdir = run_cli(tmp_path, GOOD + "num_requests: 30\n", "--overwrite", capsys=capsys)
    assert rc == 2 and "duplicate key 'num_requests'" in err and "line 7" in err, err
    rc, out, err, _ = run_cli(tmp_path, GOOD, "--overwrite", "--set", "num_requests=2.5e1", capsys=capsys)
    assert rc == 0 and "completed 25" in out, err


@pytest.mark.parametrize("name", ["../..", "/tmp/x", "", ".", "a/b", "nul\0byte", "x" * 201])
def test_a_name_that_is_not_a_folder_name_is_refused(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w.yaml").write_text(GOOD + f"name: {json.dumps(name)}\n".replace("name: t\n", ""))
    text = GOOD.replace("name: t", f"name: {json.dumps(name)}")
    (tmp_path / "w.yaml").write_text(text)
    rc = main(["run", str(tmp_path / "w.yaml"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "field 'name' must be a plain folder name" in err, err
    assert not (tmp_path / "runs").exists()


def test_an_existing_empty_folder_stays_when_the_run_fails(tmp_path, capsys):
    (tmp_path / "trace.csv").write_text("arrival_time_s,prompt_tokens,output_tokens\n0,10,5\n1,nan,5\n")
    (tmp_path / "out").mkdir()                       # the user's own folder: not ours to remove
    rc, out, err, outdir = run_cli(tmp_path, TRACE_WL, capsys=capsys)
    assert rc == 2 and "row 3" in err and outdir.is_dir()


def test_paths_in_the_way_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    for target, expect in ((tmp_path / "d", "is a folder"), (tmp_path / "no" / "s.json", "its folder does not exist")):
        assert main(["schema", "--out", str(target)]) == 2
        err = capsys.readouterr().err
        assert expect in err and "Traceback" not in err, err
    # --report into a run folder where a file sits at figures/: the run is written, the report names the file
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "figures").write_text("mine")
    rc, out, err, outdir = run_cli(tmp_path, GOOD, "--report", capsys=capsys)
    assert rc == 2 and f"{outdir / 'figures'}: a file is in the way" in err, err
    assert (tmp_path / "out" / "figures").read_text() == "mine"


@pytest.mark.parametrize("argv, expect", [
    (["--replicas", "0"], "--replicas must be >= 1, got 0"),
    (["--metric-percentiles", ""], "--metric-percentiles: '' is not a number"),
])
def test_bad_flags_of_a_run_are_found_before_its_folder(tmp_path, capsys, argv, expect):
    rc, out, err, outdir = run_cli(tmp_path, GOOD, *argv, capsys=capsys)
    assert rc == 2 and expect in err and not outdir.exists(), err


@pytest.mark.parametrize("argv, expect", [
    (["run", "W", "--out", ""], "--out '': expected a folder path"),
    (["calibrate", "--budget-s", "inf", "--out", "p.yaml"], "--budget-s must be a finite number of seconds > 0"),
    (["calibrate", "--out", "."], "--out '.': is a folder"),
    (["calibrate", "--out", "no/such/p.yaml"], "its folder does not exist"),
    (["validate", "W", "--budget-s", "nan"], "--budget-s must be a finite number of seconds > 0, got nan"),
    (["schema", "--out", ""], "its folder does not exist"),
])
def test_bad_paths_and_budgets_are_refused_before_the_work(tmp_path, capsys, monkeypatch, argv, expect):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w.yaml").write_text(GOOD)
    assert main([str(tmp_path / "w.yaml") if a == "W" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.yaml"]      # nothing written


@pytest.mark.parametrize("argv, expect", [
    (["sweep", "W"], "this is a workload file (it has arrivals, lengths, policy, num_requests), not a sweep file; "
                     "fix: run it "
                     "with `sim run"),
    (["plan", "W"], "not a plan file"),
    (["run", "."], ": is a folder; give a YAML file"),
    (["report", "nowhere"], "nowhere: no such folder"),
    (["run", ""], "error: expected a YAML file path, got ''"),               # was ".: is a folder"
    (["run", "/dev/null"], "/dev/null: is not a regular file"),             # was "file not found"
    (["run", "W", "--set", "arrivals={kind: trace, path: ''}"], "field 'arrivals.path' must be a file path, got ''"),
    (["run", "W", "--set", "arrivals={kind: trace, path: /dev/null}"], "/dev/null: is not a regular file"),
    (["run", "W", "--set", "arrivals={kind: trace, path: .}"], ": is a folder, not a trace file"),
    (["run", "W", "--set", "arrivals={kind: trace, path: t.csv, columns: {output: null}}"],
     "field 'arrivals.columns.output' must be a column name, got None"),
])
def test_the_wrong_kind_of_file_or_folder_is_named(tmp_path, capsys, monkeypatch, argv, expect):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w.yaml").write_text(GOOD)
    assert main([str(tmp_path / "w.yaml") if a == "W" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert expect in err and len(err.strip().splitlines()) == 1, err


def test_a_closed_pipe_ends_quietly(tmp_path):
    import subprocess
    import sys
    (tmp_path / "w.yaml").write_text(GOOD)
    cmd = (f"{sys.executable} -m sim.cli run {tmp_path / 'w.yaml'} --out {tmp_path / 'o'} --quiet | true; "
           f"exit ${{PIPESTATUS[0]}}")                  # the reader is gone before the summary is printed
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in p.stderr and p.stderr == "", p.stderr
    assert p.returncode == 141 and (tmp_path / "o" / "summary.json").is_file()


@pytest.mark.parametrize("redirect, rc, expect", [
    (">&-", 0, ""),                                                        # stdout closed
    ("> /dev/full", 1, "error: cannot write to standard output (No space left on device)\n"),
])
def test_an_unusable_stdout_is_not_a_traceback(tmp_path, redirect, rc, expect):
    import subprocess
    import sys
    (tmp_path / "w.yaml").write_text(GOOD.replace("name: t", "name: café"))
    cmd = f"{sys.executable} -m sim.cli run {tmp_path / 'w.yaml'} --out {tmp_path / 'o'} --quiet {redirect}"
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "PYTHONIOENCODING": "ascii"})
    assert (p.returncode, p.stderr) == (rc, expect) and (tmp_path / "o" / "summary.json").is_file()


def test_a_name_an_ascii_terminal_cannot_show_is_escaped(tmp_path):
    import subprocess
    import sys
    (tmp_path / "w.yaml").write_text(GOOD.replace("name: t", "name: café"))
    p = subprocess.run([sys.executable, "-m", "sim.cli", "run", str(tmp_path / "w.yaml"), "--out",
                        str(tmp_path / "o"), "--quiet"], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "PYTHONIOENCODING": "ascii"})
    assert p.returncode == 0 and p.stdout.startswith("caf\\xe9: policy vllm"), p.stderr


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    (d / "w.yaml").write_text(GOOD)
    assert main(["run", str(d / "w.yaml"), "--out", str(d / "run"), "--quiet"]) == 0
    return d / "run"


@pytest.mark.parametrize("damage, expect", [
    (lambda d: (d / "summary.json").write_text("{bad"), "summary.json: damaged (Expecting property name"),
    (lambda d: (d / "summary.json").write_text("[1, 2]"), "summary.json: damaged (expected a JSON object)"),
    (lambda d: (d / "meta.json").write_text(""), "meta.json: damaged (Expecting value"),
    (lambda d: (d / "requests.csv").unlink(), "this run folder has no requests.csv"),
    (lambda d: (d / "steps.csv").write_bytes(b"\x8c\xff\x00"), "steps.csv: damaged ("),
    (lambda d: (d / "tokens.npz").write_bytes(b"PK\x03"), "files are damaged or from another version"),
    (lambda d: (d / "requests.csv").write_text("a,b\n" + "1,2\n" * 20), "missing field or column 'arrival_s'"),
    # cut short: the figures would have drawn 2 of the 20 requests beside a summary of 20
    (lambda d: (d / "requests.csv").write_text("".join((d / "requests.csv").read_text().splitlines(True)[:3])),
     "requests.csv: 2 rows, but summary.json counts 20 requests (the file was cut or edited)"),
])
def test_report_on_a_damaged_run_folder_names_the_file(saved_run, tmp_path, capsys, damage, expect):
    import shutil
    d = tmp_path / "run"
    shutil.copytree(saved_run, d)
    damage(d)
    assert main(["report", str(d)]) == 2
    err = capsys.readouterr().err
    assert expect in err and "fix: run the workload again" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_report_on_a_damaged_sweep_table_names_the_line(tmp_path, capsys):
    # a garbage row appended to results.csv was reported as "3 runs (of 2 in the grid)"
    (tmp_path / "w.yaml").write_text(GOOD)
    (tmp_path / "s.yaml").write_text("base: w.yaml\nvary: {arrivals.rate: [2, 4]}\n")
    out = tmp_path / "s"
    assert main(["sweep", str(tmp_path / "s.yaml"), "--out", str(out), "--quiet"]) == 0
    table = (out / "results.csv").read_text()
    (out / "results.csv").write_text(table + "garbage\n")
    capsys.readouterr()
    assert main(["report", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'results.csv'} line 4: 1 fields, the header has" in err and "rerun the same `sim sweep`" in err
    (out / "results.csv").write_text(table[:20])                  # cut inside the header
    assert main(["report", str(out)]) == 2
    assert "the header was cut short" in capsys.readouterr().err


def test_a_profile_with_bad_engine_knobs_is_refused(tmp_path, capsys):
    import yaml
    root = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((root / "calibrate/profiles/cpu/tiny-llama/float32.yaml").read_text())
    for engine, expect in (({"max_num_seqs": -4}, "'engine.max_num_seqs' must be a positive integer, got -4"),
                           ({"block_size": "x"}, "'engine.block_size' must be a positive integer, got 'x'"),
                           ({"request_overhead_s": float("nan")}, "'engine.request_overhead_s' must be a finite"),
                           ([1, 2], "'engine' must be a mapping")):
        (tmp_path / "p.yaml").write_text(yaml.safe_dump({**data, "engine": engine}))
        rc, out, err, _ = run_cli(tmp_path, GOOD + "profile: {path: p.yaml}\n", "--overwrite", capsys=capsys)
        assert rc == 2 and expect in err and "p.yaml" in err, err
    # whole numbers written as floats (1e3, 16.0) are the integers they name
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({**data, "engine": {"block_size": 16.0, "max_num_seqs": 8}}))
    rc, out, err, outdir = run_cli(tmp_path, GOOD + "profile: {path: p.yaml}\n", "--overwrite", capsys=capsys)
    assert rc == 0 and "x 16 tokens" in out, err


def test_one_commands_folder_is_never_written_by_another(tmp_path, capsys):
    # A run, a sweep and a plan each refuse a folder holding another command's results (their files
    # would mix; `run --overwrite` used to delete the sweep's report): one line, exit 2, untouched.
    (tmp_path / "w.yaml").write_text(GOOD)
    (tmp_path / "s.yaml").write_text("base: w.yaml\nvary: {arrivals.rate: [2, 4]}\n")
    run_dir, sweep_dir = tmp_path / "r", tmp_path / "s"
    assert main(["run", str(tmp_path / "w.yaml"), "--out", str(run_dir), "--quiet"]) == 0
    assert main(["sweep", str(tmp_path / "s.yaml"), "--out", str(sweep_dir), "--quiet"]) == 0
    capsys.readouterr()
    before = sorted(p.name for p in sweep_dir.iterdir())
    for argv, expect in (
            (["sweep", str(tmp_path / "s.yaml"), "--out", str(run_dir), "--quiet"], f"--out {run_dir}: holds a run"),
            (["run", str(tmp_path / "w.yaml"), "--out", str(sweep_dir), "--overwrite", "--quiet"],
             f"--out {sweep_dir}: holds a sweep's results (sim sweep); writing a run there")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert expect in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in sweep_dir.iterdir()) == before and "report.html" in before
    assert not (run_dir / "results.csv").exists()


def test_an_unreadable_input_is_not_blamed_on_the_output_folder(tmp_path, capsys, monkeypatch):
    # EACCES on a file the command reads: "cannot read it", not "choose a folder you can write"
    # (root reads anything, so the file's mode is simulated through os.access).
    import errno

    import sim.cli
    wl = tmp_path / "w.yaml"
    wl.write_text(GOOD)
    monkeypatch.setattr(sim.cli.os, "access", lambda path, mode: Path(path) != wl)
    problem = sim.cli._os_problem(PermissionError(errno.EACCES, "Permission denied", str(wl)))
    assert problem == "permission denied: cannot read it; check its permissions"
    folder = sim.cli._os_problem(PermissionError(errno.EACCES, "Permission denied", str(tmp_path)))
    assert folder == "permission denied; choose a folder you can write"


def test_a_validation_kept_out_of_a_full_folder_says_where_it_went(tmp_path, capsys):
    # --out X holding files: the report goes to X-2, and says so (a script reading X/report.json
    # would otherwise read the old one)
    from calibrate.serving.validate_server import output_dir
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "report.json").write_text("{}")
    assert output_dir(str(tmp_path / "v"), "w", None) == tmp_path / "v-2"
    assert f"note: {tmp_path / 'v'}/ already holds files, so this report goes to {tmp_path / 'v-2'}/" in \
        capsys.readouterr().err
    assert output_dir(str(tmp_path / "fresh"), "w", None) == tmp_path / "fresh" and not capsys.readouterr().err


def test_a_block_larger_than_the_cache_and_a_bad_tp_are_named(tmp_path, capsys):
    # block_size 1e6 left 0 blocks and the message asked for "server.max_model_len <= 0"; a TP of '2'
    # (a string) in a plan candidate was blamed on gpus_per_replica, which the file did not set
    rc, _, err, _ = run_cli(tmp_path, GOOD + "server: {block_size: 1000000}\n", capsys=capsys)
    assert rc == 2 and "field 'server.block_size' (1,000,000 tokens) is larger than the whole KV cache" in err, err
    (tmp_path / "w.yaml").write_text(GOOD)
    (tmp_path / "p.yaml").write_text("base: w.yaml\ntarget_rate: 5\nslo: {ttft_ms: 2000}\ncandidates:\n"
                                     "  - {profile: {gpu: h100-sxm, tensor_parallel: '2'}, price_per_gpu_hour: 2}\n")
    assert main(["plan", str(tmp_path / "p.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert "field 'candidates[0].profile.tensor_parallel' must be an integer >= 1, got '2'" in capsys.readouterr().err
    plan_dir = tmp_path / "pl"
    plan_dir.mkdir()
    for name in ("ranked.csv", "trials.csv"):
        (plan_dir / name).write_text("a\n1\n")
    (plan_dir / "plan.json").write_text('{"plan": "x", "results": []}')
    assert main(["report", str(plan_dir)]) == 2
    assert "files are damaged or from another version" in capsys.readouterr().err
