"""The policy half of a workload's config: the ``policy`` section validated
into the policy's own config dataclass (``policy_config``), vLLM's
``enable_chunked_prefill`` and ``enable_prefix_caching`` flags on policies
that name them otherwise, and the knobs a run records (``policy_knobs``).
The rest of the workload is ``sim.run.config``'s.

Nothing here names a policy: what differs between them is read from their
declarations (``sim.core.policy.Policy``: ``prefix_switch``,
``always_chunks``, ``chunked_variant``) and from their knobs' metadata
(``policies.base.knob``: ``off``, ``below``, ``choices``).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from policies import POLICIES
from sim.core.speculative import parse_speculative
from sim.base.strict import MAX_COUNT, MAX_SPAN_S, ConfigError, _positive, build, did_you_mean

# Every knob of some policy: one of another policy's is set aside with a warning, one of none is a typo.
ALL_POLICY_KNOBS = frozenset(f.name for cfg_cls, _ in POLICIES.values()
                             for f in dataclasses.fields(cfg_cls)) - {"kind"}


def _own_knobs(kind: str) -> set[str]:
    return {f.name for f in dataclasses.fields(POLICIES[kind][0])}


def kinds_where(test: Any) -> str:
    """'a, b or c': the registered kinds whose policy class passes ``test``."""
    kinds = [kind for kind, (_, cls) in POLICIES.items() if test(cls)]
    return ", ".join(kinds[:-1]) + " or " + kinds[-1] if len(kinds) > 1 else "".join(kinds)


def _chunked_prefill_alias(data: dict[str, Any], src: str) -> dict[str, Any]:
    """vLLM's ``enable_chunked_prefill`` flag on a policy that has no such knob of
    its own: a policy that always chunks takes ``true`` and refuses ``false``
    (vLLM v1's no-chunking mode, say, is not modelled); one with a
    ``chunked_variant`` runs as that kind with ``true`` (with a note) and as
    itself with ``false``; any other refuses the flag."""
    kind = data.get("kind")
    if "enable_chunked_prefill" not in data or not isinstance(kind, str) or kind not in POLICIES:
        return data                       # (an unknown kind is reported by the caller)
    if "enable_chunked_prefill" in _own_knobs(kind):
        return data                       # the policy's own knob
    cls = POLICIES[kind][1]
    rest = {k: v for k, v in data.items() if k != "enable_chunked_prefill"}
    flag = data["enable_chunked_prefill"]
    if not isinstance(flag, bool):
        raise ConfigError(f"{src}: field 'policy.enable_chunked_prefill' expected true or false, got {flag!r}")
    if cls.always_chunks:
        if flag:
            return rest
        raise ConfigError(f"{src}: field 'policy.enable_chunked_prefill' false is not modelled for policy "
                          f"{kind}, which always chunks prefills; for a scheduler without chunked prefill "
                          f"use policy.kind {kinds_where(lambda c: c.chunked_variant is not None)}")
    if cls.chunked_variant is not None:
        if flag:
            warnings.warn(f"{src}: policy.kind {kind} with enable_chunked_prefill true is its scheduler with "
                          f"chunked prefill: simulated as policy.kind {cls.chunked_variant}", stacklevel=4)
            return {**rest, "kind": cls.chunked_variant}
        return rest
    applies = kinds_where(lambda c: c.always_chunks or c.chunked_variant is not None)
    raise ConfigError(f"{src}: field 'policy.enable_chunked_prefill' applies to policy.kind {applies}, not "
                      f"{kind!r}; remove it")


def _prefix_caching_flag(data: dict[str, Any], src: str) -> dict[str, Any]:
    """vLLM's ``enable_prefix_caching`` on a policy that has no knob of that name:
    refused where the policy switches its prefix cache by another knob (naming
    it), and where it has none, ``true`` is refused and ``false`` (what it
    does anyway) set aside."""
    kind = data["kind"]
    if "enable_prefix_caching" not in data or "enable_prefix_caching" in _own_knobs(kind):
        return data
    switch = POLICIES[kind][1].prefix_switch
    flag = data["enable_prefix_caching"]
    where = f"{src}: field 'policy.enable_prefix_caching'"
    if switch is not None:
        default = next(f.default for f in dataclasses.fields(POLICIES[kind][0]) if f.name == switch.knob)
        sense = "" if switch.on else f", the other way round ({str(switch.on).lower()}: cache on)"
        raise ConfigError(f"{where}: policy {kind} names it 'policy.{switch.knob}'{sense}; its default, "
                          f"{str(default).lower()}, has the cache {'on' if default == switch.on else 'off'}")
    if flag is not False:
        raise ConfigError(f"{where}: policy {kind} has no prefix cache (policy.kind "
                          f"{kinds_where(lambda c: c.prefix_switch is not None)} have one); remove it or set "
                          f"it false")
    return {k: v for k, v in data.items() if k != "enable_prefix_caching"}


def check_server_fields(kind: str, server: Any, src: str) -> None:
    """Refuse a ``server`` field the workload sets (``server``: the section as written)
    that policy ``kind`` does not read (``Policy.server_knobs``), naming the knob of its
    own that means it, or saying it has none: dropped, it would run the engine's default
    while the file says otherwise."""
    if not isinstance(server, dict):
        return
    unread = POLICIES[kind][1].server_knobs
    for name, value in server.items():
        if name not in unread or value is None:
            continue
        knob, note = unread[name]
        where = f"{src}: field 'server.{name}' is not read by policy {kind}"
        if knob is None:
            raise ConfigError(f"{where}, which has no knob for it ({note}); remove it")
        default = next(f.default for f in dataclasses.fields(POLICIES[kind][0]) if f.name == knob)
        raise ConfigError(f"{where}: its knob is 'policy.{knob}' ({note}; default {_shown(default)}); "
                          f"set that instead")


def _shown(value: Any) -> str:
    return "unset: the engine's rule" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _check_knobs(cfg: Any, src: str) -> None:
    """Every knob's range, from its metadata (``policies.base.knob``): numbers > 0
    (>= 0 where the default 0 means off), or the knob's ``off`` value, and below its
    ``below``; strings among its ``choices``."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        meta = f.metadata
        if "off" in meta and v == meta["off"]:
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            _positive(src, f"policy.{f.name}", v, allow_zero=f.default == 0)
            if "below" in meta and not v < meta["below"]:
                raise ConfigError(f"{src}: field 'policy.{f.name}' must be in [0, {meta['below']}), got {v}")
            # A count fits int32 as every server's does; a time (a name in _s) stays within a run's span.
            most, what = (f"{MAX_SPAN_S:g} s (31 years)", MAX_SPAN_S) if f.name.endswith("_s") else \
                (f"{MAX_COUNT:,} (a count)", MAX_COUNT if isinstance(v, int) else None)
            if what is not None and v > what:
                raise ConfigError(f"{src}: field 'policy.{f.name}' must be at most {most}, got "
                                  f"{f'{v:,}' if isinstance(v, int) else f'{v:g}'}")
        choices = meta.get("choices")
        if choices is not None and v not in choices:
            raise ConfigError(f"{src}: field 'policy.{f.name}' must be {', '.join(choices[:-1])} or "
                              f"{choices[-1]}, got {v!r}")


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
    data = _prefix_caching_flag(data, src)
    own = _own_knobs(kind)
    knobs = {k: v for k, v in data.items() if k != "kind"}
    # A knob of another policy (say max_num_batched_tokens on static) is set
    # aside with a warning, so one file or sweep can switch policy.kind; a
    # knob of no policy at all is a typo and an error.
    foreign = sorted(k for k in knobs if k not in own and k in ALL_POLICY_KNOBS)
    spec = knobs.get("speculative")
    if "speculative" in foreign and spec is not None and spec != {"num_speculative_tokens": 0}:
        # Not set aside: speculation changes every decode, and ignoring it would mislead.
        having = ", ".join(k for k in POLICIES if "speculative" in _own_knobs(k))
        raise ConfigError(f"{src}: field 'policy.speculative': speculative decoding is modelled for policy.kind "
                          f"{having}, not {kind}; remove it or set policy.kind")
    if foreign:
        warnings.warn(f"{src}: policy.{', policy.'.join(foreign)} not used by policy {kind} (ignored)",
                      stacklevel=3)
    cfg = build(POLICIES[kind][0], {k: v for k, v in knobs.items() if k not in foreign}, "policy", src)
    _check_knobs(cfg, src)
    if getattr(cfg, "speculative", None) is not None:
        # its fields, in the user's spelling (a policy may parse its engine's own: sglang's eagle_topk)
        getattr(POLICIES[kind][1], "parse_speculative", parse_speculative)(cfg.speculative, src)
    unread = {k: why for k, why in POLICIES[kind][1].unread_knobs(cfg).items() if knobs.get(k) is not None}
    for k, why in unread.items():
        warnings.warn(f"{src}: policy.{k} is ignored by policy {kind} {why}", stacklevel=3)
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
