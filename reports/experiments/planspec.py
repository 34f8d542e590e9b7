"""Plan files: parse and validate a capacity-planning question.

A plan file (paths relative to the file; ``out`` relative to the working
directory, like ``--out``)::

    name: azure-conv-50rps
    base: azure_conv.yaml               # traffic shape (arrivals, lengths); its rate is rescaled
    set: {max_tokens: output}           # overrides for every run (optional)
    target_rate: 50                     # req/s the fleet must serve
    slo: {ttft_ms: 2000, itl_ms: 100, attainment: 0.99}   # tpot_ms too; see reports.experiments.capacity
    router: least_requests              # round_robin | least_requests | least_tokens | prefix_aware
    target_utilization: 0.8             # size fleets to run at <= 80% of capacity (headroom)
    search: {num_requests: 400, rel_tol: 0.05, max_runs: 14}
    verify: {min_duration_s: 180, min_requests: 2000, max_extra_replicas: 3, max_queue_slope: 0.01}
    policies: [vllm, {kind: sarathi, max_num_batched_tokens: 512}]   # default for candidates
    candidates:
      - name: h100
        profile: {model: llama-3.1-8b, gpu: h100-sxm, tensor_parallel: 1}   # or {path: file}
        price_per_gpu_hour: 3.00        # optional: default, the GPU preset's price (sim.cost.presets)
        policies: [...]                 # optional, overrides the default list
        server: {gpu_memory_utilization: 0.9}   # optional
        gpus_per_replica: 1             # default: profile.tensor_parallel
      - disaggregation:                 # instead of profile: prefill and decode pools, xPyD searched
          prefill: {profile: {...}, price_per_gpu_hour: 3.0}   # a POOL or a list (reports.experiments.pdspec)
          decode: [{profile: {...}}, ...]
          link: {kind: rdma-400g}
    assumptions: ["prices are on-demand list prices, May 2025"]
    out: runs/plan_azure_conv

``sim plan --set KEY=VALUE`` (repeatable) edits the plan when KEY is one of
its own keys (``--set target_rate=80``, ``--set verify.min_duration_s=300``)
and otherwise the base traffic, after the file's ``set``. Keys the plan
itself decides (the candidates' policy and profile, the rate and the run
lengths) are refused there and in ``set``, where they would be overwritten.
``--seed N`` is ``--set seed=N``.
"""

from __future__ import annotations

import hashlib
import json
import math
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from reports.experiments.capacity import SearchSettings
from reports.experiments.spec import (apply_set, check_keys, check_runnable, fail, file_name, free_folder,
                                      holds_other, load_base, out_dir, positive_int, split_overrides,
                                      validate_run_settings, within)
from sim.base.strict import did_you_mean
from sim.run.config import ConfigError, Slo, load_yaml_mapping, set_dotted, workload_from_dict
from workloads.spec import MAX_RATE, MIN_RATE
from sim.results.folder import folder_kind, refuse_foreign
from workloads.generate import check_size

PLAN_KEYS = ("name", "description", "base", "set", "target_rate", "target_utilization", "slo", "router", "search",
             "verify", "policies", "candidates", "assumptions", "out")
CANDIDATE_KEYS = ("name", "profile", "price_per_gpu_hour", "policies", "server", "gpus_per_replica", "layouts")
SLO_KEYS = ("ttft_ms", "itl_ms", "tpot_ms", "attainment")
# NOTE: 0.8 because the wait of an M/G/1-like queue grows as rho / (1 - rho): 4 at 80% utilisation, 19 at
# 95%. A fleet sized at its measured capacity has no room for bursts, for a traffic ramp, or for the
# step-cost model's own error, and its p99 latencies sit on the steep part of that curve; capacity planners
# commonly aim at 70-80%.
DEFAULT_TARGET_UTILIZATION = 0.8
MIN_TARGET_UTILIZATION = 0.05                # a fleet sized to run at 5% of its capacity: 16x the default
# Workload fields the plan decides itself: a `set` or --set of them would be overwritten.
PLAN_OWNED = {"policy": "the candidates choose it: edit 'policies' (or --set policies=[...])",
              "profile": "the candidates choose it: edit 'candidates'",
              "arrivals.rate": "the plan rescales it to each trial and to the target: --set target_rate=N",
              "num_requests": "the plan sizes its runs: --set search.num_requests=N or verify.min_requests=N",
              "duration_s": "the plan sizes its runs: --set verify.min_duration_s=N",
              "slo": "the plan's 'slo' sets it: --set slo.ttft_ms=N",
              "disaggregation": "the candidates choose it: give a candidate a 'disaggregation' section"}


@dataclass(frozen=True)
class Verify:
    """How a fleet is checked at the target rate.

    Every candidate and every replica count is simulated on the same traffic:
    the first max(min_requests, min_duration_s x target_rate) requests. The
    duration lets a queue that falls behind show it (the p99 E2E latency of
    one replica at capacity is 8-40 s in the shipped plan, so 180 s holds
    several of the longest requests in each third of the window); the request
    floor keeps a p99 at a low target rate resting on 20+ samples. A fleet
    passes when it meets the SLOs, holds no backlog at the last arrival, and
    its queue delay over the last third of the arrivals trends up by at most
    ``max_queue_slope`` (``reports.experiments.capacity.queue_trend``): 0.01 s per s, the
    trend of a fleet falling 1% behind.
    """

    min_duration_s: float = 180.0
    min_requests: int = 2000
    max_extra_replicas: int = 3
    max_queue_slope: float = 0.01

    def num_requests(self, target_rate: float) -> int:
        return max(self.min_requests, math.ceil(self.min_duration_s * target_rate - 1e-9))


@dataclass(frozen=True)
class Candidate:
    """One (hardware, policy) option: the raw workload of one replica, and its price."""

    name: str
    raw: dict[str, Any]
    gpus_per_replica: int
    price_per_gpu_hour: float
    hardware: str
    policy: str
    # "given" (the plan file's), or where the default came from: the GPU preset's assumed price.
    price_source: str = "given"
    # "disaggregated": ``raw`` has a disaggregation section whose replica counts the plan sets, and
    # ``pools`` holds each pool's hardware, policy, GPUs per replica and price (reports.experiments.pdspec).
    layout: str = "aggregated"
    pools: dict[str, dict[str, Any]] | None = None
    # A layout of a ``layouts`` search that cannot run (it does not fit, or does not divide the
    # model): the one line saying why; the plan reports it and runs nothing of it.
    refused: str | None = None


@dataclass(frozen=True)
class PlanSpec:
    source: Path
    name: str
    base_path: Path
    target_rate: float
    slo: Slo
    router: str
    search: SearchSettings
    verify: Verify
    target_utilization: float
    candidates: list[Candidate]
    assumptions: list[str]
    out: Path
    kept_out_of: Path | None = None     # the default folder, when it held another plan


def _number(source: Path, field: str, value: Any, *, positive: bool = True) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (positive and value <= 0)):
        raise fail(source, field, f"must be a finite number{' > 0' if positive else ''}, got {value!r}",
                   f"set {field} to a {'positive ' if positive else ''}number")
    return float(value)


def _slo(source: Path, data: Any) -> Slo:
    if not isinstance(data, dict):
        raise fail(source, "slo", f"must be a mapping, got {data!r}", "slo: {ttft_ms: 2000, itl_ms: 100}")
    check_keys(source, "slo", data, SLO_KEYS)
    values = {k: _number(source, f"slo.{k}", v) for k, v in data.items() if v is not None}
    if not any(k in values for k in ("ttft_ms", "itl_ms", "tpot_ms")):
        raise fail(source, "slo", "sets no threshold", "give at least one of ttft_ms, itl_ms, tpot_ms")
    if not 0 < values.get("attainment", 0.99) <= 1:
        raise fail(source, "slo.attainment", f"must be in (0, 1], got {values['attainment']}", "attainment: 0.99")
    return Slo(**values)


def _section(source: Path, name: str, data: Any, cls: type) -> Any:
    if data is None:
        return cls()
    allowed = tuple(f.name for f in fields(cls))
    if not isinstance(data, dict):
        raise fail(source, name, f"must be a mapping, got {data!r}", f"{name}: {{{allowed[0]}: ...}}")
    check_keys(source, name, data, allowed)
    defaults = cls()
    for key, value in data.items():
        if isinstance(getattr(defaults, key), int):
            positive_int(source, f"{name}.{key}", value, minimum=0 if key == "max_extra_replicas" else 1)
        else:
            _number(source, f"{name}.{key}", value)
    return cls(**data)


def _policy_label(policy: Any) -> str:
    if isinstance(policy, str):
        return policy
    knobs = " ".join(f"{k}={v}" for k, v in policy.items() if k != "kind")
    return f"{policy.get('kind', '?')} {knobs}".strip()


def _candidates(source: Path, data: dict, base_raw: dict, slo: Slo, base_dir: Path,
                router: str = "least_requests") -> list[Candidate]:
    items = data.get("candidates")
    if not isinstance(items, list) or not items:
        raise fail(source, "candidates", f"must be a non-empty list, got {items!r}",
                   "candidates: [{profile: {gpu: h100-sxm}, price_per_gpu_hour: 3.0}]")
    for where, given in (("policies", data.get("policies")),
                         *((f"candidates[{i}].policies", c.get("policies")) for i, c in enumerate(items)
                           if isinstance(c, dict))):
        if given is not None and (not isinstance(given, list) or not given):
            raise fail(source, where, f"must be a non-empty list of policies, got {given!r}",
                       f"{where.split('.')[-1]}: [vllm, sarathi] (or leave it out for the base's policy)")
    default_policies = data.get("policies") or [base_raw.get("policy") or "vllm"]
    workload_slo = {k: v for k, v in (("ttft_ms", slo.ttft_ms), ("tpot_ms", slo.tpot_ms)) if v is not None}
    out: list[Candidate] = []
    checked: dict[str, None] = {}
    for i, item in enumerate(items):
        where = f"candidates[{i}]"
        if not isinstance(item, dict):
            raise fail(source, where, f"must be a mapping, got {item!r}", "{profile: {...}, price_per_gpu_hour: 3.0}")
        if "disaggregation" in item:
            out += _disaggregated(source, where, item, base_raw, workload_slo, base_dir, checked, router)
            continue
        if isinstance(item, dict) and "layouts" in item:
            out += _layouts(source, where, item, base_raw, workload_slo, base_dir, checked, default_policies)
            continue
        out += _plain(source, where, item, base_raw, workload_slo, base_dir, checked, default_policies)
    names = [c.name for c in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise fail(source, "candidates", f"name the same option twice: {dupes}", "give each candidate a distinct name:")
    return out


def _plain(source: Path, where: str, item: dict, base_raw: dict, workload_slo: dict, base_dir: Path,
           checked: dict[str, None], default_policies: list) -> list[Candidate]:
    """A candidate of one profile: one Candidate a policy."""
    out: list[Candidate] = []
    for key in item:
        if key not in CANDIDATE_KEYS:       # the closest key, disaggregation included
            close = did_you_mean(key, [*CANDIDATE_KEYS, "disaggregation"])
            raise fail(source, f"{where}.{key}", f"is unknown{close}",
                       f"use one of: {', '.join(CANDIDATE_KEYS)} (or disaggregation instead of profile)")
    check_keys(source, where, item, CANDIDATE_KEYS, required=("profile",))
    profile = item["profile"]
    if not isinstance(profile, dict):
        raise fail(source, f"{where}.profile", f"must be a mapping, got {profile!r}",
                   "profile: {model: llama-3.1-8b, gpu: h100-sxm, tensor_parallel: 1}")
    price_source = "given"
    if item.get("price_per_gpu_hour") is not None:
        price = _number(source, f"{where}.price_per_gpu_hour", item["price_per_gpu_hour"])
    else:
        price, price_source = _default_price(source, where, profile, base_dir)
    hardware = str(item.get("name") or profile.get("path") or
                   f"{profile.get('gpu', 'h100-sxm')}" + (f" x{profile['tensor_parallel']}"
                                                          if profile.get("tensor_parallel", 1) != 1 else ""))
    gpus = (positive_int(source, f"{where}.gpus_per_replica", item["gpus_per_replica"])
            if "gpus_per_replica" in item else
            positive_int(source, f"{where}.profile.tensor_parallel", profile.get("tensor_parallel", 1))
            * positive_int(source, f"{where}.profile.data_parallel_size", profile.get("data_parallel_size", 1)))
    policies = item.get("policies") or default_policies
    if not isinstance(policies, list):
        raise fail(source, f"{where}.policies", f"must be a list, got {policies!r}", "policies: [vllm, sarathi]")
    for policy in policies:
        raw = set_dotted(base_raw, "profile", profile)
        raw = set_dotted(raw, "policy", policy)
        raw = apply_set(source, raw, {"slo": workload_slo} if workload_slo else None)
        if item.get("server") is not None:
            if not isinstance(item["server"], dict):
                raise fail(source, f"{where}.server", f"must be a mapping of server fields, got {item['server']!r}",
                           "server: {gpu_memory_utilization: 0.9}")
            raw = apply_set(source, raw, {f"server.{k}": v for k, v in dict(item["server"]).items()})
        label = f"{source} [{where}, policy {_policy_label(policy)}]"
        cfg = workload_from_dict(raw, label, base_dir)
        check_runnable(cfg, checked)
        if cfg.profile.path is not None and "gpus_per_replica" not in item and policy is policies[0]:
            # A profile file states its own tensor-parallel degree (a path excludes the field):
            # a replica of a TP-2 profile is priced as 2 GPUs, as it simulates (read once: every
            # policy of the candidate runs the same file).
            from sim.cost.profile import load_profile
            gpus = load_profile(cfg.resolve_path(cfg.profile.path)).tensor_parallel
        out.append(Candidate(name=f"{hardware} / {_policy_label(policy)}", raw=raw, gpus_per_replica=gpus,
                             price_per_gpu_hour=price, hardware=hardware, policy=_policy_label(policy),
                             price_source=price_source))
    return out


def layout_grid(num_gpus: int) -> list[tuple[int, int, bool]]:
    """Every (tensor_parallel, data_parallel_size, enable_expert_parallel) of ``num_gpus`` GPUs a
    replica: t x d = num_gpus, experts split by width (False) or placed whole (True)."""
    return [(t, num_gpus // t, ep) for t in range(num_gpus, 0, -1) if num_gpus % t == 0 for ep in (False, True)]


def _layouts(source: Path, where: str, item: dict, base_raw: dict, workload_slo: dict, base_dir: Path,
             checked: dict[str, None], default_policies: list) -> list[Candidate]:
    """A candidate whose ``layouts: {gpus: N}`` asks for every TP x DP x EP layout of N GPUs a
    replica (``layout_grid``): one candidate each and policy; a layout that does not divide the
    model or does not fit its memory is kept as refused, with the line that says why. Expert
    parallelism of a dense model is no layout (left out)."""
    spec = item["layouts"]
    if not isinstance(spec, dict) or set(spec) != {"gpus"}:
        raise fail(source, f"{where}.layouts", f"must be {{gpus: N}} (the GPUs of one replica), got {spec!r}",
                   "layouts: {gpus: 8}")
    n = positive_int(source, f"{where}.layouts.gpus", spec["gpus"])
    if "profile" not in item or not isinstance(item["profile"], dict):
        raise fail(source, f"{where}.profile", "is needed with layouts: the model and GPU they lay out",
                   "profile: {model: deepseek-r1, gpu: h200}")
    fixed = sorted(k for k in ("tensor_parallel", "data_parallel_size", "enable_expert_parallel")
                   if k in item["profile"])
    if fixed or "gpus_per_replica" in item:
        key = f"profile.{fixed[0]}" if fixed else "gpus_per_replica"
        raise fail(source, f"{where}.{key}", "is what layouts searches; leave it out",
                   f"{where}.layouts: {{gpus: {n}}} tries every tensor_parallel x data_parallel_size")
    from sim.run.config import ConfigError
    out: list[Candidate] = []
    base_name = str(item.get("name") or f"{item['profile'].get('gpu', 'h100-sxm')} x{n}")
    for t, d, ep in layout_grid(n):
        profile = {**item["profile"], "tensor_parallel": t, "data_parallel_size": d, "enable_expert_parallel": ep}
        name = f"{base_name} TP{t}" + (f" DP{d}" if d > 1 else "") + (" EP" if ep else "")
        one = {k: v for k, v in item.items() if k != "layouts"}
        one.update(name=name, profile=profile, gpus_per_replica=n)
        try:
            found = _plain(source, where, one, base_raw, workload_slo, base_dir, checked, default_policies)
        except ConfigError as exc:
            why = str(exc)
            if "expert parallelism needs a mixture-of-experts model" in why:
                continue
            why = why.split("]: ", 1)[-1] if "]: " in why else why
            policy = _policy_label((item.get("policies") or default_policies)[0])
            out.append(Candidate(name=f"{name} / {policy}", raw={}, gpus_per_replica=n, price_per_gpu_hour=0.0,
                                 hardware=name, policy=policy, refused=why))
            continue
        out += found
    return out


def _disaggregated(source: Path, where: str, item: dict, base_raw: dict, workload_slo: dict, base_dir: Path,
                   checked: dict[str, None], router: str) -> list[Candidate]:
    """A candidate with a ``disaggregation`` section instead of a ``profile``: one Candidate per
    (prefill option, decode option) (reports.experiments.pdspec)."""
    from reports.experiments.pdspec import disaggregated_candidates
    if "profile" in item or "policies" in item:
        key = "profile" if "profile" in item else "policies"
        raise fail(source, f"{where}.{key}", "cannot go with a disaggregation section: each pool gives its own "
                   "profile and policy", f"move it into {where}.disaggregation.prefill and .decode")
    raw = apply_set(source, base_raw, {"slo": workload_slo} if workload_slo else None)

    def make(**fields: Any) -> Candidate:
        d = fields["pools"]["decode"]
        return Candidate(**fields, gpus_per_replica=d["gpus_per_replica"], price_per_gpu_hour=d["price_per_gpu_hour"],
                         price_source=d["price_source"], layout="disaggregated")
    return disaggregated_candidates(source, where, item, raw, base_dir, _default_price,
                                    lambda cfg: check_runnable(cfg, checked), make, router, _number)


def _default_price(source: Path, where: str, profile: dict, base_dir: Path) -> tuple[float, str]:
    """A candidate's price when the plan gives none: its GPU preset's ``price_per_gpu_hour``
    (a profile file's ``device``, else ``profile.gpu``, default h100-sxm), and where it came from."""
    from sim.cost.presets import GPU_PRESETS
    gpu = profile.get("gpu", "h100-sxm")
    if profile.get("path") is not None:
        from sim.cost.profile import ProfileError, load_profile
        path = Path(str(profile["path"])).expanduser()
        try:
            gpu = load_profile(path if path.is_absolute() else base_dir / path).device
        except ProfileError:
            gpu = None                   # the workload check names the bad file
    spec = GPU_PRESETS.get(str(gpu).lower()) if gpu is not None else None
    if spec is None and profile.get("path") is None:     # a typo, not a GPU without a price
        raise fail(source, f"{where}.profile.gpu", f"is {gpu!r}, not a GPU preset"
                   + did_you_mean(str(gpu).lower(), list(GPU_PRESETS)), f"one of {', '.join(GPU_PRESETS)}")
    if spec is None or spec.price_per_gpu_hour is None:
        raise fail(source, f"{where}.price_per_gpu_hour", f"is missing and GPU {gpu!r} has no preset price",
                   "give price_per_gpu_hour: N ($ per GPU-hour)")
    return spec.price_per_gpu_hour, f"default: preset {spec.name} (sim.cost.presets, an assumed on-demand price)"


def _check_not_owned(source: Path, overrides: dict[str, Any] | None, label: str) -> None:
    """Refuse overrides of fields the plan sets itself; ``label`` names where they came from ("--set {}")."""
    for key in overrides or {}:
        for owned, why in PLAN_OWNED.items():
            if within(str(key), owned):
                raise ConfigError(f"{source}: {label.format(key)}: the plan sets '{owned}' itself and would "
                                  f"overwrite it; fix: {why}")


def _target_utilization(source: Path, value: Any) -> float:
    u = _number(source, "target_utilization", value)
    if not MIN_TARGET_UTILIZATION <= u <= 1:           # below it, fleets of 20x what the traffic needs
        raise fail(source, "target_utilization", f"must be in [{MIN_TARGET_UTILIZATION:g}, 1], got {u:g}",
                   f"target_utilization: {DEFAULT_TARGET_UTILIZATION} (size fleets to run at 80% of capacity)")
    return u


def parse_plan(path: str | Path, out: Path | None = None, overrides: dict[str, Any] | None = None) -> PlanSpec:
    """Read, check and validate a plan file; every candidate is validated like a workload.

    ``overrides``: ``--set`` pairs (see the module docstring).
    """
    source = Path(path)
    own, traffic = split_overrides(source, overrides, PLAN_KEYS, file_only=("set", "candidates"))
    data = apply_set(source, load_yaml_mapping(source), own, "--set")
    check_keys(source, "", data, PLAN_KEYS, required=("base", "target_rate", "slo", "candidates"))
    base_path, base_raw = load_base(source, data["base"])
    if isinstance(data.get("set"), dict):
        _check_not_owned(source, data["set"], "field 'set.{}'")
    _check_not_owned(source, traffic, "--set {}")
    base_raw = apply_set(source, apply_set(source, base_raw, data.get("set")), traffic, "--set")
    kind = (base_raw.get("arrivals") or {}).get("kind", "poisson")
    if base_raw.get("disaggregation") is not None:
        raise fail(source, "base", "has a disaggregation section, which the candidates would run instead of "
                   "their own", "remove it from the base, and give a candidate a 'disaggregation' section")
    if kind == "all_at_once":
        raise fail(source, "base", "has arrivals.kind all_at_once, which has no rate to rescale",
                   "use a trace or a poisson/gamma/constant arrival process")
    if kind == "sessions":
        raise fail(source, "base", "has arrivals.kind sessions: each session sends its next turn after its reply, "
                   "and arrivals.rate counts sessions, so the request rates the plan offers are never offered",
                   "plan on open-loop arrivals (a trace or a poisson/gamma/constant process)")
    if kind == "concurrency" or (base_raw.get("arrivals") or {}).get("max_concurrency") is not None:
        raise fail(source, "base", "caps concurrency (arrivals.max_concurrency): its clients send as fast as replies "
                   "come back, so the rates the plan offers are never offered (capacity and verification would "
                   "be judged at rates the runs never saw)", "plan on open-loop arrivals (a trace or a "
                   "poisson/gamma/constant process without max_concurrency)")
    slo = _slo(source, data["slo"])
    router = str(data.get("router", "least_requests"))
    validate_run_settings(str(source), 1, router)
    search = _section(source, "search", data.get("search"), SearchSettings)
    if search.min_rate >= search.max_rate:
        raise fail(source, "search.min_rate", f"({search.min_rate}) must be below search.max_rate ({search.max_rate})",
                   "lower min_rate or raise max_rate")
    target_rate = _number(source, "target_rate", data["target_rate"])
    verify = _section(source, "verify", data.get("verify"), Verify)
    # Trial rates become each run's arrivals.rate: within what a workload accepts, found now, not
    # as every candidate's failure after the searches.
    for field, value in (("search.min_rate", search.min_rate), ("search.max_rate", search.max_rate),
                         ("target_rate", target_rate)):
        if not MIN_RATE <= value <= MAX_RATE:
            raise fail(source, field, f"must be in [{MIN_RATE:g}, {MAX_RATE:g}] requests per second, got {value:g}",
                       f"set {field} to a rate in that range")
    for field, value, hi in (("search.rel_tol", search.rel_tol, 1.0),
                             ("search.max_backlog_fraction", search.max_backlog_fraction, 1.0)):
        if not value <= hi:
            raise fail(source, field, f"must be in (0, {hi:g}], got {value:g}", f"{field}: "
                       f"{getattr(SearchSettings(), field.split('.')[1])}")
    sizes = _Sized(source)              # every run's size, against this machine's memory, before any run
    check_size(sizes, float(search.num_requests), "search.num_requests")
    num_verify = verify.num_requests(target_rate)
    check_size(sizes, float(num_verify), "verify.min_requests" if verify.min_requests >= num_verify else
               "verify.min_duration_s x target_rate")
    assumptions = data.get("assumptions") or []
    if not isinstance(assumptions, list) or not all(isinstance(a, str) for a in assumptions):
        raise fail(source, "assumptions", "must be a list of strings", 'assumptions: ["prices: on-demand, 2025"]')
    # Runs are sized by request count (search.num_requests, verify.num_requests()), not duration.
    base_raw = set_dotted({k: v for k, v in base_raw.items() if k != "duration_s"}, "num_requests", search.num_requests)
    folder, default = out_dir(source, data, out)
    spec = PlanSpec(
        source=source, name=file_name(source, data), base_path=base_path,
        target_rate=target_rate, slo=slo, router=router, search=search, verify=verify,
        target_utilization=_target_utilization(source, data.get("target_utilization", DEFAULT_TARGET_UTILIZATION)),
        candidates=_candidates(source, data, base_raw, slo, base_path.parent, router), assumptions=list(assumptions),
        out=folder)
    summary = spec_summary(spec)
    if default:
        free = free_folder(folder, lambda d: _other_plan(d, summary) or folder_kind(d) not in (None, "plan"))
        if free != folder:
            spec = dataclasses.replace(spec, out=free, kept_out_of=folder)
        return spec
    refuse_foreign(folder, "plan", "--out" if out is not None else f"{source}: field out")
    if _other_plan(folder, summary):
        raise ConfigError(f"{source}: {'--out' if out is not None else 'field out'} {folder} holds a plan for "
                          f"another question (other traffic, SLOs, candidates or settings); fix: choose another "
                          f"folder (--out DIR), or delete {folder / 'plan.json'} to replace it")
    return spec


@dataclass(frozen=True)
class _Sized:
    """What ``workloads.generate.check_size`` names in its error: the plan file."""

    source: Path


def _other_plan(d: Path, summary: dict[str, Any]) -> bool:
    """Whether ``d`` holds a plan that asked another question (or is not a folder)."""
    return holds_other(d, "plan.json", "plan.json", "plan", summary)


def spec_summary(spec: PlanSpec) -> dict[str, Any]:
    """A JSON-able record of the plan (for plan.json and the report)."""
    return json.loads(json.dumps({
        "name": spec.name, "source": str(spec.source), "base": str(spec.base_path), "target_rate": spec.target_rate,
        "slo": {k: getattr(spec.slo, k) for k in SLO_KEYS}, "slo_text": spec.slo.describe(), "router": spec.router,
        "search": spec.search.to_dict(), "verify": spec.verify.__dict__, "target_utilization": spec.target_utilization,
        "verify_requests": spec.verify.num_requests(spec.target_rate), "assumptions": spec.assumptions,
        # (layout and pools only for a disaggregated candidate: an aggregated plan's record, and so
        # the question its folder holds, stays what it was)
        "candidates": [{"name": c.name, "hardware": c.hardware, "policy": c.policy,
                        **({"layout": c.layout, "pools": c.pools} if c.layout != "aggregated" else {}),
                        "gpus_per_replica": c.gpus_per_replica, "price_per_gpu_hour": c.price_per_gpu_hour,
                        "price_source": c.price_source,
                        "profile": c.raw.get("profile"), "policy_config": c.raw.get("policy"),
                        # the whole workload it runs (base, set, --set, server): another one is another question
                        "workload_sha256": hashlib.sha256(json.dumps(c.raw, sort_keys=True, default=str)
                                                          .encode()).hexdigest()}
                       for c in spec.candidates]}, default=str))
