"""SGLang 0.5.23's waiting-queue order (``SchedulePolicy.calc_priority`` in
``sglang/srt/managers/schedule_policy.py``), for ``policies.sglang``:

- lpm, while at most ``WAITING_QUEUE_PREFIX_MATCH_MAX`` (128) wait: every
  waiting request is matched in the cache (its known tokens, uncapped; the
  walk stamps and splits nodes), and the queue is sorted (stably) by the
  match, capped at ``num_tokens - 1``, longest first. A request whose match is
  at most ``IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD`` (32) tokens is matched in
  a scratch tree of the requests before it: if it shares at least
  ``IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD`` (32) tokens with one, it
  goes last (one of them computes the shared prefix first); else it joins the
  scratch tree.
- fcfs (and lpm over 128 waiting): the order stays; every
  ``WAITING_PREFIX_REFRESH_INTERVAL`` (32)-th pass, counting from the first,
  stamps the prefixes of the first 128 waiting requests in the LRU, the
  queue's head last (``_touch_waiting_prefixes``), so eviction spares the
  prefixes the queue will need first.
"""

from __future__ import annotations

from collections import deque

from sim.core.radix import RadixCachePool, RadixTree, token_runs
from sim.core.request import Request

WAITING_QUEUE_PREFIX_MATCH_MAX = 128
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32
WAITING_PREFIX_REFRESH_INTERVAL = 32


def order_waiting(kv: RadixCachePool, waiting: deque[Request], lpm: bool, num_refresh_calls: int) -> int:
    """Order ``waiting`` in place as SGLang's calc_priority does; returns the refresh counter."""
    if lpm and len(waiting) <= WAITING_QUEUE_PREFIX_MATCH_MAX:
        scratch = RadixTree(1)
        deferred: set[int] = set()
        matched: dict[int, int] = {}
        for r in waiting:
            known = r.num_prompt_tokens + r.num_output_tokens
            prefix, _ = kv.match(r)
            matched[r.req_id] = min(prefix, known - 1)
            if prefix <= IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
                q = token_runs(r, known)
                shared, _ = scratch.match(q)
                if shared >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                    deferred.add(r.req_id)
                else:
                    scratch.insert(q)
        order = sorted(waiting, key=lambda r: float("inf") if r.req_id in deferred else -matched[r.req_id])
        waiting.clear()
        waiting.extend(order)
        return num_refresh_calls
    if not waiting or not kv.enabled:
        return num_refresh_calls
    if num_refresh_calls % WAITING_PREFIX_REFRESH_INTERVAL == 0:
        head = [waiting[i] for i in range(min(len(waiting), WAITING_QUEUE_PREFIX_MATCH_MAX))]
        for r in reversed(head):
            kv.match(r)
    return num_refresh_calls + 1
