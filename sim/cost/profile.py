"""Profile: the step-cost curves and memory facts of one (model, device) pair.

    step_time = overhead
              + linear(total tokens in the batch)            # QKV/O, MLP, norms, LM head
              + lm_head(sequences in the batch)              # kernel profiles only (else in linear)
              + sum over prefill chunks attn_prefill(chunk, context_before)
              - (prefill chunks - 1) x prefill_shared_s      # kernel profiles only (else 0)
              + attn_decode(num decode seqs, total decode context tokens)  # kernel profiles: mean context

A token is a *decode* token when its item computes exactly one token (padding
included); any item computing more is a prefill chunk. "context" is always the
KV tokens present before the step. Curves come from measurements (``sim
calibrate``) or from the analytic roofline (``sim.cost.roofline``); the profile file
says which in ``provenance``.

File format history (``FORMAT_VERSION``):
  1 - first version: overhead, linear, attn_prefill, attn_decode curves;
      memory facts; model shape; provenance; fit error. Later, optional
      fields older readers ignore: ``engine`` (the measured server's knobs)
      and ``memory.activation_bytes_per_token_per_gpu``; ``model.rope_theta``
      (absent: 10000.0). Then ``weight_dtype`` and ``kv_cache_dtype``
      (absent: the weights and KV are in ``dtype``), ``memory.kv_bytes_per_seq``
      (sliding-window KV per running request; absent: 0), and the model's
      ``head_dim`` (absent: hidden_size / num_heads), ``sliding_window``,
      ``num_sliding_layers`` and the MoE facts ``num_experts``,
      ``num_experts_per_tok``, ``moe_intermediate_size``,
      ``shared_expert_intermediate_size``, ``num_dense_layers`` (absent: 0,
      a dense model with full attention). Then, for profiles composed from measured
      kernel tables (``sim.cost.kernels``): ``curves.lm_head`` (the LM head's GEMM by the
      number of sequences it samples from; absent: the LM head is inside ``linear``),
      ``curves.prefill_shared_s`` (what the prefill chunks of one step share, charged once:
      one attention launch; absent: 0), and a curve's ``measured_max`` / ``measured``
      (where its table was measured; absent: the whole grid), ``curves.attn_decode.
      per_seq`` (true: its second axis is the decodes' mean context; absent: their sum) and
      ``memory.sampler_bytes_per_seq`` (vLLM's sampler warm-up per sequence; absent: 0).
      Then ``curves.host_step_s`` and ``curves.host_per_seq_s``: the engine's host work inside
      ``overhead_s`` and inside each sequence's attention term (``Profile.host_s``; absent: 0,
      no host part separated).

The host part (``host_s``): what of a step is the engine's host (CPU) work, per step and
per sequence scheduled, as the profile's engine terms state it (sim.cost.collectives's
synchronous engines, sim.cost.kernels's synchronous host terms); the rest is the device's.
A synchronous loop pays both one after the other (``step_time_s``); a pipelined loop runs a
step's host work beside the device's step before it (sim.loop.server.pipelined_start_s).
Profiles measured as a whole (``sim calibrate``, a server's probe traffic: the step period
the engine showed) and terms fitted on an async loop (what its overlap left unhidden) have
no host part separated: all of the step is on the device's path.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from sim.base.atomic import write_text_atomic
from sim.core.batch import Batch
from sim.cost.curves import Curve1D, Curve2D, MeasuredRange
from sim.base.strict import load_yaml
from sim.cost.shape import _POSITIVE_INT_FIELDS, MLP_KINDS, OPTIONAL_INT_FIELDS, ModelShape  # noqa: F401 (re-exported)

FORMAT_VERSION = 1
GIB = 1024**3
# Steps the activation reserve is sized for when a policy has no token budget
# (static, dynamic, orca): vLLM's profiling run with 8192 batched tokens.
DEFAULT_ACTIVATION_TOKENS = 8192


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names file, field and fix."""



@dataclass
class Profile:
    """Step costs plus memory facts. ``step_time_s`` is the simulator's hot path."""

    name: str
    model: ModelShape
    device: str
    dtype: str
    tensor_parallel: int
    memory_bytes_per_gpu: int
    weight_bytes: int                    # all ranks together
    activation_bytes_per_gpu: int        # peak activations + workspace, per GPU
    kv_bytes_per_token: int              # all ranks together
    overhead_s: float
    linear: Curve1D
    attn_prefill: Curve2D
    attn_decode: Curve2D
    provenance: dict[str, Any] = field(default_factory=dict)
    fit_error: dict[str, Any] = field(default_factory=dict)
    efficiency: dict[str, Any] = field(default_factory=dict)
    # The serving engine the profile was measured on, when it was one (``sim
    # calibrate --server``): its knobs and KV pool (max_num_seqs,
    # max_num_batched_tokens, num_gpu_blocks, block_size, max_model_len, ...).
    # ``sim run`` takes them as the server's defaults.
    engine: dict[str, Any] = field(default_factory=dict)
    # Activations that grow with the step's token budget, per token per GPU: vLLM
    # sizes its profiling run by max_num_batched_tokens, so the KV pool is what is
    # left after activation_bytes_per_gpu + this x the policy's budget (0: fixed).
    activation_bytes_per_token_per_gpu: int = 0
    # Sliding-window layers' KV per running request, all ranks (ModelShape.kv_bytes_per_seq):
    # the per-token pool (kv_bytes_per_token) holds the full-attention layers only, and the
    # KV pool is sized after reserving this for every sequence the policy may run at once.
    kv_bytes_per_seq: int = 0
    # The number formats beside ``dtype`` (sim.cost.precision): None means ``dtype`` (weights) and
    # "auto" (KV). Written only when set.
    weight_dtype: str | None = None
    kv_cache_dtype: str | None = None
    # Kernel profiles (sim.cost.kernels): the LM head by the number of sequences sampled (None: it
    # is inside ``linear``), and the part of a prefill chunk's attention that the chunks of one
    # step share (one kernel launch over all of them: charged once, not once per chunk).
    lm_head: Curve1D | None = None
    prefill_shared_s: float = 0.0
    # vLLM's start-up profiling also warms the sampler up on max_num_seqs dummy requests: their
    # logits over the whole vocabulary (on the rank that samples), sorted for top-p. Its peak, per
    # sequence, competes with the forward pass's activations for the memory the KV pool does not
    # get (vLLM's rule only; 0: not modelled, as the analytic presets leave it).
    sampler_bytes_per_seq: int = 0
    # Kernel profiles: attn_decode's second axis is the decodes' mean context (summed context /
    # decodes), the axis the tables measure generation attention on, not their summed context.
    decode_per_seq: bool = False
    # The engine's host work inside overhead_s (host_step_s <= overhead_s) and inside each prefill
    # chunk's and each decode's attention term (host_per_seq_s): ``host_s``. 0: none separated.
    host_step_s: float = 0.0
    host_per_seq_s: float = 0.0
    # Data parallelism (vLLM's --data-parallel-size): the profile is one of that many ranks of
    # ``tensor_parallel`` GPUs, each with its own scheduler and KV pool; ``weight_bytes`` is one
    # rank's, ``linear`` a rank's token-parallel ops when every rank runs as many tokens (the
    # experts meet all ranks' tokens: sim.cost.moe), the attention curves a rank's own. An MoE
    # model's ranks step together (sim.loop.dp). 1: no data parallelism.
    data_parallel_size: int = 1
    # Data-parallel MoE ranks: the routed experts of every MoE layer (their GEMMs, weights and the
    # gathers across the ranks) when each rank runs n tokens; ``linear`` then holds the rest. None:
    # inside ``linear``.
    moe: Curve1D | None = None
    # Not an init field: dataclasses.replace(profile, linear=...) must start a
    # fresh memo, not reuse the old curve's costs.
    _linear_memo: dict[int, tuple[float, bool]] = field(default_factory=dict, init=False, repr=False,
                                                        compare=False)
    _decode_memo: dict[int, tuple[float, float, int, float, bool, float]] = field(
        default_factory=dict, init=False, repr=False, compare=False)
    _lm_head_memo: dict[int, tuple[float, bool]] = field(default_factory=dict, init=False, repr=False,
                                                         compare=False)

    # ---- costs --------------------------------------------------------------
    def step_time_s(self, batch: Batch) -> float:
        """Predicted duration of one iteration running ``batch`` (seconds)."""
        t = self.overhead_s
        num_tokens = batch.num_tokens
        if num_tokens:
            # Token counts repeat step after step: memoize linear(), counting
            # every out-of-range use as the curve itself would.
            hit = self._linear_memo.get(num_tokens)
            if hit is None:
                before = self.linear.num_out_of_range
                hit = (self.linear(num_tokens), self.linear.num_out_of_range > before)
                self._linear_memo[num_tokens] = hit
            elif hit[1]:
                self.linear.num_out_of_range += 1
            t += hit[0]
            if self.moe is not None:            # one rank alone: its own tokens at the experts
                t += self.moe(num_tokens)
        if self.lm_head is not None:           # logits: one row per sequence sampled, one per draft verified
            t += self._lm_head_s(batch.num_prefill_seqs + batch.decode_seqs + batch.num_spec_tokens, True)
        if batch.prefill_chunks:
            attn_prefill = self.attn_prefill
            for chunk, context in batch.prefill_chunks:
                t += attn_prefill(chunk, context)
            if self.prefill_shared_s and batch.num_prefill_seqs > 1:
                t -= (batch.num_prefill_seqs - 1) * self.prefill_shared_s
        if batch.decode_seqs:
            n = batch.decode_seqs
            t += self.attn_decode(n, batch.decode_context / n if self.decode_per_seq else batch.decode_context)
        return t

    def dp_step_time_s(self, batches: Sequence[Batch | None], graph_tokens: int = 0,
                       expert_imbalance: float = 1.0) -> float:
        """One step of data-parallel ranks stepping together (``sim.loop.dp``), ``batches`` one a
        rank (None: a rank with nothing to run, which joins with a dummy batch of one token).

        When every rank's batch fits a CUDA graph (at most ``graph_tokens`` tokens), vLLM pads
        every rank to the largest rank's token count: each rank's token-parallel ops (``linear``)
        and the experts (``moe``) run at that count. Above, each rank runs its own tokens through
        ``linear``, and the experts meet all ranks' tokens, priced at their mean a rank (``moe``
        is measured with every rank alike). Each rank adds its own attention, LM head and
        overheads (``step_time_s``); the MoE layers' collectives hold every rank to the slowest,
        which is the group's step. ``expert_imbalance``: the tokens the busiest rank's experts get
        over the mean (1: uniform routing); the experts are priced at that many tokens."""
        tokens = [b.num_tokens if b is not None and b.num_tokens else 1 for b in batches]
        most = max(tokens)
        padded = most <= graph_tokens
        moe = self.moe
        if moe is None:
            experts = 0.0
        else:
            mean = most if padded else -(-sum(tokens) // len(tokens))
            experts = moe(mean * expert_imbalance if expert_imbalance != 1.0 else mean)
        slowest = 0.0
        for b, n in zip(batches, tokens):
            if b is None:
                own = self.overhead_s + self.linear(most if padded else n)
            else:                      # its own step, the experts apart, at the padded count when padded
                own = self.step_time_s(b) - (moe(n) if moe is not None else 0.0)
                if padded and n != most:
                    own += self.linear(most) - self.linear(n)
            slowest = max(slowest, own)
        return slowest + experts

    def proposer_s(self, spec: Any, num_seqs: int, num_tokens: int, context: int) -> float:
        """The speculative proposer's time in a step where ``num_seqs`` sequences sampled (each
        gets ``spec.num_speculative_tokens`` drafts for the next step), ``num_tokens`` tokens of
        theirs went through the target model and ``context`` is their summed context.

        EAGLE/EAGLE-3/MTP (``spec.on_device``): k forward passes of ``spec.draft_layers``
        transformer layers, priced as that share of the target's layers (the token-parallel
        layers less the LM head, and decode attention over the same contexts), each with the
        target's LM head over the sequences (EAGLE and MTP heads share it); the first pass takes
        the step's tokens of those sequences, as vLLM's padded drafter batch does, the others
        one token per sequence. The LM head is the profile's own curve where it has one (kernel
        profiles), else its share of ``linear`` by weights (vocab x hidden of the matmul
        weights one token uses). n-gram: host time per sequence (``spec.ngram_host_s_per_seq``)."""
        if not num_seqs:
            return 0.0
        k = spec.num_speculative_tokens
        if not spec.on_device:
            return num_seqs * spec.ngram_host_s_per_seq
        m = self.model
        share = spec.draft_layers / m.num_layers
        head = m.vocab_size * m.hidden_size       # the LM head's weights; the input embedding is a lookup
        matmul = m.num_active_params - (0 if m.tie_word_embeddings else head)
        head_share = 0.0 if self.lm_head is not None else head / matmul
        def body(tokens: int) -> float:
            return share * ((1.0 - head_share) * self.linear(tokens)
                            + self.attn_decode(num_seqs, context / num_seqs if self.decode_per_seq else context))
        head = (self.lm_head(num_seqs) if self.lm_head is not None else head_share * self.linear(num_seqs))
        return body(max(num_tokens, num_seqs)) + (k - 1) * body(num_seqs) + k * head

    def host_s(self, batch: Batch) -> float:
        """The engine's host (CPU) seconds inside ``step_time_s(batch)``: ``host_step_s`` plus
        ``host_per_seq_s`` per sequence scheduled (prefill chunks and decodes); the rest is the
        device's. 0.0 when the profile separates no host part."""
        return self.host_step_s + self.host_per_seq_s * (batch.num_prefill_seqs + batch.decode_seqs)

    def decode_stretch_s(self, num_seqs: int, context: int, growth: int, start_s: float, horizon_s: float,
                         max_steps: int, pre_s: Sequence[float] | None = None
                         ) -> tuple[list[float], list[float], float | None, Callable[[int], int]]:
        """Consecutive decode steps of ``num_seqs`` one-token items, the
        first starting at ``start_s`` with summed context ``context``, each
        next one ``growth`` tokens longer (the loop's fast path,
        ``sim.loop.stretch``), with, if ``pre_s`` is given, a prefill chunk in
        each, ``pre_s[k]`` being what step k costs before its decode
        attention (``chunk_steps_s``): their durations and end times, for at most
        ``max_steps`` steps, stopping before the first that would end at or
        after ``horizon_s``, and that one's duration (None if the steps
        stopped at ``max_steps``). Each duration is ``step_time_s`` of that
        batch, the same floating-point operations in the same order, and the
        end times are summed one after the other as stepping sums them: the
        same floats. Also ``out_of_range(n)``: how many of the decode
        attention lookups of the first ``n`` steps (the one at the horizon
        included) lie outside the grid. Counts nothing (the caller counts the
        steps it uses: ``count_stretch_lookups``)."""
        base_s, _, i, tx, x_out, y_last = self._decode_column(num_seqs)
        attn = self.attn_decode
        ys, row0, row1 = attn.ys, attn.zs[i], attn.zs[i + 1]
        y_first, last_j = ys[0], len(ys) - 2
        per_seq = self.decode_per_seq
        y = context / num_seqs if per_seq else context
        j = min(max(bisect_right(ys, y) - 1, 0), last_j)      # as __call__ picks it; y only grows
        # The segment's constants, as __call__ computes them (the same floats): recomputed
        # only when the context crosses into the next segment.
        y0, y1 = ys[j], ys[j + 1]
        dy, z00, z10 = y1 - y0, row0[j], row1[j]
        dz0, dz1 = row0[j + 1] - z00, row1[j + 1] - z10
        num_below = 0                       # steps whose context lies below the grid (a prefix) ...
        first_above = max_steps             # ... and the first above it (a suffix from there)
        durations: list[float] = []
        ends: list[float] = []
        crossing_s = None
        t = start_s
        add_duration, add_end = durations.append, ends.append      # bound once: this loop is hot
        chunked = pre_s is not None
        for k in range(max_steps):
            if y >= y1 and j < last_j:
                while j < last_j and y >= ys[j + 1]:
                    j += 1
                y0, y1 = ys[j], ys[j + 1]
                dy, z00, z10 = y1 - y0, row0[j], row1[j]
                dz0, dz1 = row0[j + 1] - z00, row1[j + 1] - z10
            ty = (y - y0) / dy
            z0 = z00 + dz0 * ty
            z = z0 + (z10 + dz1 * ty - z0) * tx
            d = (pre_s[k] if chunked else base_s) + (z if z > 0.0 else 0.0)
            if y < y_first:
                num_below += 1
            elif y > y_last and first_above == max_steps:
                first_above = k
            end = t + d
            if end >= horizon_s:
                crossing_s = d
                break
            add_duration(d)
            add_end(end)
            t = end
            if per_seq:
                context += growth
                y = context / num_seqs
            else:
                y += growth

        def out_of_range(n: int) -> int:
            return n if x_out else min(n, num_below) + max(0, n - first_above)

        return durations, ends, crossing_s, out_of_range

    def decode_floor_s(self, num_seqs: int) -> float:
        """What every decode-only step of ``num_seqs`` sequences costs at least:
        the fixed overhead and the token-parallel layers (attention only adds).
        Counts nothing."""
        return self._decode_column(num_seqs)[1]

    def _decode_column(self, num_seqs: int) -> tuple[float, float, int, float, bool, float]:
        """What the decode steps of ``num_seqs`` sequences share, memoized:
        overhead + linear (+ the LM head, as ``step_time_s`` adds them), that
        floored above 0, and the attention curve's ``column(num_seqs)``. Counts nothing."""
        hit = self._decode_memo.get(num_seqs)
        if hit is None:
            base_s = self.overhead_s + self._linear_uncounted(num_seqs)[0]
            if self.lm_head is not None:
                base_s += self._lm_head_s(num_seqs, False)
            hit = (base_s, max(base_s, 1e-12), *self.attn_decode.column(num_seqs))
            self._decode_memo[num_seqs] = hit
        return hit

    def _lm_head_s(self, num_seqs: int, count: bool) -> float:
        """lm_head(num_seqs), memoized like linear(); ``count``: count an out-of-range use."""
        hit = self._lm_head_memo.get(num_seqs)
        curve = self.lm_head
        if hit is None:
            before = curve.num_out_of_range
            hit = (curve(num_seqs), curve.num_out_of_range > before)
            curve.num_out_of_range = before
            self._lm_head_memo[num_seqs] = hit
        if count and hit[1]:
            curve.num_out_of_range += 1
        return hit[0]

    def _linear_uncounted(self, num_tokens: int) -> tuple[float, bool]:
        """The memo entry of linear(num_tokens): (cost, out of range), filled
        without counting the lookup (the fast path counts the steps it uses)."""
        hit = self._linear_memo.get(num_tokens)
        if hit is None:
            before = self.linear.num_out_of_range
            hit = (self.linear(num_tokens), self.linear.num_out_of_range > before)
            self.linear.num_out_of_range = before
            self._linear_memo[num_tokens] = hit
        return hit

    def chunk_steps_s(self, num_decode_seqs: int, chunks: Sequence[int], context: int
                      ) -> tuple[list[float], list[bool]]:
        """For consecutive steps of ``num_decode_seqs`` decodes plus one
        prefill chunk of ``chunks[k]`` tokens in step k, the chunk's context
        starting at ``context`` and growing by each chunk: what each step
        costs before its decode attention (overhead, the token-parallel
        layers, the chunk's attention, added as ``step_time_s`` adds them)
        and whether each chunk's attention lookup lies outside the grid.
        Counts nothing."""
        curve = self.attn_prefill
        before = curve.num_out_of_range
        costs, outs = [], []
        lm_s = None if self.lm_head is None else self._lm_head_s(num_decode_seqs + 1, False)
        for chunk in chunks:
            linear_s, _ = self._linear_uncounted(num_decode_seqs + chunk)
            counted = curve.num_out_of_range
            if lm_s is None:
                costs.append(self.overhead_s + linear_s + curve(chunk, context))
            else:
                costs.append(self.overhead_s + linear_s + lm_s + curve(chunk, context))
            outs.append(curve.num_out_of_range > counted)
            context += chunk
        curve.num_out_of_range = before
        return costs, outs

    def count_stretch_lookups(self, linear_uses: Sequence[tuple[int, int]], decode_out_of_range: int,
                              prefill_out_of_range: int = 0,
                              lm_head_uses: Sequence[tuple[int, int]] = ()) -> None:
        """Count the out-of-range lookups of the steps a stretch used
        (``linear_uses``: (token count, steps of that count);
        ``decode_out_of_range``: its ``decode_stretch_s``'s
        ``out_of_range(num_steps)``; the prefill chunks' from
        ``chunk_steps_s``; ``lm_head_uses``: (sequences, steps of that count)),
        as ``step_time_s`` would have counted them one step at a time."""
        for num_tokens, num_steps in linear_uses:
            if self._linear_uncounted(num_tokens)[1]:
                self.linear.num_out_of_range += num_steps
        self.attn_decode.num_out_of_range += decode_out_of_range
        self.attn_prefill.num_out_of_range += prefill_out_of_range
        if self.lm_head is not None:
            for num_seqs, num_steps in lm_head_uses:
                self._lm_head_s(num_seqs, False)
                if self._lm_head_memo[num_seqs][1]:
                    self.lm_head.num_out_of_range += num_steps

    @property
    def num_out_of_range(self) -> int:
        """Curve lookups outside the measured grid so far (extrapolated)."""
        return (self.linear.num_out_of_range + self.attn_prefill.num_out_of_range
                + self.attn_decode.num_out_of_range + (self.lm_head.num_out_of_range if self.lm_head else 0))

    def reset_counters(self) -> None:
        for c in (self.linear, self.attn_prefill, self.attn_decode, self.lm_head):
            if c is not None:
                c.num_out_of_range = 0

    # ---- memory -------------------------------------------------------------
    def activation_bytes(self, num_batched_tokens: int = DEFAULT_ACTIVATION_TOKENS) -> int:
        """Activation reserve per GPU for steps of up to ``num_batched_tokens`` tokens."""
        return self.activation_bytes_per_gpu + self.activation_bytes_per_token_per_gpu * num_batched_tokens

    def kv_capacity_tokens(self, gpu_memory_utilization: float,
                           num_batched_tokens: int = DEFAULT_ACTIVATION_TOKENS, share_of: str = "total",
                           max_num_seqs: int = 0) -> int:
        """KV tokens that fit (``sim.core.policy.KvMemory``), with activations sized
        for steps of ``num_batched_tokens`` (the policy's token budget): share_of
        "total" (vLLM): memory x fraction - weights - activations; "static"
        (SGLang): memory x fraction - weights; "free" (TensorRT-LLM, LMDeploy):
        fraction x (memory - weights - activations); then less the sliding-window
        layers' KV of ``max_num_seqs`` running requests (``kv_bytes_per_seq``).

        NOTE: the sliding reserve is an upper bound: it holds a full window for every
        sequence slot, where vLLM's hybrid pool lends the same blocks to full-attention
        layers while slots are empty or requests are shorter than the window."""
        free = self._kv_budget_bytes(gpu_memory_utilization, num_batched_tokens, share_of, max_num_seqs)
        if self.kv_bytes_per_seq:
            free -= max_num_seqs * self.kv_bytes_per_seq
        return max(0, int(free // self.kv_bytes_per_token))

    def _kv_budget_bytes(self, fraction: float, num_batched_tokens: int, share_of: str,
                         max_num_seqs: int = 0) -> float:
        tp, memory = self.tensor_parallel, self.memory_bytes_per_gpu
        activations = tp * self.activation_bytes(num_batched_tokens)
        if share_of == "total" and self.sampler_bytes_per_seq:
            # the profiling run's peak is the forward pass's or the sampler warm-up's, whichever is larger
            activations = tp * max(self.activation_bytes(num_batched_tokens), self.sampler_bytes_per_seq * max_num_seqs)
        if share_of == "total":
            return tp * memory * fraction - activations - self.weight_bytes
        if share_of == "static":
            return tp * memory * fraction - self.weight_bytes
        if share_of == "free":
            return fraction * (tp * memory - activations - self.weight_bytes)
        raise ValueError(f"share_of must be total, static or free, got {share_of!r}")

    def memory_report(self, gpu_memory_utilization: float, num_batched_tokens: int = DEFAULT_ACTIVATION_TOKENS,
                      share_of: str = "total", max_num_seqs: int = 0) -> str:
        tp = self.tensor_parallel
        memory = f"{tp} x {self.memory_bytes_per_gpu / GIB:.1f} GiB"
        weights = f"weights {self.weight_bytes / GIB:.1f} GiB"
        activations = (f"activations {tp} x {self.activation_bytes(num_batched_tokens) / GIB:.2f} GiB"
                       f" (steps of {num_batched_tokens} tokens)")
        sampler = self.sampler_bytes_per_seq * max_num_seqs
        if share_of == "total" and sampler > self.activation_bytes(num_batched_tokens):
            activations = (f"sampler warm-up {tp} x {sampler / GIB:.2f} GiB ({max_num_seqs} sequences, more than "
                           f"the activations of steps of {num_batched_tokens} tokens)")
        sliding = (f" - sliding-window KV {max_num_seqs} x {self.kv_bytes_per_seq / 2**20:.1f} MiB"
                   if self.kv_bytes_per_seq and max_num_seqs else "")
        if share_of == "static":
            return (f"{memory} x {gpu_memory_utilization:g} - {weights}{sliding} "
                    f"(activations outside the static share)")
        if share_of == "free":
            return f"{gpu_memory_utilization:g} x ({memory} - {weights} - {activations}){sliding}"
        return f"{memory} x {gpu_memory_utilization:g} - {weights} - {activations}{sliding}"

    # ---- files --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        m = self.model
        return {
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "device": self.device,
            "dtype": self.dtype,
            "tensor_parallel": self.tensor_parallel,
            **({"data_parallel_size": self.data_parallel_size} if self.data_parallel_size > 1 else {}),
            **({"weight_dtype": self.weight_dtype} if self.weight_dtype else {}),
            **({"kv_cache_dtype": self.kv_cache_dtype} if self.kv_cache_dtype else {}),
            "model": m.to_dict(),
            "memory": {
                "memory_bytes_per_gpu": self.memory_bytes_per_gpu,
                "weight_bytes": self.weight_bytes,
                "activation_bytes_per_gpu": self.activation_bytes_per_gpu,
                "activation_bytes_per_token_per_gpu": self.activation_bytes_per_token_per_gpu,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                **({"kv_bytes_per_seq": self.kv_bytes_per_seq} if self.kv_bytes_per_seq else {}),
                **({"sampler_bytes_per_seq": self.sampler_bytes_per_seq} if self.sampler_bytes_per_seq else {}),
            },
            "curves": {
                "overhead_s": self.overhead_s,
                "linear": self.linear.to_dict("tokens"),
                "attn_prefill": self.attn_prefill.to_dict("chunk", "context"),
                "attn_decode": {**self.attn_decode.to_dict("seqs", "context"),
                                **({"per_seq": True} if self.decode_per_seq else {})},
                **({"lm_head": self.lm_head.to_dict("seqs")} if self.lm_head is not None else {}),
                **({"moe": self.moe.to_dict("tokens")} if self.moe is not None else {}),
                **({"prefill_shared_s": self.prefill_shared_s} if self.prefill_shared_s else {}),
                **({"host_step_s": self.host_step_s} if self.host_step_s else {}),
                **({"host_per_seq_s": self.host_per_seq_s} if self.host_per_seq_s else {}),
            },
            "efficiency": self.efficiency,
            "engine": self.engine,
            "provenance": self.provenance,
            "fit_error": self.fit_error,
        }

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        if path.suffix == ".json":
            write_text_atomic(path, json.dumps(data, indent=1))
        else:
            write_text_atomic(path, yaml.safe_dump(data, sort_keys=False, width=200))


def _get(d: dict, key: str, where: str, source: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ProfileError(f"{source}: field '{where}{key}' is missing (see sim/cost/profile.py for the format)")
    return d[key]


MAX_SECONDS = 1e6          # a curve point or overhead above 11 days a step is not a measurement
MAX_BYTES = 2**50          # a PiB of memory per GPU


def _finite(value: Any, where: str, source: str, *, minimum: float = 0.0, strict: bool = False,
            maximum: float = math.inf) -> float:
    """A number (not text, not a bool) that is finite, >= minimum (> with ``strict``) and
    <= maximum, else a ProfileError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{source}: field '{where}' must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x) or x < minimum or (strict and x == minimum) or x > maximum:
        bound = f" and <= {maximum:g}" if maximum < math.inf else ""
        raise ProfileError(f"{source}: field '{where}' must be a finite number "
                           f"{'>' if strict else '>='} {minimum:g}{bound}, got {value!r}")
    return x


def _whole(value: Any, where: str, source: str, *, minimum: int = 1, maximum: float = 2**53) -> int:
    """An integer (a whole float such as 1e9 too; not text, not a bool) in [minimum, maximum]."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ProfileError(f"{source}: field '{where}' must be a whole number >= {minimum}"
                           f"{f' and <= {maximum:g}' if maximum < 2**53 else ''}, got {value!r}")
    return value


def _mapping(data: dict, key: str, source: str) -> dict[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProfileError(f"{source}: field '{key}' must be a mapping, got {value!r}")
    return dict(value)


def _fit_error(data: dict, source: str) -> dict[str, Any]:
    """``fit_error``: a mapping whose percentages (``*_pct``: errors, signed or absolute) are
    finite numbers or null."""
    fe = _mapping(data, "fit_error", source)
    for key, value in fe.items():
        if str(key).endswith("_pct") and value is not None:
            fe[key] = _finite(value, f"fit_error.{key}", source, minimum=-math.inf)
    return fe


ENGINE_COUNTS = ("max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks", "block_size", "max_model_len")
ENGINE_SECONDS = ("request_overhead_s", "request_overhead_idle_s", "request_overhead_busy_s")


def _engine(value: Any, source: str) -> dict[str, Any]:
    """The ``engine`` mapping with the knobs the simulator reads checked: counts are positive
    integers and request overheads finite seconds >= 0 (either may be null: not measured)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProfileError(f"{source}: field 'engine' must be a mapping of the server's knobs, got {value!r}")
    out = dict(value)
    for key in ENGINE_COUNTS:
        v = out.get(key)
        if v is None:
            continue
        if isinstance(v, float) and v.is_integer():
            v = out[key] = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ProfileError(f"{source}: field 'engine.{key}' must be a positive integer, got {v!r}")
    for key in ENGINE_SECONDS:
        if out.get(key) is not None:
            out[key] = _finite(out[key], f"engine.{key}", source)
    return out


def _check_curve(where: str, axes: dict[str, Any], values: Any, source: str) -> None:
    """Grid axes finite, >= 0 and strictly increasing; costs finite, >= 0 and
    non-decreasing along every axis (more work never costs less). A file that
    breaks this is refused rather than silently repaired."""
    for name, xs in axes.items():
        if not isinstance(xs, list) or len(xs) < 2:
            raise ProfileError(f"{source}: field '{where}.{name}' must be a list of at least 2 grid points")
        pts = [_finite(x, f"{where}.{name}", source) for x in xs]
        if any(b <= a for a, b in zip(pts, pts[1:])):
            raise ProfileError(f"{source}: field '{where}.{name}' must be strictly increasing, got {xs}")
    rows = values if len(axes) == 2 else [values]
    shape = [len(v) for v in axes.values()]
    if not isinstance(rows, list) or len(rows) != (shape[0] if len(axes) == 2 else 1) or any(
            not isinstance(r, list) or len(r) != shape[-1] for r in rows):
        raise ProfileError(f"{source}: field '{where}.seconds' must have shape {' x '.join(map(str, shape))}")
    grid = [[_finite(y, f"{where}.seconds", source, maximum=MAX_SECONDS) for y in r] for r in rows]
    for i, r in enumerate(grid):
        for j in range(len(r)):
            for prev, axis in ((r[j - 1] if j else None, list(axes)[-1]),
                               (grid[i - 1][j] if i else None, list(axes)[0])):
                if prev is not None and r[j] < prev * (1 - 1e-9):
                    raise ProfileError(f"{source}: field '{where}.seconds' decreases along '{axis}' "
                                       f"({prev:g} -> {r[j]:g} s): a step with more work cannot cost less")


def _flag(value: Any, where: str, source: str) -> bool:
    if not isinstance(value, bool):
        raise ProfileError(f"{source}: field '{where}' must be true or false, got {value!r}")
    return value


def _optional_curve(curves: dict, key: str, axis: str, source: str) -> Curve1D | None:
    """A profile file's optional 1-D curve ``curves.<key>`` (x axis ``axis``), checked; None when absent."""
    if curves.get(key) is None:
        return None
    where, data = f"curves.{key}", curves[key]
    _check_curve(where, {axis: _get(data, axis, f"{where}.", source)}, _get(data, "seconds", f"{where}.", source),
                 source)
    return Curve1D(data[axis], data["seconds"], name=where, measured_max=_measured_max(data, where, source))


def _measured_max(curve: dict, where: str, source: str) -> float | None:
    """A 1-D curve's optional ``measured_max``: the largest x its table measured."""
    if curve.get("measured_max") is None:
        return None
    return _finite(curve["measured_max"], f"{where}.measured_max", source)


def _measured_range(curve: dict, where: str, source: str) -> MeasuredRange | None:
    """A 2-D curve's optional ``measured`` mapping (x_max, y_max, y_per_x: ``MeasuredRange``)."""
    m = curve.get("measured")
    if m is None:
        return None
    if not isinstance(m, dict) or "x_max" not in m:
        raise ProfileError(f"{source}: field '{where}.measured' must be a mapping with x_max, y_max and y_per_x")
    y_max = m.get("y_max")
    return MeasuredRange(_finite(m["x_max"], f"{where}.measured.x_max", source),
                         math.inf if y_max is None else _finite(y_max, f"{where}.measured.y_max", source,
                                                                minimum=-math.inf),
                         _finite(m.get("y_per_x", 0.0), f"{where}.measured.y_per_x", source, minimum=-math.inf))


def _precision_fields(data: dict, source: str) -> dict[str, str]:
    """The optional ``weight_dtype`` and ``kv_cache_dtype``, checked against sim.cost.precision's names."""
    from sim.cost.precision import KV_CACHE_DTYPES, WEIGHT_DTYPES
    out = {}
    for key, allowed in (("weight_dtype", WEIGHT_DTYPES), ("kv_cache_dtype", KV_CACHE_DTYPES)):
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or value.lower() not in allowed:
            raise ProfileError(f"{source}: field '{key}' must be one of {', '.join(allowed)}, got {value!r}")
        out[key] = value.lower()
    return out


def profile_from_dict(data: Any, source: str = "<profile>") -> Profile:
    """Build a Profile from its file form, with errors that name the field."""
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    version = data.get("format_version")
    if "format_version" not in data:
        raise ProfileError(f"{source}: field 'format_version' is missing (expected {FORMAT_VERSION}); is this a "
                           f"profile written by `sim calibrate` or `python -m calibrate.vidur_import`?")
    if version != FORMAT_VERSION:
        raise ProfileError(f"{source}: field 'format_version' is {version!r}; this batchsim reads "
                           f"version {FORMAT_VERSION} (re-run `sim calibrate` or regenerate the profile)")
    try:
        m = _get(data, "model", "", source)
        if not isinstance(m, dict):
            raise ProfileError(f"{source}: field 'model' must be a mapping of the model's shape, got {m!r}")
        for key in _POSITIVE_INT_FIELDS:
            m = {**m, key: _whole(_get(m, key, "model.", source), f"model.{key}", source)}
        for key in ("name", "mlp"):
            if key in m and not isinstance(m[key], str):
                raise ProfileError(f"{source}: field 'model.{key}' must be text, got {m[key]!r}")
        for key in ("name", "device", "dtype"):
            if key in data and not isinstance(data[key], str):
                raise ProfileError(f"{source}: field '{key}' must be text, got {data[key]!r}")
        # rope_theta: written since it joined ModelShape; older files lack it (the default).
        extra = ({"rope_theta": _finite(m["rope_theta"], "model.rope_theta", source, strict=True)}
                if "rope_theta" in m else {})
        # head_dim, sliding windows and MoE facts: optional, written only when set.
        extra.update({key: _whole(m[key], f"model.{key}", source, minimum=0) for key in OPTIONAL_INT_FIELDS[1:]
                     if m.get(key) is not None})
        if m.get("head_dim") is not None:     # the file's spelling of ModelShape.explicit_head_dim
            extra["explicit_head_dim"] = _whole(m["head_dim"], "model.head_dim", source, minimum=0)
        model = ModelShape(
            name=str(_get(m, "name", "model.", source)),
            hidden_size=int(_get(m, "hidden_size", "model.", source)),
            num_layers=int(_get(m, "num_layers", "model.", source)),
            num_heads=int(_get(m, "num_heads", "model.", source)),
            num_kv_heads=int(_get(m, "num_kv_heads", "model.", source)),
            intermediate_size=int(_get(m, "intermediate_size", "model.", source)),
            vocab_size=int(_get(m, "vocab_size", "model.", source)),
            max_position_embeddings=int(_get(m, "max_position_embeddings", "model.", source)),
            mlp=str(m.get("mlp", "swiglu")),
            tie_word_embeddings=bool(m.get("tie_word_embeddings", False)),
            **extra,
        )
        mem = _get(data, "memory", "", source)
        c = _get(data, "curves", "", source)
        lin = _get(c, "linear", "curves.", source)
        pre = _get(c, "attn_prefill", "curves.", source)
        dec = _get(c, "attn_decode", "curves.", source)
        if not isinstance(mem, dict):
            raise ProfileError(f"{source}: field 'memory' must be a mapping, got {mem!r}")
        mem = dict(mem)
        for key, least in (("memory_bytes_per_gpu", 1), ("kv_bytes_per_token", 1), ("weight_bytes", 0),
                           ("activation_bytes_per_gpu", 0), ("activation_bytes_per_token_per_gpu", 0),
                           ("kv_bytes_per_seq", 0), ("sampler_bytes_per_seq", 0)):
            if key in mem or least:
                mem[key] = _whole(_get(mem, key, "memory.", source), f"memory.{key}", source, minimum=least,
                                  maximum=MAX_BYTES)
        tensor_parallel = _whole(data.get("tensor_parallel", 1), "tensor_parallel", source, maximum=1024)
        data_parallel = _whole(data.get("data_parallel_size", 1), "data_parallel_size", source, maximum=1024)
        _finite(_get(c, "overhead_s", "curves.", source), "curves.overhead_s", source, maximum=MAX_SECONDS)
        _check_curve("curves.linear", {"tokens": _get(lin, "tokens", "curves.linear.", source)},
                     _get(lin, "seconds", "curves.linear.", source), source)
        _check_curve("curves.attn_prefill", {"chunk": _get(pre, "chunk", "curves.attn_prefill.", source),
                                             "context": _get(pre, "context", "curves.attn_prefill.", source)},
                     _get(pre, "seconds", "curves.attn_prefill.", source), source)
        _check_curve("curves.attn_decode", {"seqs": _get(dec, "seqs", "curves.attn_decode.", source),
                                            "context": _get(dec, "context", "curves.attn_decode.", source)},
                     _get(dec, "seconds", "curves.attn_decode.", source), source)
        lm_head = _optional_curve(c, "lm_head", "seqs", source)
        moe = _optional_curve(c, "moe", "tokens", source)
        prefill_shared_s = _finite(c.get("prefill_shared_s", 0.0), "curves.prefill_shared_s", source,
                                   maximum=MAX_SECONDS)
        host_step_s = _finite(c.get("host_step_s", 0.0), "curves.host_step_s", source, maximum=MAX_SECONDS)
        host_per_seq_s = _finite(c.get("host_per_seq_s", 0.0), "curves.host_per_seq_s", source,
                                 maximum=MAX_SECONDS)
        prof = Profile(
            name=str(data.get("name", Path(source).stem)),
            model=model,
            device=str(_get(data, "device", "", source)),
            dtype=str(_get(data, "dtype", "", source)),
            tensor_parallel=tensor_parallel, data_parallel_size=data_parallel,
            memory_bytes_per_gpu=int(_get(mem, "memory_bytes_per_gpu", "memory.", source)),
            weight_bytes=int(_get(mem, "weight_bytes", "memory.", source)),
            activation_bytes_per_gpu=int(_get(mem, "activation_bytes_per_gpu", "memory.", source)),
            activation_bytes_per_token_per_gpu=int(_finite(mem.get("activation_bytes_per_token_per_gpu", 0),
                                                           "memory.activation_bytes_per_token_per_gpu", source)),
            kv_bytes_per_token=int(_get(mem, "kv_bytes_per_token", "memory.", source)),
            overhead_s=float(_get(c, "overhead_s", "curves.", source)),
            linear=Curve1D(_get(lin, "tokens", "curves.linear.", source),
                           _get(lin, "seconds", "curves.linear.", source), name="curves.linear",
                           measured_max=_measured_max(lin, "curves.linear", source)),
            attn_prefill=Curve2D(_get(pre, "chunk", "curves.attn_prefill.", source),
                                 _get(pre, "context", "curves.attn_prefill.", source),
                                 _get(pre, "seconds", "curves.attn_prefill.", source),
                                 name="curves.attn_prefill",
                                 measured=_measured_range(pre, "curves.attn_prefill", source)),
            attn_decode=Curve2D(_get(dec, "seqs", "curves.attn_decode.", source),
                                _get(dec, "context", "curves.attn_decode.", source),
                                _get(dec, "seconds", "curves.attn_decode.", source),
                                name="curves.attn_decode",
                                measured=_measured_range(dec, "curves.attn_decode", source)),
            lm_head=lm_head, moe=moe,
            prefill_shared_s=prefill_shared_s,
            host_step_s=host_step_s,
            host_per_seq_s=host_per_seq_s,
            decode_per_seq=_flag(dec.get("per_seq", False), "curves.attn_decode.per_seq", source),
            provenance=_mapping(data, "provenance", source),
            fit_error=_fit_error(data, source),
            efficiency=_mapping(data, "efficiency", source),
            engine=_engine(data.get("engine"), source),
            kv_bytes_per_seq=int(mem.get("kv_bytes_per_seq", 0)),
            sampler_bytes_per_seq=int(mem.get("sampler_bytes_per_seq", 0)),
            **_precision_fields(data, source),
        )
    except ProfileError:
        raise
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{source}: {exc}") from None
    if prof.kv_bytes_per_token <= 0 or prof.memory_bytes_per_gpu <= 0:
        raise ProfileError(f"{source}: memory.kv_bytes_per_token and memory.memory_bytes_per_gpu must be > 0")
    if prof.overhead_s < 0:
        raise ProfileError(f"{source}: curves.overhead_s must be >= 0, got {prof.overhead_s}")
    if prof.host_step_s > prof.overhead_s:
        raise ProfileError(f"{source}: curves.host_step_s ({prof.host_step_s}) is part of curves.overhead_s "
                           f"({prof.overhead_s}) and cannot exceed it")
    return prof


def load_profile(path: str | Path) -> Profile:
    """Read a profile file (YAML or JSON)."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"{path}: profile file not found")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else load_yaml(text)
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: not a text file (expected a YAML or JSON profile)") from None
    except RecursionError:
        raise ProfileError(f"{path}: nested too deeply to be a profile") from None
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ProfileError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}{at}: {problem}") from None
    return profile_from_dict(data, str(path))
