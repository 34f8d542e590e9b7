"""The sglang policy's radix cache and PrefillAdder against SGLang 0.5.23's own
``RadixCache`` and ``PrefillAdder``, driven in-process on CPU with the same
random operations and requests.

Needs SGLang importable (skipped otherwise) and torch, e.g.::

    pip install --no-deps --target /tmp/sglang-pkgs sglang==0.5.23   # ~20 s, 39 MB wheel
    SGLANG_PATH=/tmp/sglang-pkgs pytest tests/policies/test_sglang_differential.py

SGLang imports a few packages at module level that neither class uses
(orjson, IPython, gguf, torchvision); where one is missing a stub module
stands in for it. The tree's LRU clock (``time.monotonic``) is replaced by a
counter, so stamps never tie, as batchsim's operation clock does not.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import random
import sys
import types
from array import array

import pytest

if os.environ.get("SGLANG_PATH"):
    sys.path.insert(0, os.environ["SGLANG_PATH"])
if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (SGLANG_PATH: a --target install of sglang==0.5.23)",
                allow_module_level=True)
torch = pytest.importorskip("torch")

from policies.sglang_adder import CONTINUE, OTHER, PrefillAdder   # noqa: E402
from sim.core.radix import RadixCachePool, RadixTree               # noqa: E402
from sim.core.request import Request                               # noqa: E402

UNUSED = ("orjson", "IPython", "gguf", "torchvision")


class _Dummy(type):
    """Anything a stub module is asked for: a class that is also a decorator."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Dummy(name, (), {})

    def __call__(cls, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else cls


class _Stub(types.ModuleType):
    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Dummy(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = roots

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def sglang_importable():
    """SGLang importable with the packages of ``UNUSED`` that are missing stubbed, and SGLang's
    runtime context published for a CPU tokenizer; the stubs are gone afterwards (they must not
    outlive these tests: matplotlib, for one, reads IPython.version_info when it finds an
    IPython module loaded)."""
    missing = {m for m in UNUSED if importlib.util.find_spec(m) is None}
    if "torchvision" in missing:          # transformers must decide before a stub appears
        import transformers  # noqa: F401
        from transformers import AutoImageProcessor, AutoProcessor   # noqa: F401
    finder = _StubFinder(missing)
    sys.meta_path.append(finder)
    try:
        from sglang.srt.runtime_context import publish, reset_context
        from sglang.srt.server_args import ServerArgs
        reset_context()
        publish(ServerArgs(model_path="dummy", device="cpu"), role="tokenizer")
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] in missing]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def sgl():
    with sglang_importable():
        yield _sgl()


def _sgl() -> types.SimpleNamespace:
    import sglang.srt.mem_cache.radix_cache as rc
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder as SglAdder
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    clock = [0.0]

    def monotonic():
        clock[0] += 1.0
        return clock[0]

    rc.time = types.SimpleNamespace(monotonic=monotonic, perf_counter=monotonic)

    class Allocator(BaseTokenToKVPoolAllocator):
        def __init__(self, free_tokens, page_size):
            self.page_size, self.device, self.free_tokens = page_size, "cpu", free_tokens

        def available_size(self):
            return self.free_tokens

        def free_segment(self, *args, **kwargs):
            pass

        def alloc(self, n):
            raise NotImplementedError

        def clear(self):
            pass

        def free(self, idx):
            pass

    return types.SimpleNamespace(rc=rc, Adder=SglAdder, Result=AddReqResult, Allocator=Allocator,
                                 EvictParams=EvictParams, InsertParams=InsertParams,
                                 MatchPrefixParams=MatchPrefixParams)


def ids_of(runs) -> array:
    """SGLang's token ids for batchsim's runs: token (key, j) is key * 10_000 + j."""
    return array("q", [k * 10_000 + j for k, s, e in runs for j in range(s, e)])


def aligned(runs, n):
    out = []
    for k, s, e in runs:
        take = min(e - s, n)
        if take > 0:
            out.append((k, s, s + take))
        n -= take
    return out


def random_runs(rng: random.Random) -> list[tuple[int, int, int]]:
    return [(rng.randint(1, 3), 0, rng.randint(1, 12)) for _ in range(rng.randint(1, 4))]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(12))
def test_radix_tree_matches_inserts_locks_and_evictions_as_sglangs(sgl, seed, page_size):
    rng = random.Random(seed)
    theirs = sgl.rc.RadixCache.create_simulated(mock_allocator=sgl.Allocator(0, page_size), page_size=page_size)
    ours = RadixTree(page_size)
    locked = []                                  # (our node, their node) pairs locked
    for step in range(150):
        op = rng.random()
        runs = random_runs(rng)
        n = sum(e - s for _, s, e in runs)
        where = f"seed {seed}, step {step}"
        if op < 0.35:
            q = aligned(runs, n // page_size * page_size)
            got = ours.insert(q)[0]
            want = theirs.insert(sgl.InsertParams(key=sgl.rc.RadixKey(ids_of(q)))).prefix_len
            assert got == want, where
        elif op < 0.7:
            limit = rng.randint(1, n)
            q = aligned(runs, limit)
            got, node = ours.match(aligned(q, len(ids_of(q)) // page_size * page_size))
            res = theirs.match_prefix(sgl.MatchPrefixParams(key=sgl.rc.RadixKey(ids_of(q))))
            assert got == res.device_prefix_len, where
            if rng.random() < 0.5:
                ours.lock(node)
                theirs.inc_lock_ref(res.last_device_node)
                locked.append((node, res.last_device_node))
        elif op < 0.85 and locked:
            node, theirs_node = locked.pop(rng.randrange(len(locked)))
            ours.unlock(node)
            theirs.dec_lock_ref(theirs_node)
        else:
            want_tokens = rng.randint(1, 30)
            got = ours.evict(want_tokens)
            assert got == theirs.evict(sgl.EvictParams(num_tokens=want_tokens)).num_tokens_evicted, where
        assert ours.evictable_tokens == theirs.evictable_size(), where
        assert ours.total_tokens == theirs.total_size(), where


class _TheirReq(types.SimpleNamespace):
    """The attributes of SGLang's ``Req`` that PrefillAdder reads."""

    @property
    def extend_len(self) -> int:
        return self.extend_end - self.prefix_len


def _their_req(runs, outputs, max_new, prefix, node, computed=0):
    ids = ids_of(runs + ([(99, 0, outputs)] if outputs else []))
    r = _TheirReq(
        sampling_params=types.SimpleNamespace(max_new_tokens=max_new, ignore_eos=False),
        output_ids=list(range(outputs)), origin_input_ids=list(ids[:len(ids) - outputs]),
        full_untruncated_fill_ids=list(ids), prefix_len=prefix if not computed else computed, last_node=node,
        host_hit_length=0, swa_host_hit_length=0, auxiliary_swa_host_hit_length=0, mamba_host_hit_length=0,
        kv=types.SimpleNamespace(holds_mamba=False, req_pool_idx=0 if computed else None, holds_kv=bool(computed)),
        retracted_stain=bool(outputs), storage_hit_length=0, storage_hit_start=0, host_hit_is_storage=False,
        host_loaded_length=0, cache_request_handle=None, needs_host_load_back=lambda: False,
        materialized_host_hit_len=lambda: 0, fulfilled_storage_hit_len=lambda p: 0, is_dllm=lambda: False)
    return r


def _our_req(i, runs, outputs, max_new, computed=0):
    content = (99,) + tuple(x for k, s, e in runs for x in (k, e))
    r = Request(i, 0.0, sum(e for _, _, e in runs), max_new, content=content)
    r.num_output_tokens, r.num_computed_tokens = outputs, computed
    return r


@pytest.mark.parametrize("seed", range(40))
def test_prefill_adder_admits_as_sglangs(sgl, seed):
    rng = random.Random(1000 + seed)
    page = rng.choice([1, 1, 4])
    chunk = rng.choice([None, 16, 64, 256])
    max_prefill = rng.choice([32, 128, 16384])
    ratio = rng.choice([0.098, 0.7, 1.0])
    free_tokens = rng.randint(20, 600) // page * page
    theirs_tree = sgl.rc.RadixCache.create_simulated(mock_allocator=sgl.Allocator(free_tokens, page), page_size=page)
    pool = RadixCachePool(10_000, page)
    pool._free = free_tokens // page
    for _ in range(rng.randint(0, 4)):                       # what earlier requests left in the cache
        runs = random_runs(rng)
        q = aligned(runs, sum(e for _, _, e in runs) // page * page)
        pool.tree.insert(q)
        theirs_tree.insert(sgl.InsertParams(key=sgl.rc.RadixKey(ids_of(q))))
    running = [(rng.randint(1, 5000), rng.randint(1, 50)) for _ in range(rng.randint(0, 4))]
    their_running = types.SimpleNamespace(
        reqs=[types.SimpleNamespace(sampling_params=types.SimpleNamespace(max_new_tokens=m, ignore_eos=False),
                                    output_ids=[0] * o) for m, o in running], batch_size=lambda: len(running))
    our_running = [_our_req(100 + i, [(5, 0, 1)], o, m) for i, (m, o) in enumerate(running)]
    theirs = sgl.Adder(page, theirs_tree, theirs_tree.token_to_kv_pool_allocator, their_running, ratio,
                       max_prefill, chunk)
    ours = PrefillAdder(pool, our_running, ratio, max_prefill, chunk, 0, False)
    if chunk is not None and rng.random() < 0.3:             # a chunked request in progress
        runs, computed = [(4, 0, rng.randint(chunk + 1, 3 * chunk))], chunk
        t = _their_req(runs, 0, 50, 0, theirs_tree.root_node, computed)
        t_left = theirs.add_chunked_req(t)
        o_left = ours.add_chunked_req(_our_req(50, runs, 0, 50, computed))
        assert (t_left is None) == (o_left is None)
        assert t.extend_end - computed == ours.admitted[-1].extend_tokens
    for i in range(rng.randint(1, 6)):
        if theirs.budget_state() == sgl.Result.OTHER:
            assert ours.budget_state() == OTHER
            break
        runs = random_runs(rng)
        outputs = rng.choice([0, 0, 0, 2])
        max_new = rng.randint(1, 6000)
        r = _our_req(i, runs, outputs, max_new)
        known = r.num_prompt_tokens + outputs
        prefix, node = pool.match(r, known - 1)
        key = ids_of(runs + ([(99, 0, outputs)] if outputs else []))[:known - 1]
        m = theirs_tree.match_prefix(sgl.MatchPrefixParams(key=sgl.rc.RadixKey(key)))
        assert prefix == m.device_prefix_len
        t = _their_req(runs, outputs, max_new, m.device_prefix_len, m.last_device_node)
        want = theirs.add_one_req(t, has_chunked_req=False, truncation_align_size=None)
        got = ours.add_one_req(r, prefix, node)
        assert got == want.name.lower(), (seed, i)
        assert len(ours.admitted) == len(theirs.can_run_list), (seed, i)
        if ours.admitted and ours.admitted[-1].req is r:
            assert t.extend_end - prefix == ours.admitted[-1].extend_tokens
        if got != CONTINUE:
            break
    assert (ours.rem_input, ours.rem_chunk) == (theirs.rem_input_tokens, theirs.rem_chunk_tokens)
    assert ours.remaining_total == pytest.approx(theirs.rem_total_tokens)
    assert pool.tree.evictable_tokens == theirs_tree.evictable_size()


@pytest.mark.parametrize("seed", range(30))
def test_ignore_eos_admission_without_the_cache_as_sglangs(sgl, seed):
    # add_one_req_ignore_eos: every request's remaining outputs must fit as they finish
    rng = random.Random(5000 + seed)
    page = rng.choice([1, 4])
    chunk = rng.choice([None, 32, 256])
    free_tokens = rng.randint(50, 3000) // page * page
    theirs_tree = sgl.rc.RadixCache.create_simulated(disable=True, mock_allocator=sgl.Allocator(free_tokens, page),
                                                     page_size=page)
    pool = RadixCachePool(10_000, page)
    pool._free = free_tokens // page
    running = [(rng.randint(1, 300), rng.randint(1, 50), rng.randint(1, 300)) for _ in range(rng.randint(0, 3))]
    their_running = types.SimpleNamespace(
        reqs=[types.SimpleNamespace(sampling_params=types.SimpleNamespace(max_new_tokens=m, ignore_eos=True),
                                    output_ids=[0] * o, origin_input_ids=[0] * p) for m, o, p in running],
        batch_size=lambda: len(running))
    our_running = [_our_req(100 + i, [(5, 0, p)], o, m) for i, (m, o, p) in enumerate(running)]
    theirs = sgl.Adder(page, theirs_tree, theirs_tree.token_to_kv_pool_allocator, their_running, 0.5, 16384, chunk)
    ours = PrefillAdder(pool, our_running, 0.5, 16384, chunk, 0, True)
    for i in range(rng.randint(1, 6)):
        if theirs.budget_state() == sgl.Result.OTHER:
            break
        runs, max_new = random_runs(rng), rng.randint(1, 3000)      # outputs to come, beside the prompt
        t = _their_req(runs, 0, max_new, 0, theirs_tree.root_node)
        t.sampling_params.ignore_eos = True
        want = theirs.add_one_req(t, has_chunked_req=False, truncation_align_size=None)
        got = ours.add_one_req_ignore_eos(_our_req(i, runs, 0, max_new))
        assert got == want.name.lower(), (seed, i)
        assert [a.extend_tokens for a in ours.admitted] == [r.extend_end for r in theirs.can_run_list]
        if got != CONTINUE:
            break
    assert (ours.rem_input, ours.rem_chunk) == (theirs.rem_input_tokens, theirs.rem_chunk_tokens)
    assert ours.remaining_total == pytest.approx(theirs.rem_total_tokens)

