"""SGLang's radix prefix cache as a KV pool: ``RadixCachePool``.

The rules of ``sglang.srt.mem_cache.radix_cache.RadixCache`` in SGLang 0.5.23
(with ``mem_cache/common.py``'s ``match_kv_cache``, ``checkpoint_kv_cache``,
``release_kv_cache``, ``allocator/base.py``'s ``evict_to_free_tokens`` and
``evict_policy.py``'s LRU), on token runs instead of token ids:

- The tree's edges hold token sequences, page-aligned: every key inserted is
  cut down to whole pages of ``page_size`` (the pool's ``block_size``) tokens,
  and a match is rounded down to whole pages. Children are told apart by
  their first page.
- ``match`` walks from the root, stamps every node it passes with the
  operation's time (the LRU's clock), and splits the node in which the match
  ends inside, so the match ends on a node boundary. ``insert`` does the same
  and hangs the unmatched rest under the last node as a new leaf.
- A node is locked (``lock_ref``) by every request whose prefix runs through
  it; only unlocked leaves are evicted, least recently stamped first, a whole
  node at a time (so an eviction may free more than it asked for); a parent
  left childless and unlocked becomes a candidate in the same eviction.
  Eviction is lazy: an allocation evicts only the shortfall of free pages.
- The KV of a request is its locked prefix in the tree (``cache_protected_len``
  tokens) plus pages of its own. ``checkpoint`` (SGLang's, after each prefill
  chunk and when a request finishes) inserts the request's computed tokens,
  frees its own copies of the tokens the tree already held, moves the rest into
  the tree, and moves its lock to the new last node. A finished request is
  checkpointed with its outputs, its leaf split at the prompt's end (so the
  outputs are evicted before the prompt); a retracted one is not: it keeps
  only what its chunks checkpointed, unlocked.

Content without token ids: a request's ``content`` (``Request.content``) is
``(output_key, key_0, len_0, key_1, len_1, ...)``, as ``sim.core.prefix`` reads
it: token ``j`` of segment ``i`` is ``(key_i, j)``, output token ``j`` is
``(output_key, j)``. A sequence is a list of runs ``(key, start, stop)``, so
every tree operation costs O(runs) whatever the lengths, and a request's KV is
counted, not listed: its ``block_ids`` is ``range(pages it holds)``.

The tree itself is ``sim.core.radix_tree``'s.

Not modelled: the host (HiCache) and storage tiers, priorities and
priority-aware eviction, LFU, cache salts and LoRA extra keys, EAGLE's bigram
keys, sliding-window and Mamba trees.
"""

from __future__ import annotations

from sim.core.kv import CachingPool
from sim.core.radix_tree import Node, RadixTree, token_runs
from sim.core.request import Request, Status

__all__ = ["Node", "RadixCachePool", "RadixTree", "TokenPool", "token_runs"]


class RadixCachePool(CachingPool):
    """``num_blocks`` KV pages of ``block_size`` tokens (SGLang's ``page_size``) under a
    ``RadixTree`` (the module doc gives the rules). A page is free, in the tree
    (locked by the requests whose prefix it holds, or evictable), or a request's own.
    ``num_free_blocks`` counts what an allocation can get: the free pages and the
    evictable ones. ``watermark`` is unused (SGLang keeps none)."""

    enabled = True                  # False: SGLang's --disable-radix-cache (``TokenPool``)

    __slots__ = ("tree", "_free", "_held")

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0) -> None:
        super().__init__(num_blocks, block_size, watermark)
        self.tree = RadixTree(block_size)
        self._free = num_blocks                        # pages neither in the tree nor a request's own
        # Per request holding KV: [its locked last node, its tokens in the tree (cache_protected_len)].
        self._held: dict[int, list] = {}

    # ---- counts ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._free + self.tree.evictable_tokens // self.block_size

    @property
    def num_free_tokens(self) -> int:
        """Tokens of the free pages (SGLang's ``available_size``)."""
        return self._free * self.block_size

    @property
    def num_used_blocks(self) -> int:
        """Pages held by requests: their own and the tree's they lock."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return self.tree.evictable_tokens // self.block_size

    # ---- allocation -----------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> None:
        """Evict until ``num_tokens`` tokens are free, if the tree has enough to evict
        (``evict_to_free_tokens``: only the shortfall, whole nodes)."""
        short = num_tokens - self._free * self.block_size
        if short > 0:
            pages = self.tree.evict(short) // self.block_size
            self._free += pages
            self.evictions += pages

    def allocate(self, req: Request, num_tokens: int) -> None:
        """Grow ``req``'s own pages to hold ``num_tokens`` tokens, evicting as needed.
        Raises RuntimeError if the pool is short (callers check can_allocate)."""
        have = len(req.block_ids)
        missing = -(-num_tokens // self.block_size) - have
        if missing <= 0:
            return
        if missing > self._free:
            self.evict(missing * self.block_size)
            if missing > self._free:
                raise RuntimeError(f"KV pool exhausted: request {req.req_id} needs {missing} pages, "
                                   f"{self.num_free_blocks} free (policy must call can_allocate first)")
        self._free -= missing
        if not have and req.req_id not in self._held:
            self._held[req.req_id] = [self.tree.root, 0]
        req.block_ids = range(have + missing)        # counted: a request's pages hold no ids

    def append_block(self, req: Request) -> bool:
        """One more page for ``req`` (the fast path's growth: a hot call), evicting if none is free."""
        if self._free:
            self._free -= 1
            req.block_ids = range(len(req.block_ids) + 1)
            return True
        if not self.tree.evictable_tokens:
            return False
        self.allocate(req, (len(req.block_ids) + 1) * self.block_size)
        return True

    # ---- the prefix cache -----------------------------------------------------------------------
    def match(self, req: Request, limit: int | None = None) -> tuple[int, Node]:
        """(cached tokens, last node) of ``req``'s longest cached prefix of its known tokens, at most
        ``limit`` (SGLang's cap: ``num_tokens - 1``), in whole pages; stamps and may split nodes."""
        n = req.num_prompt_tokens + req.num_output_tokens
        if limit is not None and limit < n:
            n = limit
        n = n // self.block_size * self.block_size
        if not self.enabled or n <= 0:
            return 0, self.tree.root
        return self.tree.match(token_runs(req, n))

    def hold(self, req: Request, prefix_tokens: int, node: Node, *, locked: bool = False) -> None:
        """``req`` (holding nothing) takes its match: ``prefix_tokens`` up to ``node``, which it locks
        (``locked``: the caller took the lock already, as SGLang's PrefillAdder does at admission)."""
        if not locked:
            self.tree.lock(node)
        self._held[req.req_id] = [node, prefix_tokens]
        req.block_ids = range(prefix_tokens // self.block_size)

    def checkpoint(self, req: Request, num_tokens: int) -> None:
        """Insert ``req``'s first ``num_tokens`` tokens (whole pages) into the tree and move its lock to
        their last node (SGLang's ``RadixCache.checkpoint``): its own copies of tokens the tree held
        are freed, the rest become the tree's. Tokens past the prompt (a finished request's, or a
        retracted one's recomputed outputs) get a node of their own, split at the prompt's end."""
        held = self._held.get(req.req_id)
        if not self.enabled or held is None:
            return
        bs = self.block_size
        key_len = num_tokens // bs * bs
        q = token_runs(req, key_len)
        cached, _ = self.tree.insert(q)
        prompt = req.num_prompt_tokens // bs * bs
        if 0 < prompt < key_len:
            self.tree.insert(token_runs(req, prompt))
        self._free += max(0, cached - held[1]) // bs          # the duplicates it computed
        _, node = self.tree.match(q)
        self.tree.unlock(held[0])
        self.tree.lock(node)
        held[0], held[1] = node, key_len

    def cache(self, req: Request, num_tokens: int) -> None:
        """Decode tokens join the tree only when the request finishes: nothing to do."""

    def free(self, req: Request) -> None:
        """Give back ``req``'s KV (``release_kv_cache``): a finished request is checkpointed first,
        with its computed tokens; a preempted (retracted) one is not. Its own
        pages are freed and its lock dropped."""
        held = self._held.get(req.req_id)
        if held is not None:
            if req.status >= Status.FINISHED:
                self.checkpoint(req, req.num_computed_tokens)
            del self._held[req.req_id]
            self._free += len(req.block_ids) - held[1] // self.block_size
            self.tree.unlock(held[0])
        req.block_ids = []

    def cached_prefix_blocks(self, req: Request) -> int:
        """Whole prompt pages of ``req`` the tree holds (a router's view; changes nothing)."""
        if not self.enabled:
            return 0
        n = req.num_prompt_tokens // self.block_size * self.block_size
        return self.tree.peek(token_runs(req, n)) // self.block_size if n else 0


class TokenPool(RadixCachePool):
    """SGLang's pool with ``--disable-radix-cache``: pages counted, nothing cached or shared."""

    caching = False
    enabled = False
    __slots__ = ()
