"""The policy half of a workload's config: the ``policy`` section validated
into the policy's own config dataclass (``policy_config``), vLLM's
``enable_chunked_prefill`` alias, and the knobs a run records
(``policy_knobs``). The rest of the workload is ``sim.run.config``'s.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from policies.base import RESERVE_MODES
from policies import POLICIES
from sim.base.strict import ConfigError, _positive, build, did_you_mean

# Every knob of some policy: one of another policy's is set aside with a warning, one of none is a typo.
ALL_POLICY_KNOBS = frozenset(f.name for cfg_cls, _ in POLICIES.values()
                             for f in dataclasses.fields(cfg_cls)) - {"kind"}


def _chunked_prefill_alias(data: dict[str, Any], src: str) -> dict[str, Any]:
    """vLLM's ``enable_chunked_prefill`` flag, mapped onto the batchsim policy
    that models the scheduler it selects, with a note. vLLM v0 with chunked
    prefill is the ``sarathi`` policy (decode-first, then partial prefills,
    then new prompts under one token budget); without it, ``vllm``. vLLM v1
    and Sarathi always chunk here; v1's --no-enable-chunked-prefill (no
    partial prefill of a new request, budget raised to max_model_len) is not
    modelled, so it is refused."""
    kind = data.get("kind")
    if "enable_chunked_prefill" not in data or not isinstance(kind, str) or kind not in POLICIES:
        return data                       # (an unknown kind is reported by the caller)
    if any(f.name == "enable_chunked_prefill" for f in dataclasses.fields(POLICIES[kind][0])):
        return data                       # the policy's own knob (tensorrt_llm)
    rest = {k: v for k, v in data.items() if k != "enable_chunked_prefill"}
    flag = data["enable_chunked_prefill"]
    if not isinstance(flag, bool):
        raise ConfigError(f"{src}: field 'policy.enable_chunked_prefill' expected true or false, got {flag!r}")
    if kind == "vllm":
        if flag:
            warnings.warn(f"{src}: policy.kind vllm with enable_chunked_prefill true is vLLM v0's chunked-"
                          f"prefill scheduler: simulated as policy.kind sarathi", stacklevel=4)
            return {**rest, "kind": "sarathi"}
        return rest
    if kind in ("vllm_v1", "sarathi") and flag:
        return rest                       # they always chunk
    if kind in ("vllm_v1", "sarathi"):
        raise ConfigError(f"{src}: field 'policy.enable_chunked_prefill' false is not modelled for policy "
                          f"{kind}, which always chunks prefills; for a scheduler without chunked prefill "
                          f"use policy.kind vllm (vLLM v0)")
    raise ConfigError(f"{src}: field 'policy.enable_chunked_prefill' applies to policy.kind vllm, vllm_v1 or "
                      f"sarathi, not {kind!r}; remove it")


def policy_config(data: Any, src: str) -> Any:
    """The policy section of a workload (a mapping with a ``kind``, or just the
    kind), validated into that policy's config dataclass; ``src`` names the file."""
    if data is None:
        data = {"kind": "vllm"}
    if isinstance(data, str):
        data = {"kind": data}
    if not isinstance(data, dict) or "kind" not in data:
        raise ConfigError(f"{src}: field 'policy' needs a 'kind' ({', '.join(POLICIES)})")
    data = _chunked_prefill_alias(data, src)
    kind = data["kind"]
    if not isinstance(kind, str) or kind not in POLICIES:
        raise ConfigError(f"{src}: field 'policy.kind' must be one of {', '.join(POLICIES)}, got {kind!r}"
                          + did_you_mean(kind, list(POLICIES)))
    cls = POLICIES[kind][0]
    own = {f.name for f in dataclasses.fields(cls)}
    if "enable_prefix_caching" in data and "enable_prefix_caching" not in own:
        flag = data["enable_prefix_caching"]
        if flag is not False and "prefix_caching" in own:      # TGI's knob has its launcher's name
            raise ConfigError(f"{src}: field 'policy.enable_prefix_caching': policy {kind} names it "
                              f"'policy.prefix_caching'")
        if flag is not False:
            raise ConfigError(f"{src}: field 'policy.enable_prefix_caching': policy {kind} has no prefix cache "
                              f"(it is modelled for policy.kind vllm_v1, vLLM v1's KV manager, and lmdeploy); "
                              f"remove it or set it false")
        data = {k: v for k, v in data.items() if k != "enable_prefix_caching"}
    knobs = {k: v for k, v in data.items() if k != "kind"}
    # A knob of another policy (say max_num_batched_tokens on static) is set
    # aside with a warning, so one file or sweep can switch policy.kind; a
    # knob of no policy at all is a typo and an error.
    foreign = sorted(k for k in knobs if k not in own and k in ALL_POLICY_KNOBS)
    if foreign:
        warnings.warn(f"{src}: policy.{', policy.'.join(foreign)} not used by policy {kind} (ignored)",
                      stacklevel=3)
    cfg = build(cls, {k: v for k, v in knobs.items() if k not in foreign}, "policy", src)
    for f in dataclasses.fields(cls):
        v = getattr(cfg, f.name)
        if kind == "sglang" and f.name == "chunked_prefill_size" and v == -1:
            continue                      # SGLang's -1: chunked prefill off
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            _positive(src, f"policy.{f.name}", v, allow_zero=f.default == 0)   # a default of 0 means "off"
    if kind == "vllm_v1" and not cfg.watermark < 1:
        raise ConfigError(f"{src}: field 'policy.watermark' must be in [0, 1), got {cfg.watermark}")
    reserve = getattr(cfg, "reserve", None)
    if reserve is not None and reserve not in RESERVE_MODES:
        raise ConfigError(f"{src}: field 'policy.reserve' must be {', '.join(RESERVE_MODES[:-1])} or "
                          f"{RESERVE_MODES[-1]}, got {reserve!r}")
    return cfg


def policy_knobs(config: Any, policy: Any) -> dict[str, Any]:
    """The knobs that ran (``policy.knobs()``): ``config``, the policy's own, with
    every knob left to a default (None) replaced by the value the policy
    resolved (vLLM v0's token budget of max(max_model_len, 2048), vLLM v1's
    device defaults), so a result records what ran rather than "default"."""
    knobs = policy.knobs()
    for f in dataclasses.fields(config):        # a knob the config sets is what runs
        value = getattr(config, f.name)
        assert value is None or knobs[f.name] == value, f"{f.name}: {value} set, {knobs[f.name]} ran"
    return knobs
