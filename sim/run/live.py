"""The live seam: the simulator's own Server loop on the wall clock, with a real engine.

``run_recorded`` runs a workload through ``sim.run.runner.drive`` (the one place
that builds requests, policies, block pools and servers) and records every
step's composition; only the environment and the executor differ:

- simulation: ``simpy.Environment`` + ``SimExecutor(profile)``;
- live: ``simpy.rt.RealtimeEnvironment(factor=1, strict=False)`` (arrivals are
  released at their real arrival times) + ``LiveExecutor``, which runs the
  real forward pass for exactly the batch items (each request's ``block_ids``
  is its paged-KV block table), synchronizes, and reports as the step's
  duration the time needed for ``env.now`` to catch up with the wall clock.
  Scheduling, bookkeeping and event handling therefore count, as in
  production, and the drift between the two clocks stays bounded by one step.

Every step is recorded beyond ``StepLog``'s columns: its composition
(``batch``: ``"req:new:ctx"`` items, ``+pad`` when padded), the measured
forward time (``forward_s``) and the token-log length after it (``tok_end``).
Output lengths are pinned by the workload: the simulator's commit decides when
a request is finished; the engine never stops early. This module imports no
torch itself; the engine (``calibrate.engine.LiveEngine``) is handed in, so
it sits beside the loop in sim/.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping, Protocol

import simpy
import simpy.rt

from sim.core.batch import Batch, BatchItem, StepResult
from sim.run.config import WorkloadConfig
from sim.loop.server import Executor, Server, SimExecutor
from sim.core.kv import BlockManager
from sim.cost.profile import Profile
from sim.core.request import Request, Status
from sim.run.runner import collect, drive
from sim.results.result import RunResult
from sim.core.state import SchedulerState


class LiveEngine(Protocol):
    """What the live seam needs of a real engine (``calibrate.engine.LiveEngine``
    is one; this module never imports it, nor torch): run one batch on the
    requests' block tables, wait for the device, drop a finished request's
    bookkeeping, and the shape of its paged KV cache."""

    num_blocks: int
    block_size: int

    def step(self, batch: Batch, requests: Mapping[int, Request]) -> Any: ...

    def synchronize(self) -> None: ...

    def forget(self, req_id: int) -> None: ...


def format_batch(batch: Batch) -> str:
    """A batch's composition as text: ``"7:128:0 3:1:211"`` (req_id:num_new_tokens:context_len,
    ``+pad`` appended when an item carries padding), in the policy's item order."""
    return " ".join(f"{rid}:{n}:{ctx}" + (f"+{pad}" if pad else "") for rid, n, ctx, pad in batch.items)

class LiveExecutor:
    """Executor for a live run on ``env`` (a RealtimeEnvironment with factor 1).

    execute(batch, state): runs ``engine.step(batch, state.requests)`` and
    ``engine.synchronize()``; returns StepResult(duration_s = wall seconds
    since the env's start minus ``env.now`` (>= 0: the catch-up that makes
    the env clock track the wall clock), predicted_s = the profile's
    prediction for the batch, device_s = the measured forward time).
    Raises whatever the engine raises for an invalid batch.
    """

    def __init__(self, engine: LiveEngine, profile: Profile, env: simpy.rt.RealtimeEnvironment) -> None:
        if env.factor != 1.0:
            raise ValueError(f"a live run needs a RealtimeEnvironment with factor 1, got {env.factor}")
        self.engine = engine
        self.profile = profile
        self.env = env
        self.cpu_s: list[float] = []       # process CPU seconds of each forward pass

    def wall_s(self) -> float:
        """Wall seconds since the environment's (re)start, on its own clock."""
        return time.monotonic() - self.env.real_start

    def execute(self, batch: Batch, state: SchedulerState) -> StepResult:
        predicted_s = self.profile.step_time_s(batch)
        c0, t0 = time.process_time(), time.perf_counter()
        self.engine.step(batch, state.requests)
        self.engine.synchronize()
        forward_s = time.perf_counter() - t0
        self.cpu_s.append(time.process_time() - c0)
        return StepResult(duration_s=max(0.0, self.wall_s() - self.env.now),
                          predicted_s=predicted_s, device_s=forward_s)

class StepRecorder:
    """Server.on_step hook: composition, forward time and token count of every
    step; tells the engine (if any) to forget requests that just finished."""

    def __init__(self, state: SchedulerState, engine: LiveEngine | None = None) -> None:
        self.state = state
        self.engine = engine
        self.batches: list[str] = []
        self.forward_s: list[float] = []
        self.tok_end: list[int] = []

    def __call__(self, start_s: float, batch: Batch, result: StepResult) -> None:
        self.batches.append(format_batch(batch))
        self.forward_s.append(math.nan if result.device_s is None else result.device_s)
        self.tok_end.append(len(self.state.tokens))
        if self.engine is not None:
            requests = self.state.requests          # in flight only: done requests have left it
            for it in batch.items:
                r = requests.get(it.req_id)
                if r is None or r.status >= Status.FINISHED:
                    self.engine.forget(it.req_id)

def run_recorded(cfg: WorkloadConfig, profile: Profile, num_blocks: int, max_model_len: int,
                 env: simpy.Environment, make_executor: Callable[[simpy.Environment], Executor],
                 engine: LiveEngine | None = None, *, live: bool = False) -> RunResult:
    """Run ``cfg``'s requests through one Server on ``env``; return its RunResult.

    Requests, policy, block pool and servers are built by ``sim.run.runner.drive``,
    the very code ``run_workload`` uses; ``live``: ``env`` is a wall clock
    (``sim.run.runner.drive``). ``result.steps`` gets the extra columns ``batch``,
    ``forward_s`` and ``tok_end``. Raises RuntimeError if requests are left
    unfinished.
    """
    recorders: list[StepRecorder] = []

    def hook(server: Server) -> StepRecorder:
        recorders.append(StepRecorder(server.state, engine))
        return recorders[-1]

    servers, num_requests, num_dropped, client_queue_s = drive(cfg, profile, num_blocks, max_model_len, env,
                                                               make_executor(env), on_step=hook, live=live)
    result = collect(cfg, servers, num_requests, num_blocks, profile, client_queue_s)
    (recorder,) = recorders
    result.steps["batch"] = recorder.batches
    result.steps["forward_s"] = recorder.forward_s
    result.steps["tok_end"] = recorder.tok_end
    result.meta.update(num_blocks=num_blocks, max_model_len=max_model_len, num_replicas=1,
                       router="round_robin", num_trace_rows_dropped=num_dropped)
    return result

def run_sim(cfg: WorkloadConfig, profile: Profile, num_blocks: int, max_model_len: int) -> RunResult:
    """The simulated twin of ``run_live``: same requests, policy and pool, profile time."""
    wall0 = time.perf_counter()
    result = run_recorded(cfg, profile, num_blocks, max_model_len, simpy.Environment(),
                          lambda env: SimExecutor(profile))
    result.meta.update(mode="sim", wall_s=time.perf_counter() - wall0)
    return result

def warm_up(engine: LiveEngine, max_model_len: int, num_rounds: int = 2) -> None:
    """Run a few throw-away steps so one-time costs (allocator growth, RoPE
    tables up to ``max_model_len``) do not land in the first live steps.

    Uses its own block pool over the engine's blocks and request ids far
    above any workload's; leaves no bookkeeping behind in the engine.
    """
    kv = BlockManager(engine.num_blocks, engine.block_size)
    n = min(256, max_model_len - 1)
    base = 1 << 40
    shapes = [[(max_model_len, n, max_model_len - n)],              # (prompt, new, context)
              [(n + 1, n, 0)],
              [(n + 1, 1, n)] * 4 + [(n + 1, n // 2, 0)]]
    for _ in range(num_rounds):
        for shape in shapes:
            reqs = [Request(base + i, 0.0, prompt, 1) for i, (prompt, _, _) in enumerate(shape)]
            if kv.num_blocks_for(sum(r.num_prompt_tokens for r in reqs)) + len(reqs) > kv.num_free_blocks:
                continue
            for r in reqs:
                kv.allocate(r, r.num_prompt_tokens)
            items = tuple(BatchItem(r.req_id, new, ctx) for r, (_, new, ctx) in zip(reqs, shape))
            engine.step(Batch(items), {r.req_id: r for r in reqs})
            engine.synchronize()
            for r in reqs:
                kv.free(r)
                engine.forget(r.req_id)

def run_live(cfg: WorkloadConfig, profile: Profile, engine: LiveEngine, max_model_len: int) -> RunResult:
    """Run ``cfg`` live on ``engine`` in wall-clock time (blocks for the run's duration).

    The scheduler's pool has exactly the engine's ``num_blocks`` and
    ``block_size``. ``steps`` also gets ``cpu_s``, the process CPU time of
    each forward pass: well below ``forward_s`` x threads on a CPU run means
    other processes took the cores. ``meta`` records the mode, the engine
    and the wall time.
    """
    if engine.block_size != cfg.server.block_size:
        raise ValueError(f"engine block_size {engine.block_size} != server.block_size "
                         f"{cfg.server.block_size}")
    warm_up(engine, max_model_len)
    env = simpy.rt.RealtimeEnvironment(factor=1.0, strict=False)
    executor = LiveExecutor(engine, profile, env)
    wall0 = time.perf_counter()
    result = run_recorded(cfg, profile, engine.num_blocks, max_model_len, env, lambda e: executor, engine,
                          live=True)
    result.steps["cpu_s"] = executor.cpu_s
    result.meta.update(mode="live", wall_s=time.perf_counter() - wall0,
                       engine={"model": engine.config.name, "device": str(engine.device),
                               "dtype": str(engine.dtype).replace("torch.", ""),
                               "num_blocks": engine.num_blocks, "block_size": engine.block_size})
    return result
