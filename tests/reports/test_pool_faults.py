"""Sweeps under faults: a ``kill -9`` of the sweep's main process leaves no pool workers behind, two sweeps
cannot share a folder, leftover .tmp files go, and a damaged row of results.csv is named, dropped and redone."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The "sweep": two spawned pool workers, each running a 60 s task.
SCRIPT = """
import time
from reports.experiments.pool import run_tasks
print("ready", flush=True)
for _ in run_tasks(time.sleep, [60.0, 60.0], jobs=2):
    pass
"""


def _children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (Linux)")
def test_kill_9_of_the_main_process_leaves_no_workers() -> None:
    main = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert main.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while time.monotonic() < deadline:           # the two workers plus multiprocessing's resource tracker
            workers = _children(main.pid)
            if len(workers) >= 3:
                break
            time.sleep(0.2)
        assert len(workers) >= 3, f"pool did not start: children {workers}"
        time.sleep(1.0)                               # the workers are inside their 60 s tasks
        os.kill(main.pid, signal.SIGKILL)
        main.wait(timeout=10)
        deadline = time.monotonic() + 15              # the parent watch polls every 0.5 s
        while time.monotonic() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.2)
        assert not [p for p in workers if _alive(p)], "orphaned pool processes survived the kill -9"
    finally:
        if main.poll() is None:
            main.kill()


HOLD_LOCK = """
import sys, time
from pathlib import Path
from typing import Callable
from reports.experiments.sweep import lock_folder
lock = lock_folder(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(60)
"""


def test_two_sweeps_on_one_folder_do_not_interleave(tmp_path: Path) -> None:
    """A second sweep on a folder another process holds is refused with one line naming the holder;
    once the holder dies (kill -9 runs no clean-up) the OS has dropped the lock and the folder is free."""
    from reports.experiments.sweep import lock_folder
    from sim.run.config import ConfigError
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"another sweep is writing there \(pid {holder.pid}\)"):
            lock_folder(tmp_path)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        lock_folder(tmp_path).close()
    finally:
        if holder.poll() is None:
            holder.kill()


def test_a_sweep_removes_leftover_tmp_files_and_keeps_its_rows(tmp_path: Path) -> None:
    """An interrupted sweep's .tmp files are removed by the next run on the folder; finished rows stay."""
    import yaml

    from sim.cli import main as sim_main
    spec = tmp_path / "sweep.yaml"
    out = tmp_path / "out"
    spec.write_text(yaml.safe_dump({"name": "tmp-clean", "base": str(ROOT / "workloads" / "mixed_lengths.yaml"),
                                    "set": {"num_requests": 20}, "vary": {"arrivals.rate": [2, 4]},
                                    "out": str(out)}))
    assert sim_main(["sweep", str(spec), "-j", "1", "--quiet"]) == 0
    rows = (out / "results.csv").read_text()
    (out / ".results.csv.tmp").write_text("half a row")
    (out / "sweep.json.tmp").write_text("{")
    assert sim_main(["sweep", str(spec), "-j", "1", "--quiet"]) == 0     # nothing left to run
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))
    assert (out / "results.csv").read_text() == rows


# ---- a damaged results.csv ----------------------------------------------------------------------
# The sweep: policy.kind {vllm, sarathi} x arrivals.rate {2, 6}, 20 requests a run = 4 runs, so results.csv
# has 5 lines: the header (line 1) and one row per run in the order they ran (lines 2-5). Line 3 is a
# middle row, line 5 the last.
WORKLOAD = {"name": "tiny", "seed": 3, "num_requests": 20, "arrivals": {"kind": "poisson", "rate": 4.0},
            "lengths": {"kind": "uniform", "prompt_min": 32, "prompt_max": 256, "output_min": 8, "output_max": 48},
            "policy": {"kind": "vllm"}}
GRID = {"name": "damage", "base": "tiny.yaml", "vary": {"policy.kind": ["vllm", "sarathi"], "arrivals.rate": [2, 6]}}
RAN: list[str] = []


def pinned_run(task) -> dict:
    """run_task with its two wall-clock columns fixed at 0, so that a redone row is byte for byte the clean one."""
    from reports.experiments.sweep import run_task
    RAN.append(task.run_id)
    return {**run_task(task), "sim_wall_s": 0.0, "wall_s": 0.0}


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, list[bytes]]:
    """(the sweep file, the lines of its clean results.csv) after one undamaged sweep."""
    import yaml

    from reports.experiments.spec import expand, parse_sweep
    from reports.experiments.sweep import run_sweep
    d = tmp_path_factory.mktemp("clean")
    (d / "tiny.yaml").write_text(yaml.safe_dump(WORKLOAD))
    (d / "sweep.yaml").write_text(yaml.safe_dump(GRID))
    spec = parse_sweep(d / "sweep.yaml", out=d / "out")
    run_sweep(spec, expand(spec), jobs=1, progress=False, runner=pinned_run)
    lines = (d / "out" / "results.csv").read_bytes().splitlines(keepends=True)
    assert len(lines) == 5, lines                                  # header + 4 runs
    return d / "sweep.yaml", lines


def set_field(column: str, value: str) -> Callable[[list[bytes], int], None]:
    """Damage: line n's ``column`` holds ``value`` (the rest of the row as written)."""
    def damage(lines: list[bytes], n: int) -> None:
        header = lines[0].decode().rstrip("\r\n").split(",")
        fields = lines[n - 1].decode().rstrip("\r\n").split(",")   # no quoted commas in this sweep's rows
        fields[header.index(column)] = value
        lines[n - 1] = ",".join(fields).encode() + b"\r\n"
    return damage


def cut_at_end(lines: list[bytes], n: int) -> None:
    lines[n - 1] = lines[n - 1][:40]                               # killed mid-write: no line end


def cut_then_next_row(lines: list[bytes], n: int) -> None:
    lines[n - 1] = lines[n - 1][:40]                               # rows n and n + 1 now share one line


def extra_field(lines: list[bytes], n: int) -> None:
    lines[n - 1] = lines[n - 1].rstrip(b"\r\n") + b",7\r\n"


def lost_fields(lines: list[bytes], n: int) -> None:
    lines[n - 1] = lines[n - 1].rsplit(b",", 3)[0] + b"\r\n"        # the last 3 fields are gone


def not_utf8(lines: list[bytes], n: int) -> None:
    lines[n - 1] = lines[n - 1][:20] + b"\xff\xfe\x9c" + lines[n - 1][23:]


def nul_bytes(lines: list[bytes], n: int) -> None:
    lines[n - 1] = lines[n - 1][:20] + b"\x00\x00" + lines[n - 1][22:]


def foreign_run_id(lines: list[bytes], n: int) -> None:
    lines[n - 1] = b"0123456789ab" + lines[n - 1][12:]             # run ids are 12 hex digits


def repeats_line_2(lines: list[bytes], n: int) -> None:
    lines[n - 1] = lines[1]


def blank_line(lines: list[bytes], n: int) -> None:
    lines.insert(n - 1, b"\r\n")                                   # the rows stay; nothing to redo


# (damage, line, what the one-line message says, the clean lines whose runs are redone). {n}: the header's
# width (run_id, 2 grid columns, repetition, seed, the summary's scalars, offered_rate, sim_wall_s, wall_s).
DAMAGE = {
    "cut at the end": (cut_at_end, 5, "cut short", [5]),
    "cut, next row on its line": (cut_then_next_row, 3, r"\d+ fields, the header has {n}", [3, 4]),
    "extra field, middle": (extra_field, 3, "{n_plus_1} fields, the header has {n}", [3]),
    "extra field, end": (extra_field, 5, "{n_plus_1} fields, the header has {n}", [5]),
    "lost fields, middle": (lost_fields, 4, "{n_minus_3} fields, the header has {n}", [4]),
    "not UTF-8, middle": (not_utf8, 3, r"garbage bytes \(not UTF-8\)", [3]),
    "not UTF-8, end": (not_utf8, 5, r"garbage bytes \(not UTF-8\)", [5]),
    "NUL bytes, middle": (nul_bytes, 3, r"garbage bytes \(control character '\\x00'\)", [3]),
    "non-number, middle": (set_field("p99_ttft_ms", "12.5ms"), 3, "column 'p99_ttft_ms' is '12.5ms', not a number",
                           [3]),
    "non-number, end": (set_field("mean_batch_size", "1.2.3"), 5, "column 'mean_batch_size' is '1.2.3', not a "
                        "number", [5]),
    "wrong seed, end": (set_field("seed", "three"), 5, "column 'seed' is 'three', run [0-9a-f]{{12}} has '3'", [5]),
    "foreign run_id, middle": (foreign_run_id, 3, "run_id '0123456789ab' is not a run of this sweep", [3]),
    "foreign run_id, end": (foreign_run_id, 5, "run_id '0123456789ab' is not a run of this sweep", [5]),
    "wrong grid value, middle": (set_field("policy.kind", "vxlm"), 4, "column 'policy.kind' is 'vxlm'", [4]),
    "repeated run_id, middle": (repeats_line_2, 3, "repeats run [0-9a-f]{{12}} of line 2", [3]),
    "blank line, middle": (blank_line, 3, "0 fields, the header has {n}", []),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_row_is_named_dropped_and_its_run_redone(tmp_path: Path, clean, capsys, kind: str) -> None:
    """Each damage is one stderr line (which line, why); the row is dropped and exactly its run redone,
    and the repaired table has the clean sweep's rows byte for byte (redone rows come last)."""
    from reports.experiments.spec import expand, parse_sweep
    from reports.experiments.sweep import run_sweep
    from reports.experiments.table import DROPPED
    damage, line, why, redo_lines = DAMAGE[kind]
    sweep_file, clean_lines = clean
    spec = parse_sweep(sweep_file, out=tmp_path / "out")
    lines = list(clean_lines)
    damage(lines, line)
    spec.out.mkdir()
    (spec.out / "results.csv").write_bytes(b"".join(lines))
    (spec.out / "sweep.json").write_bytes((sweep_file.parent / "out" / "sweep.json").read_bytes())
    RAN.clear()
    run_sweep(spec, expand(spec), jobs=1, progress=False, runner=pinned_run)
    assert RAN == [clean_lines[n - 1][:12].decode() for n in redo_lines]
    messages = [m for m in capsys.readouterr().err.splitlines() if "results.csv line" in m]
    assert len(messages) == 1, messages
    n = len(clean_lines[0].split(b","))
    why = why.format(n=n, n_plus_1=n + 1, n_minus_3=n - 3)
    assert re.search(rf"results\.csv line {line}: {why}[^;]*; dropped the row", messages[0]), messages[0]
    final = (spec.out / "results.csv").read_bytes().splitlines(keepends=True)
    assert final[0] == clean_lines[0] and sorted(final[1:]) == sorted(clean_lines[1:])
    assert len({row[:12] for row in final[1:]}) == 4                 # no run_id twice
    dropped = (spec.out / DROPPED).read_bytes()                    # the damaged line's bytes, as they were
    assert dropped in b"".join(lines) and lines[line - 1].rstrip(b"\r\n") in dropped and dropped.count(b"\n") <= 1


def test_several_damaged_rows_are_redone_and_the_report_builds(tmp_path: Path, clean, capsys) -> None:
    """Before this check a middle row missing fields left its run_id twice in results.csv, and one with a
    field too many crashed the report (pandas ParserError). Rows 1, 2 and 4 of 4 damaged (lines 2, 3, 5):
    three one-line messages, three runs redone, 4 rows with the clean values, and the report builds."""
    from sim.cli import main as sim_main
    sweep_file, clean_lines = clean
    lines = list(clean_lines)
    lost_fields(lines, 2)
    extra_field(lines, 3)
    foreign_run_id(lines, 5)
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.csv").write_bytes(b"".join(lines))
    (out / "sweep.json").write_bytes((sweep_file.parent / "out" / "sweep.json").read_bytes())
    assert sim_main(["sweep", str(sweep_file), "--out", str(out), "-j", "1", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err.count("will be redone") == 2                       # line 5's run_id is foreign: its run is just missing
    assert [int(m.split("results.csv line ")[1].split(":")[0]) for m in err.splitlines() if "results.csv line" in m] \
        == [2, 3, 5]
    import pandas as pd
    final = pd.read_csv(out / "results.csv").drop(columns=["wall_s", "sim_wall_s"]).sort_values("run_id")
    want = pd.read_csv(sweep_file.parent / "out" / "results.csv").drop(columns=["wall_s", "sim_wall_s"])
    pd.testing.assert_frame_equal(final.reset_index(drop=True), want.sort_values("run_id").reset_index(drop=True))
    assert (out / "report.html").is_file()


def test_a_header_cut_mid_write_leaves_an_empty_table_and_every_run_is_redone(tmp_path: Path, clean) -> None:
    """The first run ended and the sweep was killed while writing the header: no row was finished, 4 runs redone."""
    from reports.experiments.spec import expand, parse_sweep
    from reports.experiments.sweep import run_sweep
    sweep_file, clean_lines = clean
    spec = parse_sweep(sweep_file, out=tmp_path / "out")
    spec.out.mkdir()
    (spec.out / "results.csv").write_bytes(clean_lines[0][:30])   # the first run ended; its header half written
    RAN.clear()
    run_sweep(spec, expand(spec), jobs=1, progress=False, runner=pinned_run)
    assert len(RAN) == 4
    assert (spec.out / "results.csv").read_bytes().splitlines(keepends=True) == clean_lines


def test_a_damaged_header_with_rows_is_one_line_and_changes_nothing(tmp_path: Path, clean, capsys) -> None:
    """Without its header no row can be read; the sweep refuses (exit 2, one line) and leaves the file as it is."""
    from sim.cli import main as sim_main
    sweep_file, clean_lines = clean
    out = tmp_path / "out"
    out.mkdir()
    damaged = b"run_id,policy.kind,arrivals.rate\r\n" + b"".join(clean_lines[1:])   # no repetition, seed, wall_s
    (out / "results.csv").write_bytes(damaged)
    assert sim_main(["sweep", str(sweep_file), "--out", str(out), "-j", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "results.csv: line 1 (the header) is damaged: it lacks the column(s) repetition, " \
        "seed, wall_s; fix:" in err
    assert (out / "results.csv").read_bytes() == damaged


def test_sigterm_mid_run_cleans_up_like_an_interrupt(tmp_path):
    # `timeout` and CI runners stop a command with SIGTERM: the run's spill folders (its token and
    # step logs on disk) and its half-made output folder go, as after Ctrl-C, and the exit is 143.
    spill = tmp_path / "tmp"
    spill.mkdir()
    out = tmp_path / "out"
    env = {**os.environ, "TMPDIR": str(spill)}
    proc = subprocess.Popen([sys.executable, "-m", "sim.cli", "run", str(ROOT / "workloads" / "azure_conv.yaml"),
                             "--out", str(out), "--quiet", "--set", "arrivals.repeat=20"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(spill.iterdir()) and time.monotonic() < deadline:     # the loop has started spilling
        time.sleep(0.05)
    assert any(spill.iterdir()), "the run never made its spill folder"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and err.strip().splitlines()[-1] == "terminated", err
    assert list(spill.iterdir()) == [] and not out.exists()
