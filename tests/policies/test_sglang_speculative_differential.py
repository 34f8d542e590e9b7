"""The sglang policy's speculative decode pass (rule 8) against SGLang 0.5.23's own code, in-process
on CPU: ``Scheduler.update_running_batch`` with ``ScheduleBatch.check_decode_mem``,
``_new_tokens_required_next_decode_spec_v2`` and ``retract_decode`` for a batch whose
``spec_algorithm`` is EAGLE, its decode allocation from ``get_alloc_reserve_per_decode`` and
``page_aligned_decode_alloc_lens`` (what ``eagle_prepare_for_decode`` allocates), SGLang's speculative
server args (``speculative_num_steps`` k, ``speculative_eagle_topk`` 1, ``speculative_num_draft_tokens``
k + 1) published to the functions that read them. The KV is a plain page count (nothing in the tree);
the synchronous loop (no batch in flight). The forward passes themselves (``eagle_worker_v2``) need a
GPU model and are not driven.

Needs SGLang importable (SGLANG_PATH, as tests/policies/test_sglang_differential.py) and torch.
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

from policies.sglang import SglangConfig, SglangPolicy  # noqa: E402
from sim.core.policy import PolicyContext  # noqa: E402
from sim.core.radix import RadixCachePool  # noqa: E402
from sim.core.request import Request, Status  # noqa: E402
from sim.core.state import SchedulerState  # noqa: E402
from test_sglang_differential import sglang_importable  # noqa: E402
from test_sglang_overlap_differential import _their_req, _TheirBatch  # noqa: E402

NUM_CASES = 300


@pytest.fixture(scope="module")
def sgl():
    with sglang_importable():
        import sglang.srt.managers.scheduler as sch
        import sglang.srt.mem_cache.allocation_sizing as sizing
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
        from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        yield types.SimpleNamespace(sch=sch, Scheduler=sch.Scheduler, Req=Req, ScheduleBatch=ScheduleBatch,
                                    Tracker=NewTokenRatioTracker, Allocator=BaseTokenToKVPoolAllocator,
                                    sizing=sizing, Algo=SpeculativeAlgorithm)


def _publish(sgl, monkeypatch, k, page):
    """SGLang's server args after ``_handle_eagle_family`` for k steps, topk 1, on ``page``."""
    s = sgl.sizing
    monkeypatch.setattr(s, "get_spec", lambda: types.SimpleNamespace(
        speculative_algorithm="EAGLE", speculative_num_steps=k, speculative_eagle_topk=1,
        speculative_num_draft_tokens=k + 1))
    monkeypatch.setattr(s, "max_speculative_num_draft_tokens", lambda: k + 1)
    monkeypatch.setattr(s, "get_schedule", lambda: types.SimpleNamespace(page_size=page))
    monkeypatch.setattr(s, "get_parallel", lambda: types.SimpleNamespace(attn_dcp_size=1))


class _TheirSpecBatch(_TheirBatch):
    """``_TheirBatch`` speculating: SGLang's EAGLE batch, its decode's pages those of
    ``eagle_prepare_for_decode`` (committed + get_alloc_reserve_per_decode, page-aligned)."""

    def __init__(self, sgl, reqs, page, free_tokens, batch_is_full):
        super().__init__(sgl, reqs, page, free_tokens, batch_is_full)
        self.sgl = sgl
        self.spec_algorithm = sgl.Algo.EAGLE
        self._new_tokens_required_next_decode_spec_v2 = types.MethodType(
            sgl.ScheduleBatch._new_tokens_required_next_decode_spec_v2, self)

    def prepare_for_decode(self):
        s = self.sgl.sizing
        cur, nxt, _ = s.page_aligned_decode_alloc_lens(self.reqs, reserve=s.get_alloc_reserve_per_decode(),
                                                       page_size=self.page)
        for r, c, n in zip(self.reqs, cur, nxt):
            self.decoded_after.append((r.rid, r.kv.kv_committed_len))
            self.pool.free -= (self._pages(n) - self._pages(c)) * self.page
            r.kv.kv_allocated_len = n


def test_reserve_per_decode_is_two_verify_widths(sgl, monkeypatch):
    for k in range(1, 8):
        for page in (1, 4, 16):
            _publish(sgl, monkeypatch, k, page)
            policy = SglangPolicy(SglangConfig(page_size=page, enable_overlap=False, speculative={
                "method": "eagle", "num_speculative_tokens": k, "acceptance_length": 1.0}), PolicyContext(4096))
            assert sgl.sizing.get_alloc_len_per_decode() == k + 1
            assert policy.spec_reserve == sgl.sizing.get_alloc_reserve_per_decode() == 2 * (k + 1)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_speculative_decode_pass_as_sglangs(sgl, monkeypatch, overlap):
    """Synchronously, and in the overlap loop with a batch in flight (a verify, whose tokens
    commit at its results, or a completing prefill, committed when chosen), whose requests
    finishing by length sit the pass out (``_reqs_finishing_inflight``)."""
    monkeypatch.setattr(sgl.sch, "_make_abort_req", lambda req, finished_reason: req)
    diffs, retracted, aborted, grew, skipped = 0, 0, 0, 0, 0
    for seed in range(NUM_CASES):
        rng = random.Random(9100 + seed + 1000 * overlap)
        k, page = rng.randint(1, 7), rng.choice([1, 1, 2, 4, 16])
        _publish(sgl, monkeypatch, k, page)
        reserve = 2 * (k + 1)
        specs = []
        for _ in range(rng.randint(1, 6)):
            prompt, outputs = rng.randint(1, 40), rng.choice([0, 1, 1, 2, 3, 5, 9] if overlap else [1, 1, 2, 3, 5, 9])
            # in flight: its prefill (no output yet), or a verify
            in_flight = overlap and (outputs == 0 or rng.random() < 0.6)
            committed = prompt + outputs - 1 if outputs else prompt
            # what it holds: a prefill's exact tokens, or a former decode's top-up less what it accepted since
            allocated = committed if outputs <= 1 else committed + rng.randint(0, reserve)
            specs.append((prompt, outputs, outputs + rng.randint(1, 30), committed, allocated, in_flight))
        need = sum(max(0, -(-(c + reserve) // page) - -(-a // page)) for *_, c, a, _f in specs)
        free_pages = rng.randint(max(0, need - 2 * (k + 1)), need + 2)
        ratio = rng.choice([0.7, 0.3, 0.098])
        full = rng.random() < 0.5
        # SGLang's side
        theirs = []
        for i, (p, o, m, c, a, _f) in enumerate(specs):
            t = _their_req(sgl, i, p, o, m, c)
            t.kv.kv_allocated_len = a
            theirs.append(t)
        in_flight = [t for t, sp in zip(theirs, specs) if sp[5]]
        batch = _TheirSpecBatch(sgl, theirs, page, free_pages * page, full)
        queue, aborts = [], []
        policy = SglangPolicy(SglangConfig(page_size=page, enable_overlap=False, speculative={
            "method": "eagle", "num_speculative_tokens": k, "acceptance_length": 1.0}), PolicyContext(4096))
        tracker = sgl.Tracker(init=policy.init_ratio, min=policy.min_ratio, decay=policy.ratio_decay,
                              current=ratio)
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
        pages_after = {t.rid: -(-t.kv.kv_allocated_len // page) for t in batch.reqs} if ret is not None else {}
        want = ([] if ret is None else [(rid, after) for rid, after in batch.decoded_after], queue, aborts,
                round(tracker.current, 12), batch.batch_is_full, batch.pool.free, pages_after)
        # batchsim's side
        state = SchedulerState(RadixCachePool(10_000, page), 100_000)
        running, flight = [], {}
        for i, (p, o, m, c, a, f) in enumerate(specs):
            r = Request(i, 0.0, p, m)
            assert state.add_arrival(r, m, 0.0)
            state.kv.hold(r, 0, state.kv.tree.root)
            state.kv.allocate(r, a)
            state.admit(r, 0.0)
            r.num_output_tokens, r.num_computed_tokens = o, (c if o else 0)
            if o:
                state.prefilling.discard(i)
            if f:
                flight[i] = 1 + k if o else p
            running.append(r)
        state.kv._free = free_pages
        policy.new_token_ratio, policy.batch_is_full = ratio, full
        policy._flight_verify = frozenset(i for i, sp in enumerate(specs) if sp[5] and sp[1])
        items = policy._decode(state, running, 1.0, flight)
        assert all(it.num_new_tokens == 1 + k for it in items)
        got = ([(it.req_id, it.context_len) for it in items], [r.req_id for r in state.waiting],
               [r.req_id for r in running if r.status == Status.FINISHED], round(policy.new_token_ratio, 12),
               policy.batch_is_full, state.kv.num_free_tokens,
               {it.req_id: len(state.requests[it.req_id].block_ids) for it in items})
        diffs += want != got
        retracted += bool(queue)
        aborted += bool(aborts)
        grew += any(pages_after[rid] > -(-specs[rid][4] // page) for rid in pages_after)
        skipped += ret is None
    assert diffs == 0, f"{diffs} of {NUM_CASES} cases differ"
    assert retracted > 20 and aborted > 5 and grew > 100       # the cases reach every branch
    assert (skipped > 5) is overlap                              # finishing in flight, short of pages
