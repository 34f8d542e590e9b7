"""Every registered policy, once, for the tests that run all of them.

A policy-wide test reads ``CASES`` (never a list of its own), and
``tests/policies/test_cases.py`` fails while a policy of ``policies.POLICIES``
is missing here, so a new policy cannot be silently left out of the
fast-path check, the property tests or the figures. A new policy's entry
says which of its knobs crowd a small server (``small``) and what ranges the
property tests draw them from (``ranges``; a knob not named keeps its
default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from policies.base import RESERVE_MODES

RESERVES = st.sampled_from(RESERVE_MODES)


@dataclass(frozen=True)
class PolicyCase:
    small: dict[str, Any] = field(default_factory=dict)         # knobs for a 4-slot, 64-token-budget server
    ranges: dict[str, Any] = field(default_factory=dict)        # hypothesis strategies for the knobs
    alone: dict[str, Any] = field(default_factory=dict)         # knobs that run a lone 1,000-token prompt in
    #                                                             one step, at once (tests/loop/test_analytic.py)
    stretches_while_waiting: bool = True                        # False: its decode steps move a counter while
    #                                                             requests wait, so the fast path's case (b) never
    #                                                             applies (tests/loop/test_stretch_check.py)


CASES: dict[str, PolicyCase] = {
    "static": PolicyCase({"batch_size": 4}, {"batch_size": st.integers(1, 8), "reserve": RESERVES},
                         {"batch_size": 1}),
    "dynamic": PolicyCase({"max_batch_size": 4}, {"max_batch_size": st.integers(1, 8),
                                                  "max_queue_delay_s": st.floats(0.001, 0.5)},
                          {"max_batch_size": 1, "max_queue_delay_s": 0.0}),
    "orca": PolicyCase({"max_batch_size": 4}, {"max_batch_size": st.integers(1, 16), "reserve": RESERVES}),
    "vllm": PolicyCase({"max_num_seqs": 4}, {"max_num_seqs": st.integers(1, 16),
                                             "max_num_batched_tokens": st.sampled_from([None, 512, 1024])}),
    "sarathi": PolicyCase({"max_num_seqs": 4, "max_num_batched_tokens": 64},
                          {"max_num_seqs": st.integers(1, 8), "max_num_batched_tokens": st.integers(8, 600)},
                          {"max_num_batched_tokens": 4096}),
    "vllm_v1": PolicyCase({"max_num_seqs": 4, "max_num_batched_tokens": 64},
                          {"max_num_seqs": st.integers(1, 8), "max_num_batched_tokens": st.integers(8, 600),
                           "long_prefill_token_threshold": st.sampled_from([0, 16, 100]),
                           "watermark": st.sampled_from([0.0, 0.05])},
                          {"max_num_batched_tokens": 4096}),
    "tensorrt_llm": PolicyCase({"max_batch_size": 4, "max_num_tokens": 64, "enable_chunked_prefill": True},
                               {"max_batch_size": st.integers(1, 8), "max_num_tokens": st.integers(16, 600),
                                "tokens_per_block": st.sampled_from([8, 16]),
                                "enable_chunked_prefill": st.booleans(),
                                "capacity_scheduler_policy": st.sampled_from(["GUARANTEED_NO_EVICT",
                                                                              "MAX_UTILIZATION", "STATIC_BATCH"]),
                                "context_chunking_policy": st.sampled_from(["FIRST_COME_FIRST_SERVED",
                                                                            "EQUAL_PROGRESS"])},
                               {"max_num_tokens": 4096}),
    "tgi": PolicyCase({"max_concurrent_requests": 4, "max_batch_prefill_tokens": 64},
                      {"max_concurrent_requests": st.integers(1, 8), "max_batch_prefill_tokens": st.integers(8, 600),
                       "attention": st.sampled_from(["flashinfer", "flashdecoding", "paged"]),
                       "max_waiting_tokens": st.integers(1, 30), "waiting_served_ratio": st.floats(0.1, 1.5)}),
    # prefill_interval 8: its decode prealloc takes one block at a time on the tests' 8-token pages
    "lmdeploy": PolicyCase({"max_batch_size": 4, "max_prefill_token_num": 64, "prefill_interval": 8},
                           {"max_batch_size": st.integers(1, 8), "max_prefill_token_num": st.integers(8, 600),
                            "prefill_interval": st.integers(1, 20), "block_size": st.sampled_from([16, 32, 64]),
                            "enable_prefix_caching": st.booleans()},
                           stretches_while_waiting=False),        # do_prefill's decode counter
    "sglang": PolicyCase({"max_running_requests": 4, "chunked_prefill_size": 64, "max_prefill_tokens": 64},
                         {"max_running_requests": st.integers(1, 8),
                          "chunked_prefill_size": st.sampled_from([-1, 8, 64, 600]),
                          "max_prefill_tokens": st.sampled_from([64, 16384]),
                          "schedule_policy": st.sampled_from(["fcfs", "lpm"]),
                          "schedule_conservativeness": st.sampled_from([0.3, 1.0, 3.0]),
                          "enable_mixed_chunk": st.booleans(),
                          "disable_radix_cache": st.booleans(),
                          "page_size": st.sampled_from([1, 4, 16])},
                         {"chunked_prefill_size": 4096}),
}

KINDS: tuple[str, ...] = tuple(CASES)
