"""Every registered policy, once, for the tests that run all of them.

A policy-wide test reads ``CASES`` (never a list of its own), and
``tests/policies/test_cases.py`` fails while a policy of ``policies.POLICIES``
is missing here, so a new policy cannot be silently left out of the
fast-path checks, the property tests, the replica test or the figures. A new
policy's entry states what its defaults declare (``defaults``) and whether
it preempts on a tight pool (``preempts``), and says which of its knobs crowd
a small server (``small``) and what ranges the property tests draw them from
(``ranges``; a knob not named keeps its default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from policies.base import RESERVE_MODES

RESERVES = st.sampled_from(RESERVE_MODES)


@dataclass(frozen=True)
class PolicyCase:
    defaults: tuple[int | None, int, bool]                      # (token_budget, max_num_seqs, holds_batch) its
    #                                                             defaults declare at max_model_len 4096, no
    #                                                             profile (tests/policies/test_policy_declarations.py)
    preempts: bool                                              # it preempts (recomputes) on the tight pool of
    #                                                             tests/loop/test_fast_path.py at the ``tight`` knobs
    small: dict[str, Any] = field(default_factory=dict)         # knobs for a 4-slot, 64-token-budget server
    ranges: dict[str, Any] = field(default_factory=dict)        # hypothesis strategies for the knobs
    alone: dict[str, Any] = field(default_factory=dict)         # knobs that run a lone 1,000-token prompt in
    #                                                             one step, at once (tests/loop/test_analytic.py)
    stretches_while_waiting: bool = True                        # False: its decode steps move a counter while
    #                                                             requests wait, so the fast path's case (b) never
    #                                                             applies (tests/loop/test_stretch_check.py)
    tight: dict[str, Any] = field(default_factory=dict)         # knobs for that tight pool (1,920 token slots)


CASES: dict[str, PolicyCase] = {
    "static": PolicyCase((None, 32, True), False,                 # batch_size 32
                         {"batch_size": 4}, {"batch_size": st.integers(1, 8), "reserve": RESERVES},
                         {"batch_size": 1}, tight={"batch_size": 8}),
    "dynamic": PolicyCase((None, 32, True), False,                # max_batch_size 32
                          {"max_batch_size": 4}, {"max_batch_size": st.integers(1, 8),
                                                  "max_queue_delay_s": st.floats(0.001, 0.5)},
                          {"max_batch_size": 1, "max_queue_delay_s": 0.0}, tight={"max_batch_size": 8}),
    "orca": PolicyCase((None, 256, False), False,                 # max_batch_size 256
                       {"max_batch_size": 4}, {"max_batch_size": st.integers(1, 16), "reserve": RESERVES},
                       tight={"reserve": "pow2"}),
    "vllm": PolicyCase((4096, 256, False), True,                  # budget max(4096, 2048) = 4096
                       {"max_num_seqs": 4}, {"max_num_seqs": st.integers(1, 16),
                                             "max_num_batched_tokens": st.sampled_from([None, 512, 1024])}),
    "sarathi": PolicyCase((512, 256, False), True,
                          {"max_num_seqs": 4, "max_num_batched_tokens": 64},
                          {"max_num_seqs": st.integers(1, 8), "max_num_batched_tokens": st.integers(8, 600)},
                          {"max_num_batched_tokens": 4096}, tight={"max_num_batched_tokens": 256}),
    # unknown device: vLLM's 2048 / 256, min(2048, 256 x 4096) = 2048
    "vllm_v1": PolicyCase((2048, 256, False), True,
                          {"max_num_seqs": 4, "max_num_batched_tokens": 64},
                          {"max_num_seqs": st.integers(1, 8), "max_num_batched_tokens": st.integers(8, 600),
                           "long_prefill_token_threshold": st.sampled_from([0, 16, 100]),
                           "watermark": st.sampled_from([0.0, 0.05]), "async_scheduling": st.booleans()},
                          {"max_num_batched_tokens": 4096},
                          # (the fast path is the synchronous loop's: async scheduling steps every step)
                          tight={"max_num_batched_tokens": 256, "max_num_seqs": 64, "async_scheduling": False}),
    # max_num_tokens 8192, max_batch_size 2048 (any device); GUARANTEED_NO_EVICT never preempts
    "tensorrt_llm": PolicyCase((8192, 2048, False), False,
                               {"max_batch_size": 4, "max_num_tokens": 64, "enable_chunked_prefill": True},
                               {"max_batch_size": st.integers(1, 8), "max_num_tokens": st.integers(16, 600),
                                "tokens_per_block": st.sampled_from([8, 16]),
                                "enable_chunked_prefill": st.booleans(),
                                "capacity_scheduler_policy": st.sampled_from(["GUARANTEED_NO_EVICT",
                                                                              "MAX_UTILIZATION", "STATIC_BATCH"]),
                                "context_chunking_policy": st.sampled_from(["FIRST_COME_FIRST_SERVED",
                                                                            "EQUAL_PROGRESS"]),
                                "disable_overlap_scheduler": st.booleans()},
                               {"max_num_tokens": 4096},
                               # (the fast path is the synchronous loop's: the overlap scheduler steps
                               # every step)
                               tight={"disable_overlap_scheduler": True}),
    # max_batch_prefill_tokens 4096, max_concurrent_requests 128; reserves at admission, never preempts
    "tgi": PolicyCase((4096, 128, False), False,
                      {"max_concurrent_requests": 4, "max_batch_prefill_tokens": 64},
                      {"max_concurrent_requests": st.integers(1, 8), "max_batch_prefill_tokens": st.integers(8, 600),
                       "attention": st.sampled_from(["flashinfer", "flashdecoding", "paged"]),
                       "max_waiting_tokens": st.integers(1, 30), "waiting_served_ratio": st.floats(0.1, 1.5)}),
    # prefill_interval 8: its decode prealloc takes one block at a time on the tests' 8-token pages
    # max_prefill_token_num 8192; unknown device: max_batch_size 128
    "lmdeploy": PolicyCase((8192, 128, False), True,
                           {"max_batch_size": 4, "max_prefill_token_num": 64, "prefill_interval": 8},
                           {"max_batch_size": st.integers(1, 8), "max_prefill_token_num": st.integers(8, 600),
                            "prefill_interval": st.integers(1, 20), "block_size": st.sampled_from([16, 32, 64]),
                            "enable_prefix_caching": st.booleans()},
                           stretches_while_waiting=False),        # do_prefill's decode counter
    # unknown device: chunked_prefill_size 4096; max_running_requests 4096 until the pool is known
    "sglang": PolicyCase((4096, 4096, False), True,
                         {"max_running_requests": 4, "chunked_prefill_size": 64, "max_prefill_tokens": 64},
                         {"max_running_requests": st.integers(1, 8),
                          "chunked_prefill_size": st.sampled_from([-1, 8, 64, 600]),
                          "max_prefill_tokens": st.sampled_from([64, 16384]),
                          "schedule_policy": st.sampled_from(["fcfs", "lpm"]),
                          "schedule_conservativeness": st.sampled_from([0.3, 1.0, 3.0]),
                          "enable_mixed_chunk": st.booleans(),
                          "disable_radix_cache": st.booleans(),
                          "page_size": st.sampled_from([1, 4, 16]), "enable_overlap": st.booleans()},
                         {"chunked_prefill_size": 4096},
                         # (the fast path is the synchronous loop's: the overlap loop steps every step)
                         tight={"enable_overlap": False}),
}

KINDS: tuple[str, ...] = tuple(CASES)
