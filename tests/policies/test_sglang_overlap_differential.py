"""The sglang policy's overlap loop (rule 7, enable_overlap) against SGLang
0.5.23's own scheduler code, run in-process on CPU.

SGLang's ``Scheduler`` cannot be built here (it needs a GPU worker and its
processes), but its methods are plain functions of their ``self``: each test
calls SGLang's own method on a stand-in ``self`` that holds only what the
method reads.

- ``Scheduler._reqs_finishing_inflight`` (with ``Req.next_output_finishes_by_length``):
  which running requests the batch in flight finishes by length;
- ``Scheduler.update_running_batch`` with ``ScheduleBatch.retract_decode``,
  ``check_decode_mem``, ``new_tokens_required_next_decode``,
  ``BaseTokenToKVPoolAllocator.check_decode_capacity`` and
  ``NewTokenRatioTracker``: the decode pass with a batch in flight (who decodes
  after which tokens, who is retracted or aborted, the ratio, ``batch_is_full``,
  the pool left), against ``SglangPolicy._decode``; the stand-in batch frees a
  retracted request's pages and allocates the decode's, the tree holding nothing;
- ``Scheduler.event_loop_overlap`` with ``is_disable_overlap_for_batch``: the
  loop itself drives the policy (``get_next_batch_to_run``) and
  ``SchedulerState.commit_overlap`` (``process_batch_result``) on a clock where
  a launched batch starts when the GPU is free and a result is processed when
  its batch ends, against batchsim's SimPy loop (``sim.loop.server``): the same
  batches at the same times, the same tokens. With
  ``SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP`` set too: that variable moves
  only when a result is processed, never what is chosen.

What runs on batchsim's side of the last test is the policy itself: this
checks the loop and the commit; the pass's own rules are checked by the first
two tests and by tests/policies/test_sglang_differential.py (radix cache,
PrefillAdder). Needs SGLang importable (skipped otherwise), as that file.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import types
from collections import deque

import pytest

if os.environ.get("SGLANG_PATH"):
    sys.path.insert(0, os.environ["SGLANG_PATH"])
if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (SGLANG_PATH: a --target install of sglang==0.5.23)",
                allow_module_level=True)
torch = pytest.importorskip("torch")

import simpy  # noqa: E402

from conftest import linear_profile  # noqa: E402
from policies.sglang import SglangConfig, SglangPolicy  # noqa: E402
from sim.core.batch import Batch  # noqa: E402
from sim.core.policy import PolicyContext  # noqa: E402
from sim.core.radix import RadixCachePool  # noqa: E402
from sim.core.request import Request, Status  # noqa: E402
from sim.core.state import SchedulerState  # noqa: E402
from sim.loop.feed import feed  # noqa: E402
from sim.loop.server import Server, SimExecutor  # noqa: E402
from test_sglang_differential import sglang_importable  # noqa: E402

NUM_CASES = 300


@pytest.fixture(scope="module")
def sgl():
    with sglang_importable():
        import sglang.srt.managers.scheduler as sch
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
        from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
        yield types.SimpleNamespace(sch=sch, Scheduler=sch.Scheduler, Req=Req, ScheduleBatch=ScheduleBatch,
                                    Tracker=NewTokenRatioTracker, Allocator=BaseTokenToKVPoolAllocator)


class _TheirReq:
    """A stand-in for SGLang's ``Req``: hashed and compared by identity, as ``Req`` is."""


def _their_req(sgl, rid, prompt, outputs, max_new, kv_len):
    """The attributes of SGLang's ``Req`` that the decode pass reads (its own length rule bound)."""
    t = _TheirReq()
    t.__dict__.update(rid=rid, output_ids=[0] * outputs, origin_input_ids=[0] * prompt,
                      sampling_params=types.SimpleNamespace(max_new_tokens=max_new), beam_group=None,
                      kv=types.SimpleNamespace(kv_committed_len=kv_len, kv_allocated_len=kv_len),
                      is_retracted=False, to_finish=None)
    t.finished = lambda: False
    t.next_output_finishes_by_length = types.MethodType(sgl.Req.next_output_finishes_by_length, t)
    t.reset_for_retract = lambda: setattr(t, "is_retracted", True)
    return t


def _random_running(rng):
    """(prompt, committed outputs, max_tokens, in flight) per running request: decodes whose next
    token may be in flight, and prefills whose result is (merged into the running batch)."""
    specs = []
    for _ in range(rng.randint(1, 6)):
        outputs = rng.choice([0, 1, 1, 2, 3, 5])
        in_flight = outputs == 0 or rng.random() < 0.7
        specs.append((rng.randint(1, 12), outputs, outputs + rng.randint(1, 4), in_flight))
    return specs


def test_finishing_in_flight_as_sglangs(sgl):
    diffs = 0
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        specs = _random_running(rng)
        queued = rng.random() < 0.8                      # else nothing in flight (result_queue empty)
        theirs = [_their_req(sgl, i, p, o, m, 0) for i, (p, o, m, _) in enumerate(specs)]
        ours = []
        for i, (p, o, m, _) in enumerate(specs):
            r = Request(i, 0.0, p, m)
            r.num_output_tokens = o
            ours.append(r)
        flight = {i: 1 for i, s in enumerate(specs) if s[3]} if queued else {}
        me = types.SimpleNamespace(enable_skip_finishing_decode=True, result_queue=deque(
            [(types.SimpleNamespace(reqs=[t for t, s in zip(theirs, specs) if s[3]]), None)] if queued else []))
        want = [t.rid for t in sgl.Scheduler._reqs_finishing_inflight(me, types.SimpleNamespace(reqs=theirs))]
        got = [r.req_id for r in ours if SglangPolicy._finishes_inflight(r, flight)]
        diffs += want != got
    assert diffs == 0, f"{diffs} of {NUM_CASES} cases differ"


class _TheirBatch:
    """SGLang's running ``ScheduleBatch`` as the decode pass uses it: SGLang's own memory check,
    retraction and order; the KV a plain page count (nothing in the tree)."""

    def __init__(self, sgl, reqs, page, free_tokens, batch_is_full):
        self.reqs = reqs
        self.batch_is_full = batch_is_full
        self.tree_cache = None
        self.spec_algorithm = types.SimpleNamespace(is_none=lambda: True)
        pool = types.SimpleNamespace(free=free_tokens)
        alloc = types.SimpleNamespace(page_size=page, available_size=lambda: pool.free,
                                      evict_to_free_tokens=lambda tree, n: None)
        alloc.check_decode_capacity = types.MethodType(sgl.Allocator.check_decode_capacity, alloc)
        self.token_to_kv_pool_allocator = alloc
        self.pool = pool
        self.page = page
        self.decoded_after: list[tuple[int, int]] = []
        SB = sgl.ScheduleBatch
        self.check_decode_mem = types.MethodType(SB.check_decode_mem, self)
        self.new_tokens_required_next_decode = types.MethodType(SB.new_tokens_required_next_decode, self)
        self.retract_decode = types.MethodType(SB.retract_decode, self)
        self._get_decode_retraction_order = SB._get_decode_retraction_order

    def batch_size(self):
        return len(self.reqs)

    def is_empty(self):
        return not self.reqs

    def filter_batch(self, reqs_to_exclude=None, keep_indices=None):
        if keep_indices is None:
            reqs_to_exclude = reqs_to_exclude or []
            keep_indices = [i for i, r in enumerate(self.reqs) if not r.finished() and r not in reqs_to_exclude]
        self.reqs = [self.reqs[i] for i in keep_indices]

    def _pages(self, tokens):
        return -(-tokens // self.page)

    def release_req(self, idx, remaining, offload_kv=True):
        r = self.reqs[idx]
        self.pool.free += self._pages(r.kv.kv_allocated_len) * self.page
        r.kv.kv_allocated_len = r.kv.kv_committed_len = 0
        r.reset_for_retract()
        return True

    def prepare_for_decode(self):
        for r in self.reqs:
            self.decoded_after.append((r.rid, r.kv.kv_committed_len))
            if not r.kv.kv_committed_len % self.page:
                self.pool.free -= self.page
            r.kv.kv_committed_len += 1
            r.kv.kv_allocated_len += 1


def test_the_decode_pass_with_a_batch_in_flight_as_sglangs(sgl, monkeypatch):
    monkeypatch.setattr(sgl.sch, "_make_abort_req", lambda req, finished_reason: req)
    diffs, retracted, skipped, aborted = 0, 0, 0, 0
    for seed in range(NUM_CASES):
        rng = random.Random(7000 + seed)
        page = rng.choice([1, 1, 2, 4])
        specs = _random_running(rng)
        # what each holds: prompt + outputs (the token in flight's included) or prompt + outputs - 1
        held = [p + o if f else p + o - 1 for p, o, _, f in specs]
        free_pages = rng.randint(0, len(specs) + 1)
        ratio = rng.choice([0.7, 0.3, 0.098])
        full = rng.random() < 0.5
        # SGLang's side
        theirs = [_their_req(sgl, i, p, o, m, held[i]) for i, (p, o, m, _) in enumerate(specs)]
        batch = _TheirBatch(sgl, theirs, page, free_pages * page, full)
        queue, aborts = [], []
        policy_cfg = SglangConfig(page_size=page)
        ours_policy = SglangPolicy(policy_cfg, PolicyContext(4096))
        tracker = sgl.Tracker(init=ours_policy.init_ratio, min=ours_policy.min_ratio,
                              decay=ours_policy.ratio_decay, current=ratio)
        in_flight = [t for t, s in zip(theirs, specs) if s[3]]
        me = types.SimpleNamespace(
            enable_skip_finishing_decode=True,
            result_queue=deque([(types.SimpleNamespace(reqs=in_flight), None)] if in_flight else []),
            forward_ct=1, decode_offload_manager=None, new_token_ratio_tracker=tracker,
            token_to_kv_pool_allocator=batch.token_to_kv_pool_allocator,
            tree_cache=types.SimpleNamespace(req_to_token_pool=types.SimpleNamespace()),
            metrics_reporter=types.SimpleNamespace(num_retracted_reqs=0, enable_metrics=False),
            send_abort_output=lambda out, req: aborts.append(req.rid),
            beam_coordinator=types.SimpleNamespace(retire_group=lambda req: None),
            _add_request_to_queue=lambda req, is_retracted=False: queue.append(req.rid))
        me._reqs_finishing_inflight = types.MethodType(sgl.Scheduler._reqs_finishing_inflight, me)
        ret = sgl.Scheduler.update_running_batch(me, batch)
        want = ([] if ret is None else [(rid, after) for rid, after in batch.decoded_after], queue, aborts,
                round(tracker.current, 12), batch.batch_is_full, batch.pool.free)
        # batchsim's side
        state = SchedulerState(RadixCachePool(10_000, page), 100_000)
        running, flight = [], {}
        for i, (p, o, m, f) in enumerate(specs):
            r = Request(i, 0.0, p, m)
            assert state.add_arrival(r, m, 0.0)
            state.kv.hold(r, 0, state.kv.tree.root)
            state.kv.allocate(r, held[i])
            state.admit(r, 0.0)
            r.num_output_tokens = o
            r.num_computed_tokens = 0 if o == 0 else p + o - 1
            if o:
                state.prefilling.discard(i)
            if f:
                flight[i] = p if o == 0 else 1
            running.append(r)
        state.kv._free = free_pages
        ours_policy.new_token_ratio, ours_policy.batch_is_full = ratio, full
        items = ours_policy._decode(state, running, 1.0, flight)
        got = ([(it.req_id, it.context_len) for it in items], [r.req_id for r in state.waiting],
               [r.req_id for r in running if r.status == Status.FINISHED], round(ours_policy.new_token_ratio, 12),
               ours_policy.batch_is_full, state.kv.num_free_tokens)
        diffs += want != got
        retracted += bool(queue)
        aborted += bool(aborts)
        skipped += ret is None
    assert diffs == 0, f"{diffs} of {NUM_CASES} cases differ"
    assert retracted > 20 and skipped > 5 and aborted > 5       # the cases reach every branch


# ---- the loop itself -------------------------------------------------------------------------------
class _Batch:
    """A ``ScheduleBatch`` as ``event_loop_overlap`` and ``is_disable_overlap_for_batch`` read it."""

    def __init__(self, batch: Batch, extend: bool):
        self.inner = batch
        self.forward_mode = types.SimpleNamespace(is_extend=lambda: extend)
        self.spec_algorithm = types.SimpleNamespace(is_none=lambda: True)

    def copy(self):
        return self


class _Loop:
    """The parts of ``Scheduler`` that ``event_loop_overlap`` calls: batchsim's policy chooses
    (``get_next_batch_to_run``), its state commits (``process_batch_result``). A launched batch
    starts when the GPU is free; processing its result waits for its end."""

    def __init__(self, sgl, policy, state, executor, reqs, outs):
        self.policy, self.state, self.executor = policy, state, executor
        self.arrivals = deque(zip(reqs, outs))
        self.gracefully_exit = False
        self._engine_paused = False
        self.enable_unified_memory = False
        self.is_generation = True
        self.require_mlp_sync = False
        self.last_batch = self.running_batch = None
        self.now_s = self.gpu_free_s = 0.0
        self.trace: list[tuple[float, tuple]] = []
        self.is_disable_overlap_for_batch = types.MethodType(sgl.Scheduler.is_disable_overlap_for_batch, self)
        self.num_iterations = 0

    def ingest_requests(self):
        self.num_iterations += 1
        assert self.num_iterations < 100_000, "the loop did not end"
        while self.arrivals and self.arrivals[0][0].arrival_s <= self.now_s:
            r, out = self.arrivals.popleft()
            self.state.add_arrival(r, out, r.arrival_s)
        if not self.arrivals:
            self.state.all_arrived = True

    def get_next_batch_to_run(self, running_batch, last_batch):
        decision = self.policy.schedule(self.state, self.now_s)
        batch = None
        if isinstance(decision, Batch):
            pending = self.state.pending[-1] if self.state.pending else None
            batch = _Batch(decision, self.state.prefill_items(decision, pending) > 0 or bool(decision.prefill_chunks))
            self.state.pending.append(decision)      # chosen, its KV allocated: in flight from now on
        return types.SimpleNamespace(running_batch=None, batch_to_run=batch)

    def run_batch(self, batch):
        start_s = max(self.now_s, self.gpu_free_s)
        self.gpu_free_s = start_s + self.executor.execute(batch.inner, self.state).duration_s
        self.trace.append((_ns(start_s), batch.inner.items))
        return types.SimpleNamespace(end_s=self.gpu_free_s)

    def process_batch_result(self, batch, result):
        self.now_s = max(self.now_s, result.end_s)
        self.state.commit_overlap(batch.inner, result.end_s)

    def on_idle(self):
        """Nothing chosen, nothing in flight: wait for the next arrival (as the SimPy loop does)."""
        if self.arrivals:
            self.now_s = max(self.now_s, self.arrivals[0][0].arrival_s)
        else:
            assert self.state.done, "idle with requests left and none to come"
            self.gracefully_exit = True

    def _apply_war_barrier(self):
        pass

    def launch_batch_sample_if_needed(self, result, batch):
        pass


def _random_workload(rng):
    page = rng.choice([1, 1, 4])
    # a low schedule_conservativeness reserves few outputs for the running requests: decodes outgrow
    # the pool and retract
    knobs = {"page_size": page, "max_running_requests": rng.randint(2, 8),
             "chunked_prefill_size": rng.choice([8, 16, 64, -1]),
             "enable_mixed_chunk": rng.random() < 0.3, "schedule_policy": rng.choice(["fcfs", "lpm"]),
             "schedule_conservativeness": rng.choice([1.0, 0.3, 0.1])}
    if knobs["chunked_prefill_size"] == -1:
        knobs["enable_mixed_chunk"] = False
    num_tokens = rng.choice([100, 150, 250]) // page * page
    specs, t = [], 0.0
    for i in range(rng.randint(4, 14)):
        t += rng.random() * 0.004
        prompt_runs = [(rng.randint(1, 3), rng.randint(1, 25)) for _ in range(rng.randint(1, 2))]
        prompt = sum(n for _, n in prompt_runs)
        max_tokens = min(rng.randint(1, 60), num_tokens - page - 1 - prompt)   # max_request_tokens
        true_output = rng.choice([max_tokens, max_tokens, rng.randint(1, max_tokens)])   # a length or EOS stop
        specs.append((t, prompt, max_tokens, true_output, (10_000 + i,) + tuple(x for run in prompt_runs for x in run)))
    return knobs, num_tokens, specs


def _requests(specs):
    return ([Request(i, a, p, m, content=c) for i, (a, p, m, _, c) in enumerate(specs)], [o for *_, o, _ in specs])


def _ns(t):
    return None if t is None else round(t, 9)     # SimPy's clock after a timeout may be an ulp off


def _outcome(state, reqs):
    return ([(r.req_id, r.status, r.num_output_tokens, _ns(r.first_token_s), _ns(r.finished_s), r.num_preemptions)
             for r in reqs], list(state.tokens.ids), state.num_preemptions, state.kv.tree.total_tokens)


@pytest.mark.parametrize("disable_consecutive_prefill_overlap", [False, True])
def test_event_loop_overlap_chooses_and_commits_as_the_simpy_loop(sgl, monkeypatch,
                                                                 disable_consecutive_prefill_overlap):
    if disable_consecutive_prefill_overlap:
        monkeypatch.setenv("SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP", "1")
    assert sgl.sch.envs.SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP.get() is disable_consecutive_prefill_overlap
    profile = linear_profile()
    diffs, retractions, wasted = 0, 0, 0
    for seed in range(NUM_CASES // 2):
        rng = random.Random(9000 + seed)
        knobs, num_tokens, specs = _random_workload(rng)

        def fresh():
            policy = SglangPolicy(SglangConfig(**knobs), PolicyContext(1024))
            return policy, SchedulerState(RadixCachePool(num_tokens // knobs["page_size"], knobs["page_size"]), 1024)

        # SGLang's loop
        policy, state = fresh()
        reqs, outs = _requests(specs)
        loop = _Loop(sgl, policy, state, SimExecutor(profile), reqs, outs)
        sgl.Scheduler.event_loop_overlap(loop)
        theirs = (loop.trace, _outcome(state, reqs))
        # batchsim's SimPy loop
        policy, state = fresh()
        reqs, outs = _requests(specs)
        env = simpy.Environment()
        trace = []
        server = Server(env, policy, state, SimExecutor(profile),
                        on_step=lambda start_s, batch, result: trace.append((_ns(start_s), batch.items)))
        env.process(feed(env, [server], reqs, outs))
        env.run()
        trace.sort(key=lambda row: row[0])        # on_step runs when a step commits, in start order
        ours = (trace, _outcome(state, reqs))
        diffs += theirs != ours
        retractions += state.num_preemptions > 0
        wasted += sum(len(items) for _, items in trace) > len(state.tokens.ids)
        assert state.done and not state.pending and state.kv.num_used_blocks == 0
    assert diffs == 0, f"{diffs} of {NUM_CASES // 2} workloads differ"
    assert retractions > 10 and wasted > 20          # the cases retract and waste EOS decodes
