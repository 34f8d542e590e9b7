"""vLLM's KV layout of a hybrid model: attention layers beside layers that hold a fixed state per
sequence (Gated DeltaNet: Qwen3-Next, Qwen3.5; Mamba2: Nemotron-H, Nemotron-3), as vLLM 0.32 lays
it out. Both kinds are a ``MambaSpec`` there (``vllm/v1/kv_cache_interface.py``: its page is
the state's shapes times their dtypes), so one layout serves them.

vLLM keeps one block pool for both kinds of layer (``vllm/v1/core/kv_cache_utils.py``,
``_get_kv_cache_groups_uniform_page_size``; ``vllm/platforms/interface.py``,
``_align_hybrid_block_size``):

1. Block size: a block of one attention layer must hold at least one linear layer's state, so
   the attention block is raised to the smallest multiple of the kernel alignment (the larger of
   the backend's smallest kernel block, 16, and the configured block size) whose page (tokens x
   one layer's K and V a token, per rank) is at least the state's page (the conv window and the
   recurrent state, per rank); the state's page is padded up to it.
2. Groups: the layers of each kind are split into groups of ``group_size`` layers: the smaller
   kind's count, or the larger's when it is less than 1.5 x the smaller (then the smaller kind is
   padded). One block of the pool holds one page of every layer of a group, so the pool has
   memory / (group_size x page) blocks, and each group has its own block table.
3. Requests: an attention group takes ceil(tokens / block_size) blocks, as a plain model's pool;
   a linear group (``mamba_cache_mode`` "none", which vLLM uses with prefix caching off) takes one
   block per request, its state, from the request's first allocation until it ends or is
   preempted (``MambaManager``: its block size is max_model_len).
4. With prefix caching on, vLLM runs ``mamba_cache_mode`` "align" (``MambaModelConfig.
   verify_and_update_config``) with the linear groups' block size set to the attention block
   size of rule 1 (``_align_hybrid_block_size``): the layout is the same, but a linear group
   keeps a state block at each block boundary a request's steps end on, and its hits, as
   ``sim.core.mamba_align`` models it (the prefill chunks cut at block boundaries: rule 10 of
   ``policies.vllm_v1``).

batchsim's pool then holds ``num_blocks`` blocks of ``block_size`` tokens for the attention
group, and each request holds ``state_groups`` blocks more (``sim.core.kv.StateBlockPool``),
or with prefix caching an ``AlignStatePool`` (``sim.core.mamba_align``). Not modelled: more than
one attention group (attention layers outnumbering the linear ones by 1.5 x or more), and
speculative decoding's extra state blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.cost.shape import ModelShape

KERNEL_BLOCK = 16        # the smallest kernel block of vLLM's CUDA attention backends (FlashAttention, FlashInfer)


@dataclass(frozen=True, slots=True)
class HybridLayout:
    """vLLM's layout of a hybrid model's KV cache on one rank (the module doc)."""

    block_size: int          # tokens a block, raised (rule 1)
    requested_block_size: int
    group_size: int          # layers a KV cache group (rule 2)
    attention_groups: int
    state_groups: int        # blocks a request holds for its linear layers' state (rule 3)
    attention_page_bytes: int    # one attention layer's K and V of one token, one rank
    state_page_bytes: int    # one linear layer's state of one sequence, one rank (unpadded)

    @property
    def page_bytes(self) -> int:
        """A block of one layer: block_size x attention_page_bytes (the state's page padded to it)."""
        return self.block_size * self.attention_page_bytes

    def num_blocks(self, capacity_tokens: int, num_attention_layers: int) -> int:
        """Blocks of the pool whose memory holds ``capacity_tokens`` tokens of the attention
        layers' KV: memory / (group_size x page) (rule 2), the attention layers padded to
        group_size."""
        return capacity_tokens * num_attention_layers // (self.group_size * self.attention_groups) // self.block_size


def vllm_hybrid_layout(model: ModelShape, kv_bytes_per_token: int, tensor_parallel: int, dtype_bytes: int,
                       block_size: int) -> HybridLayout:
    """The layout of ``model`` (``is_hybrid``) with ``kv_bytes_per_token`` of KV all ranks together
    (``Profile.kv_bytes_per_token``: the attention layers'), on ``tensor_parallel`` ranks, its
    weights in ``dtype_bytes``, and ``block_size`` configured. ValueError for what is not modelled."""
    t = tensor_parallel
    n_attn, n_lin = model.num_attention_layers, model.num_state_layers
    attention_page, rest = divmod(kv_bytes_per_token, t * n_attn)
    if rest or attention_page <= 0:
        raise ValueError(f"model {model.name!r}: {kv_bytes_per_token} KV bytes a token do not split evenly over "
                         f"{t} ranks and {n_attn} attention layers")
    conv, ssm = model.state_bytes_per_seq(dtype_bytes, t)
    state_page = conv + ssm
    alignment = max(KERNEL_BLOCK, block_size)
    needed = alignment * -(-state_page // (alignment * attention_page))
    needed = KERNEL_BLOCK * -(-needed // KERNEL_BLOCK)
    smaller, larger = min(n_attn, n_lin), max(n_attn, n_lin)
    group_size = larger if larger < 1.5 * smaller else smaller
    attention_groups = -(-n_attn // group_size)
    if attention_groups > 1:
        raise ValueError(f"model {model.name!r}: {n_attn} attention layers beside {n_lin} linear ones make "
                         f"{attention_groups} attention groups in vLLM's hybrid KV cache; batchsim models one")
    return HybridLayout(block_size=max(block_size, needed), requested_block_size=block_size, group_size=group_size,
                        attention_groups=attention_groups, state_groups=-(-n_lin // group_size),
                        attention_page_bytes=attention_page, state_page_bytes=state_page)
