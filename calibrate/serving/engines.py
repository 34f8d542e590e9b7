"""The serving engines ``--server`` recognises: how each says what it is, what its
knobs are called, and which batchsim policy models its scheduler. Torch-free, no I/O
(``client.server_info`` fetches; this module reads what came back).

Detection (``detect``), from what answers:

* **vLLM**: ``/metrics`` is Prometheus text with ``vllm:`` series (its
  ``vllm:cache_config_info`` gauge holds the KV pool), or ``/v1/models`` cards
  are ``owned_by: vllm``.
* **SGLang** (read from sglang 0.5.23's wheel:
  ``python/sglang/srt/entrypoints/http_server.py`` ``get_server_info`` ->
  ``server_info``, ``python/sglang/srt/utils/common.py`` ``build_server_info``,
  ``python/sglang/srt/server_args.py`` ``ServerArgs.resolved_dict``, the fields
  in ``python/sglang/srt/arg_groups/fields/*.py``,
  ``python/sglang/srt/managers/scheduler.py`` ``get_init_info``):
  ``GET /get_server_info`` (deprecated alias of ``/server_info``) answers one
  flat JSON object: every resolved server arg under its own name
  (``max_running_requests``, ``chunked_prefill_size``, ``max_prefill_tokens``,
  ``page_size``, ``mem_fraction_static``, ``schedule_policy``,
  ``schedule_conservativeness``, ``disable_radix_cache``, ``enable_mixed_chunk``,
  ``context_length``, ``tp_size``, ...), the scheduler's ``max_total_num_tokens``
  (the KV token pool) and ``max_req_input_len``, ``internal_states`` (one per
  data-parallel rank, each with ``effective_max_running_requests_per_dp``) and
  ``version``. Its ``/v1/models`` cards are ``owned_by: sglang`` with
  ``max_model_len`` (the model's context length).
* **TensorRT-LLM** ``trtllm-serve`` (read from NVIDIA/TensorRT-LLM's
  ``tensorrt_llm/serve/openai_server.py``, ``register_routes`` /
  ``get_iteration_stats`` / ``version`` / ``get_model``,
  ``tensorrt_llm/serve/openai_protocol.py`` ``ModelCard``,
  ``cpp/tensorrt_llm/executor/jsonSerialization.cpp`` and
  ``tensorrt_llm/_torch/pyexecutor/py_executor.py`` ``_update_iter_stats``, as
  stored in the search index; 1.2.1's own wheel was not downloaded (NVIDIA's
  index, gigabytes), so field names are those of the stored source):
  ``GET /metrics`` answers a JSON *list* of the iteration stats queued since the
  last read (``iter``, ``numActiveRequests``, ``maxNumActiveRequests``,
  ``maxBatchSizeStatic``, ``maxNumTokensStatic``, ``kvCacheStats``:
  ``maxNumBlocks``, ``freeNumBlocks``, ``usedNumBlocks``, ``tokensPerBlock``,
  ``reusedBlocks``, ...), empty unless the server runs with
  ``enable_iter_perf_stats: true`` and has run an iteration since; ``GET
  /version`` is ``{"version": ...}``; ``/v1/models`` cards are ``owned_by:
  tensorrt_llm`` and give no ``max_model_len``.

What cannot be recovered. TensorRT-LLM: ``max_seq_len`` (the model length:
``--model-config``'s ``max_position_embeddings`` stands in), ``max_num_tokens``
on the PyTorch backend (its stats leave ``maxNumTokensStatic`` 0; the token
budget is then inferred by probing), ``capacity_scheduler_policy``,
``enable_chunked_prefill`` and ``enable_block_reuse`` (no endpoint says them:
the policy's defaults stand), and anything at all without iteration stats.
SGLang: every knob named here is in ``/get_server_info``; the page count is
``max_total_num_tokens // page_size``.

Mapping (``ENGINES``): engine kind -> the batchsim policy kind, the policy's knobs
under the engine's names, and the batchsim keys the runner reads
(``sim.run.runner.resolve_server``, ``policies.vllm_v1.engine_defaults``:
max_num_seqs, max_num_batched_tokens, num_gpu_blocks, block_size,
max_model_len). ``policy_for`` refuses a policy kind this batchsim does not
register (``policies.POLICIES``) with one clear ConfigError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sim.base.strict import ConfigError

ENGINE_KINDS = ("vllm", "sglang", "tensorrt_llm", "unknown")
BATCHSIM_KEYS = ("max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks", "block_size", "max_model_len")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine: its name for people, the policy that models it and the knobs that policy
    takes (the engine's names). Which of them switches prefix caching is the policy's own
    declaration (``Policy.prefix_switch``)."""

    kind: str
    label: str
    policy: str
    policy_knobs: tuple[str, ...]


ENGINES: dict[str, EngineSpec] = {
    "vllm": EngineSpec("vllm", "vLLM", "vllm_v1", ("max_num_seqs", "max_num_batched_tokens")),
    "sglang": EngineSpec("sglang", "SGLang", "sglang",
                         ("max_running_requests", "chunked_prefill_size", "max_prefill_tokens", "page_size",
                          "mem_fraction_static", "schedule_policy", "schedule_conservativeness",
                          "disable_radix_cache", "enable_mixed_chunk")),
    "tensorrt_llm": EngineSpec("tensorrt_llm", "TensorRT-LLM", "tensorrt_llm",
                               ("max_batch_size", "max_num_tokens", "tokens_per_block", "capacity_scheduler_policy",
                                "enable_chunked_prefill", "enable_block_reuse")),
    # An OpenAI-compatible server that says nothing about itself: simulated as vLLM, as before.
    "unknown": EngineSpec("unknown", "an OpenAI-compatible server", "vllm_v1",
                          ("max_num_seqs", "max_num_batched_tokens")),
}


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What one engine's endpoints said: its kind and version, its knobs under its own
    names (``knobs``: only those it said), and the batchsim keys made from them
    (``batchsim``: None where unknown; plus ``enable_prefix_caching``)."""

    kind: str
    version: str | None
    knobs: dict[str, Any]
    batchsim: dict[str, Any]


def _pos_int(value: Any) -> int | None:
    """A positive whole number, else None (JSON numbers, or digit strings as vLLM's gauges have)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return value if isinstance(value, int) and value > 0 else None


def card_owner(models: Any) -> str | None:
    """``owned_by`` of the first ``/v1/models`` card, if it has one."""
    data = models.get("data") if isinstance(models, dict) else None
    card = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    owner = card.get("owned_by")
    return owner if isinstance(owner, str) else None


def detect(models: Any, metrics_text: str | None, sglang_info: Any) -> str:
    """The engine kind from what answered: ``/v1/models`` (parsed), ``/metrics``' body
    (None: no answer) and ``/get_server_info`` (parsed; None: no answer)."""
    text = metrics_text or ""
    if "vllm:" in text:
        return "vllm"
    if isinstance(sglang_info, dict) and ("max_total_num_tokens" in sglang_info
                                          or "max_running_requests" in sglang_info):
        return "sglang"
    if text.lstrip().startswith("["):          # trtllm-serve: iteration stats as a JSON list
        return "tensorrt_llm"
    if "sglang:" in text:                        # SGLang with --enable-metrics, /get_server_info unread
        return "sglang"
    owner = card_owner(models)
    return {"vllm": "vllm", "sglang": "sglang", "tensorrt_llm": "tensorrt_llm"}.get(owner or "", "unknown")


def sglang_facts(info: dict[str, Any], max_model_len: int | None = None) -> EngineFacts:
    """SGLang's knobs from ``/get_server_info`` (module doc). ``max_model_len``: the
    ``/v1/models`` card's, else the server's ``context_length``. The running-request cap
    is the scheduler's effective one (``internal_states[0]``) when it says, else the arg;
    the step's token budget is ``chunked_prefill_size`` capped by ``max_prefill_tokens``
    (without chunked prefill, -1: ``max_prefill_tokens``)."""
    spec = ENGINES["sglang"]
    knobs = {k: info[k] for k in spec.policy_knobs if info.get(k) is not None}
    states = info.get("internal_states")
    state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    running = _pos_int(state.get("effective_max_running_requests_per_dp")) or _pos_int(info.get("max_running_requests"))
    if running is not None:
        knobs["max_running_requests"] = running
    for key in ("context_length", "tp_size", "max_total_num_tokens"):
        if info.get(key) is not None:
            knobs[key] = info[key]
    page = _pos_int(info.get("page_size"))
    pool = _pos_int(info.get("max_total_num_tokens"))
    chunk, prefill = info.get("chunked_prefill_size"), _pos_int(info.get("max_prefill_tokens"))
    chunk = _pos_int(chunk)
    budget = min(chunk, prefill) if chunk and prefill else chunk or prefill
    radix_off = info.get("disable_radix_cache")
    batchsim = {"max_num_seqs": running, "max_num_batched_tokens": budget,
                "num_gpu_blocks": pool // page if pool and page else None, "block_size": page,
                "max_model_len": _pos_int(max_model_len) or _pos_int(info.get("context_length")),
                "enable_prefix_caching": None if not isinstance(radix_off, bool) else not radix_off}
    version = info.get("version")
    return EngineFacts("sglang", str(version) if version is not None else None, knobs, batchsim)


def trtllm_facts(stats: Any, version: str | None = None) -> EngineFacts:
    """TensorRT-LLM's knobs from ``/metrics``' iteration stats (the latest that has
    ``kvCacheStats``; module doc). ``max_batch_size``: ``maxBatchSizeStatic`` where the
    C++ executor fills it, else ``maxNumActiveRequests`` (the PyTorch executor's
    ``max_num_active_requests``: max_batch_size x pipeline stages, 1 stage assumed);
    ``max_num_tokens``: ``maxNumTokensStatic`` where filled, else unknown."""
    entries = [s for s in stats if isinstance(s, dict)] if isinstance(stats, list) else []
    with_kv = [s for s in entries if isinstance(s.get("kvCacheStats"), dict)]
    last = (with_kv or entries or [{}])[-1]
    kv = last.get("kvCacheStats") if isinstance(last.get("kvCacheStats"), dict) else {}
    batch = _pos_int(last.get("maxBatchSizeStatic")) or _pos_int(last.get("maxNumActiveRequests"))
    tokens = _pos_int(last.get("maxNumTokensStatic"))
    per_block, blocks = _pos_int(kv.get("tokensPerBlock")), _pos_int(kv.get("maxNumBlocks"))
    knobs = {k: v for k, v in (("max_batch_size", batch), ("max_num_tokens", tokens),
                                ("tokens_per_block", per_block), ("max_num_blocks", blocks)) if v is not None}
    batchsim = {"max_num_seqs": batch, "max_num_batched_tokens": tokens, "num_gpu_blocks": blocks,
                "block_size": per_block, "max_model_len": None, "enable_prefix_caching": None}
    return EngineFacts("tensorrt_llm", version, knobs, batchsim)


def engine_mapping(kind: str, knobs: dict[str, Any], batchsim: dict[str, Any]) -> dict[str, Any]:
    """The profile's ``engine`` entries for an engine: ``engine_kind``, its knobs under its
    own names, and the batchsim keys (``BATCHSIM_KEYS``, ``enable_prefix_caching``) the
    runner reads; a batchsim key wins over an engine knob of the same name."""
    out: dict[str, Any] = {"engine_kind": kind, **knobs}
    out.update({k: batchsim.get(k) for k in (*BATCHSIM_KEYS, "enable_prefix_caching")})
    return out


def require_policy(kind: str) -> EngineSpec:
    """The engine's spec; ConfigError when its policy is not registered here."""
    from policies import POLICIES

    spec = ENGINES.get(kind, ENGINES["unknown"])
    if spec.policy not in POLICIES:
        raise ConfigError(f"policy {spec.policy} is not available in this batchsim (the server is {spec.label}); "
                          f"the policies here: {', '.join(sorted(POLICIES))}")
    return spec


def policy_for(kind: str, knobs: dict[str, Any], prefix_caching: bool | None = None) -> dict[str, Any]:
    """The workload ``policy`` section that simulates engine ``kind``: its policy kind and
    the knobs it was given under the engine's names (those of ``spec.policy_knobs`` in
    ``knobs`` that are not None), ``prefix_caching`` as the engine's own switch unless
    None. ConfigError when the policy is not registered here (``require_policy``)."""
    from policies import POLICIES

    spec = require_policy(kind)
    policy: dict[str, Any] = {"kind": spec.policy}
    policy.update({k: knobs[k] for k in spec.policy_knobs if knobs.get(k) is not None})
    switch = POLICIES[spec.policy][1].prefix_switch
    if prefix_caching is not None and switch is not None:
        policy[switch.knob] = prefix_caching == switch.on
    return policy


def prefix_caching_of(policy_config: Any) -> bool | None:
    """Whether a validated policy config caches prefixes, by its policy's switch
    (``Policy.prefix_switch``: vLLM's ``enable_prefix_caching``, SGLang's
    ``disable_radix_cache``, TensorRT-LLM's ``enable_block_reuse``, ...); None for a
    policy without one."""
    from policies import POLICIES

    switch = POLICIES[policy_config.kind][1].prefix_switch
    return None if switch is None else getattr(policy_config, switch.knob) == switch.on
