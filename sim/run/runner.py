"""Run a workload: config -> requests -> SimPy servers -> RunResult (data only).

Nothing here writes files; ``sim.results.folder`` does, for the CLI.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import sys
import time
import warnings
from array import array
from typing import Any, Callable, Iterator, NamedTuple, Sequence, TextIO

import numpy as np
import pandas as pd
import simpy

from policies import POLICIES, make_policy
from policies.config import kinds_where, policy_knobs
from sim.base.heap import trim_heap, tune_heap
from sim.core.batch import Batch, StepResult
from sim.core.logs import StepLog, TokenLog
from sim.core.policy import KvMemory, Policy, PolicyContext, PolicyError
from sim.core.request import REJECT_REASONS, Request
from sim.core.speculative import Speculation
from sim.core.state import SchedulerState
from sim.cost.profile import DEFAULT_ACTIVATION_TOKENS, FORMAT_VERSION, Profile, ProfileError, load_profile
from sim.loop.feed import ROUTERS, ClientPool, SessionFeed, feed, feed_capped
from sim.loop.server import Executor, Server, SimExecutor
from sim.results.metrics import Values, itl_values, step_totals, summarize_logs
from sim.results.result import RunLogs, RunResult
from sim.results.runfiles import RunFilesProcess
from sim.results.table import RequestTable
from sim.run.config import ConfigError, WorkloadConfig
from workloads.generate import RequestSpecs, generate


OnStep = Callable[[Server], Callable[[float, Batch, StepResult], None] | None]


def build_profile(cfg: WorkloadConfig) -> Profile:
    """The workload's profile: a file, the measured kernel tables of the policy's engine
    (``profile.kernels``), or the analytic roofline of a preset pair."""
    p = cfg.profile
    if p.path is not None:
        try:
            return load_profile(cfg.resolve_path(p.path))
        except ProfileError as exc:
            raise ConfigError(f"{cfg.source}: field 'profile.path': {exc}") from None
    from sim.cost.roofline import preset_profile
    model = read_model_config(cfg) if _is_config_path(p.model) else p.model
    if p.kernels is not None:
        return build_kernel_profile(cfg, model)
    if isinstance(model, str) and "/" in model:
        model = wheel_model_config(cfg, model)
    try:
        return preset_profile(model, p.gpu, tensor_parallel=p.tensor_parallel, dtype=p.dtype, engine=p.engine,
                              weight_dtype=p.weight_dtype, kv_cache_dtype=p.kv_cache_dtype,
                              expert_parallel=p.enable_expert_parallel, data_parallel=p.data_parallel_size)
    except ValueError as exc:
        raise ConfigError(f"{cfg.source}: field 'profile': {exc}") from None


def kernel_engine(cfg: WorkloadConfig) -> str:
    """Whose kernel tables price the policy (``Policy.kernel_tables``: vLLM's unless the
    policy is another engine's)."""
    from policies import POLICIES
    return POLICIES[cfg.policy.kind][1].kernel_tables


def build_kernel_profile(cfg: WorkloadConfig, model: str | dict[str, Any]) -> Profile:
    """``sim.cost.kernels.kernel_profile`` of the workload's profile section, with the host
    terms of the policy's engine; ConfigError naming the field for anything the tables lack."""
    from sim.cost.kernels import KernelsError, KernelSpec, host_terms, kernel_profile
    p = cfg.profile
    engine = kernel_engine(cfg)
    spec = KernelSpec(model=model, gpu=p.gpu, engine=engine, tensor_parallel=p.tensor_parallel, dtype=p.dtype,
                      weight_dtype=p.weight_dtype, kv_cache_dtype=p.kv_cache_dtype,
                      expert_parallel=p.enable_expert_parallel, data_parallel=p.data_parallel_size,
                      engine_version=None if p.engine_version is None else str(p.engine_version),
                      moe_a2a=None if p.moe_a2a_backend == "allgather_reducescatter" else p.moe_a2a_backend)
    generation = p.engine
    wanted = async_scheduling_of(cfg)
    if wanted is None and p.data_parallel_size > 1:
        wanted = False               # data parallelism: the synchronous loop (sim.loop.dp)
    if wanted or (wanted is None and hasattr(cfg.policy, "async_scheduling")):
        # vLLM's async host terms (on a GPU, unset means on): what its host work leaves unhidden
        # behind the forward pass, fitted on public runs served with --async-scheduling
        # (sim.cost.kernels.HOST_TERMS).
        generation = "vllm-v1-async"
    try:
        return kernel_profile(spec, host_terms(engine, generation))
    except (KernelsError, ValueError) as exc:
        raise ConfigError(f"{cfg.source}: field 'profile' (kernels: {p.kernels}): {exc}") from None


def wheel_model_config(cfg: WorkloadConfig, model_id: str) -> dict[str, Any]:
    """A Hugging Face id's config from the aiconfigurator-core wheel's bundled configs."""
    from sim.cost import aic
    try:
        return aic.model_config(model_id)
    except aic.KernelsError as exc:
        raise ConfigError(f"{cfg.source}: field 'profile.model': {model_id!r} is not a preset; as a Hugging Face "
                          f"id it resolves through the wheel's bundled configs: {exc}") from None


def _is_config_path(model: Any) -> bool:
    """``profile.model`` names a config.json file (any name ending in .json), not a preset."""
    return isinstance(model, str) and model.lower().endswith(".json")


def read_model_config(cfg: WorkloadConfig) -> dict[str, Any]:
    """The HF config.json that ``profile.model`` names, relative to the workload file;
    ConfigError naming the field for a missing, unreadable or non-mapping file. The
    config's name defaults to the file's folder (HF's repo/config.json layout)."""
    path = cfg.resolve_path(cfg.profile.model)
    where = f"{cfg.source}: field 'profile.model'"
    if not path.is_file():
        raise ConfigError(f"{where}: config file {path} not found (give a preset name, an HF config mapping, "
                          f"or the path of a config.json relative to the workload file)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: {path} is not valid JSON (line {exc.lineno}, column {exc.colno}): "
                          f"{exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {path} must hold a JSON object of config fields, got {type(data).__name__}")
    if not (data.get("name") or data.get("_name_or_path")):
        data = {**data, "name": path.parent.name if path.name == "config.json" else path.stem}
    return data


def resolve_server(cfg: WorkloadConfig, profile: Profile) -> WorkloadConfig:
    """``cfg`` with the server facts it leaves unset taken from the server the
    profile was measured on (``profile.engine``: block_size, max_model_len,
    num_gpu_blocks, the null block included), when the profile says. A pool
    given in other blocks keeps its tokens."""
    eng = profile.engine or {}
    given = cfg.raw.get("server") if isinstance(cfg.raw.get("server"), dict) else {}
    updates: dict[str, int] = {}
    if given.get("block_size") is None and eng.get("block_size"):
        updates["block_size"] = int(eng["block_size"])
    if given.get("max_model_len") is None and eng.get("max_model_len"):
        updates["max_model_len"] = int(eng["max_model_len"])
    if given.get("num_blocks") is None and eng.get("num_gpu_blocks") and eng.get("block_size"):
        block_size = updates.get("block_size", cfg.server.block_size)
        updates["num_blocks"] = int(eng["num_gpu_blocks"]) * int(eng["block_size"]) // block_size
    if not updates:
        return cfg
    return dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, **updates))


def max_model_len_of(cfg: WorkloadConfig, profile: Profile) -> int:
    """The context the server serves: ``server.max_model_len`` if set (at most the
    model's, as vLLM checks at start-up), else the model's."""
    s = cfg.server
    context = profile.model.max_position_embeddings
    if s.max_model_len is not None and s.max_model_len > context:
        # vLLM refuses this at start-up too (unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1): positions past
        # the trained context give garbage, and a simulated server must not take what a real one won't
        raise ConfigError(f"{cfg.source}: field 'server.max_model_len' ({s.max_model_len:,}) is longer than the "
                          f"model's context ({profile.model.name}: max_position_embeddings {context:,}); "
                          f"set server.max_model_len <= {context:,} or leave it out")
    return s.max_model_len or context


def drafter_share(capacity: int, profile: Profile, spec) -> int:
    """The KV tokens left when an EAGLE/MTP proposer of d layers is loaded beside the target's L:
    vLLM loads its weights before the memory profiling run (priced as d / L of the decoder
    layers' weights, the embedding and LM head shared) and gives its attention layers KV of their
    own (every token cached in L + d layers instead of L): (capacity x kv - drafter weights) x L /
    ((L + d) x kv). Unchanged without an on-device proposer."""
    if spec is None or not spec.on_device or not spec.num_speculative_tokens or capacity <= 0:
        return capacity
    m, kv = profile.model, profile.kv_bytes_per_token
    layers, d = m.num_layers, spec.draft_layers
    body = profile.weight_bytes * (1.0 - m.embed_params / m.num_params)     # the decoder layers' bytes
    left = capacity * kv - body * d / layers
    return max(0, int(left * layers // ((layers + d) * kv)))


def kv_blocks(cfg: WorkloadConfig, profile: Profile, policy: Policy | None = None) -> tuple[int, int]:
    """(num_blocks, max_model_len), with vLLM's start-up checks as clear errors
    (``policy``: the run's, built here if not given).

    Unset, the pool is what the profile's memory leaves after weights and
    activations, the activations sized (as vLLM's profiling run does) for the
    policy's token budget; max_model_len is the model's context."""
    s = cfg.server
    max_model_len = max_model_len_of(cfg, profile)
    if policy is None:
        policy = build_policy(cfg, max_model_len, profile)
    block_size = block_size_of(cfg, policy)
    page, _ = engine_field(cfg, policy, "block_size")
    memory, memory_given = engine_field(cfg, policy, "gpu_memory_utilization")
    more = (f"raise {memory}" if memory else "a larger GPU or profile.tensor_parallel") if s.num_blocks is None \
        else "raise server.num_blocks"
    if s.num_blocks is not None:
        num_blocks = s.num_blocks
        where = "server.num_blocks"
    else:
        step_tokens = policy.token_budget or DEFAULT_ACTIVATION_TOKENS
        rule = policy.kv_memory or KvMemory(s.gpu_memory_utilization, "total")
        # Sliding-window layers keep up to a window per running request: reserved for every slot.
        capacity = profile.kv_capacity_tokens(rule.fraction, step_tokens, rule.share_of,
                                              max_num_seqs=policy.max_num_seqs)
        capacity = drafter_share(capacity, profile, getattr(policy, "speculative", None))
        if capacity <= 0:
            report = profile.memory_report(rule.fraction, step_tokens, rule.share_of,
                                           max_num_seqs=policy.max_num_seqs)
            raise ConfigError(
                f"{cfg.source}: field '{memory if memory_given else 'profile'}': the model's weights do not fit "
                f"({report} leaves no room for KV); raise profile.tensor_parallel, pick a larger GPU"
                + (f" or raise {memory}" if memory else ""))
        hybrid = getattr(policy, "hybrid", None)
        num_blocks = (hybrid.num_blocks(capacity, profile.model.num_attention_layers) if hybrid is not None
                      else capacity // block_size)
        where = memory if memory_given else "profile"
        if num_blocks == 0 and memory_given:    # a memory share that leaves less than a page
            raise ConfigError(f"{cfg.source}: field '{memory}': the KV cache it leaves holds {capacity:,} tokens, "
                              f"less than one page of {block_size:,} ({page}); raise {memory}")
        if num_blocks == 0:                # the pool holds tokens, but not one block of this size
            raise ConfigError(f"{cfg.source}: field '{page}' ({block_size:,} tokens) is larger than "
                              f"the whole KV cache ({capacity:,} tokens); use a smaller page"
                              + (" (vLLM's block sizes: 16, 32)" if page == "server.block_size" else ""))
    if num_blocks * block_size < max_model_len:
        raise ConfigError(
            f"{cfg.source}: field '{where}': KV cache holds {num_blocks * block_size} tokens, fewer "
            f"than one request of max_model_len {max_model_len}; set server.max_model_len <= "
            f"{num_blocks * block_size}, or give the KV cache more memory ({more})")
    most = policy.max_request_tokens(num_blocks, block_size)
    if getattr(policy, "hybrid", None) is not None:     # a request's state blocks besides its tokens'
        most = min(most, (num_blocks - policy.num_reserved_blocks - policy.hybrid.state_groups) * block_size)
    if most < max_model_len:
        # The policy's own start-up limit (SGLang's page and reservation): a request up to max_model_len
        # would pass the context check and then wait forever.
        raise ConfigError(
            f"{cfg.source}: field '{where}': policy {cfg.policy.kind} can schedule at most {most:,} tokens "
            f"(prompt + max_tokens) of one request on this KV cache of {num_blocks * block_size:,} tokens "
            f"({page} {block_size}), fewer than max_model_len {max_model_len:,}, so a request that long "
            f"would wait forever; set server.max_model_len <= {most:,}, or give the KV cache more memory "
            f"({more})")
    return num_blocks, max_model_len


def engine_field(cfg: WorkloadConfig, policy: Policy, name: str) -> tuple[str | None, bool]:
    """The field the workload's policy sizes its pool by in place of ``server.<name>``
    (``Policy.server_knobs``: SGLang's ``policy.page_size`` for ``block_size``), or None where
    its engine has none; and whether the workload sets it."""
    if name not in policy.server_knobs:
        given = cfg.raw.get("server")
        return f"server.{name}", isinstance(given, dict) and given.get(name) is not None
    knob = policy.server_knobs[name].knob
    given = cfg.raw.get("policy")
    return (None if knob is None else f"policy.{knob}"), isinstance(given, dict) and given.get(knob) is not None


def block_size_of(cfg: WorkloadConfig, policy: Policy) -> int:
    """The KV page in tokens: the policy's where the engine has it as a knob, else server.block_size."""
    return policy.block_size or cfg.server.block_size


def policy_context(max_model_len: int, profile: Profile | None = None) -> PolicyContext:
    """What the policy's engine defaults depend on, from the run's profile (the
    device, its memory, the TP degree, a measured server's knobs); without a
    profile the device is unknown."""
    if profile is None:
        return PolicyContext(max_model_len)
    cpu = profile.device.lower().startswith("cpu") or (profile.provenance or {}).get("device") == "cpu"
    return PolicyContext(max_model_len, profile.device, profile.memory_bytes_per_gpu, profile.tensor_parallel,
                         profile.engine, cpu=cpu, data_parallel=profile.data_parallel_size,
                         mla=profile.model.is_mla)


def build_policy(cfg: WorkloadConfig, max_model_len: int, profile: Profile | None = None) -> Policy:
    """A policy object, with the engines' start-up checks as config errors
    (``make_policy``: without a profile the device is unknown). A policy may
    keep state between its calls (SGLang's chunked request, TGI's step
    counters), so every replica gets one of its own (``drive``)."""
    from policies import POLICIES
    policy_cfg = cfg.policy
    if getattr(policy_cfg, "async_scheduling", False) is None:
        wanted = async_scheduling_of(cfg)
        if wanted is not None:
            policy_cfg = dataclasses.replace(policy_cfg, async_scheduling=wanted)
    cls = POLICIES[cfg.policy.kind][1]
    given = given_policy(cfg)
    if (profile is not None and profile.data_parallel_size > 1 and cls.pipelined_knob is not None
            and given.get(cls.pipelined_knob) is None):
        # data parallelism is modelled with the synchronous loop (its knobs say the pipelined loop is off)
        policy_cfg = dataclasses.replace(policy_cfg, **{cls.pipelined_knob: cls.pipelined_off})
    try:
        policy = make_policy(policy_cfg, policy_context(max_model_len, profile))
    except ValueError as exc:
        raise ConfigError(f"{cfg.source}: field 'policy': {exc}") from None
    if profile is not None and profile.model.is_hybrid:
        hybrid_pool(cfg, policy, profile)
    spec = getattr(policy, "speculative", None)
    if profile is not None and spec is not None and spec.method == "mtp" and "draft_layers" not in (
            getattr(cfg.policy, "speculative", None) or {}):
        # MTP drafts with the checkpoint's own multi-token-prediction layers (num_nextn_predict_layers)
        layers = profile.model.num_mtp_layers
        if not layers:
            raise ConfigError(f"{cfg.source}: field 'policy.speculative.method' is mtp, but {profile.model.name}'s "
                              f"config names no MTP layers (num_nextn_predict_layers or mtp_num_hidden_layers); "
                              f"give policy.speculative.draft_layers, or use eagle or eagle3")
        policy.speculative = dataclasses.replace(spec, draft_layers=layers)
    return policy


def dp_lockstep(profile: Profile) -> bool:
    """Whether the profile's data-parallel ranks step together (an MoE model: sim.loop.dp)."""
    return profile.data_parallel_size > 1 and profile.model.is_moe


# GPUs of compute capability 10.x (data-center Blackwell), where vLLM's CUDA graphs reach 1024 tokens.
_SM100 = frozenset({"b200-sxm", "b300-sxm", "gb200", "gb300"})


def cuda_graph_tokens(policy: Policy, profile: Profile) -> int:
    """The largest step the engine's CUDA graphs run, up to which data-parallel ranks are padded
    to the largest one (sim.loop.dp): the policy's own (``dp_graph_tokens``: SGLang's decode graphs)
    or vLLM 0.32's max_cudagraph_capture_size (VllmConfig._set_cudagraph_sizes): min(2 x
    max_num_seqs, 512), 1024 on data-center Blackwell."""
    if policy.dp_graph_tokens is not None:
        return policy.dp_graph_tokens
    return min(2 * policy.max_num_seqs, 1024 if profile.device.lower() in _SM100 else 512)


def given_policy(cfg: WorkloadConfig) -> dict[str, Any]:
    """The workload file's own ``policy`` section (what the user wrote, before defaults)."""
    raw = cfg.raw.get("policy")
    return raw if isinstance(raw, dict) else {}


def built_config(cfg: WorkloadConfig, policy: Policy) -> Any:
    """The policy config ``policy`` was built from: ``cfg.policy`` with what ``build_policy``
    resolved (a pipelined loop turned off for data-parallel ranks), where the policy keeps it
    as its ``config`` (a user's policy may keep another)."""
    own = getattr(policy, "config", None)
    return own if type(own) is type(cfg.policy) else cfg.policy


def check_data_parallel(cfg: WorkloadConfig, profile: Profile, num_replicas: int, router: str) -> str:
    """The router of a data-parallel deployment (the engine's own, ``Policy.dp_router``: vLLM's
    load balancer ``vllm_dp``, SGLang's controller ``sglang_dp``), or the given one without data
    parallelism; ConfigError for what is not modelled."""
    from policies import POLICIES
    d = profile.data_parallel_size
    if d == 1:
        return router
    where = f"{cfg.source}: field 'profile.data_parallel_size'"
    cls = POLICIES[cfg.policy.kind][1]
    own = cls.dp_router
    if own is None:
        raise ConfigError(f"{where}: data parallelism is modelled as vLLM (policy vllm_v1) and SGLang's DP "
                          f"attention (policy sglang) run it; {cfg.policy.kind}'s is not modelled yet")
    if router not in ("round_robin", "least_requests", own):
        raise ConfigError(f"{where} is {d}: its ranks sit behind the engine's own data-parallel balancer "
                          f"(router {own}; several deployments: {_DP_ROUTING[own]}); --router {router} is not "
                          f"how they are routed")
    knob_name = cls.pipelined_knob
    given = given_policy(cfg)
    if knob_name is not None and knob_name in given and given[knob_name] not in (None, cls.pipelined_off):
        raise ConfigError(f"{cfg.source}: field 'policy.{knob_name}' is {str(given[knob_name]).lower()}: "
                          f"data-parallel ranks are modelled with the synchronous loop only (sim.loop.dp); set it "
                          f"{str(cls.pipelined_off).lower()} or leave it out")
    if getattr(cfg.policy, "speculative", None):
        raise ConfigError(f"{cfg.source}: field 'policy.speculative': speculative decoding with "
                          f"data-parallel ranks is not modelled yet")
    return own


_DP_ROUTING = {"vllm_dp": "the least loaded, then its balancer",
               "sglang_dp": "round robin over them, then each one's controller in turn"}


def hybrid_pool(cfg: WorkloadConfig, policy: Policy, profile: Profile) -> None:
    """A hybrid model's KV pool, as vLLM lays it out (``sim.cost.hybrid``): ``policy`` gets the
    raised block size, a pool whose requests hold their state blocks, and the layout
    (``policy.hybrid``). ConfigError where it is not modelled."""
    from sim.core.kv import state_block_pool
    from sim.cost.hybrid import vllm_hybrid_layout
    from sim.cost.roofline import DTYPE_BYTES
    name, kind = profile.model.name, profile.model.state_layer_kind
    if cfg.policy.kind != "vllm_v1":
        raise ConfigError(f"{cfg.source}: field 'policy.kind': {name} has {kind}, whose state "
                          f"memory batchsim models as vLLM lays it out (policy vllm_v1) only; "
                          f"{cfg.policy.kind} is not modelled for such models yet")
    caching = policy.kv_pool_class.caching
    if caching and profile.model.num_mamba_layers:
        raise ConfigError(f"{cfg.source}: field 'policy.enable_prefix_caching': {name} has {kind}, and vLLM's "
                          f"mamba_cache_mode 'align' keeps Mamba2 layers' prefill checkpoint blocks, which are "
                          f"not modelled (its Gated DeltaNet path is); set policy.enable_prefix_caching: false")
    if getattr(policy, "speculative", None) is not None:
        raise ConfigError(f"{cfg.source}: field 'policy.speculative': speculative decoding with {kind} "
                          f"(their per-draft state blocks) is not modelled; remove it for {name}")
    try:
        layout = vllm_hybrid_layout(profile.model, profile.kv_bytes_per_token, profile.tensor_parallel,
                                    DTYPE_BYTES.get(profile.dtype, 2), cfg.server.block_size)
    except ValueError as exc:
        raise ConfigError(f"{cfg.source}: field 'profile': {exc}") from None
    policy.block_size = layout.block_size
    if caching:
        # mamba_cache_mode "align" (vLLM's default with prefix caching on): a state block at each
        # block boundary, its blocks taken and given back on every step, so no decode stretch.
        from sim.core.mamba_align import align_state_pool
        policy.kv_pool_class = align_state_pool(layout.state_groups)
        policy.decode_stretch = False
    else:
        policy.kv_pool_class = state_block_pool(layout.state_groups)
    policy.hybrid = layout


def speculative_summary(runs: Sequence[Speculation | None]) -> dict[str, Any]:
    """vLLM's spec-decode counters summed over the replicas (``Speculation.totals``), as
    ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
    ``..._num_accepted_tokens_per_pos`` name them, with the acceptance rate (accepted / draft
    tokens) and mean acceptance length (1 + accepted / drafts) they give; {} without drafts."""
    runs = [r for r in runs if r is not None]
    if not runs:
        return {}
    return {**{f"spec_decode_{k}": v for k, v in Speculation.totals(runs).items()},
            "speculative": runs[0].spec.to_dict()}


def async_scheduling_of(cfg: WorkloadConfig) -> bool | None:
    """Whether vLLM's async scheduling is on, as the workload says it: ``policy.async_scheduling``
    if given, else what an explicit ``profile.engine`` names (vllm-v1: the synchronous loop;
    vllm-v1-async), else None (the policy decides by the device, as vLLM does). A
    contradiction between the two is a ConfigError."""
    if not hasattr(cfg.policy, "async_scheduling"):
        return None
    raw = cfg.raw.get("profile")
    given = raw.get("engine") if isinstance(raw, dict) else None
    named = {"vllm-v1": False, "vllm-v1-async": True}.get(given)
    explicit = cfg.policy.async_scheduling
    if explicit is not None and named is not None and explicit != named:
        raise ConfigError(f"{cfg.source}: field 'profile.engine' ({given!r}) names "
                          f"{'the asynchronous' if named else 'a synchronous'} loop's host terms, but "
                          f"policy.async_scheduling is {str(explicit).lower()}; leave one of them out")
    return explicit if explicit is not None else named


def request_max_tokens(cfg: WorkloadConfig, specs: RequestSpecs, max_model_len: int) -> np.ndarray:
    """Each request's max_tokens (the client's cap): the trace's own column if it
    has one, else the workload's ``max_tokens`` (``output``: the true output
    length; ``context``: what the context leaves after the prompt, at least 1;
    a number)."""
    if specs.max_tokens is not None:
        return np.asarray(specs.max_tokens, dtype=np.int64)
    if cfg.max_tokens == "output":
        return np.asarray(specs.output_tokens, dtype=np.int64)
    if cfg.max_tokens == "context":
        return np.maximum(1, max_model_len - np.asarray(specs.prompt_tokens, dtype=np.int64))
    return np.full(len(specs), int(cfg.max_tokens), dtype=np.int64)


class RequestStream:
    """The run's requests in arrival order, each Request made as the feed
    releases it (``sim.loop.feed.feed``), a chunk of the arrays at a time, never
    all at once: with the servers dropping done requests (``RequestRecords``),
    a run holds Request objects only for the requests in flight.
    ``true_outputs()`` yields their true output lengths in the same order."""

    CHUNK = 4096

    def __init__(self, specs: RequestSpecs, max_tokens: np.ndarray) -> None:
        self.specs = specs
        self.max_tokens = max_tokens

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self) -> Iterator[Request]:
        specs = self.specs
        contents = specs.contents
        for lo in range(0, len(specs), self.CHUNK):
            hi = lo + self.CHUNK
            for i, arrival, prompt, max_tokens in zip(range(lo, min(hi, len(specs))),
                                                      specs.arrival_s[lo:hi].tolist(),
                                                      specs.prompt_tokens[lo:hi].tolist(),
                                                      self.max_tokens[lo:hi].tolist()):
                yield Request(req_id=i, arrival_s=arrival, num_prompt_tokens=prompt, max_output_tokens=max_tokens,
                              content=contents.content(i) if contents is not None else None)

    def true_outputs(self) -> Iterator[int]:
        out = self.specs.output_tokens
        for lo in range(0, len(out), self.CHUNK):
            yield from out[lo:lo + self.CHUNK].tolist()

    def make(self, i: int) -> tuple[Request, int]:
        """Request i, as iteration makes it, and its true output length: for a
        feed that sends requests out of id order (``sim.loop.feed.SessionFeed``)."""
        specs, contents = self.specs, self.specs.contents
        req = Request(req_id=i, arrival_s=float(specs.arrival_s[i]), num_prompt_tokens=int(specs.prompt_tokens[i]),
                      max_output_tokens=int(self.max_tokens[i]),
                      content=contents.content(i) if contents is not None else None)
        return req, int(specs.output_tokens[i])


def make_requests(cfg: WorkloadConfig, specs: RequestSpecs, max_model_len: int) -> list[Request]:
    """All of ``specs``' requests as a list (small runs and tools; ``drive`` streams them)."""
    return list(RequestStream(specs, request_max_tokens(cfg, specs, max_model_len)))


class Driven(NamedTuple):
    """What ``drive`` hands back."""

    servers: list[Server]              # each request is in one server's ``state.records``
    num_requests: int
    num_dropped: int                   # trace rows that could not be replayed
    client_queue_s: np.ndarray | None  # with max_concurrency: each request's wait for a free client (by id)


def drive(cfg: WorkloadConfig, profile: Profile, num_blocks: int, max_model_len: int,
          env: simpy.Environment, executor: Executor, *, num_replicas: int = 1,
          router: str = "round_robin", on_step: OnStep | None = None,
          progress: bool = False, live: bool = False,
          files: RunFilesProcess | None = None, policy: Policy | None = None,
          check_stretch: bool = False, specs: RequestSpecs | None = None) -> Driven:
    """Run ``cfg``'s requests through ``num_replicas`` servers on ``env``.

    The one place that builds requests, policies, block pools and servers, for
    the simulator (``simpy.Environment`` + ``SimExecutor``) and the live driver
    (``live``: a real-time environment + a live executor, ``sim.run.live``) alike.
    Live, the servers step one iteration at a time on the wall clock and a
    measured server's per-request overhead is not added (it happens).
    ``on_step(server)`` builds each server's step hook. ``files``, if
    given, writes steps.csv and tokens.npz from the logs in a second process
    while the loop runs and after it (``sim.results.runfiles``). Every replica
    runs a policy object of its own: ``policy``, if given, is the first
    replica's (the one that sized the KV pool), the others are built alike.
    ``check_stretch``: step every iteration and check the fast path's
    prediction of each against it (``sim.loop.server.Server``). ``specs``: the
    requests to run instead of ``generate(cfg)``'s (a replay of measured or
    hand-built requests, their contents included). Returns the servers
    (each request is in one server's ``state.records``), the number of
    requests and of trace rows dropped, and under a concurrency cap each
    request's wait for a client (by request id; sessions: a first turn's wait,
    0 for later turns); nothing else of the request arrays outlives the run.
    Multi-turn sessions (``specs.sessions``) go through ``SessionFeed``: each
    turn is sent ``think_time_s`` after its predecessor's reply.
    Raises RuntimeError if a request is left unfinished (a policy that stalls).
    """
    specs = generate(cfg) if specs is None else specs
    if len(specs) == 0:
        raise ConfigError(f"{cfg.source}: the workload has no requests (check num_requests, duration_s, "
                          f"arrivals.start_s)")
    requests = RequestStream(specs, request_max_tokens(cfg, specs, max_model_len))
    lockstep = dp_lockstep(profile)           # an MoE model's data-parallel ranks step together
    if lockstep and (live or not isinstance(executor, SimExecutor)):
        raise ConfigError(f"{cfg.source}: field 'profile.data_parallel_size': the live engine runs one rank; "
                          f"data-parallel ranks are simulated only")
    servers = []
    for k in range(num_replicas):
        if policy is None or k:
            policy = build_policy(cfg, max_model_len, profile)
        if live and policy.pipelined:
            knob_name = policy.pipelined_knob
            if knob_name == "async_scheduling":
                said = "is true" if getattr(cfg.policy, "async_scheduling", None) else (
                    f"is unset, which on this profile's device ({profile.device}, not a CPU) means on, as in vLLM")
            else:
                given = given_policy(cfg)
                said = (f"is {str(given[knob_name]).lower()}" if knob_name in given
                        else "is unset, which means on, as in the engine it follows")
            raise ConfigError(f"{cfg.source}: field 'policy.{knob_name}' {said}; the live engine runs one step "
                              f"at a time and cannot choose a step while another runs: set "
                              f"policy.{knob_name}: {str(policy.pipelined_off).lower()} to run it live")
        usable = num_blocks - policy.num_reserved_blocks    # vLLM v1's null block
        state = SchedulerState(policy.kv_pool_class(usable, block_size_of(cfg, policy), cfg.server.watermark),
                               max_model_len, policy.max_prompt_tokens, refuse_by_prompt=policy.refuses_by_prompt,
                               clamp_max_tokens=policy.clamps_max_tokens)
        spec = getattr(policy, "speculative", None)
        if spec is not None:
            if live:
                raise ConfigError(f"{cfg.source}: field 'policy.speculative': the live engine has no proposer "
                                  f"and cannot verify drafts; remove policy.speculative to run it live")
            state.speculation = Speculation(spec, np.random.default_rng([cfg.seed, k]))
        server = Server(env, policy, state, executor, replica=k, coalesce=not live, check_stretch=check_stretch,
                        start=not lockstep)
        server.on_step = on_step(server) if on_step is not None else None
        servers.append(server)
    d = profile.data_parallel_size
    for server in servers if d > 1 else ():
        server.dp_size = d
    if lockstep:
        from sim.loop.dp import DpGroup
        for g in range(0, len(servers), d):            # one lockstep group a deployment
            DpGroup(env, servers[g:g + d], profile, cuda_graph_tokens(servers[0].policy, profile),
                    cfg.profile.expert_imbalance, servers[0].policy.dp_pads_prefill)
    # A measured server's per-request overhead delays arrivals in simulation; live, it happens.
    lag_s = 0.0 if live else float(profile.engine.get("request_overhead_s") or 0.0)
    a = cfg.arrivals
    clients = None
    waits_s = None                          # each request's wait for a free client, by id
    if specs.sessions is not None:          # a client per session, or max_concurrency of them
        first_ids = specs.sessions.tolist()
        if a.max_concurrency is not None:
            clients = ClientPool(env, min(a.max_concurrency, len(first_ids) - 1))
            waits_s = array("d", bytes(8 * len(requests)))
        sessions = SessionFeed(env, servers, requests.make, first_ids, a.think_time_s, router, lag_s, clients,
                               waits_s)
        env.process(sessions.release_first_turns())
    elif a.max_concurrency is None:
        env.process(feed(env, servers, requests, requests.true_outputs(), router, lag_s))
    else:                                   # clients over the whole fleet, not per replica
        clients = ClientPool(env, min(a.max_concurrency, len(requests)), a.think_time_s)
        waits_s = clients.waits_s           # in release order, which is id order
        env.process(feed_capped(env, servers, requests, requests.true_outputs(), clients, router, lag_s))
    profile.reset_counters()
    if files is not None:
        files.start([s.log for s in servers], [s.state.tokens for s in servers], [s.replica for s in servers],
                    num_blocks)
    if live:
        env.sync()                          # t = 0 is now, not when the env was built
    _run_env(env, servers, len(requests), progress)
    trim_heap()                             # the pages the loop freed: the summaries' peak comes next
    unfinished = [(r, s) for s in servers for r in (*s.state.waiting, *s.state.running)]
    if unfinished:
        r, s = unfinished[0]
        raise PolicyError(f"policy {cfg.policy.kind}: the run stalled with {len(unfinished)} request(s) unfinished, "
                          f"first request {r.req_id} ({r.num_prompt_tokens:,} prompt + {r.max_output_tokens:,} "
                          f"max_tokens tokens, {r.status.name.lower()}, {r.num_computed_tokens:,} computed, on a "
                          f"pool of {s.state.kv.capacity_tokens:,} tokens): nothing was left to happen but it "
                          f"never finished")
    num_done = sum(len(s.state.records) for s in servers)
    if num_done != len(specs):
        raise PolicyError(f"policy {cfg.policy.kind}: the run ended with {num_done} of {len(specs)} requests done")
    if files is not None:
        files.finish()
    return Driven(servers, len(specs), specs.num_dropped,
                  np.frombuffer(waits_s, dtype=np.float64) if waits_s is not None else None)


def run_workload(cfg: WorkloadConfig, *, num_replicas: int = 1, router: str = "round_robin",
                 progress: bool = False, strict: bool = False,
                 files: RunFilesProcess | None = None, check_stretch: bool = False,
                 specs: RequestSpecs | None = None) -> RunResult:
    """Simulate ``cfg`` on ``num_replicas`` identical servers behind ``router``
    (``files``, ``check_stretch``, ``specs``: see ``drive``; the workload's
    ``check_fast_path`` checks too). Raises ``PolicyError`` if the policy
    breaks its contract (``sim.core.policy``)."""
    if router not in ROUTERS:
        raise ConfigError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    if num_replicas < 1:
        raise ConfigError(f"num_replicas must be >= 1, got {num_replicas}")
    cap = cfg.arrivals.max_concurrency
    knob = POLICIES[cfg.policy.kind][1].full_batch_knob
    if cap is not None and knob is not None and cap < getattr(cfg.policy, knob) * num_replicas:
        # The policy waits for a full batch; a closed loop never has more than ``cap`` requests
        # out, so every replica starting a batch needs a full batch x replicas of them.
        full = getattr(cfg.policy, knob)
        raise ConfigError(f"{cfg.source}: field 'arrivals.max_concurrency': policy {cfg.policy.kind} waits for "
                          f"policy.{knob} = {full} requests per replica, but at most {cap} are ever in flight "
                          f"over {num_replicas} replica(s), so a batch would never fill; raise max_concurrency "
                          f"to >= {full * num_replicas}, lower policy.{knob}, or use a policy that does not wait "
                          f"for a full batch (policy.kind {kinds_where(lambda c: c.full_batch_knob is None)})")
    wall0 = time.perf_counter()
    tune_heap()
    profile = build_profile(cfg)
    router = check_data_parallel(cfg, profile, num_replicas, router)
    num_replicas *= profile.data_parallel_size         # a data-parallel rank a replica, ranks of a deployment adjacent
    cfg = resolve_server(cfg, profile)
    policy = build_policy(cfg, max_model_len_of(cfg, profile), profile)
    num_blocks, max_model_len = kv_blocks(cfg, profile, policy)
    check_stretch = check_stretch or cfg.check_fast_path
    loop0 = time.perf_counter()
    servers, num_requests, num_dropped, client_queue_s = drive(
        cfg, profile, num_blocks, max_model_len, simpy.Environment(), SimExecutor(profile),
        num_replicas=num_replicas, router=router, progress=progress, files=files, policy=policy,
        check_stretch=check_stretch, specs=specs)
    loop_s = time.perf_counter() - loop0
    result = collect(cfg, servers, num_requests, num_blocks, profile, client_queue_s)
    rejected = result.summary["failed_by_reason"]
    if rejected:
        limit = servers[0].policy.max_prompt_tokens
        reasons = "; ".join(f"{n} with " + REJECT_REASONS[why].format(max_model_len=max_model_len, limit=limit)
                            for why, n in sorted(rejected.items()))
        msg = (f"{cfg.source}: {sum(rejected.values())} of {num_requests} requests were rejected "
               f"({reasons}); counted as failed")
        if strict:
            raise ConfigError(msg + " (--strict)")
        warnings.warn(msg, stacklevel=2)
    cut = sum(s.state.num_cut_short for s in servers)
    if cut:
        warnings.warn(f"{cfg.source}: {cut} of {num_requests} requests were cut short: preempted, they had to "
                      f"recompute more tokens than the KV pool holds above the watermark, so the scheduler ended "
                      f"them with the tokens they had (vLLM v0 ignores such requests); they count as completed, "
                      f"with fewer output tokens (add KV blocks, or lower max_tokens or server.watermark)",
                      stacklevel=2)
    clamped = sum(s.state.num_clamped for s in servers)
    if clamped:
        warnings.warn(f"{cfg.source}: {clamped} of {num_requests} requests asked for more tokens than the context "
                      f"leaves (prompt + max_tokens > max_model_len {max_model_len:,}); as vLLM's API server does, "
                      f"their max_tokens was cut to max_model_len - prompt", stacklevel=2)
    if cfg.profile.path is not None:
        path = cfg.resolve_path(cfg.profile.path)
        result.meta["profile_file"] = {"path": str(path), "format_version": FORMAT_VERSION,
                                       "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    result.meta.update(wall_s=time.perf_counter() - wall0, loop_s=loop_s, num_blocks=num_blocks, num_cut_short=cut,
                       num_max_tokens_clamped=clamped, max_model_len=max_model_len, num_replicas=num_replicas,
                       router=router,
                       num_trace_rows_dropped=num_dropped)
    if check_stretch:
        result.meta["fast_path_steps_checked"] = sum(s.num_stretch_steps_checked for s in servers)
    return result


def _run_env(env: simpy.Environment, servers: list[Server], num_requests: int, progress: bool) -> None:
    # The loop allocates many short-lived tuples that reference counting frees;
    # a rarer young-generation collection saves a few percent of the run.
    threshold = gc.get_threshold()
    gc.set_threshold(100_000, threshold[1], threshold[2])
    try:
        _run_env_inner(env, servers, num_requests, progress)
    finally:
        gc.set_threshold(*threshold)


def _run_env_inner(env: simpy.Environment, servers: list[Server], num_requests: int, progress: bool) -> None:
    if not progress:
        env.run()
        return
    shown: ProgressBar | ProgressLines = (ProgressBar(num_requests) if sys.stderr.isatty()
                                          else ProgressLines(num_requests, sys.stderr))
    env.process(_progress_ticker(env, servers, shown))
    env.run()
    shown.close()


class ProgressBar:
    """Progress on a terminal: a tqdm bar of finished requests."""

    def __init__(self, num_requests: int) -> None:
        from tqdm import tqdm
        self.bar = tqdm(total=num_requests, unit="req", desc="simulating", file=sys.stderr, leave=False)

    def update(self, now_s: float, num_done: int) -> None:
        self.bar.n = num_done
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class ProgressLines:
    """Progress where there is no terminal (a log file, CI): one plain line
    every ``every_wall_s`` wall seconds, never a bar's redrawn frames."""

    def __init__(self, num_requests: int, out: TextIO, every_wall_s: float = 10.0) -> None:
        self.num_requests = num_requests
        self.out = out
        self.every_wall_s = every_wall_s
        self.start_wall_s = self.last_wall_s = time.perf_counter()

    def update(self, now_s: float, num_done: int) -> None:
        wall_s = time.perf_counter()
        if wall_s - self.last_wall_s >= self.every_wall_s:
            self.last_wall_s = wall_s
            print(progress_line(now_s, num_done, self.num_requests, wall_s - self.start_wall_s),
                  file=self.out, flush=True)

    def close(self) -> None:
        pass


def progress_line(now_s: float, num_done: int, num_requests: int, wall_s: float) -> str:
    """'simulated 1,234.5 s: 12,345/100,000 requests done, 456.7 requests per wall second'."""
    rate = num_done / wall_s if wall_s > 0 else 0.0
    return (f"simulated {now_s:,.1f} s: {num_done:,}/{num_requests:,} requests done, "
            f"{rate:,.1f} requests per wall second")


def _progress_ticker(env: simpy.Environment, servers: list[Server], shown: ProgressBar | ProgressLines,
                     every_s: float = 5.0):
    """A SimPy process that reports progress every ``every_s`` simulated
    seconds, and leaves once nothing else is left to happen."""
    while True:
        shown.update(env.now, sum(s.state.num_finished + s.state.num_rejected for s in servers))
        if all(s.process.triggered for s in servers) or env.peek() == float("inf"):
            return
        yield env.timeout(every_s)


def profile_trust(profile: Profile) -> dict[str, Any]:
    """How far this profile's step costs are known to be off, and against what:
    an analytic preset's held-out error against public vLLM runs for its GPU, TP
    degree and weight precision (``sim.cost.presets.serving_error``: vLLM >= 0.10
    serving runs, for the vllm-v1 engines and quantized weights;
    ``sim.cost.presets.preset_error``: vLLM 0.5 batches), or a measured profile's
    held-out self-check. ``error_pct`` is None where nothing was checked."""
    if profile.provenance.get("source") == "analytic-roofline":
        from sim.cost.presets import preset_error, serving_error
        weights = profile.weight_dtype or profile.dtype
        # vLLM v1's host work (engine vllm-v1*) or quantized weights: the 2025-26 serving runs;
        # vLLM v0's (the presets' default) in fp16/bf16: the vLLM 0.5 batches
        v1 = str(profile.efficiency.get("engine", "")).startswith("vllm-v1")
        serving = serving_error(profile.device, weights, profile.tensor_parallel) if v1 or profile.weight_dtype else None
        if serving is not None:
            return serving_trust(serving, profile)
        if profile.weight_dtype or profile.kv_cache_dtype or profile.model.is_moe:
            # the vLLM 0.5 batches below ran dense models in fp16 only
            what = "a mixture of experts" if profile.model.is_moe else f"{weights} weights"
            return {"error_pct": None, "basis": f"analytic preset, not validated on {profile.device} at TP "
                                                 f"{profile.tensor_parallel} with {what} (no public measurements)"}
        err = preset_error(profile.device, profile.tensor_parallel)
        if err is None:
            return {"error_pct": None, "basis": f"analytic preset, not validated on {profile.device} at "
                                                 f"TP {profile.tensor_parallel} (no public measurements)"}
        return {"error_pct": err["mae_pct"], "bias_pct": err["bias_pct"],
                "basis": f"analytic preset vs {err['num_rows']} held-out public vLLM batches on "
                         f"{profile.device} TP {profile.tensor_parallel} (mean abs step error)"}
    if profile.provenance.get("source") == "kernel-tables":
        return kernel_trust(profile)
    fe = profile.fit_error or {}
    for key, basis in (("holdout_mape_pct", "held-out calibration batches (MAPE)"),
                       ("selfcheck_max_abs_err_pct", "held-out self-check against the server (worst |error|)")):
        if fe.get(key) is not None:
            return {"error_pct": float(fe[key]), "basis": f"{profile.provenance.get('source', 'measured')}: {basis}"}
    return {"error_pct": None, "basis": f"{profile.provenance.get('source', 'unknown')}: no held-out check recorded"}


def kernel_trust(profile: Profile) -> dict[str, Any]:
    """``profile_trust`` of a kernel profile: the GPU kernels are measured (the tables), the
    host time fitted (``HostTerms.source``), and end to end it is as far off as the public
    serving runs of its engine on its GPU, precision and TP say (``kernel_serving_error``),
    or unchecked there."""
    from sim.cost.presets import kernel_serving_error
    prov = profile.provenance
    weights = profile.weight_dtype or profile.dtype
    measured = (f"kernels measured ({prov.get('label', 'kernel tables')}), host time "
                f"{prov.get('host', {}).get('source', 'not fitted')}")
    err = kernel_serving_error(prov.get("engine", ""), profile.device, weights, profile.tensor_parallel)
    if err is None:
        return {"error_pct": None, "basis": f"{measured}; not checked end to end on {profile.device} TP "
                                             f"{profile.tensor_parallel} {weights} (no public serving runs)"}
    from sim.cost.aic import ENGINES
    trust = serving_trust(err, profile, ENGINES.get(prov.get("engine", ""), "?"), what=measured + ";")
    return trust


def serving_trust(err: dict[str, Any], profile: Profile, engine_name: str = "vLLM",
                  what: str = "analytic preset") -> dict[str, Any]:
    """``profile_trust`` from a public serving-run check (``sim.cost.presets.serving_error``):
    the held-out models' mean abs TTFT and TPOT errors where there are any, else every row's
    (the fitted models': said so); ``error_pct`` is the larger of the two."""
    where = f"{profile.device} TP {profile.tensor_parallel} {err['weight_dtype']}"
    held = err["num_held_out"] > 0
    ttft, tpot = ((err["ttft_mae_pct"], err["tpot_mae_pct"]) if held
                  else (err["ttft_mae_pct_all"], err["tpot_mae_pct_all"]))
    parts = [f"{name} {v:.0f}%" for name, v in (("TTFT", ttft), ("TPOT", tpot)) if v is not None]
    which = (f"{err['num_held_out']} held-out" if held
             else f"{err['num_all']} (training models' only, none held out)")
    return {"error_pct": max(v for v in (ttft, tpot) if v is not None),
            "ttft_error_pct": ttft, "tpot_error_pct": tpot,
            "basis": f"{what} vs {which} public {engine_name} serving values on {where} "
                     f"(mean abs {', '.join(parts)})"}


def prefix_cache_summary(pools: Sequence[Any]) -> dict[str, Any]:
    """The prefix cache's counters over ``pools`` (nothing without prefix caching):
    ``prefix_cache_hit_rate`` = hit tokens / queried tokens of new requests, the
    ratio of vLLM's ``vllm:prefix_cache_hits`` and ``vllm:prefix_cache_queries``
    (a preempted request's lookup is counted apart, as vLLM does), and the
    cached blocks popped for reuse."""
    if not pools or not pools[0].caching:
        return {}
    queries = sum(p.queries for p in pools)
    hits = sum(p.hits for p in pools)
    return {"prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_preempted_queries": sum(p.preempted_queries for p in pools),
            "prefix_cache_preempted_hits": sum(p.preempted_hits for p in pools),
            "prefix_cache_evicted_blocks": sum(p.evictions for p in pools)}


def request_table(servers: list[Server], num_requests: int) -> RequestTable:
    """The compact requests table of a run (``sim.results.table``), from the servers' records
    (``drive`` numbers the requests 0 .. ``num_requests`` - 1)."""
    return RequestTable.from_records([s.state.records for s in servers], [s.replica for s in servers],
                                     num_requests, prefix_caching=servers[0].state.kv.caching)


def log_summary(requests: pd.DataFrame | RequestTable, steps: list[StepLog], tokens: list[TokenLog],
                slo: dict[str, Any] | None, kv_total_blocks: int, itl: Values | None = None) -> dict[str, Any]:
    """``sim.results.metrics.summarize_logs`` of these requests and these replicas' logs, read chunk by chunk
    (``itl``: these logs' ITL values, if already computed)."""
    columns = ((dur, ints[:, StepLog.BATCH_SIZE], ints[:, StepLog.KV_USED_BLOCKS])
               for log in steps for _, dur, _, ints in log.chunks())
    totals = step_totals(columns, sum(len(log) for log in steps), sum(1 for log in steps if len(log)),
                         kv_total_blocks)
    if itl is None:
        itl = itl_values((chunk for log in tokens for chunk in log.chunks()), sum(len(log) for log in tokens))
    summary = summarize_logs(requests, itl, totals, slo)
    trim_heap()                            # the columns and sorted copies the statistics took
    return summary


def collect(cfg: WorkloadConfig, servers: list[Server], num_requests: int, num_blocks: int,
            profile: Profile, client_queue_s: np.ndarray | None = None) -> RunResult:
    table = request_table(servers, num_requests)
    logs = RunLogs([s.replica for s in servers], [s.log for s in servers], [s.state.tokens for s in servers],
                   num_blocks)
    slo = cfg.slo.goodput_thresholds() if cfg.slo else None
    result = RunResult(table, None, None, {}, {}, logs)
    # each step row is one replica's
    summary = log_summary(table, logs.steps, logs.tokens, slo, num_blocks, result.itl())
    summary["num_out_of_range_lookups"] = profile.num_out_of_range
    # a kernel profile's label names its engine, version and wheel (analytic profiles have none)
    summary["profile_source"] = profile.provenance.get("label") or profile.provenance.get("source", "unknown")
    summary["profile_trust"] = profile_trust(profile)
    summary["policy"] = cfg.policy.kind
    summary["failed_by_reason"] = table.failed_by_reason()
    summary.update(prefix_cache_summary([s.state.kv for s in servers]))
    summary.update(speculative_summary([s.state.speculation for s in servers]))
    if len(servers) > 1:
        # grouped once: O(requests), not O(replicas x requests)
        order = np.argsort(table.cols["replica"], kind="stable")
        bounds = np.searchsorted(table.cols["replica"][order], [s.replica for s in servers] + [len(servers)])
        summary["replicas"] = [log_summary(table.take(order[bounds[k]:bounds[k + 1]]), [s.log], [s.state.tokens],
                                           slo, num_blocks) | prefix_cache_summary([s.state.kv])
                               for k, s in enumerate(servers)]
    meta = {"config": cfg.to_dict(), "seed": cfg.seed, "profile_name": profile.name,
            "profile_provenance": profile.provenance, "profile_efficiency": profile.efficiency,
            "kv_block_size": block_size_of(cfg, servers[0].policy), "policy_knobs": policy_knobs(built_config(cfg, servers[0].policy), servers[0].policy)}
    result.summary, result.meta = summary, meta
    result.client_queue_s = client_queue_s
    result.prefix_cache = prefix_cache_timeline(servers)
    return result


def prefix_cache_timeline(servers: list[Server]) -> pd.DataFrame | None:
    """The servers' prefix cache samples as one table (None without a prefix cache)."""
    if servers[0].cache_samples is None:
        return None
    parts = []
    for s in servers:
        a = np.frombuffer(s.cache_samples, dtype=np.float64).reshape(-1, 3)
        parts.append(pd.DataFrame({"time_s": a[:, 0], "replica": np.full(len(a), s.replica, np.int64),
                                   "kv_used_blocks": a[:, 1].astype(np.int64),
                                   "cached_free_blocks": a[:, 2].astype(np.int64)}))
    return pd.concat(parts, ignore_index=True).sort_values(["time_s", "replica"], kind="stable",
                                                           ignore_index=True)
