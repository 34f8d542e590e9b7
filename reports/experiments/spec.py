"""Sweep files: parse, expand into runs, validate every run before any starts.

A sweep file (paths in it are relative to the file, except ``out``, which
like ``--out`` is relative to the working directory)::

    base: azure_conv.yaml            # the workload every run starts from
    set: {num_requests: 400}         # fixed overrides for every run (optional)
    vary:                            # cartesian grid over dotted keys
      policy.max_num_batched_tokens: [256, 512, 1024]
      arrivals.rate: [2, 4, 8]
      policy: [{kind: static, batch_size: 32}, vllm]   # whole sub-mappings work too
    repetitions: 2                   # independent seeds per grid point (default 1)
    num_replicas: 1                  # run-level settings; may also be varied
    router: round_robin
    save_runs: false                 # keep each run's files under OUT/runs/<run_id>/
    out: runs/my_sweep               # default runs/<sweep file stem>

``sim sweep --set KEY=VALUE`` (repeatable) edits the sweep file when KEY is
one of its own keys (``--set repetitions=3``, ``--set num_replicas=2``) and
otherwise the base workload of every run, after the file's ``set``
(``--set policy.max_num_seqs=64``). A KEY the grid varies (or
a field inside it) is refused: the grid would overwrite it. ``--seed N`` is
``--set seed=N``.

Seeds: repetition 0 uses the workload's own seed (so one repetition
reproduces ``sim run``); repetition r > 0 uses
``SeedSequence(seed, spawn_key=(r,))``. Grid points share the seed of a
repetition (common random numbers), so they see the same traffic.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from sim.run.config import ConfigError, WorkloadConfig, load_yaml_mapping, set_dotted, workload_from_dict
from sim.results.folder import folder_kind, refuse_foreign

RUN_KEYS = ("num_replicas", "router")          # run_workload arguments, not workload fields
MAX_RUNS = 100_000          # runs of one sweep (each a simulation: a bigger grid is a typo or days of work)
SWEEP_KEYS = ("name", "description", "base", "set", "vary", "repetitions", "num_replicas", "router",
              "save_runs", "out")


def fail(source: Path | str, field: str, problem: str, fix: str) -> ConfigError:
    """A ConfigError in the project's one-line format: file, field, what is wrong, the fix."""
    return ConfigError(f"{source}: field '{field}' {problem}; fix: {fix}")


WORKLOAD_ONLY = ("arrivals", "lengths", "policy", "server", "profile", "num_requests", "duration_s")


def check_keys(source: Path | str, where: str, data: dict, allowed: tuple[str, ...],
               required: tuple[str, ...] = ()) -> None:
    """Reject unknown keys (listing the allowed ones) and missing required ones; a workload file
    given where a sweep or plan belongs is named as one."""
    if not where and "base" not in data and "base" in required:
        own = [k for k in WORKLOAD_ONLY if k in data]
        if own:
            kind = "sweep" if "vary" in required else "plan"
            raise ConfigError(f"{source}: this is a workload file (it has {', '.join(own)}), not a {kind} file; "
                              f"fix: run it with `sim run {source}`, or write a {kind} file whose 'base:' names it")
    for key in data:
        if key not in allowed:
            field = f"{where}.{key}" if where else str(key)
            raise fail(source, field, "is unknown", f"use one of: {', '.join(allowed)}")
    for key in required:
        if data.get(key) is None:
            field = f"{where}.{key}" if where else key
            raise fail(source, field, "is missing", f"add '{key}:' ({_HINTS.get(key, 'see the docs')})")


_HINTS = {"base": "a workload YAML, relative to this file", "vary": "a mapping of dotted key -> list of values",
          "target_rate": "requests per second the fleet must serve", "slo": "e.g. {ttft_ms: 2000, itl_ms: 100}",
          "candidates": "a list of {profile, price_per_gpu_hour, policies}",
          "price_per_gpu_hour": "the GPU's price in $ per hour (default: the GPU preset's)", "profile": "{model, gpu, tensor_parallel} or {path}"}


def positive_int(source: Path | str, field: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise fail(source, field, f"must be an integer >= {minimum}, got {value!r}",
                   f"set {field}: {max(minimum, 1)} or more")
    return value


def load_base(source: Path, value: Any, field: str = "base") -> tuple[Path, dict[str, Any]]:
    """Resolve ``base`` relative to the file that names it and read its raw mapping."""
    if not isinstance(value, str) or not value:
        raise fail(source, field, f"must be a path to a workload YAML, got {value!r}", "base: my_workload.yaml")
    path = (source.parent / value).resolve()
    if path.is_dir():
        raise fail(source, field, f"names {value!r}, a folder ({path})", "give a workload YAML path relative to "
                   "this file")
    if not path.is_file():
        raise fail(source, field, f"names {value!r}, which does not exist ({path})",
                   "give a workload YAML path relative to this file")
    raw = load_yaml_mapping(path)
    other = [key for key in ("base", "vary", "candidates", "target_rate") if key in raw]
    if other:
        what = "plan" if {"candidates", "target_rate"} & set(other) else "sweep"
        raise fail(source, field, f"names {value!r}, a {what} file (it has '{other[0]}'), not a workload",
                   "base: the workload YAML that `sim run` takes")
    return path, raw


def apply_set(source: Path, raw: dict[str, Any], overrides: Any, field: str = "set") -> dict[str, Any]:
    if overrides is None:
        return raw
    if not isinstance(overrides, dict):
        raise fail(source, field, f"must be a mapping of dotted key -> value, got {overrides!r}",
                   f"{field}: {{num_requests: 400}}")
    for key, value in overrides.items():
        raw = set_dotted(raw, str(key), value, f"{source} ({field}: {key})")
    return raw


def cli_overrides(pairs: list[str] | None, seed: int | None = None) -> dict[str, Any]:
    """``--set KEY=VALUE`` texts (YAML values) and ``--seed`` as one mapping of dotted key -> value."""
    from sim.run.config import parse_override
    overrides = dict(parse_override(text) for text in pairs or [])
    if seed is not None:
        overrides["seed"] = seed
    return overrides


def split_overrides(source: Path, overrides: dict[str, Any] | None, file_keys: tuple[str, ...],
                    file_only: tuple[str, ...]) -> tuple[dict, dict]:
    """(overrides of the sweep or plan file's own keys, overrides of the base workload).

    Keys under ``file_only`` (mappings with dotted or list keys of their own,
    such as a sweep's ``vary``) are refused: a dotted --set cannot address them.
    """
    own = {k: v for k, v in (overrides or {}).items() if k.split(".")[0] in file_keys}
    for key in own:
        if key.split(".")[0] in file_only:
            raise ConfigError(f"{source}: --set {key}: '{key.split('.')[0]}' can only be edited in the file; "
                              f"fix: edit it in {source.name}, or --set a workload field (e.g. --set "
                              f"policy.max_num_seqs=64)")
    return own, {k: v for k, v in (overrides or {}).items() if k not in own}


def file_name(source: Path, data: dict[str, Any]) -> str:
    """A sweep's or plan's ``name`` (default: the file's stem): a string, as it titles reports."""
    name = data.get("name")
    if name is not None and not (isinstance(name, str) and name.strip()):
        raise fail(source, "name", f"must be a text, got {name!r}", f"name: {source.stem}")
    return name or source.stem


def within(key: str, other: str) -> bool:
    """Whether dotted ``key`` is ``other`` or a field inside it (so that setting ``other`` replaces it)."""
    return key == other or key.startswith(other + ".")


def flatten(key: str, value: Any) -> dict[str, Any]:
    """Columns for one varied value: scalars stay, mappings flatten to dotted keys."""
    if key == "policy" and isinstance(value, str):
        value = {"kind": value}
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(f"{key}.{k}", v))
        return out
    if isinstance(value, list):
        return {key: json.dumps(value)}
    return {key: value}


def run_id_of(values: dict[str, Any], repetition: int) -> str:
    """Stable 12-hex-digit id of a grid point and repetition (independent of key order)."""
    text = json.dumps({"values": values, "repetition": repetition}, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def repetition_seed(seed: int, repetition: int) -> int:
    """Repetition 0 keeps ``seed``; r > 0 gets an independent stream's 32-bit seed."""
    if repetition == 0:
        return int(seed)
    ss = np.random.SeedSequence(entropy=int(seed), spawn_key=(repetition,))
    return int(ss.generate_state(1, dtype=np.uint32)[0])


@dataclass(frozen=True)
class RunTask:
    """One simulation of a sweep: everything a worker needs, picklable."""

    run_id: str
    values: dict[str, Any]        # the grid point: vary key -> value as written
    columns: dict[str, Any]       # the grid point flattened to table columns
    repetition: int
    seed: int
    raw: dict[str, Any]           # the full raw workload mapping of this run
    source: str
    base_dir: str
    num_replicas: int
    router: str
    save_dir: str | None = None


@dataclass(frozen=True)
class SweepSpec:
    source: Path
    name: str
    base_path: Path
    base_raw: dict[str, Any]      # the base workload with ``set`` applied
    vary: dict[str, list[Any]]
    repetitions: int
    num_replicas: int
    router: str
    save_runs: bool
    out: Path
    kept_out_of: Path | None = None     # the default folder, when it held another sweep

    def fingerprint(self) -> str:
        """What a results table depends on besides its run ids: base, grid keys, run settings."""
        text = json.dumps({"base": self.base_raw, "vary_keys": sorted(self.vary), "num_replicas": self.num_replicas,
                           "router": self.router}, sort_keys=True, default=str)
        return hashlib.sha1(text.encode()).hexdigest()[:16]


def parse_sweep(path: str | Path, out: Path | None = None, overrides: dict[str, Any] | None = None) -> SweepSpec:
    """Read and check a sweep file (structure only; ``expand`` validates the runs).

    ``overrides``: ``--set`` pairs (see the module docstring).
    """
    source = Path(path)
    own, workload = split_overrides(source, overrides, SWEEP_KEYS, file_only=("vary", "set"))
    data = apply_set(source, load_yaml_mapping(source), own, "--set")
    check_keys(source, "", data, SWEEP_KEYS, required=("base", "vary"))
    base_path, base_raw = load_base(source, data["base"])
    base_raw = apply_set(source, base_raw, data.get("set"))
    vary = data["vary"]
    if not isinstance(vary, dict) or not vary:
        raise fail(source, "vary", f"must be a non-empty mapping of dotted key -> list of values, got {vary!r}",
                   "vary: {policy.max_num_batched_tokens: [512, 1024]}")
    for key, values in vary.items():
        if not isinstance(values, list) or not values:
            raise fail(source, f"vary.{key}", f"must be a non-empty list of values, got {values!r}",
                       f"vary: {{{key}: [value1, value2]}}")
        if key in ("seed", "name"):
            raise fail(source, f"vary.{key}", "cannot be varied", "use 'repetitions: N' for independent seeds")
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) != len(values):
            raise fail(source, f"vary.{key}", f"lists a value twice: {values!r}", "remove the duplicate")
    for key in vary:
        for other in vary:
            if other != key and within(str(other), str(key)):
                raise fail(source, f"vary.{other}", f"lies within vary.{key}, which sets it too: each run would "
                           f"take one of the two values and lose the other", "vary one of them")
    for key in overrides or {}:
        for varied in vary:
            if within(key, str(varied)):
                raise ConfigError(f"{source}: --set {key}: the sweep varies '{varied}', which would overwrite it in "
                                  f"every run; fix: drop --set {key}, or change vary.{varied} in the file")
    base_raw = apply_set(source, base_raw, workload, "--set")
    repetitions = positive_int(source, "repetitions", data.get("repetitions", 1))
    num_runs = math.prod(len(v) for v in vary.values()) * repetitions
    if num_runs > MAX_RUNS:
        raise fail(source, "repetitions" if repetitions > 1 else "vary",
                   f"asks for {num_runs:,} runs, more than {MAX_RUNS:,}", "a smaller grid, or split the sweep")
    save_runs = data.get("save_runs", False)
    if not isinstance(save_runs, bool):
        raise fail(source, "save_runs", f"must be true or false, got {save_runs!r}", "save_runs: true")
    folder, default = out_dir(source, data, out)
    spec = SweepSpec(
        source=source, name=file_name(source, data), base_path=base_path, base_raw=base_raw,
        vary={str(k): list(v) for k, v in vary.items()},
        repetitions=repetitions,
        num_replicas=positive_int(source, "num_replicas", data.get("num_replicas", 1)),
        router=str(data.get("router", "round_robin")), save_runs=save_runs, out=folder)
    if default:
        fingerprint = spec.fingerprint()
        free = free_folder(folder, lambda d: holds_other(d, "results.csv", "sweep.json", "fingerprint", fingerprint)
                           or folder_kind(d) not in (None, "sweep"))
        if free != folder:
            spec = dataclasses.replace(spec, out=free, kept_out_of=folder)
    else:
        refuse_foreign(folder, "sweep", "--out" if out is not None else f"{source}: field out")
    return spec


def holds_other(d: Path, results: str, record: str, key: str, expected: Any) -> bool:
    """Whether ``d`` is not a folder, or holds ``results`` whose ``record`` JSON has another
    ``key`` than ``expected`` (or cannot be read): another sweep's or plan's question."""
    if d.exists() and not d.is_dir():
        return True
    if not (d / results).is_file():
        return False
    try:
        return json.loads((d / record).read_text()).get(key) != expected
    except (OSError, ValueError, AttributeError):
        return True


def free_folder(default: Path, taken: Callable[[Path], bool]) -> Path:
    """``default``, or the first of DEFAULT-2, DEFAULT-3, ... that ``taken`` does not refuse (as
    ``sim run`` picks a folder: results of another question are never overwritten)."""
    path, k = default, 1
    while taken(path):
        k += 1
        path = default.with_name(f"{default.name}-{k}")
    return path


def out_dir(source: Path, data: dict[str, Any], cli_out: Path | None) -> tuple[Path, bool]:
    """The output folder: ``--out``, else the file's ``out`` field, else runs/<file stem>, and
    whether it is a default (not ``--out``: a sweep or plan that asks another question then goes
    to a free sibling folder instead). A file at a given path, or an ``out`` that is not a path,
    is an error before any run starts."""
    value = data.get("out")
    if cli_out is None and value is not None and (not isinstance(value, str) or not value.strip()):
        raise fail(source, "out", f"must be a folder path, got {value!r}", f"out: runs/{source.stem}")
    out = cli_out or (Path(value) if value else Path("runs") / source.stem)
    if cli_out is None and not value:
        return out, True
    for parent in (out, *out.parents):
        if parent.exists() and not parent.is_dir():
            where = "--out" if cli_out is not None else "field 'out'"
            problem = "is a file, not a folder" if parent == out else f"runs through {parent}, which is a file"
            raise ConfigError(f"{source}: {where} {out} {problem}; fix: choose another folder (--out DIR)")
        if parent.exists():
            break
    return out, cli_out is None


def validate_run_settings(source: str, num_replicas: Any, router: Any) -> None:
    """num_replicas >= 1 and a known router, else a ConfigError naming ``source``."""
    from sim.loop.feed import ROUTERS
    positive_int(source, "num_replicas", num_replicas)
    if router not in ROUTERS:
        raise fail(source, "router", f"must be one of {', '.join(ROUTERS)}, got {router!r}", "router: least_requests")


def check_runnable(cfg: WorkloadConfig, checked: dict[str, None]) -> None:
    """Build the profile and KV pool once per distinct (profile, server), and read each
    distinct trace file once, so that an unknown GPU, a model that does not fit or a
    malformed trace fails before any run starts."""
    from sim.run.runner import build_profile, kv_blocks
    from workloads.traces import load_trace
    resolved = cfg.to_dict()
    key = json.dumps([resolved["profile"], resolved["server"]], sort_keys=True, default=str)
    if key not in checked:
        kv_blocks(cfg, build_profile(cfg))
        checked[key] = None
    from workloads.generate import check_size
    if cfg.num_requests is not None:           # as the run itself would refuse it, but before any run
        check_size(cfg, float(cfg.num_requests), "num_requests")
    elif cfg.duration_s is not None and cfg.arrivals.rate is not None:
        check_size(cfg, cfg.arrivals.rate * cfg.duration_s, "duration_s")
    a, ln = cfg.arrivals, cfg.lengths
    traces = []
    if a.kind == "trace" and a.path:
        traces.append((cfg.resolve_path(a.path), dict(need_arrivals=True, columns=a.columns, time_unit=a.time_unit)))
    if ln.kind == "empirical" and ln.path:
        traces.append((cfg.resolve_path(ln.path), dict(need_arrivals=False, columns=ln.columns,
                                                       columns_field="lengths.columns")))
    for path, how in traces:
        key = json.dumps([str(path), how], sort_keys=True, default=str)
        if key not in checked:
            load_trace(path, **how)
            checked[key] = None
    if ln.kind == "sessions" and ln.path:
        from workloads.traces import load_sessions
        path = cfg.resolve_path(ln.path)
        key = json.dumps([str(path), "sessions"])
        if key not in checked:
            load_sessions(path)
            checked[key] = None


def expand(spec: SweepSpec) -> list[RunTask]:
    """Every run of the grid x repetitions, each validated like a workload file.

    Raises ConfigError naming the sweep file and the offending grid point.
    """
    keys = list(spec.vary)
    arrivals, lengths = spec.base_raw.get("arrivals") or {}, spec.base_raw.get("lengths") or {}
    if spec.repetitions > 1 and arrivals.get("kind") == "trace" and lengths.get("kind", "trace") == "trace":
        warnings.warn(f"{spec.source}: field 'repetitions' is {spec.repetitions}, but the base replays a trace's "
                      f"arrivals and lengths, which no seed changes: the repetitions will be identical", stacklevel=2)
    tasks: list[RunTask] = []
    checked: dict[str, None] = {}
    for combo in itertools.product(*(spec.vary[k] for k in keys)):
        values = dict(zip(keys, combo))
        label = ", ".join(f"{k}={json.dumps(v, default=str)}" for k, v in values.items())
        where = f"{spec.source} [run {label}]"
        raw = dict(spec.base_raw)
        run_settings = {"num_replicas": spec.num_replicas, "router": spec.router}
        for key, value in values.items():
            if key in RUN_KEYS:
                run_settings[key] = value
            else:
                raw = set_dotted(raw, key, value, where)
        validate_run_settings(where, run_settings["num_replicas"], run_settings["router"])
        cfg = workload_from_dict(raw, where, spec.base_path.parent)
        check_runnable(cfg, checked)
        columns: dict[str, Any] = {}
        for key, value in values.items():
            columns.update(flatten(key, value))
        for rep in range(spec.repetitions):
            seed = repetition_seed(cfg.seed, rep)
            run_id = run_id_of(values, rep)
            tasks.append(RunTask(
                run_id=run_id, values=values, columns=columns, repetition=rep, seed=seed,
                raw=set_dotted(raw, "seed", seed), source=str(spec.base_path), base_dir=str(spec.base_path.parent),
                num_replicas=int(run_settings["num_replicas"]), router=str(run_settings["router"]),
                save_dir=str(spec.out / "runs" / run_id) if spec.save_runs else None))
    return tasks
