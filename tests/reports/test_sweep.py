"""Sweeps: grid expansion, seeds, up-front validation, resume, and local pool == Dask."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml

from reports.experiments.spec import expand, parse_sweep, repetition_seed, run_id_of
from reports.experiments.sweep import run_sweep, run_sweep_file, run_task
from reports.experiments.table import read_table_ids
from reports.presentation.report import regenerate
from reports.presentation.terminal import slo_met
from sim.cli import main
from sim.run.config import ConfigError

WORKLOAD = {"name": "tiny", "seed": 3, "num_requests": 40, "arrivals": {"kind": "poisson", "rate": 4.0},
            "lengths": {"kind": "uniform", "prompt_min": 32, "prompt_max": 256, "output_min": 8, "output_max": 48},
            "policy": {"kind": "vllm"}}
TIMING_COLUMNS = ["wall_s", "sim_wall_s"]


def write_files(tmp_path: Path, sweep: dict, workload: dict | None = None) -> Path:
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(workload or WORKLOAD))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": "tiny.yaml", **sweep}))
    return path


GRID = {"vary": {"policy.kind": ["vllm", "sarathi"], "arrivals.rate": [2.0, 6.0]}, "repetitions": 2}


def test_grid_expands_with_stable_ids_and_independent_seeds(tmp_path: Path) -> None:
    spec = parse_sweep(write_files(tmp_path, GRID), out=tmp_path / "out")
    tasks = expand(spec)
    assert len(tasks) == 2 * 2 * 2 and len({t.run_id for t in tasks}) == 8
    # Repetition 0 keeps the workload's seed (it reproduces `sim run`); repetition 1 gets another one,
    # the same at every grid point (common random numbers).
    assert {t.seed for t in tasks if t.repetition == 0} == {3}
    assert len({t.seed for t in tasks if t.repetition == 1}) == 1 and repetition_seed(3, 1) != 3
    assert tasks[0].raw["policy"]["kind"] == "vllm" and tasks[0].raw["arrivals"]["rate"] == 2.0
    assert run_id_of({"a": 1, "b": 2}, 0) == run_id_of({"b": 2, "a": 1}, 0) != run_id_of({"a": 1, "b": 2}, 1)


def test_mapping_values_replace_a_section_and_become_columns(tmp_path: Path) -> None:
    sweep = {"vary": {"policy": ["vllm", {"kind": "static", "batch_size": 8}]}}
    tasks = expand(parse_sweep(write_files(tmp_path, sweep), out=tmp_path / "out"))
    assert tasks[1].raw["policy"] == {"kind": "static", "batch_size": 8}
    assert tasks[0].columns == {"policy.kind": "vllm"}
    assert tasks[1].columns == {"policy.kind": "static", "policy.batch_size": 8}


@pytest.mark.parametrize("sweep, message", [
    ({"vary": {"arrivals.rate": [1.0]}, "repititions": 2}, "field 'repititions' is unknown"),
    ({"vary": {"arrivals.rate": []}}, "field 'vary.arrivals.rate' must be a non-empty list"),
    ({"vary": {}}, "field 'vary' must be a non-empty mapping"),
    ({"vary": {"arrivals.rate": [1.0, 1.0]}}, "lists a value twice"),
    ({"vary": {"seed": [1, 2]}}, "use 'repetitions: N'"),
    ({"vary": {"arrivals.rate": [1.0]}, "repetitions": 0}, "field 'repetitions' must be an integer >= 1"),
    ({"vary": {"arrivals.rate": [1.0]}, "save_runs": "no"}, "field 'save_runs' must be true or false, got 'no'"),
    ({"vary": {"arrivals.rate": [1.0]}, "out": 5}, "field 'out' must be a folder path, got 5"),
    ({"vary": {"policy.kind": ["vllm", "sarathi"], "policy": ["orca", "static"]}},
     "field 'vary.policy.kind' lies within vary.policy, which sets it too"),
    ({"vary": {"arrivals.rate": [1.0, 2.0]}, "repetitions": 10**8}, "field 'repetitions' asks for 200,000,000 runs"),
    ({"vary": {"arrivals.rate": [1.0]}, "name": ["a", "b"]}, "field 'name' must be a text"),
    ({"vary": {"arrivals.rate": [1.0]}, "base": "."}, "field 'base' names '.', a folder"),
    ({"vary": {"arrivals.rate": [1.0]}, "base": "sweep.yaml"}, "field 'base' names 'sweep.yaml', a sweep file"),
])
def test_bad_sweep_files_name_the_field_and_the_fix(tmp_path: Path, sweep: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_sweep(write_files(tmp_path, sweep))
    assert "sweep.yaml" in str(info.value) and "fix:" in str(info.value)


def test_missing_base_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"vary": {"arrivals.rate": [1.0]}}))
    with pytest.raises(ConfigError, match="field 'base' is missing"):
        parse_sweep(path)
    path.write_text(yaml.safe_dump({"base": "nope.yaml", "vary": {"arrivals.rate": [1.0]}}))
    with pytest.raises(ConfigError, match="names 'nope.yaml', which does not exist"):
        parse_sweep(path)


NEVER_CALLED: list[str] = []


def never_run(task) -> dict:
    NEVER_CALLED.append(task.run_id)
    raise AssertionError("no run may start when a variant is invalid")


@pytest.mark.parametrize("vary, message", [
    ({"policy.kind": ["vllm", "fifo"]}, "policy.kind=\"fifo\".*must be one of"),
    ({"arrivals.rate": [2.0, -1.0]}, "arrivals.rate=-1.0.*must be > 0"),
    ({"policy.max_num_seqs": [8], "arrivals.rat": [1.0]}, "unknown field 'arrivals.rat'"),
    ({"profile.gpu": ["h100-sxm", "tpu-v9"]}, "profile.gpu=\"tpu-v9\""),
    ({"router": ["round_robin", "random"]}, "field 'router' must be one of"),
    ({"num_requests": [20, 10**30]}, "num_requests=10+]: field 'num_requests' asks for about 1e\\+30"),
])
def test_every_variant_is_validated_before_any_run(tmp_path: Path, vary: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run_sweep_file(write_files(tmp_path, {"vary": vary}), out=tmp_path / "out", jobs=1, progress=False)
    assert not NEVER_CALLED and not (tmp_path / "out" / "results.csv").exists()


def test_each_engines_switch_turns_its_cache_off_in_a_sweep(tmp_path: Path) -> None:
    # Prompts of one 512-token prefix and a 64-token suffix: with the cache on every later request
    # hits; each engine's own switch turns it off in a sweep as in a run (no hit, no cache columns),
    # while vLLM's flag varied over the kinds is refused at the kind that names it otherwise.
    lengths = {"kind": "prefix_repetition", "prefix_len": 512, "suffix_len": 64, "num_prefixes": 1, "output_len": 8}
    base = {**WORKLOAD, "lengths": lengths}
    off = [{"kind": "vllm_v1", "enable_prefix_caching": False}, {"kind": "sglang", "disable_radix_cache": True},
           {"kind": "tensorrt_llm", "enable_block_reuse": False}]
    for task in expand(parse_sweep(write_files(tmp_path, {"vary": {"policy": off}}, base), out=tmp_path / "out")):
        row = run_task(task)
        assert not row.get("prefix_cache_hits"), (task.values, row.get("prefix_cache_hits"))
    on = expand(parse_sweep(write_files(tmp_path, {"vary": {"policy.kind": ["vllm_v1", "sglang", "tensorrt_llm"]}},
                                        base), out=tmp_path / "out2"))
    assert all(run_task(task)["prefix_cache_hits"] > 0 for task in on)
    with pytest.raises(ConfigError, match=r"\[run policy.kind=\"sglang\"\]: field 'policy.enable_prefix_caching': "
                                          r"policy sglang names it 'policy.disable_radix_cache'"):
        expand(parse_sweep(write_files(tmp_path, {"vary": {"policy.kind": ["vllm_v1", "sglang"]}},
                                       {**base, "policy": off[0]}), out=tmp_path / "out3"))


def test_what_fails_before_any_run_writes_nothing(tmp_path: Path, capsys) -> None:
    # a malformed trace in the base workload is read once, before the output folder exists
    (tmp_path / "tr.csv").write_text("arrival_time_s,prompt_tokens,output_tokens\n0,10,5\n1,abc,5\n")
    workload = {**WORKLOAD, "arrivals": {"kind": "trace", "path": "tr.csv"}, "lengths": {"kind": "trace"}}
    del workload["num_requests"]
    path = write_files(tmp_path, {"vary": {"policy.kind": ["vllm", "sarathi"]}}, workload)
    assert main(["sweep", str(path), "--out", str(tmp_path / "out"), "--quiet", "-j", "1"]) == 2
    assert "tr.csv: column 'prompt_tokens' row 3" in capsys.readouterr().err
    # bad --jobs and --cluster are found before the lock and sweep.json are written
    (tmp_path / "tr.csv").write_text("arrival_time_s,prompt_tokens,output_tokens\n0,10,5\n1,12,5\n")
    for flags, message in ((["-j", "0"], "--jobs must be >= 1, got 0"),
                           (["--cluster", "foo://x"], "expected 'local' or a scheduler address")):
        assert main(["sweep", str(path), "--out", str(tmp_path / "out"), "--quiet", *flags]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # an output path that is a file
    (tmp_path / "afile").write_text("")
    assert main(["sweep", str(path), "--out", str(tmp_path / "afile"), "--quiet"]) == 2
    assert f"--out {tmp_path / 'afile'} is a file, not a folder" in capsys.readouterr().err


def test_another_sweep_in_the_default_folder_goes_next_to_it(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    path = write_files(tmp_path, {"vary": {"arrivals.rate": [4.0]}})
    assert main(["sweep", str(path), "-j", "1"]) == 0
    assert (tmp_path / "runs" / "sweep" / "results.csv").is_file()
    # the same sweep again: its folder, its one run already there
    assert main(["sweep", str(path), "-j", "1"]) == 0
    assert "1 runs, 1 already in runs/sweep/results.csv, running 0" in capsys.readouterr().err
    # a what-if (--set) is another sweep: it goes to runs/sweep-2, saying so; the first stays
    assert main(["sweep", str(path), "-j", "1", "--set", "num_requests=30"]) == 0
    err = capsys.readouterr().err
    assert "note: runs/sweep/ holds another sweep" in err and "goes to runs/sweep-2/" in err, err
    assert len(pd.read_csv(tmp_path / "runs" / "sweep" / "results.csv")) == 1
    assert pd.read_csv(tmp_path / "runs" / "sweep-2" / "results.csv")["completed"].tolist() == [30]
    # an explicit --out holding another sweep is still refused
    assert main(["sweep", str(path), "-j", "1", "--set", "num_requests=20", "--out", "runs/sweep"]) == 2
    assert "holds results of a different sweep" in capsys.readouterr().err


class Interrupt(KeyboardInterrupt):
    pass


CALLS: list[str] = []
INTERRUPT_AT: list[int] = []


def counting_run(task) -> dict:
    CALLS.append(task.run_id)
    if INTERRUPT_AT and len(CALLS) == INTERRUPT_AT[0]:
        raise Interrupt()                       # Ctrl-C during this run
    return run_task(task)


def test_interrupted_sweep_keeps_its_rows_and_resumes_without_rerunning(tmp_path: Path) -> None:
    spec = parse_sweep(write_files(tmp_path, GRID), out=tmp_path / "out")
    tasks = expand(spec)
    CALLS.clear()
    INTERRUPT_AT[:] = [4]
    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, tasks, jobs=1, progress=False, runner=counting_run)
    INTERRUPT_AT.clear()
    table = tmp_path / "out" / "results.csv"
    _, done = read_table_ids(table)
    assert done == set(CALLS[:3])               # the three finished runs were written as they ended
    with table.open("a") as f:
        f.write("deadbeef0000,vllm,2.0")        # a row cut short by a kill mid-write
    CALLS.clear()
    run_sweep(spec, tasks, jobs=1, progress=False, runner=counting_run)
    assert len(CALLS) == 5 and not set(CALLS) & done
    final = pd.read_csv(table)
    assert sorted(final["run_id"]) == sorted(t.run_id for t in tasks)
    assert {"policy.kind", "arrivals.rate", "repetition", "seed", "p99_ttft_ms", "offered_rate"} <= set(final.columns)
    CALLS.clear()
    run_sweep(spec, tasks, jobs=1, progress=False, runner=counting_run)
    assert CALLS == []                          # a complete sweep reruns nothing


def test_out_dir_of_another_sweep_is_refused(tmp_path: Path) -> None:
    path = write_files(tmp_path, {"vary": {"arrivals.rate": [2.0]}})
    spec = parse_sweep(path, out=tmp_path / "out")
    run_sweep(spec, expand(spec), jobs=1, progress=False)
    changed = {"base": "tiny.yaml", "set": {"num_requests": 20}, "vary": {"arrivals.rate": [2.0]}}
    path.write_text(yaml.safe_dump(changed))
    spec = parse_sweep(path, out=tmp_path / "out")
    with pytest.raises(ConfigError, match="holds results of a different sweep"):
        run_sweep(spec, expand(spec), jobs=1, progress=False)


def comparable(table: Path) -> pd.DataFrame:
    return pd.read_csv(table).drop(columns=TIMING_COLUMNS).sort_values("run_id").reset_index(drop=True)


def test_dask_cluster_gives_the_same_table_as_the_local_pool(tmp_path: Path) -> None:
    from distributed import Client, LocalCluster
    path = write_files(tmp_path, {**GRID, "save_runs": True})
    local = run_sweep_file(path, out=tmp_path / "pool", jobs=2, progress=False)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        spec = parse_sweep(path, out=tmp_path / "dask")
        dask = run_sweep(spec, expand(spec), cluster=client, progress=False)
    pd.testing.assert_frame_equal(comparable(local), comparable(dask))
    assert len(comparable(local)) == 8
    # The pool sweep wrote every run's files, and its report builds from the folder.
    regenerate(tmp_path / "pool")
    assert (tmp_path / "pool" / "report.html").is_file()
    assert (tmp_path / "pool" / "figures" / "latency_throughput.png").is_file()
    assert len(list((tmp_path / "pool" / "runs").glob("*/summary.json"))) == 8


def test_sweep_prints_its_table_sorted_by_the_varied_values(tmp_path: Path, capsys) -> None:
    workload = {**WORKLOAD, "slo": {"ttft_ms": 1000}}
    path = write_files(tmp_path, {"vary": {"policy.kind": ["vllm", "sarathi"], "arrivals.rate": [6, 2, 10]}},
                       workload)
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "-j", "1", "--quiet",
                 "--set", "num_requests=20", "--seed", "4"]) == 0
    printed = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in printed.splitlines()
            if line.startswith("| ") and "completed" not in line]
    # Knob columns in the file's vary order (safe_dump sorted it: arrivals.rate, policy.kind); rows by
    # their values: numbers in numeric order (as text, "10" would sort before "2"), words alphabetically.
    assert [r[:2] for r in rows] == [["2", "sarathi"], ["2", "vllm"], ["6", "sarathi"], ["6", "vllm"],
                                     ["10", "sarathi"], ["10", "vllm"]]
    table = pd.read_csv(out / "results.csv")
    assert set(table["seed"]) == {4} and set(table["completed"] + table["failed"]) == {20}   # --seed, --set
    by_key = table.set_index(["arrivals.rate", "policy.kind"])
    for r in rows:
        run = by_key.loc[(int(r[0]), r[1])]
        assert r[2] == str(run["completed"]) and r[-1] == ("yes" if slo_met(run, {"ttft_ms": 1000}) else "no")
    assert f"results: {out / 'results.csv'}" in printed and "SLO met: p99 TTFT <= 1000 ms" in printed
    assert "\x1b" not in printed and not any("\u2500" <= ch <= "\u257f" for ch in printed)


def test_slo_met_by_hand() -> None:
    run = pd.Series({"p99_ttft_ms": 900.0, "p99_tpot_ms": 60.0, "failed": 0})
    assert slo_met(run, {"ttft_ms": 1000})                       # 900 <= 1000
    assert not slo_met(run, {"ttft_ms": 1000, "tpot_ms": 50})    # 60 > 50
    assert not slo_met(run.replace(0, 1), {"ttft_ms": 1000})      # one request rejected
    assert not slo_met(run, {"e2el_ms": 5000})                   # no p99 E2E measured: not met


def test_set_overrides_the_sweep_and_the_base_workload(tmp_path: Path) -> None:
    path = write_files(tmp_path, {"vary": {"policy.kind": ["vllm", "sarathi"]}})
    spec = parse_sweep(path, overrides={"repetitions": 2, "policy.max_num_seqs": 64, "num_requests": 10})
    assert spec.repetitions == 2 and spec.base_raw["num_requests"] == 10
    tasks = expand(spec)
    assert [t.raw["policy"] for t in tasks[::2]] == [{"kind": "vllm", "max_num_seqs": 64},
                                                     {"kind": "sarathi", "max_num_seqs": 64}]


@pytest.mark.parametrize("extra, message", [
    (["--set", "arrivals.rate=3"], "--set arrivals.rate: the sweep varies 'arrivals.rate'"),
    (["--set", "policy={kind: orca}"], "--set policy: the sweep varies 'policy'"),
    (["--set", "vary.arrivals.rate=[1]"], "--set vary.arrivals.rate: 'vary' can only be edited in the file"),
    (["--set", "rate"], "--set 'rate': expected key=value"),
    (["--set", "arrivals.rat=3"], "unknown field 'arrivals.rat'"),
])
def test_bad_set_on_a_sweep_is_one_line(tmp_path: Path, capsys, extra: list[str], message: str) -> None:
    path = write_files(tmp_path, {"vary": {"arrivals.rate": [2.0], "policy": ["vllm"]}})
    assert main(["sweep", str(path), "--out", str(tmp_path / "out"), "--quiet", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_terminal_names_the_knee_of_a_budget_sweep() -> None:
    """The knee line `sim sweep` prints, on a hand-made 2 x 2 grid with SLO p99 TTFT <= 1000 ms,
    p99 TPOT <= 50 ms:
      8 req/s:  budget 256 (TTFT 300, TPOT 20) and 1024 (TTFT 200, TPOT 40) both meet; the lower TTFT wins: 1024
      16 req/s: budget 256 (TTFT 5000) misses; 1024 (TTFT 900, TPOT 45) meets -> the knee is at 16 req/s
    and with a third rate, 32 req/s, where both miss, the line says none does there."""
    import pandas as pd

    from reports.presentation.sweepreport import knee_line
    grid = ["policy.max_num_batched_tokens", "arrivals.rate"]
    table = pd.DataFrame({"policy.max_num_batched_tokens": [256, 1024, 256, 1024, 256, 1024],
                          "arrivals.rate": [8, 8, 16, 16, 32, 32],
                          "p99_ttft_ms": [300, 200, 5000, 900, 9000, 4000],
                          "p99_tpot_ms": [20, 40, 25, 45, 30, 70],
                          "output_throughput": [1.0] * 6})
    line = knee_line(table, grid, {"ttft_ms": 1000, "tpot_ms": 50})
    assert line.startswith("Knee at 16 req/s: max_num_batched_tokens 1024 meets the SLO there, recommended 1024; "
                           "none does at 32 req/s and above"), line
    assert knee_line(table, grid, {}) is None                    # no SLO: no knee to name
