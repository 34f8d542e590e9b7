"""Tensor-parallel collectives and the per-step costs that do not shrink with TP.

Besides its share of the math (``sim.cost.roofline``), every step on ``t`` GPUs pays:

- collectives, each a latency plus a bandwidth term over the GPU-to-GPU link
  (NVLink, or PCIe where there is none): Megatron tensor parallelism puts two
  all-reduces of the ``T x hidden`` activations in every decoder layer (after
  the attention output projection and after the MLP down projection), one
  after the vocab-parallel embedding, and gathers the sampled rows' logits
  (``rows x vocab / t`` per rank) to the rank that samples; with expert
  parallelism (MoE, EP degree = t) each MoE layer's MLP all-reduce is replaced
  by two all-to-alls, dispatch and combine (``alltoall_s``);
- a floor per decoder layer: about ten kernels a layer, each paying launch,
  ramp-up and tail time however small its shard is;
- the engine's host work: per step (schedule, prepare inputs, sample, process
  outputs), an extra per step when ``t > 1`` (the step's inputs sent to the
  worker processes), and per scheduled sequence (its block table, sampling
  and output objects). The engine generation sets these (``ENGINES``). A
  synchronous loop's terms are host work that a pipelined loop runs beside the
  forward pass before (``Profile.host_s``: the step costs the larger of the two
  there, sim.loop.server.pipelined_start_s); an async loop's (``overlapped``)
  are what its overlap left between two forward passes, on the device's path.

``TpStepCosts`` evaluates them for one (model, GPU, t, dtype, engine), and
``sim.cost.roofline.Roofline`` adds them to its sharded math; their knobs are
fields of ``sim.cost.roofline.Efficiency`` (so of every analytic profile's
``efficiency`` mapping); ``terms`` names every number with its source. The
values are fitted or sourced in ``calibrate/profiles/README.md`` ("Checked
against public vLLM runs").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sim.cost.presets import GpuSpec
from sim.cost.profile import ModelShape

ALLREDUCES_PER_LAYER = 2       # attention o_proj and MLP down_proj outputs (Megatron TP)
EMBEDDING_ALLREDUCES = 1       # vocab-parallel embedding: each rank holds vocab / t rows
# The LM head is charged for min(tokens, MAX_SAMPLED_ROWS) rows, as sim.cost.roofline does.
MAX_SAMPLED_ROWS = 256


@dataclass(frozen=True, slots=True)
class EngineOverhead:
    """Host (CPU) work of one serving-engine generation, in seconds."""

    name: str
    step_s: float          # per step, any batch
    tp_step_s: float       # extra per step when tensor_parallel > 1
    per_seq_s: float       # per sequence scheduled in the step (prefill chunk or decode)
    source: str
    # True: measured on an async loop, so the terms are the gap its overlap leaves between two
    # forward passes (charged on the device's path, never hidden again); False: a synchronous
    # loop's host work, which a pipelined loop hides behind the forward pass (Profile.host_s).
    overlapped: bool = False


ENGINES: dict[str, EngineOverhead] = {
    # Fitted on the Argonne LLM-Inference-Bench vLLM runs (vLLM 0.5.x, offline
    # LLM.generate, CUDA graphs, A100 and H100); see calibrate/profiles/README.md.
    "vllm-v0": EngineOverhead(
        "vllm-v0", step_s=1.5e-3, tp_step_s=0.95e-3, per_seq_s=54e-6,
        source="fitted on public vLLM 0.5 runs (argonne-lcf/LLM-Inference-Bench); the vLLM team measured "
               "62% of Llama-3-8B/H100 serving time as CPU work in v0.5.3 (blog.vllm.ai 2024-09-05); the "
               "per-step metadata broadcast to TP workers: vllm-project/vllm#4440, #5775"),
    # V1 engine, synchronous scheduling: a busy-loop engine core with a
    # persistent batch; TP inputs go to workers through a shared-memory queue.
    "vllm-v1": EngineOverhead(
        "vllm-v1", step_s=0.5e-3, tp_step_s=0.1e-3, per_seq_s=20e-6,
        source="not fitted here: a 5-6 ms gap between decodes at batch 256 (Llama-2-7B, early V1, "
               "vllm-project/vllm#10634) gives ~20 us per sequence; shared-memory broadcast to TP workers "
               "(vllm-project/vllm#9856)"),
    # V1 with async scheduling: the next step is scheduled while the GPU runs
    # this one, so only the unoverlapped gap remains.
    "vllm-v1-async": EngineOverhead(
        "vllm-v1-async", step_s=0.2e-3, tp_step_s=0.05e-3, per_seq_s=1e-6,
        source="not fitted here: a 150-300 us gap between decodes at batch 256 with scheduling overlapped "
               "(vllm-project/vllm#10634, #11133; async scheduling landed in #19970, full overlap in #23569)",
        overlapped=True),
}
DEFAULT_ENGINE = "vllm-v0"

# Fitted with the engine terms above (calibrate/profiles/README.md); sim.cost.roofline.Efficiency's defaults.
LAYER_FIXED_S = 25e-6          # per decoder layer per forward pass: the kernels' launch/ramp/tail floor
INTERCONNECT_EFFICIENCY = 0.20  # achieved all-reduce bus bandwidth / link peak at serving message sizes
# vLLM's paged-attention decode kernel runs on CUDA cores, not tensor cores, and works
# per query head: ~1.3% of the tensor-core peak (~20% of the FP32 CUDA-core peak on both
# A100 and H100).
ATTN_DECODE_FLOPS = 0.013


def engine_overhead(name: str | EngineOverhead) -> EngineOverhead:
    """The ``ENGINES`` entry for ``name`` (an ``EngineOverhead`` passes through);
    ValueError naming the known ones."""
    if isinstance(name, EngineOverhead):
        return name
    eng = ENGINES.get(name) if isinstance(name, str) else None
    if eng is None:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}")
    return eng


def allreduce_s(nbytes: Any, tp: int, link_bytes_s: float, latency_s: float, efficiency: float) -> Any:
    """One ring all-reduce of ``nbytes`` per rank over ``tp`` ranks.

    A ring moves 2 (tp - 1) / tp of the buffer through every rank's link
    (reduce-scatter, then all-gather), at ``efficiency`` of the link peak.
    """
    if tp <= 1:
        return np.zeros_like(np.asarray(nbytes, dtype=float))
    b = np.asarray(nbytes, dtype=float)
    return latency_s + 2 * (tp - 1) / tp * b / (link_bytes_s * efficiency)


def alltoall_s(nbytes: Any, ep: int, link_bytes_s: float, latency_s: float, efficiency: float) -> Any:
    """One all-to-all over ``ep`` ranks of ``nbytes`` per rank (``tokens x k x hidden x act
    bytes`` for an MoE dispatch or combine): (ep - 1) / ep of it leaves each rank over its link,
    plus the call's latency."""
    if ep <= 1:
        return np.zeros_like(np.asarray(nbytes, dtype=float))
    b = np.asarray(nbytes, dtype=float)
    return latency_s + (ep - 1) / ep * b / (link_bytes_s * efficiency)


def gather_s(nbytes_total: Any, tp: int, link_bytes_s: float, latency_s: float, efficiency: float) -> Any:
    """Gather a buffer of ``nbytes_total`` (all ranks' shards together) to one rank:
    (tp - 1) / tp of it crosses the receiving rank's link."""
    if tp <= 1:
        return np.zeros_like(np.asarray(nbytes_total, dtype=float))
    b = np.asarray(nbytes_total, dtype=float)
    return latency_s + (tp - 1) / tp * b / (link_bytes_s * efficiency)


class TpStepCosts:
    """The terms that sim.cost.roofline's sharded math leaves out, for one configuration.

    ``comm_s(tokens)``: collectives of a step computing ``tokens`` tokens;
    ``layers_fixed_s``: the per-layer kernel floor of a forward pass (GPU time,
    charged with the linear layers); ``fixed_step_s``: the engine's host work
    per step and its TP extra; ``per_seq_s``: per scheduled sequence.
    """

    def __init__(self, model: ModelShape, gpu: GpuSpec, tensor_parallel: int, dtype_bytes: int,
                 engine: str | EngineOverhead = DEFAULT_ENGINE, layer_fixed_s: float = LAYER_FIXED_S,
                 interconnect_efficiency: float = INTERCONNECT_EFFICIENCY, *, expert_parallel: bool = False,
                 data_parallel: int = 1) -> None:
        if not 0 < interconnect_efficiency <= 1:
            raise ValueError(f"interconnect_efficiency must be in (0, 1], got {interconnect_efficiency!r}")
        if layer_fixed_s < 0:
            raise ValueError(f"layer_fixed_s must be >= 0, got {layer_fixed_s!r}")
        self.model, self.gpu, self.tp, self.dtype_bytes = model, gpu, tensor_parallel, dtype_bytes
        self.engine = engine_overhead(engine)
        self.layer_fixed_s = layer_fixed_s
        self.interconnect_efficiency = interconnect_efficiency
        # one after each mixer and each MLP: ALLREDUCES_PER_LAYER a layer, one a single-block layer (Nemotron-H)
        blocks = model.num_sublayers if model.num_ffn_layers else ALLREDUCES_PER_LAYER * model.num_layers
        self.allreduce_calls = blocks + EMBEDDING_ALLREDUCES if tensor_parallel > 1 else 0
        # Expert parallelism: an MoE layer's experts are whole on each GPU, its tokens sent to
        # them and back (2 all-to-alls) instead of the MLP all-reduce; attention stays TP.
        self.expert_parallel = expert_parallel and tensor_parallel > 1
        self.alltoall_calls = 2 * model.num_moe_layers if self.expert_parallel else 0
        if self.expert_parallel:
            self.allreduce_calls -= model.num_moe_layers
        # Data parallelism (d > 1): an MoE layer's tokens of all d ranks meet at its experts. vLLM's
        # default all2all backend (allgather_reducescatter) all-gathers the d ranks' hidden states
        # before the experts and reduce-scatters their outputs after: 2 collectives a layer, each
        # moving (d - 1) / d of the d ranks' tokens x hidden through a GPU's link.
        self.data_parallel = data_parallel
        self.dp_calls = 2 * model.num_moe_layers if data_parallel > 1 else 0
        if self.dp_calls and self.expert_parallel:
            self.alltoall_calls = 0                  # the gathers take the dispatch's place
        self.fixed_step_s = self.engine.step_s + (self.engine.tp_step_s if tensor_parallel > 1 else 0.0)
        # a single-block layer (Nemotron-H: a mixer or an MLP) runs about half a layer's kernels
        self.layers_fixed_s = (model.num_sublayers / 2 if model.num_ffn_layers else model.num_layers) * layer_fixed_s
        self.per_seq_s = self.engine.per_seq_s

    def comm_s(self, num_tokens: Any) -> Any:
        """All-reduces of the ``T x hidden`` activations plus the logits gather."""
        tokens = np.asarray(num_tokens, dtype=float)
        m, g, eff = self.model, self.gpu, self.interconnect_efficiency
        dp = self.dp_comm_s(tokens)
        if self.tp <= 1:
            return dp
        act_bytes = tokens * m.hidden_size * self.dtype_bytes
        logit_bytes = np.minimum(tokens, MAX_SAMPLED_ROWS) * m.vocab_size * self.dtype_bytes
        comm = (self.allreduce_calls * allreduce_s(act_bytes, self.tp, g.interconnect_bytes_s,
                                                   g.interconnect_latency_s, eff)
                + gather_s(logit_bytes, self.tp, g.interconnect_bytes_s, g.interconnect_latency_s, eff))
        if self.alltoall_calls:
            comm = comm + self.alltoall_calls * alltoall_s(self.alltoall_bytes(tokens), self.tp,
                                                           g.interconnect_bytes_s, g.interconnect_latency_s, eff)
        return comm + dp

    def dp_comm_s(self, num_tokens: Any) -> Any:
        """The MoE layers' gathers across the data-parallel ranks when each runs ``num_tokens``
        tokens (0 without data parallelism)."""
        tokens = np.asarray(num_tokens, dtype=float)
        if not self.dp_calls:
            return np.zeros_like(tokens)
        d, g = self.data_parallel, self.gpu
        return self.dp_calls * gather_s(d * tokens * self.model.hidden_size * self.dtype_bytes, d,
                                        g.interconnect_bytes_s, g.interconnect_latency_s, self.interconnect_efficiency)

    def alltoall_bytes(self, num_tokens: Any) -> Any:
        """Bytes per rank of one MoE dispatch (or combine): tokens x k x hidden x activation bytes."""
        m = self.model
        return np.asarray(num_tokens, dtype=float) * m.num_experts_per_tok * m.hidden_size * self.dtype_bytes

    def decode_step_message_bytes(self, num_seqs: int) -> int:
        """Bytes per rank of one all-reduce in a decode step of ``num_seqs`` sequences."""
        return num_seqs * self.model.hidden_size * self.dtype_bytes

    def prefill_chunk_message_bytes(self, chunk_tokens: int) -> int:
        """Bytes per rank of one all-reduce in a prefill chunk of ``chunk_tokens`` tokens."""
        return chunk_tokens * self.model.hidden_size * self.dtype_bytes

    def terms(self) -> dict[str, Any]:
        """Every term, named, for a profile's ``efficiency`` mapping."""
        g, e = self.gpu, self.engine
        return {
            "engine": e.name,
            "engine_step_s": e.step_s,
            "engine_tp_step_s": e.tp_step_s if self.tp > 1 else 0.0,
            "engine_per_seq_s": e.per_seq_s,
            "engine_source": e.source,
            "layer_fixed_s": self.layer_fixed_s,
            "allreduce_calls_per_step": self.allreduce_calls,
            "allreduce_latency_s": g.interconnect_latency_s if self.tp > 1 else 0.0,
            **({"alltoall_calls_per_step": self.alltoall_calls} if self.alltoall_calls else {}),
            "interconnect_link": getattr(g, "interconnect_kind", "unknown"),
            "interconnect_efficiency": self.interconnect_efficiency,
            "tp_costs_source": "sim.cost.collectives; fitted and checked in calibrate/profiles/README.md "
                               "('Checked against public vLLM runs')",
        }
