"""Sweeps under faults: a ``kill -9`` of the sweep's main process leaves no pool workers behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The "sweep": two spawned pool workers, each running a 60 s task.
SCRIPT = """
import time
from reports.pool import run_tasks
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
from reports.sweep import lock_folder
lock = lock_folder(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(60)
"""


def test_two_sweeps_on_one_folder_do_not_interleave(tmp_path: Path) -> None:
    """A second sweep on a folder another process holds is refused with one line naming the holder;
    once the holder dies (kill -9 runs no clean-up) the OS has dropped the lock and the folder is free."""
    from reports.sweep import lock_folder
    from sim.config import ConfigError
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
