"""SGLang 0.5.23's defaults by GPU memory (``sglang/srt/arg_groups/memory_hook.py``,
``handle_gpu_memory_settings`` and ``reserve_for_graph_mb``; ``cuda_graph_hook.py``'s
prefill capture sizes), for one GPU of ``PolicyContext`` (memory in MiB as
SGLang reads it):

- ``chunked_prefill_size``: < 20 GiB 2048; < 35 GiB 4096; < 60 GiB 4096;
  < 90 GiB 8192; < 160 GiB 8192; else 16384; unknown device (and CPU): 4096.
- the decode CUDA-graph batch: < 20 GiB 8; < 35 GiB 48 (160 at TP >= 4);
  < 60 GiB 32 (160); < 160 GiB 256 (512); else 512; at most max_running_requests.
- ``mem_fraction_static`` = round((memory - reserve) / memory, 3), the reserve
  (MiB) 512 + 1.5 x max(chunked_prefill_size (or max_prefill_tokens without
  chunking), 2048) + TP/8 x 1024 + 2 x the decode graph batch + 8 per prefill
  capture size (CUDA's breakable prefill graphs; none on AMD), at least
  10 GiB above 60 GiB of memory; unknown device: 0.95.

With DP attention (``data_parallel`` d > 1: SGLang's ``--tp d x t --dp d
--enable-dp-attention``), SGLang's TP size is the whole group's, d x t, in the
rules above, and ``reserve_for_graph_mb`` adds 3 x d x the decode graph batch
(4.5 x above a batch of 300) for the padding DP attention needs.

An MLA model (``context.mla``) reserves 1.5 GiB for its attention backend in place of
the prefill graphs' 8 MiB a capture size.

Assumed: one pipeline stage, no DeepEP or
multimodal input, post-capture KV sizing off (its default). Speculative decoding
changes none of these: ``handle_gpu_memory_settings`` runs before
``handle_speculative_decoding`` (which sets max_running_requests 48 when unset;
``policies.sglang`` rule 8), and its activation term counts draft tokens only for
a disaggregated decode instance.
"""

from __future__ import annotations

from sim.core.policy import PolicyContext

MIB = 1024**2
GIB_MIB = 1024


def prefill_capture_sizes(max_bs: int) -> list[int]:
    """``generate_prefill_cuda_graph_batch_sizes``: the token counts the prefill graphs capture."""
    sizes = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256)) + list(range(4608, max_bs + 1, 512)))
    return [s for s in sizes if s <= max_bs]


def _tier(context: PolicyContext, tp: int) -> tuple[bool, int, int]:
    """(device known, default chunked_prefill_size, default decode graph batch) by GPU memory."""
    device = context.device.lower()
    mem = context.memory_bytes_per_gpu / MIB
    known = mem > 0 and not device.startswith("cpu")
    if not known:
        return False, 4096, 160
    if mem < 20 * GIB_MIB:
        return True, 2048, 8
    if mem < 35 * GIB_MIB:
        return True, 4096, 48 if tp < 4 else 160
    if mem < 60 * GIB_MIB:
        return True, 4096, 32 if tp < 4 else 160
    if mem < 160 * GIB_MIB:
        return True, 8192, 256 if tp < 4 else 512
    return True, 16384, 512


def decode_graph_bs(context: PolicyContext, max_running_requests: int | None, data_parallel: int = 1) -> int:
    """The decode CUDA graphs' largest batch (``cuda_graph_config.decode.max_bs``), at most the
    server's max_running_requests (all DP ranks' together, as the server argument is given)."""
    _, _, graph_bs = _tier(context, context.world_size * data_parallel)
    return graph_bs if max_running_requests is None else min(graph_bs, max_running_requests)


def engine_defaults(context: PolicyContext, chunked_prefill_size: int | None, max_prefill_tokens: int,
                    max_running_requests: int | None, data_parallel: int = 1) -> tuple[int, float]:
    """(chunked_prefill_size, -1 for off; mem_fraction_static) as SGLang resolves them, before DP
    attention divides the chunk (``policies.sglang`` rule 10)."""
    device = context.device.lower()
    mem = context.memory_bytes_per_gpu / MIB
    tp = context.world_size * data_parallel
    known, chunk, graph_bs = _tier(context, tp)
    if chunked_prefill_size is not None:
        chunk = chunked_prefill_size
    if not known:
        return chunk, 0.95
    if max_running_requests is not None:
        graph_bs = min(graph_bs, max_running_requests)
    activation_tokens = max(chunk if chunk > 0 else max_prefill_tokens, 2048)
    reserve = 512 + activation_tokens * 1.5 + tp / 8 * 1024 + graph_bs * 2
    if data_parallel > 1:                   # reserve_for_graph_mb: DP attention's padding
        reserve += graph_bs * data_parallel * 3 + (graph_bs * data_parallel * 1.5 if graph_bs > 300 else 0)
    if context.mla:                         # reserve_for_graph_mb: the MLA backends' overhead
        reserve += 1.5 * 1024
    elif not any(name in device for name in ("amd", "mi300", "mi325", "mi350", "mi355", "instinct")):
        reserve += len(prefill_capture_sizes(chunk)) * 8
    if mem > 60 * GIB_MIB:
        reserve = max(reserve, 10 * GIB_MIB)
    return chunk, round((mem - reserve) / mem, 3)
