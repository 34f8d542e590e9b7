"""Public serving benchmarks (``vllm bench serve`` and alike) replayed on the analytic presets.

A row of ``calibrate/profiles/public_serving/measurements.csv`` is one published
run: a GPU, a TP degree, a model at a precision, input and output lengths
(fixed, or ShareGPT's published means), and either every prompt at once, a
client concurrency (a closed loop: a new request the moment one returns) or a
Poisson request rate, with the TTFT and TPOT it
measured (mean and/or median). Each is replayed here under ``vllm_v1`` with the
engine's defaults for the device, and the simulated TTFT and TPOT are compared
with the measured ones.

The fit (``fit_matmul_fractions``) needs many evaluations, so it does not rerun
the simulator: without a request rate a replay's step shapes do not depend on
how long a step takes (every request arrives at 0 or at the end of the step
that freed its client), so each request's TTFT and TPOT are sums of step durations
over fixed step ranges (``StepLog``), and new efficiencies only reprice the
steps. Rows at a request rate are not fitted; they are checked by a full
replay.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import simpy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sim.core.batch import Batch, StepResult  # noqa: E402
from sim.cost.profile import Profile  # noqa: E402
from sim.run.config import ConfigError, workload_from_dict  # noqa: E402
from sim.run.runner import drive, kv_blocks  # noqa: E402

DATA = ROOT / "calibrate" / "profiles" / "public_serving"
MEASUREMENTS_CSV = DATA / "measurements.csv"
MAX_REPLAY_REQUESTS = 1000          # longer runs: their first 1,000 requests (medians settle well before)
METRICS = ("ttft_ms_mean", "ttft_ms_median", "tpot_ms_mean", "tpot_ms_median")


def _num(value: str | None) -> float | None:
    value = (value or "").strip()
    return float(value) if value else None


# The research CSV names GPUs as their sources do; a replay needs a preset. Unstated variants
# are mapped to the one the same lab states elsewhere (GPUStack: "A100 SXM 80GB", "H100 SXM").
GPU_NAMES = {"h100-sxm": "h100-sxm", "h200": "h200", "b200": "b200-sxm", "a100-80gb": "a100-80gb",
             "rtx-pro-6000": "rtx-pro-6000", "l40s": "l40s", "a100-40gb": "a100-40gb"}
GPU_ASSUMED = {"other:h100": "h100-sxm", "other:a100": "a100-80gb"}      # prefix -> preset (flagged)
# HF model id (prefix before any " (" remark) -> batchsim preset; models the roofline cannot
# describe are skipped with the reason.
MODEL_PRESETS_BY_ID = {
    "openai/gpt-oss-120b": "gpt-oss-120b", "openai/gpt-oss-20b": "gpt-oss-20b",
    "Qwen/Qwen3-8B": "qwen3-8b", "Qwen/Qwen3-14B": "qwen3-14b", "Qwen/Qwen3-32B": "qwen3-32b",
    "Qwen/Qwen3-32B-FP8": "qwen3-32b", "Qwen/Qwen3-14B-FP8": "qwen3-14b", "Qwen/Qwen3-8B-FP8": "qwen3-8b",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b", "Qwen/Qwen3-235B-A22B-Instruct-2507": "qwen3-235b-a22b",
    "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8": "qwen3-235b-a22b",
    # vllm#49723 names "Mistral-24B", quantized by its reporter from the BF16 Mistral Small 24B:
    # taken as Mistral-Small-24B-Instruct-2501's shape (flagged: model_assumed)
    "Mistral-24B": "mistral-small-24b",
}
MODELS_ASSUMED = frozenset({"Mistral-24B"})
# NOTE: DeepSeek's multi-head latent attention is priced by the kernel tables (kernel_serving.py
# replays those rows); the analytic check leaves them out, as it has since before MLA was modelled.
SKIP_MODELS = {"deepseek-ai": "multi-head latent attention (MLA) is not modelled",
               "Qwen/Qwen3.5": "hybrid linear attention (Gated DeltaNet) is not modelled",
               "google/gemma-4": "Gemma 4's config is not bundled", "nvidia/Gemma-4": "Gemma 4's config is not bundled",
               "MiniMaxAI": "MiniMax-M2.5's config is not bundled",
               "DeepSeek": "multi-head latent attention (MLA) is not modelled"}
PRECISIONS = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}
# vllm bench serve's ShareGPT sampling keeps prompts <= 1024 tokens and prompt + output <= 2048;
# the rows give only the totals, so lengths are drawn lognormal (sigma 1) with the published means.
SHAREGPT_SIGMA = 1.0


@dataclass(frozen=True)
class ServingRow:
    """One published run, as a replay reads it."""

    index: int                       # its row in the CSV (0-based, header excluded)
    source: str
    engine: str
    engine_version: str
    gpu: str                         # a batchsim GPU preset
    gpu_assumed: bool                # the source did not state the variant
    model_assumed: bool              # nor the exact checkpoint
    tensor_parallel: int
    expert_parallel: bool
    model: str                       # a batchsim model preset
    weight_dtype: str
    kv_cache_dtype: str
    dataset: str                     # random | sharegpt
    input_len: int                   # fixed (random) or mean (sharegpt)
    output_len: int
    max_concurrency: int | None
    request_rate: float | None       # None: all at once (vllm bench serve's default inf)
    num_prompts: int
    flags: tuple[tuple[str, Any], ...]   # server flags from the notes (max_num_batched_tokens, ...)
    measured: tuple[tuple[str, float], ...]          # (metric, ms) of METRICS that the source gives


_FLAGS = ((r"--max-num-batched-tokens[ =](\d+)", "max_num_batched_tokens", int),
          (r"--max-model-len[ =](\d+)", "max_model_len", int),
          (r"--gpu-memory-utilization[ =]([\d.]+)", "gpu_memory_utilization", float),
          (r"--async-scheduling", "async_scheduling", None),
          (r"--enable-expert-parallel", "enable_expert_parallel", None),
          (r"--kv-cache-dtype[ =]fp8", "kv_fp8", None))


def _version_ok(version: str) -> bool:
    """vLLM 0.10 or later: a release number, or a main/PR branch dated August 2025 or later."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m:
        return (int(m.group(1)), int(m.group(2))) >= (0, 10)
    dated = re.search(r"(20\d\d)-(\d\d)", version)
    return bool(dated) and (int(dated.group(1)), int(dated.group(2))) >= (2025, 8)


def normalise(index: int, r: dict[str, str], engines: tuple[str, ...] = ("vllm",),
              gpu_assumed: dict[str, str] | None = None, models: dict[str, str] | None = None,
              skip_models: dict[str, str] | None = None) -> tuple[ServingRow | None, str]:
    """The row as a replay reads it, or None and why it cannot be replayed. ``engines``: the
    engines replayed (the analytic check: vLLM's only); ``gpu_assumed`` and ``models``: the
    GPU prefixes and model ids mapped (default ``GPU_ASSUMED``, ``MODEL_PRESETS_BY_ID``);
    ``skip_models``: the model-id prefixes left out and why (default ``SKIP_MODELS``)."""
    engine = r["engine"].strip()
    if engine not in engines:
        return None, f"engine {engine} (replayed under {', '.join(POLICY_OF.get(e, e) for e in engines)} only)"
    if engine == "vllm" and not _version_ok(r["engine_version"]):
        return None, "vLLM older than 0.10 or version unknown"
    gpu_raw = r["gpu"].strip()
    gpu = GPU_NAMES.get(gpu_raw)
    gpu_assumed = GPU_ASSUMED if gpu_assumed is None else gpu_assumed
    assumed = gpu is None and any(gpu_raw.startswith(k) for k in gpu_assumed)
    if gpu is None:
        gpu = next((v for k, v in gpu_assumed.items() if gpu_raw.startswith(k)), None)
        if gpu is None:
            return None, f"GPU {gpu_raw.split(' ')[0]} has no preset"
    model_id = r["model"].split(" (")[0].strip()
    skip = next((why for k, why in (SKIP_MODELS if skip_models is None else skip_models).items()
                 if model_id.startswith(k)), None)
    if skip:
        return None, skip
    model = (MODEL_PRESETS_BY_ID if models is None else models).get(model_id)
    if model is None:
        return None, f"model {model_id} has no preset"
    dtype = PRECISIONS.get(r["weight_dtype"].strip())
    if dtype is None:
        return None, f"weight precision {r['weight_dtype'].strip()} is not modelled"
    notes = r.get("notes") or ""
    if "pipeline parallel" in notes:
        return None, "pipeline parallel is not modelled"
    flags: dict[str, Any] = {}
    for pattern, name, conv in _FLAGS:
        m = re.search(pattern, notes)
        if m:
            flags[name] = conv(m.group(1)) if conv else True
    dataset = "sharegpt" if r["dataset"].startswith("sharegpt") else "random"
    if dataset == "sharegpt":
        m = re.search(r"input (\d+)\s*/\s*generated (\d+)", notes)
        n = _num(r.get("num_prompts")) or 1000
        # rows of one source share its totals: the first row of each source states them
        totals = (int(m.group(1)), int(m.group(2))) if m else SHAREGPT_TOTALS.get(model.split("-")[0])
        if totals is None:
            return None, "ShareGPT lengths not stated"
        input_len, output_len = round(totals[0] / n), round(totals[1] / n)
    else:
        if not r["input_len"] or not r["output_len"]:
            return None, "lengths not stated"
        input_len, output_len = int(_num(r["input_len"])), int(_num(r["output_len"]))
    measured = tuple((m, v) for m in METRICS if (v := _num(r.get(m))) is not None)
    if not measured:
        return None, "no TTFT or TPOT"
    rate = _num(r.get("request_rate"))
    conc = _num(r.get("max_concurrency"))
    ep = (r.get("expert_parallel") or "").strip()
    kv = (r.get("kv_cache_dtype") or "").strip()
    return ServingRow(
        index=index, source=r["source_url"], engine=engine, engine_version=r["engine_version"], gpu=gpu,
        gpu_assumed=assumed, model_assumed=model_id in MODELS_ASSUMED, tensor_parallel=int(_num(r["tensor_parallel"]) or 1),
        expert_parallel=bool(ep and float(ep) > 1) or "enable_expert_parallel" in flags, model=model,
        weight_dtype=dtype, kv_cache_dtype="fp8" if kv == "fp8" or "kv_fp8" in flags else "auto",
        dataset=dataset, input_len=input_len, output_len=output_len,
        max_concurrency=int(conc) if conc is not None else None,
        request_rate=None if rate is None or math.isinf(rate) else rate,
        num_prompts=int(_num(r.get("num_prompts")) or 1000), flags=tuple(sorted(flags.items())),
        measured=measured), ""


# ShareGPT totals (input, generated tokens per 1,000 prompts) as the sources state them once per
# tokenizer: gpt-oss's (o200k) and Qwen3's.
SHAREGPT_TOTALS = {"gpt": (215312, 195544), "qwen3": (217393, 201422)}


def load_rows(path: Path = MEASUREMENTS_CSV, **how: Any) -> tuple[list[ServingRow], dict[str, int]]:
    """The replayable rows, and how many were left out for each reason (``how``: ``normalise``'s
    keywords)."""
    rows, skipped = [], {}
    with path.open(newline="") as f:
        for i, r in enumerate(csv.DictReader(f)):
            row, why = normalise(i, r, **how)
            if row is None:
                skipped[why] = skipped.get(why, 0) + 1
            else:
                rows.append(row)
    return rows, skipped


def workload(row: ServingRow, profile_spec: dict[str, Any], policy_kind: str = "vllm_v1") -> dict[str, Any]:
    """The row as a workload: its lengths, its client concurrency or rate, vLLM v1's defaults
    (and the server flags the source gives)."""
    n = min(row.num_prompts, MAX_REPLAY_REQUESTS)
    arrivals: dict[str, Any] = ({"kind": "all_at_once"} if row.request_rate is None
                                else {"kind": "poisson", "rate": row.request_rate})
    if row.max_concurrency is not None:
        arrivals["max_concurrency"] = row.max_concurrency
    if row.dataset == "sharegpt":
        lengths = {"kind": "lognormal", "prompt_mean": row.input_len, "output_mean": row.output_len,
                   "sigma": SHAREGPT_SIGMA, "prompt_max": 1024, "output_max": 1024, "output_min": 2}
    else:
        lengths = {"kind": "fixed", "prompt_tokens": row.input_len, "output_tokens": row.output_len}
    flags = dict(row.flags)
    # vllm bench serve's random and ShareGPT prompts share no prefix worth a cache lookup: each
    # engine's prefix cache is off (it would only cost simulation time)
    policy: dict[str, Any] = {"kind": policy_kind, **PREFIX_CACHE_OFF[policy_kind]}
    if "max_num_batched_tokens" in flags and policy_kind == "vllm_v1":      # vLLM's flag spelling
        policy["max_num_batched_tokens"] = flags["max_num_batched_tokens"]
    server: dict[str, Any] = {}
    if "max_model_len" in flags:
        server["max_model_len"] = flags["max_model_len"]
    if "gpu_memory_utilization" in flags:
        server["gpu_memory_utilization"] = flags["gpu_memory_utilization"]
    return {"name": "public-serving", "num_requests": n, "seed": 0, "arrivals": arrivals, "lengths": lengths,
            # vllm bench serve's random dataset: random token ids, no prefix hits worth modelling
            "policy": policy, "server": server, "profile": profile_spec}


# The policy a published engine's runs replay under.
POLICY_OF = {"vllm": "vllm_v1", "sglang": "sglang", "tensorrt-llm": "tensorrt_llm"}
PREFIX_CACHE_OFF = {"vllm_v1": {"enable_prefix_caching": False}, "sglang": {"disable_radix_cache": True},
                    "tensorrt_llm": {"enable_block_reuse": False}}


@dataclass
class StepLog:
    """The step shapes of one replay and, per request, the steps its metrics span."""

    batches: list[Batch] = field(default_factory=list)
    ttft_steps: list[tuple[int, int]] = field(default_factory=list)     # (first, last + 1) step index
    decode_steps: list[tuple[int, int, int]] = field(default_factory=list)  # (first, last + 1, outputs - 1)


class _Recorder:
    def __init__(self, profile: Profile) -> None:
        self.profile, self.batches, self.ends_s, self.t_s = profile, [], [], 0.0

    def execute(self, batch: Batch, state: Any) -> StepResult:
        d = self.profile.step_time_s(batch)
        self.batches.append(batch)
        self.t_s += d
        self.ends_s.append(self.t_s)
        return StepResult(duration_s=d, predicted_s=d)


def replay(row: ServingRow, profile: Profile, policy_kind: str = "vllm_v1") -> tuple[dict[str, float], StepLog]:
    """Simulated METRICS of ``row`` on ``profile`` (ms) under ``policy_kind``, and its StepLog."""
    spec = workload(row, profile_spec(row), policy_kind)
    cfg = workload_from_dict(spec)
    try:
        num_blocks, max_model_len = kv_blocks(cfg, profile)
    except ConfigError as exc:
        # A server whose KV cannot hold one request of the model's whole context does not start;
        # the source's did, so it ran a shorter max_model_len than it states: the longest that fits.
        fits = re.search(r"set server.max_model_len <= (\d+)", str(exc))
        if fits is None:
            raise
        spec["server"]["max_model_len"] = int(fits.group(1))
        cfg = workload_from_dict(spec)
        num_blocks, max_model_len = kv_blocks(cfg, profile)
    rec = _Recorder(profile)
    (server,), _, _, _ = drive(cfg, profile, num_blocks, max_model_len, simpy.Environment(), rec)
    rec_cols = server.state.records
    arrival = np.asarray(rec_cols.pop("arrival_s"))
    first = np.asarray(rec_cols.pop("first_token_s"))
    finished = np.asarray(rec_cols.pop("finished_s"))
    outputs = np.asarray(rec_cols.pop("output_tokens"))
    ttft_ms = (first - arrival) * 1e3
    tpot_ms = (finished - first) / np.maximum(outputs - 1, 1) * 1e3
    sim = {"ttft_ms_mean": float(ttft_ms.mean()), "ttft_ms_median": float(np.median(ttft_ms)),
           "tpot_ms_mean": float(tpot_ms[outputs > 1].mean()), "tpot_ms_median": float(np.median(tpot_ms[outputs > 1]))}
    log = StepLog(batches=rec.batches)
    ends = np.asarray(rec.ends_s)
    # A step index from a time: the step that ends then (arrivals at 0 come before step 0).
    def step_of(t: np.ndarray) -> np.ndarray:
        return np.searchsorted(ends, t - 1e-12 * np.maximum(t, 1.0))
    a, f, e = step_of(arrival) , step_of(first), step_of(finished)
    a = np.where(arrival <= 0, 0, a + 1)            # the first step after the arrival
    log.ttft_steps = list(zip(a.tolist(), (f + 1).tolist()))
    log.decode_steps = list(zip((f + 1).tolist(), (e + 1).tolist(), (outputs - 1).tolist()))
    return sim, log


def repriced(log: StepLog, step_s: Callable[[list[Batch]], np.ndarray]) -> dict[str, float]:
    """METRICS of a closed-loop replay with every step repriced by ``step_s``."""
    ends = np.concatenate([[0.0], np.cumsum(step_s(log.batches))])
    ttft = np.array([ends[j] - ends[i] for i, j in log.ttft_steps]) * 1e3
    dec = [(ends[j] - ends[i]) / n for i, j, n in log.decode_steps if n > 0]
    tpot = np.array(dec) * 1e3
    return {"ttft_ms_mean": float(ttft.mean()), "ttft_ms_median": float(np.median(ttft)),
            "tpot_ms_mean": float(tpot.mean()), "tpot_ms_median": float(np.median(tpot))}


def errors(rows: list[ServingRow], sims: dict[ServingRow, dict[str, float]], group: Callable[[ServingRow], Any]
           ) -> dict[Any, dict[str, dict[str, float]]]:
    """Per group and per metric family (ttft, tpot): n, MAE and bias (%) of (sim - real) / real,
    over every measured value (mean and median each count)."""
    out: dict[Any, dict[str, list[float]]] = {}
    for r in rows:
        for metric, real in r.measured:
            fam = metric.split("_")[0]
            err = sims[r][metric] / real - 1
            for key in (group(r), "all"):
                out.setdefault(key, {}).setdefault(fam, []).append(err)
    return {k: {fam: {"n": len(v), "mae": 100 * float(np.mean(np.abs(v))), "bias": 100 * float(np.mean(v))}
                for fam, v in fams.items()} for k, fams in out.items()}


def format_errors(title: str, table: dict[Any, dict[str, dict[str, float]]]) -> str:
    lines = [title, f"{'group':<34} | {'TTFT n':>6} {'MAE':>7} {'bias':>7} | {'TPOT n':>6} {'MAE':>7} {'bias':>7}"]
    for key in sorted(table, key=lambda k: (k == "all", str(k))):
        cells = []
        for fam in ("ttft", "tpot"):
            e = table[key].get(fam)
            cells.append(f"{e['n']:>6} {e['mae']:>6.1f}% {e['bias']:>+6.1f}%" if e else f"{'-':>6} {'':>7} {'':>7}")
        label = key if isinstance(key, str) else " ".join(str(k) for k in key)
        lines.append(f"{label:<34} | {cells[0]} | {cells[1]}")
    return "\n".join(lines)


def profile_spec(row: ServingRow) -> dict[str, Any]:
    """The workload's profile section for ``row``: its preset, precision, TP/EP and the host
    work of vLLM v1 (async scheduling where the source ran it)."""
    spec: dict[str, Any] = {"model": row.model, "gpu": row.gpu, "tensor_parallel": row.tensor_parallel,
                            "engine": "vllm-v1-async" if dict(row.flags).get("async_scheduling") else "vllm-v1"}
    if row.weight_dtype not in ("bf16", "fp16"):
        spec["weight_dtype"] = row.weight_dtype
    else:
        spec["dtype"] = row.weight_dtype
    if row.kv_cache_dtype != "auto":
        spec["kv_cache_dtype"] = row.kv_cache_dtype
    if row.expert_parallel:
        spec["enable_expert_parallel"] = True
    return spec


def build_profile(row: ServingRow, efficiency: Any | None = None) -> Profile:
    """The analytic preset of ``row`` (``efficiency``: other fractions than the fitted defaults)."""
    from sim.cost.roofline import preset_profile
    spec = profile_spec(row)
    return preset_profile(row.model, row.gpu, row.tensor_parallel, spec.get("dtype", "bf16"), engine=spec["engine"],
                          weight_dtype=spec.get("weight_dtype"), kv_cache_dtype=spec.get("kv_cache_dtype"),
                          expert_parallel=row.expert_parallel, efficiency=efficiency)


# ---- fit ---------------------------------------------------------------------------
# Whole models are held out: the fit sees only the training models' rows; the check reports
# the held-out models' rows apart.
TRAIN_MODELS = frozenset({"gpt-oss-120b", "qwen3-32b", "qwen3-235b-a22b", "mistral-small-24b"})
HELD_OUT_RULE = ("by model: fit on gpt-oss-120b, Qwen3-32B, Qwen3-235B-A22B, Mistral-Small-24B; held out "
                 "gpt-oss-20b, Qwen3-14B, Qwen3-8B")
FIT_GRID = np.geomspace(0.05, 1.0, 41)
# Rows checked but not fitted on, and why.
NOT_FITTED = {88: "vllm#49723: its reporter traces the FP8 prefill slowdown to a kernel-selection problem",
              89: "vllm#49723: its reporter traces the FP8 prefill slowdown to a kernel-selection problem"}      # candidate achieved fractions of the GEMM class's peak


def gemm_key(row: ServingRow) -> tuple[str, str, str] | None:
    """(GPU generation, GEMM class, model kind) of the row's quantized GEMMs, None for
    unquantized weights."""
    from sim.cost.precision import Precision
    from sim.cost.presets import GPU_PRESETS
    if row.weight_dtype in ("bf16", "fp16"):
        return None
    gpu = GPU_PRESETS[row.gpu]
    from sim.cost.presets import MODEL_PRESETS
    kind = "moe" if MODEL_PRESETS[row.model].is_moe else "dense"
    return gpu.generation, Precision(weight_dtype=row.weight_dtype).gemm_precision(gpu), kind


def _score(rows: list[ServingRow], sims: dict[ServingRow, dict[str, float]]) -> float:
    """Mean |log(sim / real)| over every measured value of ``rows``."""
    errs = [abs(math.log(sims[r][m] / v)) for r in rows for m, v in r.measured]
    return float(np.mean(errs)) if errs else 0.0


def fit_matmul_fractions(rows: list[ServingRow], logs: dict[ServingRow, StepLog]
                         ) -> dict[tuple[str, str, str], tuple[float, int]]:
    """Per (generation, GEMM class) of the training rows with quantized weights: the achieved
    fraction of that class's peak that best fits their TTFT and TPOT (a 1-D grid search on mean
    |log error|, repricing each replay's steps: ``repriced``), and how many rows it saw. Each
    row's quantized GEMMs run in one class, so the classes fit apart. A class whose best
    fraction is the grid's floor gets no entry (a miss no GEMM speed explains)."""
    from sim.cost.efficiency import Efficiency
    from sim.cost.presets import GPU_PRESETS
    groups: dict[tuple[str, str], list[ServingRow]] = {}
    for r in rows:
        key = gemm_key(r)
        if (key is not None and r.model in TRAIN_MODELS and r in logs and r.index not in NOT_FITTED
                and r.request_rate is None):        # repricing holds only without timed arrivals
            groups.setdefault(key, []).append(r)
    fitted = {}
    for key, group in sorted(groups.items()):
        field_name = f"matmul_flops_{key[1]}"
        best = None
        for fraction in FIT_GRID:
            sims = {}
            for r in group:
                base = Efficiency.for_gpu(GPU_PRESETS[r.gpu], Efficiency.for_engine(profile_spec(r)["engine"]),
                                          moe=key[2] == "moe")
                prof = build_profile(r, dataclasses.replace(base, **{field_name: float(fraction)}))
                sims[r] = repriced(logs[r], lambda bs, p=prof: np.array([p.step_time_s(b) for b in bs]))
            score = _score(group, sims)
            if best is None or score < best[0]:
                best = (score, float(fraction))
        if best[1] > FIT_GRID[0]:          # at the floor, the miss is not the GEMMs' speed: no entry
            fitted[key] = (round(best[1], 3), len(group))
    return fitted


# ---- the check ---------------------------------------------------------------------
SERVING_ERRORS_CSV = DATA / "preset_errors.csv"


def replay_all(rows: list[ServingRow]) -> tuple[dict[ServingRow, dict[str, float]], dict[ServingRow, StepLog]]:
    """Every row replayed on today's presets (the fitted table included)."""
    sims, logs = {}, {}
    for r in rows:
        sims[r], logs[r] = replay(r, build_profile(r))
    return sims, logs


def group_of(row: ServingRow) -> tuple[str, str, int]:
    return row.gpu, row.weight_dtype, row.tensor_parallel


def error_rows(rows: list[ServingRow], sims: dict[ServingRow, dict[str, float]],
               group: Callable[[ServingRow], tuple] = group_of,
               describe: Callable[[tuple], dict[str, Any]] | None = None,
               source: str = "calibrate/profiles/public_serving/measurements.csv (vLLM 0.10-0.25 serving runs)",
               held_out: str = HELD_OUT_RULE) -> list[dict[str, Any]]:
    """The trust table: per ``group`` (default: GPU, weight precision, TP), TTFT and TPOT error
    on the held-out models' rows and on every row (empty where a group has no such row);
    ``describe(key)``: the key's columns (default: gpu, weight_dtype, tensor_parallel and the
    vllm-v1 engine)."""
    if describe is None:
        def describe(key: tuple) -> dict[str, Any]:
            return {"gpu": key[0], "weight_dtype": key[1], "tensor_parallel": key[2], "engine": "vllm-v1"}
    held = errors([r for r in rows if r.model not in TRAIN_MODELS and r in sims], sims, group)
    every = errors([r for r in rows if r in sims], sims, group)
    out = []
    for key in sorted(k for k in every if k != "all"):
        h, e = held.get(key, {}), every[key]
        cell = lambda t, fam, what: round(t[fam][what], 1) if fam in t else ""    # noqa: E731
        out.append({**describe(key), "held_out": held_out,
                    "num_held_out": sum(h[f]["n"] for f in h), "ttft_mae_pct": cell(h, "ttft", "mae"),
                    "ttft_bias_pct": cell(h, "ttft", "bias"), "tpot_mae_pct": cell(h, "tpot", "mae"),
                    "tpot_bias_pct": cell(h, "tpot", "bias"), "num_all": sum(e[f]["n"] for f in e),
                    "ttft_mae_pct_all": cell(e, "ttft", "mae"), "tpot_mae_pct_all": cell(e, "tpot", "mae"),
                    "source": source})
    return out


def write_table(path: Path, table: list[dict[str, Any]]) -> None:
    """A trust table as CSV (header from the first row)."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    print(f"wrote {path}")


def print_check(rows: list[ServingRow], skipped: dict[str, int], sims: dict[ServingRow, dict[str, float]]) -> None:
    print(f"{len(rows)} published runs replayed; left out: "
          + "; ".join(f"{n} {why}" for why, n in sorted(skipped.items(), key=lambda kv: -kv[1])))
    held = [r for r in rows if r.model not in TRAIN_MODELS]
    train = [r for r in rows if r.model in TRAIN_MODELS]
    for title, subset in ((f"held-out models ({HELD_OUT_RULE})", held), ("training models", train), ("all rows", rows)):
        print()
        print(format_errors(f"{title}: (sim - real) / real per GPU, weight precision, TP", errors(subset, sims, group_of)))
