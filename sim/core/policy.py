"""The contract between a policy and the loop: ``Policy``, the ``PolicyContext``
it is built with, and the ``StretchShape`` it describes to the fast path.

A policy is pure scheduling logic: ``schedule(state, now_s) -> Batch | Idle``.
It never sleeps, reads no clock of its own and imports neither SimPy nor
torch. It may admit and preempt requests and grow their block tables through
``state`` (that is how nano-vllm and vLLM schedule too); ``state.commit``
does all token accounting after the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Protocol, Sequence

from sim.core.batch import Batch, Idle
from sim.core.request import Request
from sim.core.state import SchedulerState


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What an engine's defaults depend on besides the policy's own config:
    the model's context length and the device (and, for a profile measured on
    a serving engine, that engine's knobs) from the run's profile.

    Without a profile the device is unknown (``memory_bytes_per_gpu`` 0), and
    an engine picks its defaults for the smallest devices it distinguishes.
    """

    max_model_len: int
    device: str = "unknown"                                    # the profile's device name
    memory_bytes_per_gpu: int = 0                              # 0: unknown
    world_size: int = 1                                        # tensor-parallel ranks
    engine: Mapping[str, Any] = field(default_factory=dict)    # the measured server's knobs (Profile.engine)
    # The device is a CPU: a device named so, or a profile batchsim measured on a CPU (named by
    # its CPU model, "AMD EPYC", with provenance.device "cpu"). vLLM's CPU platform runs
    # synchronously (vllm_v1's async_scheduling).
    cpu: bool = False
    data_parallel: int = 1          # attention data-parallel ranks of one deployment (profile.data_parallel_size)
    mla: bool = False               # the model's attention is multi-head latent attention (SGLang's reserve)


class KvMemory(NamedTuple):
    """How an engine sizes its KV pool from the device memory (per GPU), when
    it is not vLLM's rule (``Policy.kv_memory`` None: ``server.
    gpu_memory_utilization`` x memory - weights - activations).

    share_of "total": fraction x memory - weights - activations (vLLM's rule with
        the engine's own fraction);
    share_of "static": fraction x memory - weights; activations and CUDA graphs
        live in the rest (SGLang's ``mem_fraction_static``);
    share_of "free": fraction x (memory - weights - activations) (TensorRT-LLM's
        ``free_gpu_memory_fraction``, LMDeploy's ``cache_max_entry_count``).
    """

    fraction: float
    share_of: str                 # "total" | "static" | "free"


KV_MEMORY_SHARES = ("total", "static", "free")


class PrefixSwitch(NamedTuple):
    """The config knob that turns a policy's prefix cache on or off, under the
    engine's own name (``Policy.prefix_switch``): ``on`` is the value that
    means "cache" (SGLang's ``disable_radix_cache`` says it the other way
    round: ``PrefixSwitch("disable_radix_cache", on=False)``)."""

    knob: str
    on: bool = True


class EngineKnob(NamedTuple):
    """What an engine has in place of a ``server`` field its policy does not read
    (``Policy.server_knobs``): ``knob``, the policy's own config field that means it
    (SGLang's ``page_size`` for ``server.block_size``), or None where the engine has no
    such knob; ``note`` says in a few words what the engine does instead. A workload
    that sets the field is refused, naming ``knob`` (``policies.config.check_server_fields``)."""

    knob: str | None
    note: str


class PolicyError(RuntimeError):
    """A policy broke the contract below while a run was going on: it made no
    progress, returned an empty batch, or (``sim.loop.stretch.StretchMismatch``)
    its fast-path declaration does not hold. The message names the policy and
    what it did; ``sim run`` prints it as one line and exits 1."""


class StretchShape(NamedTuple):
    """The step a policy repeats while nothing changes (``Policy.stretch_shape``),
    as the loop's fast path (``sim.loop.stretch``) prices and logs it."""

    decode_context: int    # the KV tokens the first step's decodes attend over, summed
    context_growth: int    # how much that sum grows from one step to the next
    chunk_tokens: int = 0  # case (c): the prefilling request's chunk in every full step (0: nobody prefills)


class Policy(Protocol):
    """Chooses the work of the next iteration, and declares what the rest of
    batchsim needs to know about it (readers never guess knob names).

    Built as ``PolicyClass(config, context)``, one object per replica (a
    policy may keep state of its own between calls); raises ValueError for a
    config the engine would refuse at start-up.

    schedule(state, now_s): return the Batch to run now (at least one item),
    or Idle when nothing can run (Idle.wake_at_s asks to be called again at
    that simulated/wall time even if no request arrives). Raises nothing on
    normal input. The loop raises ``PolicyError`` naming the policy for an
    empty Batch, and for decisions that make no progress (no token computed,
    no request admitted, finished or arrived) over ``sim.loop.server.
    MAX_IDLE_DECISIONS`` in a row, or ``SPIN_DECISIONS`` in a row within
    ``SPIN_S`` of simulated time.

    knobs(): every config field, in declaration order, with the value that
    runs (defaults filled in), as a result records it.

    ``decode_stretch``: True if the policy keeps the invariant of the loop's
    fast path (``sim.loop.stretch``, cases (a) and (b)): with nothing waiting
    and every running request caught up it decodes them all; after a
    decode-only step that admitted, preempted and finished nobody it returns
    the same requests again, one token further on; both until something
    arrives, finishes or fails to get a block. Say why beside the flag; False
    steps every iteration. The flag is checked, not trusted: a run with
    ``check_stretch`` (the tests run every policy so) steps every iteration
    and fails on the first step that differs from the one the fast path
    would have run.

    ``chunk_stretch``: True if the policy also keeps case (c) of
    ``sim.loop.stretch``: with one running request prefilling and every other
    one caught up, it decodes them all and gives the prefilling request a
    chunk of the rest of its token budget (the budget full, nobody admitted),
    step after step, until the chunk that completes the prompt; its
    ``stretch_shape`` says how large that chunk is. Say why beside the flag.

    max_request_tokens(num_blocks, block_size): the most tokens (prompt +
    max_tokens) of one request this policy can ever schedule, alone, on an
    empty pool of ``num_blocks`` blocks of ``block_size`` tokens, its budgets
    and reservations included (SGLang's PrefillAdder wants prompt + max_tokens
    + one page below the pool). The run refuses at start-up a max_model_len
    above it, as vLLM refuses one its KV cache cannot hold, so no request that
    passes the context check waits forever. Default: the whole pool.

    unread_knobs(config): read from the class, before any policy is built:
    the knobs of ``config`` that its other knobs leave unread, each with the
    reason ("with attention flashinfer, which chunks prefills"); a workload
    that sets one gets a warning that it is ignored, as TGI's router warns.
    Default: none.

    stretch_shape(running, live_context, num_live, prefilling): with
    ``decode_stretch``, the shape of the step the policy repeats from here:
    ``running`` is ``state.running``, of which ``num_live`` requests decode,
    attending over ``live_context`` tokens in all; ``prefilling`` is the one
    running request still prefilling (case (c) of ``sim.loop.stretch``), or
    None. Return None when this state does not repeat (the loop steps it).
    """

    # Every declaration but max_num_seqs has a safe default in ``policies.base.PolicyBase``: a
    # policy that subclasses it declares only what differs.
    token_budget: int | None       # most tokens one step computes; sizes the activation reserve as vLLM's
    #                                profiling run does (None: no budget, ``DEFAULT_ACTIVATION_TOKENS``)
    max_num_seqs: int              # most requests running at once (no default: every policy sets it)
    holds_batch: bool              # True: a batch runs to completion and nobody joins it (static, dynamic):
    #                                while any request runs, schedule() steps the running group, whatever waits
    max_prompt_tokens: int | None  # longer prompts are refused at arrival (None: only the context limits)
    refuses_by_prompt: bool        # True: refused at arrival for the pool (kv_pool) only if the prompt's blocks
    #                                exceed it above the watermark (vLLM v0's AllocStatus.NEVER); a recompute
    #                                that outgrows it later is cut short (SchedulerState.cut_short). False: if
    #                                prompt + max_tokens exceeds the whole pool (reserved at admission, or
    #                                vllm_v1, which keeps no watermark back from a lone request)
    clamps_max_tokens: bool        # True: a max_tokens the context cannot hold is cut to what it leaves, and
    #                                only a prompt >= max_model_len or a max_tokens > it is refused (vLLM 0.32's
    #                                OpenAI server); False: prompt + max_tokens > max_model_len is refused
    num_reserved_blocks: int       # blocks of the pool that never hold KV (vLLM v1's null block: 1)
    decode_stretch: bool
    chunk_stretch: bool
    pipelined: bool                # True: schedule() chooses a step while the one before it runs and sees it
    #                                in ``state.pending`` (vLLM's async scheduling; sim.loop.server's
    #                                _serve_pipelined, SchedulerState.commit_pipelined); no fast path
    overlap_loop: bool             # with pipelined: SGLang's overlap loop, whose outputs are committed by
    #                                SchedulerState.commit_overlap (a retracted request's output dropped)
    pipelined_knob: str | None     # the knob of the config that turns the pipelined loop off (live runs)
    pipelined_off: Any             # the value of that knob that turns it off: False (vLLM's async_scheduling,
    #                                SGLang's enable_overlap) or True (TensorRT-LLM's disable_overlap_scheduler)
    kv_pool_class: type            # the KV pool each replica gets, a sim.core.kv.KVPool: BlockManager, a
    #                                caching pool (sim.core.prefix, sim.core.radix: its ``caching`` says so)
    block_size: int | None         # the engine's KV page in tokens where the policy has it as a knob (SGLang's
    #                                page_size, TensorRT-LLM's tokens_per_block); None: server.block_size
    kv_memory: KvMemory | None     # how the engine sizes its KV pool; None: vLLM's rule (KvMemory)
    # Read from the class, before any policy is built (the config's checks):
    prefix_switch: PrefixSwitch | None   # the knob of its prefix cache; None: it has none
    full_batch_knob: str | None    # the knob that says how many requests a batch waits for before it
    #                                launches while more may arrive (static's batch_size); None: it runs
    #                                what waits, so a closed loop or a session can never starve it
    always_chunks: bool            # True: it always chunks prefills (vLLM's enable_chunked_prefill: true is
    #                                accepted, false refused)
    chunked_variant: str | None    # the kind that runs this scheduler with vLLM's enable_chunked_prefill
    #                                true (vllm: sarathi); false keeps this one
    kernel_tables: str             # whose measured kernel tables price it (profile.kernels): vllm, sglang
    #                                or trtllm (sim.cost.aic.ENGINES)
    dp_router: str | None          # the router of its data-parallel ranks (profile.data_parallel_size > 1;
    #                                sim.loop.feed): vllm_dp, sglang_dp; None: its data parallelism is not
    #                                modelled (refused)
    dp_pads_prefill: bool          # True: DP ranks are padded to the largest under the CUDA graphs whatever
    #                                the step holds (vLLM); False: only decode-only steps (SGLang; sim.loop.dp)
    dp_graph_tokens: int | None    # the largest step its CUDA graphs run, up to which DP ranks are padded;
    #                                None: vLLM's max_cudagraph_capture_size (sim.run.runner.cuda_graph_tokens)
    server_knobs: Mapping[str, EngineKnob]   # the ``server`` fields it does not read, each with the knob of
    #                                its own that means it (or none): a workload setting one is refused

    def max_request_tokens(self, num_blocks: int, block_size: int) -> int: ...

    @staticmethod
    def unread_knobs(config: Any) -> Mapping[str, str]: ...

    def knobs(self) -> dict[str, Any]: ...

    def schedule(self, state: SchedulerState, now_s: float) -> Batch | Idle: ...

    def stretch_shape(self, running: Sequence[Request], live_context: int, num_live: int,
                      prefilling: Request | None) -> StretchShape | None: ...
