"""The public serving runs (``public_serving.py``) replayed on kernel profiles: each row's
engine's measured kernel tables (``sim.cost.kernels``), under that engine's policy (vLLM ->
vllm_v1, SGLang -> sglang, TensorRT-LLM -> tensorrt_llm), with the engine's host terms.

Besides the replays: the fit of those host terms (``fit_host``: per engine, on the training
models' rows only, by repricing each replay's steps: a kernel step costs its tables' time
plus step_s (+ tp_step_s with TP > 1) plus per_seq_s per sequence, so new host terms
reprice a closed-loop or all-at-once replay without rerunning it; request_s is added to
every TTFT), and AIConfigurator's own estimate of the same rows (``aic_static``: its
static-batch model, ``run_static`` of the wheel's compiled engine at the row's concurrency),
so the error table shows what batchsim's scheduling adds over the kernel sum alone.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import public_serving as ps
from sim.cost import aic
from sim.cost.kernels import HOST_TERMS, HostTerms, KernelSpec, host_terms, kernel_profile
from sim.cost.profile import Profile

POLICIES = ps.POLICY_OF
TABLES = {"vllm": "vllm", "sglang": "sglang", "tensorrt-llm": "trtllm"}
# "other:b300" is the B300 HGX board (SXM) where a source gives no variant; Hopper unnamed stays out.
GPU_ASSUMED = {**ps.GPU_ASSUMED, "other:b300": "b300-sxm"}
# Beside the presets: Hugging Face ids the wheel bundles (kernel profiles take them directly).
# DeepSeek-R1 (multi-head latent attention, priced by the MLA kernel tables): the R1 and R1-0528
# checkpoints share the shape; the FP4 ones run it with NVFP4 weights (the row's weight_dtype).
MODELS = {**ps.MODEL_PRESETS_BY_ID, "Qwen/Qwen3-1.7B": "Qwen/Qwen3-1.7B", "Qwen/Qwen3-0.6B": "Qwen/Qwen3-0.6B",
          "deepseek-ai/DeepSeek-R1": "deepseek-r1", "deepseek-ai/DeepSeek-R1-0528": "deepseek-r1",
          "nvidia/DeepSeek-R1-0528-FP4-v2": "deepseek-r1", "DeepSeek-R1 FP4": "deepseek-r1",
          "MiniMaxAI/MiniMax-M2.5": "minimax-m2.5"}
SKIP_MODELS = {k: why for k, why in ps.SKIP_MODELS.items() if k not in ("deepseek-ai", "DeepSeek", "MiniMaxAI")}


def load_rows() -> tuple[list[ps.ServingRow], dict[str, int]]:
    """Every engine's replayable rows (vLLM >= 0.10, any SGLang or TensorRT-LLM version)."""
    return ps.load_rows(engines=tuple(POLICIES), gpu_assumed=GPU_ASSUMED, models=MODELS, skip_models=SKIP_MODELS)


def host_of(row: ps.ServingRow, terms: dict[str, HostTerms] | None = None) -> HostTerms:
    """The host terms of the row's engine (vLLM's async ones where the source ran it)."""
    table = HOST_TERMS if terms is None else terms
    generation = "vllm-v1-async" if dict(row.flags).get("async_scheduling") else "vllm-v1"
    key = host_terms(TABLES[row.engine], generation).engine
    return table[key]


def spec_of(row: ps.ServingRow) -> KernelSpec:
    """The row's kernel profile: its engine's tables at the version nearest the source's."""
    analytic = ps.profile_spec(row)
    version = row.engine_version.split(" ")[0]
    return KernelSpec(model=row.model, gpu=row.gpu, engine=TABLES[row.engine], tensor_parallel=row.tensor_parallel,
                      dtype=analytic.get("dtype", "bf16"), weight_dtype=analytic.get("weight_dtype"),
                      kv_cache_dtype=analytic.get("kv_cache_dtype"), expert_parallel=row.expert_parallel,
                      engine_version=version if aic.version_key(version) != (0, 0, 0, 0, 0, 0) else None)


def tables_of(row: ps.ServingRow) -> Profile:
    """The row's kernel profile with no host time (what ``fit_host`` reprices)."""
    return kernel_profile(spec_of(row), HostTerms("none", 0.0, 0.0, 0.0, 0.0, "kernels only"))


def replay(row: ps.ServingRow, terms: dict[str, HostTerms] | None = None) -> tuple[dict[str, float], ps.StepLog]:
    return ps.replay(row, kernel_profile(spec_of(row), host_of(row, terms)), POLICIES[row.engine])


def replay_all(rows: list[ps.ServingRow], terms: dict[str, HostTerms] | None = None
               ) -> tuple[dict[ps.ServingRow, dict[str, float]], dict[ps.ServingRow, ps.StepLog], dict[ps.ServingRow, str]]:
    """Every row replayed; the rows a kernel profile cannot build or a server cannot hold are
    left out with why (third mapping)."""
    sims, logs, failed = {}, {}, {}
    for r in rows:
        try:
            sims[r], logs[r] = replay(r, terms)
        except (ValueError, ps.ConfigError) as exc:
            failed[r] = str(exc).split("\n")[0][:160]
    return sims, logs, failed


# ---- the host fit --------------------------------------------------------------------------
FIT_PARAMS = ("step_s", "tp_step_s", "per_seq_s", "request_s")
FIT_START = (0.5e-3, 0.1e-3, 20e-6, 5e-3)
# What host work can plausibly cost: a step's scheduling and input preparation (a few ms at
# most), the TP broadcast, a sequence's bookkeeping and output (~10-100 us in Python), a
# request's API work (tokenizing, detokenizing: tens of ms at most).
FIT_HI = (3e-3, 2e-3, 200e-6, 50e-3)
# Fewer training rows than this and an engine takes vLLM's fitted terms (said in its source):
# four numbers from two or three runs fit the runs, not the engine.
MIN_FIT_ROWS = 6


@dataclasses.dataclass(frozen=True)
class Priced:
    """A replay's steps as the fit reprices them: kernel seconds, sequences, and the steps
    each request's TTFT and TPOT span (``ps.StepLog``)."""

    kernel_s: np.ndarray
    num_seqs: np.ndarray
    tp: int
    log: ps.StepLog


def priced(row: ps.ServingRow, log: ps.StepLog) -> Priced:
    tables = tables_of(row)
    return Priced(np.array([tables.step_time_s(b) for b in log.batches]),
                  np.array([b.num_prefill_seqs + b.decode_seqs for b in log.batches], dtype=float),
                  row.tensor_parallel, log)


def repriced(p: Priced, x: dict[str, float]) -> dict[str, float]:
    step = p.kernel_s + x["step_s"] + (x["tp_step_s"] if p.tp > 1 else 0.0) + x["per_seq_s"] * p.num_seqs
    out = ps.repriced(p.log, lambda _: step)
    out["ttft_ms_mean"] += 1e3 * x["request_s"]
    out["ttft_ms_median"] += 1e3 * x["request_s"]
    return out


def fit_host(rows: list[ps.ServingRow], logs: dict[ps.ServingRow, ps.StepLog]) -> dict[str, tuple[dict[str, float], int]]:
    """Per engine, the host terms that best fit the training models' TTFT and TPOT (least
    squares on log(sim / real), soft L1), and how many rows they saw. Rows at a request rate
    are left out (repricing holds only without timed arrivals), as are held-out models'."""
    from scipy.optimize import least_squares
    groups: dict[str, list[ps.ServingRow]] = {}
    for r in rows:
        if r.model in ps.TRAIN_MODELS and r in logs and r.request_rate is None and r.index not in ps.NOT_FITTED:
            groups.setdefault(host_of(r).engine, []).append(r)
    fitted = {}
    for engine, group in sorted(groups.items()):
        if len(group) < MIN_FIT_ROWS:
            continue
        prices = {r: priced(r, logs[r]) for r in group}
        free = [k for k in FIT_PARAMS if k != "tp_step_s" or any(r.tensor_parallel > 1 for r in group)]

        def resid(v: np.ndarray) -> np.ndarray:
            x = {**dict.fromkeys(FIT_PARAMS, 0.0), **dict(zip(free, v))}
            out = []
            for r in group:
                sim = repriced(prices[r], x)
                out.extend(math.log(sim[m] / real) for m, real in r.measured)
            return np.array(out)

        lo = np.zeros(len(free))
        hi = np.array([FIT_HI[FIT_PARAMS.index(k)] for k in free])
        start = np.array([FIT_START[FIT_PARAMS.index(k)] for k in free])
        res = least_squares(resid, start, bounds=(lo, hi), loss="soft_l1", f_scale=0.1)
        fitted[engine] = ({**dict.fromkeys(FIT_PARAMS, 0.0), **dict(zip(free, (float(v) for v in res.x)))},
                          len(group))
    return fitted


# ---- AIConfigurator's own estimate ------------------------------------------------------------
def aic_static(row: ps.ServingRow, max_num_seqs: int) -> dict[str, float] | None:
    """AIConfigurator's static-batch estimate of the row (ms): a batch of the row's client
    concurrency (all its prompts at once: as many as the engine runs, ``max_num_seqs``)
    prefilled together (TTFT) and decoded together (TPOT), at the row's mean lengths. None at
    a request rate (the static model has no arrival process)."""
    if row.request_rate is not None:
        return None
    from sim.cost.kernels import resolve_model, cache_dir, quant_modes
    spec = spec_of(row)
    system = aic.system_of(row.gpu)
    version = aic.resolve_version(system, spec.engine, spec.engine_version)
    model = resolve_model(spec.model, cache_dir())
    from sim.cost.precision import precision_from_hf
    from sim.cost.presets import GPU_PRESETS
    stated, scope = precision_from_hf(model.config, model.name)
    weights = spec.weight_dtype or stated
    from sim.cost.hf_config import model_shape_from_hf
    modes = quant_modes(weights, stated, scope if weights == stated else "linear", spec.kv_cache_dtype or "auto",
                        GPU_PRESETS[row.gpu].generation, mla=model_shape_from_hf(model.config, model.name).is_mla)
    tables = aic.KernelTables(model.wheel_path, system, spec.engine, version, spec.tensor_parallel,
                              expert_parallel=spec.expert_parallel, **modes)
    batch = min(row.max_concurrency or row.num_prompts, row.num_prompts, max_num_seqs)
    with aic.quiet():
        ctx_ms, gen_ms, _ = tables.handle.run_static(batch_size=batch, isl=row.input_len, osl=max(2, row.output_len))
    tpot = gen_ms / max(1, row.output_len - 1)
    return {"ttft_ms_mean": ctx_ms, "ttft_ms_median": ctx_ms, "tpot_ms_mean": tpot, "tpot_ms_median": tpot}
