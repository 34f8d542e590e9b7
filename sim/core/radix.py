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

Not modelled: the host (HiCache) and storage tiers, priorities and
priority-aware eviction, LFU, cache salts and LoRA extra keys, EAGLE's bigram
keys, sliding-window and Mamba trees.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

from sim.core.kv import KVPool
from sim.core.prefix import own_content
from sim.core.request import Status

if TYPE_CHECKING:
    from sim.core.request import Request

Runs = list  # [(key, start, stop), ...]: tokens (key, start) .. (key, stop - 1), in order


def token_runs(req: Request, num_tokens: int) -> Runs:
    """The runs of ``req``'s first ``num_tokens`` tokens: its prompt's segments, then its outputs."""
    content = req.content
    if content is None:
        content = req.content = own_content(req.req_id, req.num_prompt_tokens)
    runs: Runs = []
    left = min(num_tokens, req.num_prompt_tokens)
    for i in range(1, len(content), 2):
        n = min(content[i + 1], left)
        if n > 0:
            runs.append((content[i], 0, n))
            left -= n
    if left > 0:                  # content shorter than the prompt: the rest is the request's own
        own = own_content(req.req_id, req.num_prompt_tokens)[1]
        runs.append((own, req.num_prompt_tokens - left, req.num_prompt_tokens))
    if num_tokens > req.num_prompt_tokens:
        runs.append((content[0], 0, num_tokens - req.num_prompt_tokens))
    return runs


def _advance(q: Runs, i: int, o: int, n: int) -> tuple[int, int]:
    """The cursor (run i, offset o in it) moved on by n tokens."""
    while n:
        step = min(n, q[i][2] - q[i][1] - o)
        n -= step
        o += step
        if q[i][1] + o == q[i][2]:
            i, o = i + 1, 0
    return i, o


def _common(edge: tuple, q: Runs, i: int, o: int) -> int:
    """How many of ``edge``'s tokens equal ``q``'s from the cursor (i, o) on."""
    n = 0
    for k, s, e in edge:
        while s < e:
            if i == len(q):
                return n
            qk, qs, qe = q[i]
            if qk != k or qs + o != s:
                return n
            take = min(e - s, qe - qs - o)
            n += take
            s += take
            o += take
            if qs + o == qe:
                i, o = i + 1, 0
    return n


def _page_key(q: Runs, i: int, o: int, page: int) -> tuple:
    """The child key of the sequence at the cursor: its first token, or its first page's runs."""
    k, s, e = q[i]
    if page == 1:
        return k, s + o
    out = []
    while page and i < len(q):
        k, s, e = q[i]
        take = min(page, e - s - o)
        out.append((k, s + o, s + o + take))
        page -= take
        i, o = i + 1, 0
    return tuple(out)


def _split_runs(runs: tuple, n: int) -> tuple[tuple, tuple]:
    """``runs`` cut after n tokens (0 < n < their length)."""
    for idx, (k, s, e) in enumerate(runs):
        if n < e - s:
            head = runs[:idx] + (((k, s, s + n),) if n else ())
            return head, ((k, s + n, e),) + runs[idx + 1:]
        n -= e - s
    raise AssertionError("split past the edge's end")


class Node:
    __slots__ = ("parent", "children", "runs", "length", "lock_ref", "access", "nid")

    def __init__(self, parent: Node | None, runs: tuple, length: int, access: int, nid: int) -> None:
        self.parent = parent
        self.children: dict[tuple, Node] = {}
        self.runs = runs
        self.length = length
        self.lock_ref = 0
        self.access = access
        self.nid = nid


class RadixTree:
    """The tree of SGLang's ``RadixCache`` (the module doc gives its rules), in tokens."""

    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size
        self.clock = 0
        self.num_nodes = 0                         # nodes in the tree, the root aside
        self._last_id = 0
        self.root = Node(None, (), 0, 0, 0)
        self.root.lock_ref = 1                     # never evicted, as SGLang's
        self.total_tokens = 0
        self.evictable_tokens = 0                  # tokens of unlocked nodes (SGLang's evictable_size_)
        self._heap: list[tuple[int, int, Node]] = []   # (access, nid, leaf), stale entries skipped

    # ---- the walk shared by match and insert -------------------------------------------------------
    def _walk(self, q: Runs, touch: bool, split: bool) -> tuple[int, Node, int, int]:
        """Follow ``q`` from the root: (tokens matched, last node, cursor run, cursor offset)."""
        page, node, i, o, total = self.page_size, self.root, 0, 0, 0
        if touch:
            self.clock += 1
            node.access = self.clock
        while i < len(q):
            child = node.children.get(_page_key(q, i, o, page))
            if child is None:
                break
            if touch:
                child.access = self.clock
            n = _common(child.runs, q, i, o) // page * page
            total += n
            i, o = _advance(q, i, o, n)
            if n < child.length:
                if split:
                    node = self._split(child, n)
                    self._touched(child)
                break
            node = child
        return total, node, i, o

    def _split(self, child: Node, n: int) -> Node:
        head, tail = _split_runs(child.runs, n)
        self.num_nodes += 1
        self._last_id += 1
        new = Node(child.parent, head, n, self.clock, self._last_id)
        new.lock_ref = child.lock_ref
        new.parent.children[_page_key(list(head), 0, 0, self.page_size)] = new
        child.parent, child.runs, child.length = new, tail, child.length - n
        new.children[_page_key(list(tail), 0, 0, self.page_size)] = child
        return new

    def _touched(self, node: Node) -> None:
        """Queue ``node`` for eviction if it is an unlocked leaf (with its current stamp). Entries
        go stale when a node is stamped again, locked or given a child; once they outnumber the
        nodes twice over they are dropped, so the queue stays within the tree's size."""
        if not node.lock_ref and not node.children and node.parent is not None:
            heap = self._heap
            heappush(heap, (node.access, node.nid, node))
            if len(heap) > 2 * self.num_nodes + 64:
                self._heap = heap = [e for e in heap if self._valid(e)]
                heapify(heap)

    # ---- SGLang's RadixCache API -------------------------------------------------------------------
    def match(self, q: Runs) -> tuple[int, Node]:
        """(cached tokens of ``q``'s longest prefix, its last node): ``match_prefix``."""
        if not q:
            return 0, self.root
        total, node, _, _ = self._walk(q, True, True)
        self._touched(node)
        return total, node

    def peek(self, q: Runs) -> int:
        """Cached tokens of ``q``'s longest prefix, changing nothing (no stamp, no split)."""
        return self._walk(q, False, False)[0] if q else 0

    def insert(self, q: Runs) -> tuple[int, Node]:
        """Insert ``q`` (page-aligned): (tokens it found cached, its last node)."""
        total, node, i, o = self._walk(q, True, True)
        if i < len(q):
            rest = [(q[i][0], q[i][1] + o, q[i][2])] + q[i + 1:]
            length = sum(e - s for _, s, e in rest)
            self.num_nodes += 1
            self._last_id += 1
            leaf = Node(node, tuple(rest), length, self.clock, self._last_id)
            node.children[_page_key(rest, 0, 0, self.page_size)] = leaf
            self.total_tokens += length
            self.evictable_tokens += length
            node = leaf
        self._touched(node)
        return total, node

    def lock(self, node: Node) -> None:
        while node is not self.root:
            if not node.lock_ref:
                self.evictable_tokens -= node.length
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if not node.lock_ref:
                self.evictable_tokens += node.length
                self._touched(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves, least recently used first, until ``num_tokens`` are freed or none is left;
        the tokens freed (whole nodes)."""
        freed = 0
        while freed < num_tokens and self._heap:      # (_touched may rebuild the queue)
            entry = heappop(self._heap)
            if not self._valid(entry):
                continue
            node = entry[2]
            parent = node.parent
            del parent.children[_page_key(list(node.runs), 0, 0, self.page_size)]
            node.parent = None
            self.num_nodes -= 1
            freed += node.length
            self.total_tokens -= node.length
            self.evictable_tokens -= node.length
            self._touched(parent)
        return freed

    @staticmethod
    def _valid(entry: tuple[int, int, Node]) -> bool:
        node = entry[2]
        return node.parent is not None and not node.lock_ref and not node.children and node.access == entry[0]


class RadixCachePool(KVPool):
    """``num_blocks`` KV pages of ``block_size`` tokens (SGLang's ``page_size``) under a
    ``RadixTree`` (the module doc gives the rules). A page is free, in the tree
    (locked by the requests whose prefix it holds, or evictable), or a request's own.
    ``num_free_blocks`` counts what an allocation can get: the free pages and the
    evictable ones. ``watermark`` is unused (SGLang keeps none)."""

    caching = True
    enabled = True                  # False: SGLang's --disable-radix-cache (``TokenPool``)

    __slots__ = ("tree", "_free", "_held", "queries", "hits", "preempted_queries", "preempted_hits", "evictions")

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0) -> None:
        super().__init__(num_blocks, block_size, watermark)
        self.tree = RadixTree(block_size)
        self._free = num_blocks                        # pages neither in the tree nor a request's own
        # Per request holding KV: [its locked last node, its tokens in the tree (cache_protected_len)].
        self._held: dict[int, list] = {}
        # Prompt (+ recomputed output) tokens looked up at admission and found cached; preempted apart.
        self.queries = self.hits = self.preempted_queries = self.preempted_hits = 0
        self.evictions = 0                             # pages evicted from the tree

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

    def checkpoint(self, req: Request, num_tokens: int, split_prompt: bool = False) -> None:
        """Insert ``req``'s first ``num_tokens`` tokens (whole pages) into the tree and move its lock to
        their last node (SGLang's ``RadixCache.checkpoint``): its own copies of tokens the tree held
        are freed, the rest become the tree's. ``split_prompt``: end a node at the prompt's end too."""
        held = self._held.get(req.req_id)
        if not self.enabled or held is None:
            return
        bs = self.block_size
        key_len = num_tokens // bs * bs
        q = token_runs(req, key_len)
        cached, _ = self.tree.insert(q)
        if split_prompt:
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
        with its computed tokens and the prompt split; a preempted (retracted) one is not. Its own
        pages are freed and its lock dropped."""
        held = self._held.get(req.req_id)
        if held is not None:
            if req.status >= Status.FINISHED:
                self.checkpoint(req, req.num_computed_tokens, split_prompt=True)
            del self._held[req.req_id]
            self._free += len(req.block_ids) - held[1] // self.block_size
            self.tree.unlock(held[0])
        req.block_ids = []

    def record_lookup(self, req: Request, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup: its known tokens queried, the match hit; preempted apart."""
        num_tokens = req.num_prompt_tokens + req.num_output_tokens
        if req.num_preemptions:
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hit_tokens
        else:
            self.queries += num_tokens
            self.hits += num_hit_tokens
            req.num_cached_tokens = num_hit_tokens

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


class _NullTree:
    """A tree that holds nothing: lock and unlock have nothing to count."""

    def __init__(self) -> None:
        self.root = Node(None, (), 0, 0, 0)
        self.evictable_tokens = 0

    def lock(self, node: Node) -> None:
        pass

    unlock = lock


class CountingView:
    """Another pool (``sim.core.kv.BlockManager``'s counts) seen through ``RadixCachePool``'s
    interface with nothing cached: SGLang with ``--disable-radix-cache`` on a pool the
    caller built (tests build their own)."""

    enabled = False

    def __init__(self, kv: KVPool) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.tree = _NullTree()
        self.capacity_tokens = kv.capacity_tokens

    @property
    def num_free_tokens(self) -> int:
        return self.kv.num_free_blocks * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return self.kv.num_blocks_for(num_tokens)

    def allocate(self, req: Request, num_tokens: int) -> None:
        self.kv.allocate(req, num_tokens)

    def match(self, req: Request, limit: int | None = None) -> tuple[int, Node]:
        return 0, self.tree.root

    def hold(self, req: Request, prefix_tokens: int, node: Node, *, locked: bool = False) -> None:
        pass

    def checkpoint(self, req: Request, num_tokens: int, split_prompt: bool = False) -> None:
        pass

    def evict(self, num_tokens: int) -> None:
        pass

    def record_lookup(self, req: Request, num_hit_tokens: int) -> None:
        pass
