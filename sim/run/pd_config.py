"""The ``disaggregation`` section of a workload: two pools, a link, the proxy's hop; every field
checked. The run is ``sim.run.disagg``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from sim.base.strict import ConfigError, did_you_mean
from sim.loop.feed import ROUTERS
from sim.loop.handoff import LinkSpec
from sim.run.pd_trtllm import check_tensorrt_llm_pools

# Each GPU's port, each way: nominal line rates (gigabits per second, as NICs are sold) and a
# one-way latency before the data flows. What a transfer engine achieves is below line rate:
# give bandwidth_gbps for the rate measured on your fabric.
LINK_PRESETS: dict[str, tuple[float, float, str]] = {
    "nvlink4": (3600.0, 2.0, "NVLink 4 within a node (H100/H200: 900 GB/s both ways = 450 GB/s each way)"),
    "nvlink5": (7200.0, 2.0, "NVLink 5 within a node or an NVL72 rack (B200/GB200: 1.8 TB/s both ways)"),
    "rdma-400g": (400.0, 5.0, "a 400G RDMA NIC per GPU (ConnectX-7 NDR InfiniBand or RoCE)"),
    "rdma-800g": (800.0, 5.0, "an 800G RDMA NIC per GPU (ConnectX-8 XDR)"),
    "pcie5": (512.0, 3.0, "PCIe 5.0 x16 (64 GB/s each way)"),
    "tcp-100g": (100.0, 50.0, "TCP over 100G Ethernet"),
}
POOL_KEYS = ("replicas", "router", "profile", "policy", "server")
SECTION_KEYS = ("prefill", "decode", "link", "proxy_ms", "abort_timeout_s", "num_reserved_decode_tokens")
# The fields of one handoff only: vLLM's proxy and NixlConnector, SGLang's decode headroom.
VLLM_ONLY = ("proxy_ms", "abort_timeout_s")
SGLANG_ONLY = ("num_reserved_decode_tokens",)
LINK_KEYS = ("kind", "bandwidth_gbps", "latency_us")


@dataclass(frozen=True, slots=True)
class Pool:
    name: str                   # prefill | decode
    replicas: int
    router: str
    cfg: Any                    # the workload as this pool runs it (a WorkloadConfig)


@dataclass(frozen=True, slots=True)
class Disaggregation:
    prefill: Pool
    decode: Pool
    link: LinkSpec
    link_kind: str | None
    proxy_s: float
    abort_timeout_s: float | None         # None: no abort timeout (TensorRT-LLM: sim.run.pd_trtllm)
    # The handoff: "vllm" (NixlConnector, sim.loop.handoff), "sglang" (both pools sglang:
    # sim.loop.handoff_sglang), with SGLang's num_reserved_decode_tokens, or "tensorrt_llm" (both
    # pools tensorrt_llm: sim.run.pd_trtllm).
    handoff: str = "vllm"
    num_reserved_decode_tokens: int = 512

    def to_dict(self) -> dict[str, Any]:
        d = {"prefill": {"replicas": self.prefill.replicas, "router": self.prefill.router},
             "decode": {"replicas": self.decode.replicas, "router": self.decode.router},
             "link": {"kind": self.link_kind, "bandwidth_gbps": self.link.bandwidth_gbps,
                      "latency_us": self.link.latency_us}}
        if self.handoff == "sglang":
            d.update(handoff="sglang", num_reserved_decode_tokens=self.num_reserved_decode_tokens)
        else:
            d.update(proxy_ms=self.proxy_s * 1e3, abort_timeout_s=self.abort_timeout_s)
            if self.handoff != "vllm":
                d["handoff"] = self.handoff
        return d


def _number(value: Any, where: str, source: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(f"{source}: field '{where}' must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"{source}: field '{where}' must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _mapping(value: Any, where: str, source: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: field '{where}' must be a mapping, got {value!r}")
    for key in value:
        if key not in keys:
            raise ConfigError(f"{source}: unknown field '{where}.{key}'{did_you_mean(key, list(keys))}; "
                              f"allowed: {', '.join(keys)}")
    return value


def _pool(data: dict[str, Any], name: str, source: str, base_dir: str, build: Callable[..., Any]) -> Pool:
    where = f"disaggregation.{name}"
    raw = _mapping(data["disaggregation"].get(name), where, source, POOL_KEYS)
    replicas = raw.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"{source}: field '{where}.replicas' must be an integer >= 1, got {replicas!r}")
    router = raw.get("router", "round_robin")
    if router not in ROUTERS:
        raise ConfigError(f"{source}: field '{where}.router' must be one of {', '.join(ROUTERS)}, got {router!r}"
                          f"{did_you_mean(router, list(ROUTERS))}")
    merged = {k: v for k, v in data.items() if k != "disaggregation"}
    for section in ("profile", "server", "policy"):
        if section not in raw:
            continue
        given = raw[section]
        if not isinstance(given, dict):
            raise ConfigError(f"{source}: field '{where}.{section}' must be a mapping, got {given!r}")
        base = data.get(section) if isinstance(data.get(section), dict) else {}
        if section == "policy" and "kind" in given and given["kind"] != base.get("kind"):
            base = {}                            # another policy: none of the workload's knobs apply
        merged[section] = {**base, **given}
    cfg = build(merged, f"{source} ({where})", base_dir)
    return Pool(name, replicas, router, cfg)


def parse_disaggregation(data: dict[str, Any], source: str, base_dir: str,
                         build: Callable[..., Any]) -> Disaggregation:
    """The workload's ``disaggregation`` section, every field checked (file, field, what was
    expected); ``build`` makes each pool's workload from its merged mapping (``workload_from_dict``,
    passed in so that this module does not import the one that imports it)."""
    section = _mapping(data["disaggregation"], "disaggregation", source, SECTION_KEYS)
    for name in ("prefill", "decode"):
        if name not in section:
            raise ConfigError(f"{source}: field 'disaggregation.{name}' is missing: a disaggregated run needs a "
                              f"prefill pool and a decode pool (each may be {{}} to take the workload's own)")
    prefill = _pool(data, "prefill", source, base_dir, build)
    decode = _pool(data, "decode", source, base_dir, build)
    if check_tensorrt_llm_pools(section, prefill, decode, source):      # sim.run.pd_trtllm
        handoff = "tensorrt_llm"
        for key in SGLANG_ONLY:
            if key in section:
                raise ConfigError(f"{source}: field 'disaggregation.{key}' is SGLang's (its decode side's headroom); "
                                  f"both pools are tensorrt_llm, whose handoff is TensorRT-LLM's: remove it")
    else:
        handoff = _handoff(section, prefill, decode, source)
    if handoff == "sglang":
        decode = _sglang_decode_pool(data, decode, source)
    if getattr(decode.cfg.policy, "speculative", None):
        raise ConfigError(f"{source}: field 'disaggregation.decode.policy.speculative': speculative decoding on "
                          f"a decode instance with a KV connector is not modelled; remove it")
    for field in ("model", "dtype", "kv_cache_dtype", "weight_dtype", "path"):
        a, b = getattr(prefill.cfg.profile, field), getattr(decode.cfg.profile, field)
        if a != b and field in ("model", "kv_cache_dtype", "path"):
            raise ConfigError(f"{source}: field 'disaggregation': the prefill pool's profile.{field} ({a!r}) "
                              f"differs from the decode pool's ({b!r}); both serve the same model with the same "
                              f"KV layout (converting KV between precisions is not modelled)")
    if data.get("arrivals", {}).get("kind") == "sessions" if isinstance(data.get("arrivals"), dict) else False:
        raise ConfigError(f"{source}: field 'arrivals.kind' sessions with disaggregation is not modelled; use "
                          f"open-loop arrivals or arrivals.max_concurrency")
    link_raw = _mapping(section.get("link", {"kind": "rdma-400g"}), "disaggregation.link", source, LINK_KEYS)
    kind = link_raw.get("kind")
    if kind is not None and kind not in LINK_PRESETS:
        raise ConfigError(f"{source}: field 'disaggregation.link.kind' must be one of {', '.join(LINK_PRESETS)}, "
                          f"got {kind!r}{did_you_mean(kind, list(LINK_PRESETS))}")
    if kind is None and "bandwidth_gbps" not in link_raw:
        raise ConfigError(f"{source}: field 'disaggregation.link' needs a kind ({', '.join(LINK_PRESETS)}) or a "
                          f"bandwidth_gbps")
    bw, lat = (LINK_PRESETS[kind][:2] if kind is not None else (None, 0.0))
    if "bandwidth_gbps" in link_raw:
        bw = _number(link_raw["bandwidth_gbps"], "disaggregation.link.bandwidth_gbps", source)
    if "latency_us" in link_raw:
        lat = _number(link_raw["latency_us"], "disaggregation.link.latency_us", source, positive=False)
    proxy_s = _number(section.get("proxy_ms", 0.0), "disaggregation.proxy_ms", source, positive=False) / 1e3
    timeout = (None if handoff == "tensorrt_llm" else
               _number(section.get("abort_timeout_s", 480.0), "disaggregation.abort_timeout_s", source))
    reserved = section.get("num_reserved_decode_tokens", 512)
    if isinstance(reserved, bool) or not isinstance(reserved, int) or reserved < 0:
        raise ConfigError(f"{source}: field 'disaggregation.num_reserved_decode_tokens' must be an integer >= 0 "
                          f"(SGLang's --num-reserved-decode-tokens, default 512), got {reserved!r}")
    return Disaggregation(prefill, decode, LinkSpec(bw, lat), kind, proxy_s, timeout, handoff, reserved)


def _handoff(section: dict[str, Any], prefill: Pool, decode: Pool, source: str) -> str:
    """Which handoff the pools' kinds select: a decode pool of vllm_v1 is vLLM's (any prefill
    policy, as before); one of sglang is SGLang's, whose prefill pool must be sglang too (its
    bootstrap server and prealloc queue have no counterpart in the other engines). Any other
    decode kind, and a field of the other handoff, are refused."""
    pk, dk = prefill.cfg.policy.kind, decode.cfg.policy.kind
    if dk == "vllm_v1":
        for key in SGLANG_ONLY:
            if key in section:
                raise ConfigError(f"{source}: field 'disaggregation.{key}' is SGLang's (its decode side's headroom); "
                                  f"the decode pool is vllm_v1, whose handoff is vLLM's: remove it, or set both "
                                  f"pools' policy kind to sglang")
        return "vllm"
    if dk != "sglang":
        raise ConfigError(f"{source}: field 'disaggregation.decode.policy.kind' is {dk}; the KV handoffs modelled "
                          f"are vLLM's (NixlConnector, decode pool vllm_v1), SGLang's (both pools sglang) and "
                          f"TensorRT-LLM's (both pools tensorrt_llm): set the decode pool's policy kind to "
                          f"vllm_v1 or sglang, or both pools' to tensorrt_llm")
    if pk != "sglang":
        raise ConfigError(f"{source}: field 'disaggregation.decode.policy.kind' is sglang but "
                          f"'disaggregation.prefill.policy.kind' is {pk}: SGLang's handoff (the decode side "
                          f"reserves KV, the prefill side's bootstrap queue waits for it) runs between SGLang "
                          f"instances only; set the prefill pool's policy kind to sglang, or the decode pool's "
                          f"to vllm_v1")
    for key in VLLM_ONLY:
        if key in section:
            what = ("the vLLM proxy's hop from the prefill reply to the decode send; SGLang's router sends "
                    "both at once" if key == "proxy_ms" else
                    "vLLM NixlConnector's timeout for KV nobody read; SGLang's decode side reserves the KV "
                    "before the prefill, so none is left unread")
            raise ConfigError(f"{source}: field 'disaggregation.{key}' is {what}: remove it (both pools are sglang)")
    return "sglang"


def _sglang_decode_pool(data: dict[str, Any], decode: Pool, source: str) -> Pool:
    """The decode pool as SGLang runs a decode instance: its radix cache off
    (``handle_pd_disaggregation`` sets ``disable_radix_cache`` unless
    ``--disaggregation-decode-enable-radix-cache``, not modelled)."""
    own = data["disaggregation"]["decode"].get("policy") or {}
    if own.get("disable_radix_cache") is False:
        raise ConfigError(f"{source}: field 'disaggregation.decode.policy.disable_radix_cache' is false: an "
                          f"SGLang decode instance runs without its radix cache unless "
                          f"--disaggregation-decode-enable-radix-cache, which is not modelled; remove the field")
    cfg = decode.cfg
    if not cfg.policy.disable_radix_cache:
        cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, disable_radix_cache=True))
    return Pool(decode.name, decode.replicas, decode.router, cfg)
