"""LiveEngine: one real model iteration for exactly the items of a ``Batch``.

Selective batching (Orca): every new token of the batch, pads included, goes
through the token-parallel layers (embedding, norms, QKV/O, MLP) as one
[T, hidden] tensor; attention runs per prefill item and once for all decode
items in a few groups, reading the paged KV cache through each request's block
table (``Request.block_ids``: token position t lives in block ``block_ids[t //
block_size]``, slot ``t % block_size``). The LM head runs only on the last row
of items that sample.

Decode attention: one SDPA call per *group* of decodes, each padded only to its
own longest context, so the work follows the total decode context (as a paged
attention kernel's does, and as ``sim.cost.profile``'s attn_decode assumes) rather
than (number of decodes x longest context). Decodes are sorted by their number
of KV blocks and cut into at most ``MAX_DECODE_GROUPS`` contiguous groups, top
down, always at the cut that saves the most padded blocks, until the padded
work is within ``DECODE_PAD_TOLERANCE`` of the exact total or a cut would save
less K+V than ``MIN_DECODE_SPLIT_BYTES`` (an extra call costs more than that).

Row layout inside a step: [decode rows (1 per n == 1 item, by ascending
context)] [prefill rows, item by item] [pad rows]. Every real row writes its
K/V into the paged cache first. A chunk with context (c > 0) and every decode then read positions 0..own from
the cache; a prefill from c == 0 attends over its own fresh K/V (what paged
engines do: the cache holds exactly the same values). Prompt pad rows
(a static batch's prompts padded to the longest) cost token-parallel time,
write no KV, and get a zero attention output. A finished slot of a static
group (an item with no new token and one pad token) is a decode row: a dense
static batch still runs its attention over the context it holds, so it reads
its KV like any decode (and writes position ``context_len``, a slot of its
own reservation that nothing reads); it samples nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from calibrate.model import LlamaModel
from sim.core.batch import Batch
from sim.cost.profile import ModelShape
from sim.core.request import Request

PROMPT_ID_MUL_REQ = 1_000_003
PROMPT_ID_MUL_POS = 7919
MAX_DECODE_GROUPS = 16            # SDPA calls per layer for the decodes, at most
DECODE_PAD_TOLERANCE = 0.03       # stop cutting once padded blocks <= (1 + this) x exact blocks
# A cut must save at least this many bytes of padded K+V per layer: an extra call (~15 us on
# CPU, where decode attention costs ~150 ns per KiB of K+V; a few launches on CUDA) costs more
MIN_DECODE_SPLIT_BYTES = {"cpu": 256 * 1024, "cuda": 16 * 1024 * 1024}


class _Prefill(NamedTuple):
    """Attention work of one item with num_new_tokens > 1 (a prompt or a chunk)."""

    row_start: int
    num_new_tokens: int
    context_len: int
    kv_slots: torch.Tensor | None     # [c+n] flat cache slots of positions 0..c+n-1; None if c == 0
    mask: torch.Tensor | None         # [n, c+n] bool, True = attend; None if c == 0


class _DecodeGroup(NamedTuple):
    """Decode rows row_start..row_stop-1, each padded to the KV blocks of the group's last (longest)."""

    row_start: int
    row_stop: int
    block_start: int                  # its slice of _Decode.block_table
    block_stop: int
    mask: torch.Tensor                # [rows, 1, 1, num_blocks * block_size] bool, True = attend


class _Decode(NamedTuple):
    """Attention work of all n == 1 items (rows 0..D-1, ascending context), in padded groups."""

    block_table: torch.Tensor         # [sum of rows x num_blocks over groups] int64, padded with block 0
    groups: list[_DecodeGroup]
    num_rows: int                     # D


class _Plan(NamedTuple):
    """Everything one step needs besides the weights and the cache; rows as in the module docstring."""

    token_ids: torch.Tensor           # [T] int64, T = real rows + pad rows
    positions: torch.Tensor           # [T] int64 (pads: 0)
    slots: torch.Tensor               # [R] int64 flat cache slot of each real row, R = num_real
    num_real: int
    sampling: list[int]               # indices into batch.items of the items that sample, in order
    sample_rows: torch.Tensor         # [S] int64 last row of each sampling item
    decode: _Decode | None
    prefills: list[_Prefill]


class LiveEngine:
    """A random-weight Llama model plus a paged KV cache, stepped batch by batch.

    KV cache: per layer, K and V of shape [num_blocks, block_size, nkv, hd],
    zero-initialised. The engine remembers the greedy output tokens it
    sampled per request, so the token at position t of request r is its
    pseudo-random prompt id for t < num_prompt_tokens and its own output
    ``outputs[t - num_prompt_tokens]`` after that. A position whose output the
    engine never sampled (e.g. a calibration grid feeding a synthetic context)
    falls back to the pseudo-random id, which costs the same.
    """

    def __init__(self, config: ModelShape, num_blocks: int, block_size: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, num_threads: int | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = LlamaModel(config, self.device, dtype, seed)
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k_cache = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(config.num_layers)]
        self.v_cache = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(config.num_layers)]
        self._outputs: dict[int, list[int]] = {}
        # reused K and V gather buffers: a fresh multi-MB tensor per layer costs page faults on CPU
        self._scratch = [torch.empty(0, device=self.device, dtype=dtype) for _ in range(2)]

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * sum(t.numel() * t.element_size() for t in self.k_cache)

    def output_token_ids(self, req_id: int) -> tuple[int, ...]:
        """Output tokens sampled so far for ``req_id`` (greedy)."""
        return tuple(self._outputs.get(req_id, ()))

    def forget(self, req_id: int) -> None:
        """Drop the bookkeeping of a finished request (its outputs)."""
        self._outputs.pop(req_id, None)

    def synchronize(self) -> None:
        """Wait for queued device work (CUDA); a no-op on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def token_ids(self, req: Request, start: int, stop: int) -> np.ndarray:
        """Ids the engine feeds at positions start..stop-1 of ``req``: [stop - start] int64.

        Prompt position t: ``(req_id * 1_000_003 + t * 7919) % vocab_size``; output
        position t: the engine's own sampled token (or that formula if never sampled).
        """
        pos = np.arange(start, stop, dtype=np.int64)
        ids = (req.req_id * PROMPT_ID_MUL_REQ + pos * PROMPT_ID_MUL_POS) % self.config.vocab_size
        outs = self._outputs.get(req.req_id)
        num_prompt = req.num_prompt_tokens
        if outs and stop > num_prompt:
            lo, hi = max(start, num_prompt), min(stop, num_prompt + len(outs))
            if hi > lo:
                ids[lo - start: hi - start] = outs[lo - num_prompt: hi - num_prompt]
        return ids

    def _token_id(self, req: Request, position: int) -> int:
        """Token id at one position of ``req`` (scalar twin of ``token_ids``)."""
        k = position - req.num_prompt_tokens
        outs = self._outputs.get(req.req_id)
        if k >= 0 and outs is not None and k < len(outs):
            return outs[k]
        return (req.req_id * PROMPT_ID_MUL_REQ + position * PROMPT_ID_MUL_POS) % self.config.vocab_size

    def _block_ids(self, req: Request, num_positions: int) -> list[int]:
        """The first blocks of the table covering ``num_positions`` tokens; validated."""
        num_needed = -(-num_positions // self.block_size)
        table = req.block_ids
        if len(table) < num_needed:
            raise ValueError(f"request {req.req_id} needs {num_needed} blocks for {num_positions} "
                             f"tokens of block_size {self.block_size}, has {len(table)}")
        table = table[:num_needed]
        if table and (max(table) >= self.num_blocks or min(table) < 0):
            raise ValueError(f"request {req.req_id} has a block id outside 0..{self.num_blocks - 1}")
        return table

    def _gather(self, which: int, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``source.index_select(0, index)`` written into scratch buffer ``which`` (0: K, 1: V).

        The result is valid until the next gather into the same buffer.
        """
        num_rows = index.shape[0]
        need = num_rows * source[0].numel()
        if self._scratch[which].numel() < need:
            self._scratch[which] = torch.empty(need + need // 2, device=self.device, dtype=self.dtype)
        out = self._scratch[which][:need].view(num_rows, *source.shape[1:])
        return torch.index_select(source, 0, index, out=out)

    @torch.inference_mode()
    def step(self, batch: Batch, requests: Mapping[int, Request]) -> torch.Tensor | None:
        """Run one iteration for exactly ``batch.items``; return the sampled rows' logits.

        Reads each request's counters as they are *before* the simulator
        commits this batch. An item samples when ``context_len +
        num_new_tokens == num_prompt_tokens + num_output_tokens``; its greedy
        token becomes output number ``num_output_tokens`` of the request
        (re-running a step overwrites, so timing loops are idempotent).
        Returns logits [num_sampling_items, vocab] in batch-item order (None
        if no item samples). Raises ValueError for an item that computes
        tokens the request does not know or lacks blocks for.
        """
        plan = self._plan(batch, requests)
        if plan is None:
            return None
        x = self.model.embed(plan.token_ids)                                   # [T, hidden]
        for layer in range(self.config.num_layers):
            q, k, v = self.model.qkv(layer, x, plan.positions)                 # [T, nh|nkv, hd]
            kc, vc = self.k_cache[layer], self.v_cache[layer]
            kc.view(-1, *kc.shape[2:]).index_copy_(0, plan.slots, k[:plan.num_real])
            vc.view(-1, *vc.shape[2:]).index_copy_(0, plan.slots, v[:plan.num_real])
            attn = self._attention(layer, q, k, v, plan)
            x = self.model.finish_layer(layer, x, attn)
        if not plan.sampling:
            return None
        logits = self.model.logits(x.index_select(0, plan.sample_rows))       # [S, vocab]
        for i, tok in zip(plan.sampling, logits.argmax(dim=-1).tolist()):
            req = requests[batch.items[i].req_id]
            outs = self._outputs.setdefault(req.req_id, [])
            del outs[req.num_output_tokens:]
            if len(outs) < req.num_output_tokens:  # outputs never sampled: the ids that were fed
                start = req.num_prompt_tokens + len(outs)
                outs.extend(self.token_ids(req, start, req.num_tokens).tolist())
            outs.append(tok)
        return logits

    def _plan(self, batch: Batch, requests: Mapping[int, Request]) -> _Plan | None:
        """Validate the items and build every index tensor of the step (None: nothing to run)."""
        bs, dev, items = self.block_size, self.device, batch.items
        # decodes first, by ascending context (so their groups are contiguous rows), then chunks;
        # a finished slot of a static group (n == 0, one pad token) decodes too, see the module doc
        decodes = [i for i, it in enumerate(items)
                   if it.num_new_tokens == 1 or (it.num_new_tokens == 0 and it.num_pad_tokens == 1)]
        order = sorted(decodes, key=lambda i: items[i].context_len) \
            + [i for i, it in enumerate(items) if it.num_new_tokens > 1]
        empty = np.zeros(0, dtype=np.int64)
        ids_parts, pos_parts, slot_parts = [empty], [empty], [empty]
        last_row: dict[int, int] = {}                 # item index -> its last row
        prefills: list[_Prefill] = []
        decode_tables: list[list[int]] = []
        dec_ids: list[int] = []
        dec_pos: list[int] = []                       # = context_len of each decode
        dec_slots: list[int] = []
        row = max_pos = num_slot_pads = 0
        for i in order:
            it = items[i]
            req, n, c = requests[it.req_id], it.num_new_tokens, it.context_len
            if c < 0 or c + n > req.num_tokens:
                raise ValueError(f"request {req.req_id}: context {c} + {n} new tokens exceeds its "
                                 f"{req.num_tokens} known tokens")
            if n == 0:                             # a finished slot's wasted decode
                n = 1
                num_slot_pads += 1
            table = self._block_ids(req, c + n)
            if n == 1:                             # python scalars: numpy is slow on 1 element
                dec_ids.append(self._token_id(req, c))
                dec_pos.append(c)
                dec_slots.append(table[c // bs] * bs + c % bs)
                decode_tables.append(table)
            else:
                pos = np.arange(c, c + n, dtype=np.int64)
                ids_parts.append(self.token_ids(req, c, c + n))
                pos_parts.append(pos)
                slot_parts.append(np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs)
                prefills.append(self._prefill_meta(row, n, c, table))
            row += n
            last_row[i] = row - 1
            max_pos = max(max_pos, c + n)
        # decode rows come first
        ids_parts[0], pos_parts[0] = np.array(dec_ids, dtype=np.int64), np.array(dec_pos, dtype=np.int64)
        slot_parts[0] = np.array(dec_slots, dtype=np.int64)
        num_pad = sum(it.num_pad_tokens for it in items) - num_slot_pads
        if row + num_pad == 0:
            return None
        ids_parts.append(np.zeros(num_pad, dtype=np.int64))
        pos_parts.append(np.zeros(num_pad, dtype=np.int64))
        sampling = [i for i in sorted(last_row)
                    if items[i].context_len + items[i].num_new_tokens == requests[items[i].req_id].num_tokens]
        self.model.rope_tables(max(max_pos, 1))
        return _Plan(
            token_ids=torch.from_numpy(np.concatenate(ids_parts)).to(dev),
            positions=torch.from_numpy(np.concatenate(pos_parts)).to(dev),
            slots=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            num_real=row,
            sampling=sampling,
            sample_rows=torch.tensor([last_row[i] for i in sampling], dtype=torch.int64).to(dev),
            decode=self._decode_meta(decode_tables, dec_pos),
            prefills=prefills,
        )

    def _decode_meta(self, tables: list[list[int]], context_lens: list[int]) -> _Decode | None:
        """Groups of the decode rows (tables in ascending length), their padded block table and masks."""
        if not tables:
            return None
        bs = self.block_size
        lens = [len(t) for t in tables]
        flat_table: list[int] = []
        masks: list[np.ndarray] = []
        bounds: list[tuple[int, int, int, int]] = []
        block_bytes = 2 * self.k_cache[0][0].numel() * self.k_cache[0].element_size()   # K + V, one layer
        min_bytes = MIN_DECODE_SPLIT_BYTES.get(self.device.type, MIN_DECODE_SPLIT_BYTES["cuda"])
        for lo, hi in decode_groups(lens, -(-min_bytes // block_bytes)):
            width = lens[hi - 1]
            start = len(flat_table)
            for t in tables[lo:hi]:
                flat_table += t
                flat_table += [0] * (width - len(t))
            bounds.append((lo, hi, start, len(flat_table)))
            ctx = np.asarray(context_lens[lo:hi], dtype=np.int64)
            masks.append((np.arange(width * bs)[None, :] <= ctx[:, None]).reshape(-1))
        # one host-to-device copy each for the table and all masks
        block_table = torch.tensor(flat_table, dtype=torch.int64).to(self.device)
        mask_flat = torch.from_numpy(np.concatenate(masks)).to(self.device)
        groups, offset = [], 0
        for (lo, hi, b0, b1), m in zip(bounds, masks):
            mask = mask_flat[offset: offset + m.size].view(hi - lo, 1, 1, -1)
            offset += m.size
            groups.append(_DecodeGroup(lo, hi, b0, b1, mask))
        return _Decode(block_table, groups, len(tables))

    def _prefill_meta(self, row_start: int, n: int, c: int, table: list[int]) -> _Prefill:
        if c == 0:
            return _Prefill(row_start, n, c, None, None)
        bs = self.block_size
        pos = np.arange(c + n, dtype=np.int64)
        kv_slots = torch.from_numpy(np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs)
        span = torch.arange(c + n, device=self.device)
        query_pos = torch.arange(c, c + n, device=self.device)
        mask = span[None, :] <= query_pos[:, None]                                   # [n, c+n]
        return _Prefill(row_start, n, c, kv_slots.to(self.device), mask)

    def _attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   plan: _Plan) -> torch.Tensor:
        """Attention output [T, nh*hd] for all rows; pad rows get zeros."""
        num_rows, nh, hd = q.shape
        num_real, decode = plan.num_real, plan.decode
        out = torch.zeros(num_rows, nh, hd, device=q.device, dtype=q.dtype) if num_rows > num_real \
            else torch.empty(num_rows, nh, hd, device=q.device, dtype=q.dtype)
        if decode is not None:
            kc, vc = self.k_cache[layer], self.v_cache[layer]
            nkv = kc.shape[2]
            kall = self._gather(0, kc, decode.block_table)                         # [blocks, bs, nkv, hd]
            vall = self._gather(1, vc, decode.block_table)
            # GQA folded into the query length: the nh // nkv query heads sharing a KV head are
            # its "queries" (head h reads KV head h // (nh // nkv), as enable_gqa does), so each
            # KV head is read once, not once per query head: faster, and no slower per token for
            # long contexts (whose per-head K/V no longer stays in cache between query heads)
            qd = q[:decode.num_rows].view(decode.num_rows, nkv, nh // nkv, hd)
            for g in decode.groups:
                rows = g.row_stop - g.row_start
                kd = kall[g.block_start:g.block_stop].view(rows, -1, nkv, hd).transpose(1, 2)
                vd = vall[g.block_start:g.block_stop].view(rows, -1, nkv, hd).transpose(1, 2)
                # kd, vd: [rows, nkv, L, hd]
                o = F.scaled_dot_product_attention(qd[g.row_start:g.row_stop], kd, vd,
                                                   attn_mask=g.mask)              # [rows, nkv, nh/nkv, hd]
                out[g.row_start:g.row_stop] = o.view(rows, nh, hd)
        for p in plan.prefills:
            rows = slice(p.row_start, p.row_start + p.num_new_tokens)
            qp = q[rows].transpose(0, 1).unsqueeze(0)                                  # [1, nh, n, hd]
            if p.kv_slots is None:
                kp, vp = k[rows], v[rows]                                              # [n, nkv, hd]
                o = F.scaled_dot_product_attention(qp, kp.transpose(0, 1).unsqueeze(0),
                                                   vp.transpose(0, 1).unsqueeze(0),
                                                   is_causal=True, enable_gqa=True)
            else:
                kc = self.k_cache[layer].view(-1, *self.k_cache[layer].shape[2:])
                vc = self.v_cache[layer].view(-1, *self.v_cache[layer].shape[2:])
                kp, vp = self._gather(0, kc, p.kv_slots), self._gather(1, vc, p.kv_slots)  # [c+n, nkv, hd]
                o = F.scaled_dot_product_attention(qp, kp.transpose(0, 1).unsqueeze(0),
                                                   vp.transpose(0, 1).unsqueeze(0),
                                                   attn_mask=p.mask, enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)
        return out.view(num_rows, nh * hd)


def decode_groups(num_blocks: list[int], min_saved_blocks: int = 1) -> list[tuple[int, int]]:
    """Contiguous groups [(lo, hi), ...] of decodes sorted by ascending ``num_blocks``.

    Each group is padded to its last (longest) item. Top down: cut the group
    where the cut saves the most padded blocks, while there are fewer than
    MAX_DECODE_GROUPS groups, padded blocks exceed (1 + DECODE_PAD_TOLERANCE)
    x the exact total, and the best cut saves at least ``min_saved_blocks``.
    """
    n = len(num_blocks)
    if n == 0:
        return []
    b = np.asarray(num_blocks, dtype=np.int64)
    exact = int(b.sum())
    padded = n * int(b[-1])

    def best_cut(lo: int, hi: int) -> tuple[int, int]:
        """(padded blocks saved, cut) of the best cut of lo..hi-1; (0, lo) if none."""
        if hi - lo < 2 or b[lo] == b[hi - 1]:
            return 0, lo
        save = np.arange(1, hi - lo) * (b[hi - 1] - b[lo:hi - 1])    # cut after j items
        j = int(save.argmax())
        return int(save[j]), lo + j + 1

    groups, cuts = [(0, n)], [best_cut(0, n)]
    while len(groups) < MAX_DECODE_GROUPS and padded > (1 + DECODE_PAD_TOLERANCE) * exact:
        g = max(range(len(groups)), key=lambda i: cuts[i][0])
        saved, cut = cuts[g]
        if saved < max(min_saved_blocks, 1):
            break
        lo, hi = groups[g]
        groups[g:g + 1] = [(lo, cut), (cut, hi)]
        cuts[g:g + 1] = [best_cut(lo, cut), best_cut(cut, hi)]
        padded -= saved
    return groups
