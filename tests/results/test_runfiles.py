"""steps.csv and tokens.npz written by a second process while a run goes on (``sim.results.runfiles``).

The process formats the step logs' spilled chunks as they come and writes
tokens.npz after the loop; ``write_run`` renames its files into place. Its
files must be byte for byte those ``write_run`` writes in process, with any
chunking and any number of replicas, and a process that fails or is given up
must leave no file behind and no run that looks complete.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import ROOT, linear_profile

import sim.core.logs
import sim.results.runfiles
from sim.cli import main
from sim.run.config import workload_from_dict
from sim.results.folder import write_run
from sim.results.runfiles import STEP_COLUMNS, RunFilesProcess, csv_columns, step_chunk_text
from sim.run.runner import run_workload


def workload(tmp: Path, **top):
    linear_profile().save(tmp / "p.yaml")
    return workload_from_dict({
        "name": "runfiles", "seed": 5, "num_requests": 60, "arrivals": {"kind": "poisson", "rate": 40.0},
        "lengths": {"kind": "uniform", "prompt_min": 5, "prompt_max": 80, "output_min": 1, "output_max": 40},
        "policy": {"kind": "sarathi"}, "server": {"num_blocks": 256, "max_model_len": 256},
        "profile": {"path": str(tmp / "p.yaml")}, **top})


def written(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in ("steps.csv", "tokens.npz", "requests.csv", "summary.json")}


@pytest.mark.parametrize("replicas", [1, 3])
def test_the_process_writes_the_bytes_write_run_writes(tmp_path, monkeypatch, replicas) -> None:
    cfg = workload(tmp_path)
    alone = write_run(run_workload(cfg, num_replicas=replicas, router="least_requests"), tmp_path / "alone")
    monkeypatch.setattr(sim.results.runfiles, "STREAM_STEP_CHUNK", 7)      # many chunks, announced one by one
    monkeypatch.setattr(sim.core.logs, "TOKEN_CHUNK", 11)
    out = tmp_path / "streamed"
    out.mkdir()
    sent: list[str] = []
    with RunFilesProcess(out) as files:
        send = files._send
        monkeypatch.setattr(files, "_send", lambda line: (sent.append(line), send(line)))
        result = run_workload(cfg, num_replicas=replicas, router="least_requests", files=files)
        assert files.started
        write_run(result, out, files=files)
    assert written(out) == written(alone)
    # ~600 steps in chunks of 7 (a stretch may overshoot one), each announced before the end
    steps = sum(1 for line in sent if line.startswith("C "))
    num_steps = len(result.steps)
    assert num_steps > 100 and num_steps / 7 / 3 < steps <= num_steps / 7 + replicas
    assert sent[-1] == f"E {num_steps} {result.num_tokens}\n"
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "requests.csv", "steps.csv", "summary.json",
                                                   "tokens.npz"]
    with np.load(out / "tokens.npz") as z:                   # what readers get
        assert len(z["req_id"]) == result.num_tokens == len(result.tokens)
    assert 10 < files.peak_rss_mib < 1000                     # reported by the process itself


def test_sim_run_uses_the_process_and_says_nothing_of_it(tmp_path, capsys, monkeypatch) -> None:
    started = []
    start = RunFilesProcess.start
    monkeypatch.setattr(RunFilesProcess, "start", lambda self, *a: started.append(1) or start(self, *a))
    cfg = {"name": "t", "seed": 1, "num_requests": 30, "arrivals": {"kind": "poisson", "rate": 5},
           "lengths": {"kind": "fixed", "prompt_tokens": 50, "output_tokens": 12}, "policy": {"kind": "vllm"}}
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp_path / "w.yaml"), "--out", str(tmp_path / "a"), "--quiet"]) == 0
    assert started == [1]
    monkeypatch.setattr(RunFilesProcess, "start", lambda self, *a: False)       # no process: in process
    assert main(["run", str(tmp_path / "w.yaml"), "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert written(tmp_path / "a") == written(tmp_path / "b")
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.endswith(".tmp")]
    steps = pd.read_csv(tmp_path / "a" / "steps.csv")
    # 30 requests x 12 output tokens = 360 tokens; every step samples at least one
    assert steps["num_decode_tokens"].sum() + steps["num_prefill_seqs"].sum() == 360
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["completed"] == 30


def test_many_replicas_write_in_process(tmp_path) -> None:
    # 17 > MAX_REPLICAS = 16: nothing is started (each replica would spill its last rows alone)
    files = RunFilesProcess(tmp_path)
    logs = [sim.core.logs.StepLog() for _ in range(17)]
    assert not files.start(logs, [sim.core.logs.TokenLog() for _ in logs], range(17), 10) and not files.started
    assert files.start(logs[:16], [sim.core.logs.TokenLog() for _ in logs[:16]], range(16), 10) and files.started
    files.close()
    assert list(tmp_path.iterdir()) == []


def test_a_failing_process_leaves_no_file_and_no_summary(tmp_path, capsys) -> None:
    cfg = {"name": "t", "num_requests": 20, "arrivals": {"kind": "poisson", "rate": 5},
           "lengths": {"kind": "fixed", "prompt_tokens": 100, "output_tokens": 10}, "policy": {"kind": "vllm"}}
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    out.mkdir()
    blocker = out / f".tokens.npz.{os.getpid()}.tmp"       # the process's tokens.npz cannot be created
    blocker.mkdir()
    rc = main(["run", str(tmp_path / "w.yaml"), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{out / 'tokens.npz'}: cannot write (Is a directory)" in err, err
    assert "Traceback" not in err and "incomplete (no summary.json)" in err
    assert not (out / "summary.json").exists() and not (out / "steps.csv").exists()
    # its steps.csv (whole, but not committed) is gone; requests.csv was written before, as in process
    assert sorted(p.name for p in out.iterdir()) == [blocker.name, "requests.csv"]


def test_a_run_given_up_stops_the_process_and_removes_its_files(tmp_path) -> None:
    cfg = workload(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    with RunFilesProcess(out) as files:
        run_workload(cfg, files=files)       # the loop ran and announced everything, but nothing commits
        proc = files.proc
        assert proc is not None
        for _ in range(600):                 # the process has started and written steps.csv (up to 30 s)
            if files.tmps[1].exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert files.tmps[0].exists() and files.tmps[1].exists()
    assert proc.returncode is not None and files.proc is None
    assert list(out.iterdir()) == []


def serve(tmp_path: Path, messages: str) -> tuple[int, str]:
    """The second process's main, in this process, on these stdin lines."""
    code = ("import sys, io; from sim.results.runfiles import main; "
            f"sys.exit(main([{str(tmp_path / 's.tmp')!r}, {str(tmp_path / 't.tmp')!r}, '100']))")
    proc = subprocess.run([sys.executable, "-c", code], input=messages, capture_output=True, text=True, cwd=ROOT)
    return proc.returncode, proc.stderr.strip()


def chunk_file(tmp_path: Path, name: str, num_steps: int) -> Path:
    """A StepLog spill file of ``num_steps`` steps (float columns t, t, t; ints 0..)."""
    path = tmp_path / name
    with open(path, "wb") as f:
        t = np.arange(num_steps, dtype=np.float64) / 4
        for a in (t, t, t, np.arange(num_steps * 8, dtype=np.int32)):
            np.save(f, a)
    return path


def test_the_process_checks_what_it_was_told(tmp_path) -> None:
    a, b = chunk_file(tmp_path, "a.npy", 3), chunk_file(tmp_path, "b.npy", 2)
    # no E: the parent went away; nothing is left and nothing is said (the parent knows)
    assert serve(tmp_path, f"C 0 0 {a}\n") == (1, "")
    assert not (tmp_path / "s.tmp").exists()
    # 3 + 2 steps written, 6 announced
    rc, err = serve(tmp_path, f"C 0 0 {a}\nC 1 1 {b}\nE 6 0\n")
    assert rc == 1 and err == "steps.csv: RuntimeError: 5 steps written, 6 announced"
    rc, err = serve(tmp_path, f"C 0 0 {tmp_path / 'missing.npy'}\nE 0 0\n")
    assert rc == 1 and err.startswith("steps.csv: No such file") and not (tmp_path / "s.tmp").exists()
    # replica 1's chunk comes first but is written after replica 0's
    rc, err = serve(tmp_path, f"C 1 7 {b}\nC 0 4 {a}\nE 5 0\n")
    assert rc == 0 and err.startswith("peak_rss_kib ") and int(err.split()[1]) > 1000   # its own, > 1 MiB
    rows = (tmp_path / "s.tmp").read_text().splitlines()
    assert rows[0] == ",".join(STEP_COLUMNS) and [r.split(",")[0] for r in rows[1:]] == ["4"] * 3 + ["7"] * 2
    # the second step of replica 4: t = 1/4; ints 8..15; kv_total_blocks 100
    assert rows[2] == "4,0.25,0.25,0.25,8,9,10,11,12,13,14,15,100"
    with np.load(tmp_path / "t.tmp") as z:
        assert len(z["req_id"]) == len(z["t_s"]) == 0


def test_csv_columns_is_to_csv() -> None:
    rng = np.random.default_rng(0)
    cols = {"i": rng.integers(-5, 10**12, 50), "small": rng.integers(0, 9, 50), "f": rng.random(50) * 1e-7,
            "g": np.where(rng.random(50) < 0.3, np.nan, rng.random(50) * 1e9), "b": rng.random(50) < 0.5,
            "s": np.array(["finished", "", "rejected"] * 16 + ["x", "y"], dtype=object)}
    frame = pd.DataFrame(cols)
    assert csv_columns(list(cols), list(cols.values())) == frame.to_csv(index=False)
    assert csv_columns(["s"], [np.array(["", "a"], dtype=object)], header=False) == '""\na\n'   # as pandas
    assert csv_columns(["x"], [np.array(["a,b"], dtype=object)]) is None                    # would need quotes
    text = step_chunk_text(2, np.array([0.5]), np.array([0.1]), np.array([np.nan]), np.arange(8), 9, header=True)
    assert text == ",".join(STEP_COLUMNS) + "\n2,0.5,0.1,,0,1,2,3,4,5,6,7,9\n"
    assert io.StringIO(text).readline().rstrip() == "replica,t_s,duration_s,predicted_s,batch_size," \
        "num_prefill_tokens,num_decode_tokens,num_pad_tokens,num_prefill_seqs,num_waiting,num_running," \
        "kv_used_blocks,kv_total_blocks"


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds processes through /proc (Linux)")
def test_killing_sim_run_ends_the_process_and_its_files(tmp_path) -> None:
    """kill -9 of `sim run` mid-run: the second process reads the end of its
    stdin, removes its half-written files and exits; nothing is left running."""
    cfg = {"name": "t", "seed": 1, "num_requests": 200_000, "arrivals": {"kind": "poisson", "rate": 50},
           "lengths": {"kind": "fixed", "prompt_tokens": 40, "output_tokens": 30}, "policy": {"kind": "vllm"}}
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "-m", "sim.cli", "run", str(tmp_path / "w.yaml"), "--out", str(out),
                            "--quiet"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):                            # until the second process writes (up to 60 s)
            if out.is_dir() and list(out.glob(".steps.csv.*.tmp")):
                break
            time.sleep(0.1)
        assert list(out.glob(".steps.csv.*.tmp")), "the second process never started writing"
    finally:
        run.kill()
        run.wait()

    def writers() -> list[int]:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"sim.results.runfiles" in argv and any(str(out).encode() in a for a in argv):
                found.append(int(proc.name))
        return found

    for _ in range(300):                                # it notices within a chunk's formatting (up to 30 s)
        if not writers() and not list(out.iterdir()):
            break
        time.sleep(0.1)
    assert writers() == [] and list(out.iterdir()) == []
