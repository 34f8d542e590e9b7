"""Disaggregated plan candidates: a candidate's ``disaggregation`` section, checked and expanded.

::

    candidates:
      - name: pd                              # optional
        disaggregation:
          prefill: {profile: {model: llama-3.1-8b, gpu: h100-sxm, tensor_parallel: 2}, router: least_tokens}
          decode:                             # a POOL or a list of POOLs
            - {profile: {model: llama-3.1-8b, gpu: h100-sxm}, price_per_gpu_hour: 2.99}
            - {profile: {model: llama-3.1-8b, gpu: h200}}
          link: {kind: rdma-400g}             # as a workload's (sim.run.pd_config)
          proxy_ms: 0.0
          abort_timeout_s: 480

A POOL is ``{profile, policy, server, price_per_gpu_hour, gpus_per_replica, router}``:
its profile is complete (nothing of the base workload's profile is merged in, as for an
aggregated candidate), its policy defaults to vllm_v1 (the decode side's is vllm_v1, the KV
handoff modelled being vLLM's), its server fields go over the base's, its price defaults to
the GPU preset's, its GPUs per replica to its tensor-parallel degree, its router to the
plan's ``router``. Each prefill option x each decode option is one candidate, named
"P <prefill> / D <decode>". The replica counts are what the plan searches
(``reports.experiments.pdplan``), so a pool's ``replicas`` is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from reports.experiments.spec import fail, positive_int
from sim.base.strict import did_you_mean
from sim.loop.feed import ROUTERS
from sim.run.config import set_dotted, workload_from_dict
from sim.run.pd_config import SECTION_KEYS

POOL_KEYS = ("profile", "policy", "server", "price_per_gpu_hour", "gpus_per_replica", "router")
CANDIDATE_KEYS = ("name", "disaggregation")
DEFAULT_POLICY = {"kind": "vllm_v1"}


def check_known(source: Path, where: str, data: dict, allowed: tuple[str, ...]) -> None:
    """Unknown keys named with the closest allowed one; a pool's ``replicas`` with why."""
    for key in data:
        if key == "replicas" and "router" in allowed:
            raise fail(source, f"{where}.replicas", "is set by the plan: it searches the prefill and decode "
                       "replica counts (xPyD) for the target rate", "remove it")
        if key not in allowed:
            raise fail(source, f"{where}.{key}", f"is unknown{did_you_mean(key, list(allowed))}",
                       f"use one of: {', '.join(allowed)}")


def _options(source: Path, where: str, value: Any) -> list[tuple[str, dict[str, Any]]]:
    """(field name, POOL mapping) for a POOL or a non-empty list of them."""
    if isinstance(value, dict):
        return [(where, value)]
    if not isinstance(value, list) or not value:
        raise fail(source, where, f"must be a pool mapping or a non-empty list of them, got {value!r}",
                   f"{where.rsplit('.', 1)[-1]}: {{profile: {{model: llama-3.1-8b, gpu: h100-sxm}}}}")
    return [(f"{where}[{i}]", v) for i, v in enumerate(value)]


def _label(pool: dict[str, Any]) -> str:
    profile = pool["profile"]
    tp = profile.get("tensor_parallel", 1)
    return str(profile.get("path") or profile.get("gpu", "h100-sxm")) + (f" x{tp}" if tp != 1 else "")


def _policy(source: Path, where: str, pool: dict[str, Any]) -> dict[str, Any]:
    policy = pool.get("policy", DEFAULT_POLICY)
    if isinstance(policy, str):
        policy = {"kind": policy}
    if not isinstance(policy, dict) or "kind" not in policy:
        raise fail(source, f"{where}.policy", f"must be a policy kind or a mapping with a kind, got {policy!r}",
                   "policy: {kind: vllm_v1}")
    return dict(policy)


def _pool(source: Path, where: str, pool: Any, base_dir: Path, default_price: Callable[..., tuple[float, str]],
          router: str, number: Callable[..., float]) -> dict[str, Any]:
    """The pool as the workload's disaggregation section takes it, and its price."""
    if not isinstance(pool, dict):
        raise fail(source, where, f"must be a mapping, got {pool!r}", "{profile: {gpu: h100-sxm}, router: round_robin}")
    check_known(source, where, pool, POOL_KEYS)
    if not isinstance(pool.get("profile"), dict):
        raise fail(source, f"{where}.profile", f"must be a mapping, got {pool.get('profile')!r}",
                   "profile: {model: llama-3.1-8b, gpu: h100-sxm, tensor_parallel: 1}")
    if pool.get("server") is not None and not isinstance(pool["server"], dict):
        raise fail(source, f"{where}.server", f"must be a mapping of server fields, got {pool['server']!r}",
                   "server: {gpu_memory_utilization: 0.9}")
    if pool.get("price_per_gpu_hour") is not None:
        price, price_source = number(source, f"{where}.price_per_gpu_hour", pool["price_per_gpu_hour"]), "given"
    else:
        price, price_source = default_price(source, where, pool["profile"], base_dir)
    gpus = (positive_int(source, f"{where}.gpus_per_replica", pool["gpus_per_replica"]) if "gpus_per_replica" in pool
            else positive_int(source, f"{where}.profile.tensor_parallel", pool["profile"].get("tensor_parallel", 1)))
    if "router" in pool and pool["router"] not in ROUTERS:
        close = did_you_mean(str(pool["router"]), list(ROUTERS))
        raise fail(source, f"{where}.router", f"is {pool['router']!r}{close}",
                   f"one of {', '.join(ROUTERS)} (default: the plan's router, {router})")
    section = {"replicas": 1, "router": pool.get("router", router), "profile": dict(pool["profile"]),
               "policy": _policy(source, where, pool)}
    if pool.get("server") is not None:
        section["server"] = pool["server"]
    return {"section": section, "label": _label(pool), "gpus_per_replica": gpus, "price_per_gpu_hour": price,
            "price_source": price_source, "explicit_gpus": "gpus_per_replica" in pool}


def disaggregated_candidates(source: Path, where: str, item: dict[str, Any], base_raw: dict[str, Any],
                             base_dir: Path, default_price: Callable[..., tuple[float, str]],
                             check_runnable: Callable[[Any], None], make: Callable[..., Any],
                             router: str, number: Callable[..., float]) -> list[Any]:
    """The candidates of one ``disaggregation`` entry (the product of its prefill and decode
    options), each validated as the workload it runs, before any run; ``make`` builds a
    ``planspec.Candidate``; ``router``: the plan's, each pool's unless it names its own; ``number``
    checks a price (``planspec._number``: passed in, as planspec imports this module)."""
    check_known(source, where, item, CANDIDATE_KEYS)
    section = item["disaggregation"]
    at = f"{where}.disaggregation"
    if not isinstance(section, dict):
        raise fail(source, at, f"must be a mapping, got {section!r}", "disaggregation: {prefill: POOL, decode: POOL}")
    check_known(source, at, section, SECTION_KEYS)
    for side in ("prefill", "decode"):
        if side not in section:
            raise fail(source, f"{at}.{side}", "is missing", f"add '{side}:' (a pool: {{profile: {{...}}}}, or a "
                       f"list of them)")
    prefills = [_pool(source, w, p, base_dir, default_price, router, number)
                for w, p in _options(source, f"{at}.prefill", section["prefill"])]
    decodes = [_pool(source, w, p, base_dir, default_price, router, number)
               for w, p in _options(source, f"{at}.decode", section["decode"])]
    shared = {k: section[k] for k in SECTION_KEYS if k not in ("prefill", "decode") and k in section}
    many = len(prefills) * len(decodes) > 1
    out = []
    for i, p in enumerate(prefills):
        for j, d in enumerate(decodes):
            hardware = f"P {p['label']} / D {d['label']}"
            # The workload's own profile and policy stay out of the pools: {} merges nothing into a
            # pool's profile, and a bare kind none of its knobs (sim.run.pd_config merges a pool's
            # sections over the workload's).
            raw = {k: v for k, v in base_raw.items() if k != "profile"}
            raw = set_dotted(raw, "profile", {})
            raw = set_dotted(raw, "policy", {"kind": d["section"]["policy"]["kind"]})
            raw = set_dotted(raw, "disaggregation", {"prefill": p["section"], "decode": d["section"], **shared})
            label = f"{source} [{at}, {hardware}]"
            cfg = workload_from_dict(raw, label, base_dir)
            for pool in (cfg.disaggregation.prefill, cfg.disaggregation.decode):
                check_runnable(pool.cfg)
            gpus = {}
            for side, chosen, pool in (("prefill", p, cfg.disaggregation.prefill),
                                       ("decode", d, cfg.disaggregation.decode)):
                gpus[side] = chosen["gpus_per_replica"]
                if pool.cfg.profile.path is not None and not chosen["explicit_gpus"]:
                    from sim.cost.profile import load_profile
                    gpus[side] = load_profile(pool.cfg.resolve_path(pool.cfg.profile.path)).tensor_parallel
            pools = {side: {"hardware": chosen["label"], "policy": _policy_text(chosen["section"]["policy"]),
                            "gpus_per_replica": gpus[side], "price_per_gpu_hour": chosen["price_per_gpu_hour"],
                            "price_source": chosen["price_source"]}
                     for side, chosen in (("prefill", p), ("decode", d))}
            name = item.get("name")
            name = (f"{name}: {hardware}" if many else str(name)) if name else hardware
            policy = pools["prefill"]["policy"] if pools["prefill"]["policy"] == pools["decode"]["policy"] else \
                f"P {pools['prefill']['policy']} / D {pools['decode']['policy']}"
            out.append(make(name=name, raw=raw, hardware=hardware, policy=policy, pools=pools))
    return out


def _policy_text(policy: dict[str, Any]) -> str:
    knobs = " ".join(f"{k}={v}" for k, v in policy.items() if k != "kind")
    return f"{policy['kind']} {knobs}".strip()
