"""Analytic presets against public vLLM runs: batch latency error per GPU and TP degree.

The runs (calibrate/profiles/public_vllm/, Argonne LLM-Inference-Bench, vLLM
0.5, fp16, A100-40GB and H100-SXM, TP 1/2/4) each process one batch of B
requests with input = output = L tokens. Each is replayed here as B
``all_at_once`` requests under the ``vllm`` policy with vLLM's defaults, and
the simulated makespan is compared with the measured latency:

    python benchmarks/bench_presets_public.py                 # before/after table
    python benchmarks/bench_presets_public.py --fit           # refit on the training models
    python benchmarks/bench_presets_public.py --write-errors  # write preset_errors.csv
    python benchmarks/bench_presets_public.py --serving       # the 2025-26 serving runs (public_serving.py)
    python benchmarks/bench_presets_public.py --serving --fit --write-errors

"before" is the presets as committed before the tensor-parallel and fixed-cost
terms (baseline_predictions.csv, git f16a188); "after" is preset_profile as it is
now (sim.cost.roofline with sim.cost.collectives' terms). Rows are held out by model: the fit sees Llama-2-7B, Llama-3-8B and
Llama-2-70B; Mistral-7B, Llama-3-70B, Qwen2-7B and Qwen2-72B are held out.
Targets on held-out rows: MAE <= 15%, |bias| <= 10% in every (GPU, TP) group.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import simpy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from sim.core.batch import Batch, StepResult  # noqa: E402
from sim.cost.collectives import DEFAULT_ENGINE  # noqa: E402
from sim.run.config import workload_from_dict  # noqa: E402
from sim.cost.presets import GPU_PRESETS, MODEL_PRESETS, PRESET_ERRORS_PATH, model_shape_from_hf  # noqa: E402
from sim.cost.profile import ModelShape, Profile  # noqa: E402
from sim.cost.roofline import Efficiency, Roofline, preset_profile  # noqa: E402
from sim.run.runner import drive, kv_blocks  # noqa: E402

DATA = ROOT / "calibrate" / "profiles" / "public_vllm"
RUNS_CSV = DATA / "argonne_llm_inference_bench_vllm.csv"
BASELINE_CSV = DATA / "baseline_predictions.csv"
GPUS = {"Nvidia A100 GPU": "a100-40gb", "Nvidia H100 GPU": "h100-sxm"}


def _hf(name: str, h: int, layers: int, heads: int, kv: int, inter: int, vocab: int, ctx: int) -> dict[str, Any]:
    return {"name": name, "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": inter, "vocab_size": vocab,
            "max_position_embeddings": ctx, "hidden_act": "silu", "tie_word_embeddings": False}


# Each model's config.json (Hugging Face); presets where batchsim has the exact model.
MODELS: dict[str, str | dict[str, Any]] = {
    "meta-llama/Llama-2-7b-hf": "llama-2-7b",
    "mistralai/Mistral-7B-v0.1": "mistral-7b",
    "meta-llama/Meta-Llama-3-8B": _hf("llama-3-8b", 4096, 32, 32, 8, 14336, 128256, 8192),
    "meta-llama/Llama-2-70b-hf": _hf("llama-2-70b", 8192, 80, 64, 8, 28672, 32000, 4096),
    "meta-llama/Meta-Llama-3-70B": _hf("llama-3-70b", 8192, 80, 64, 8, 28672, 128256, 8192),
    "Qwen/Qwen2-7B": _hf("qwen2-7b", 3584, 28, 28, 4, 18944, 152064, 131072),
    "Qwen/Qwen2-72B": _hf("qwen2-72b", 8192, 80, 64, 8, 29568, 152064, 131072),
}
HELD_OUT = frozenset({"mistralai/Mistral-7B-v0.1", "meta-llama/Meta-Llama-3-70B", "Qwen/Qwen2-7B",
                      "Qwen/Qwen2-72B"})
HELD_OUT_RULE = "by model: fit on Llama-2-7B, Llama-3-8B, Llama-2-70B; held out Mistral-7B, Llama-3-70B, Qwen2-7B, Qwen2-72B"
TARGET_MAE_PCT, TARGET_BIAS_PCT = 15.0, 10.0


@dataclass(frozen=True)
class Row:
    gpu: str
    tp: int
    model: str
    length: int          # input = output tokens per request
    batch: int
    latency_s: float

    @property
    def held_out(self) -> bool:
        return self.model in HELD_OUT

    def shape(self) -> ModelShape:
        m = MODELS[self.model]
        return MODEL_PRESETS[m] if isinstance(m, str) else model_shape_from_hf(m, m["name"])


def load_rows() -> list[Row]:
    with RUNS_CSV.open(newline="") as f:
        return [Row(GPUS[r["Hardware"]], int(r["Num of Hardware"]), r["Model"], int(r["Input Output Length"]),
                    int(r["Batch Size"]), float(r["Latency"])) for r in csv.DictReader(f)]


def load_baseline() -> dict[Row, float]:
    """The presets' predictions before this work, keyed like load_rows()."""
    with BASELINE_CSV.open(newline="") as f:
        return {Row(r["gpu"], int(r["tp"]), r["model"], int(r["io_len"]), int(r["batch"]), float(r["latency_s"])):
                float(r["sim_before_s"]) for r in csv.DictReader(f)}


def new_profile(row: Row, engine: str = DEFAULT_ENGINE) -> Profile:
    return preset_profile(MODELS[row.model], row.gpu, row.tp, "fp16", engine=engine)


@dataclass
class StepTrace:
    """Per-step batch shapes of one replay (they do not depend on step times:
    every request arrives at t = 0)."""

    tokens: list[int] = field(default_factory=list)
    decode_seqs: list[int] = field(default_factory=list)
    decode_context: list[int] = field(default_factory=list)
    chunks: list[tuple[int, int]] = field(default_factory=list)   # (tokens, context) of every prefill chunk


class _Recorder:
    def __init__(self, profile: Profile) -> None:
        self.profile, self.trace = profile, StepTrace()

    def execute(self, batch: Batch, state: Any) -> StepResult:
        t = self.profile.step_time_s(batch)
        tr = self.trace
        tr.tokens.append(batch.num_tokens)
        tr.decode_seqs.append(batch.decode_seqs)
        tr.decode_context.append(batch.decode_context)
        tr.chunks.extend(batch.prefill_chunks)
        return StepResult(duration_s=t, predicted_s=t)


def replay(row: Row, profile: Profile) -> tuple[float, StepTrace]:
    """Simulated latency of the row's batch on ``profile``, and its step shapes."""
    cfg = workload_from_dict({
        "name": "public-vllm", "num_requests": row.batch, "arrivals": {"kind": "all_at_once"},
        "lengths": {"kind": "fixed", "prompt_tokens": row.length, "output_tokens": row.length},
        "policy": {"kind": "vllm"},
        "profile": {"model": MODELS[row.model], "gpu": row.gpu, "tensor_parallel": row.tp, "dtype": "fp16"}})
    num_blocks, max_model_len = kv_blocks(cfg, profile)
    rec = _Recorder(profile)
    (server,), _, _, _ = drive(cfg, profile, num_blocks, max_model_len, simpy.Environment(), rec)
    return max(server.state.records.pop("finished_s")), rec.trace


def error_table(rows: list[Row], pred: dict[Row, float]) -> dict[tuple[str, int], dict[str, float]]:
    """Per (gpu, tp): n, MAE and bias (%) of (sim - real) / real, p90 of |error|."""
    groups: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        groups.setdefault((r.gpu, r.tp), []).append(pred[r] / r.latency_s - 1)
        groups.setdefault(("all", 0), []).append(pred[r] / r.latency_s - 1)
    return {k: {"n": len(v), "mae": 100 * float(np.mean(np.abs(v))), "bias": 100 * float(np.mean(v)),
                "p90": 100 * float(np.percentile(np.abs(v), 90))} for k, v in sorted(groups.items(), key=lambda kv: (kv[0][0] == "all", kv[0]))}


def format_table(title: str, before: dict, after: dict) -> str:
    lines = [title, f"{'gpu':<10} {'tp':>2} {'rows':>4} | {'MAE before':>10} {'bias':>7} | "
                    f"{'MAE after':>9} {'bias':>7} {'p90':>6}"]
    for k, a in after.items():
        b = before[k]
        miss = "*" if a["mae"] > TARGET_MAE_PCT or abs(a["bias"]) > TARGET_BIAS_PCT else " "
        lines.append(f"{k[0]:<10} {k[1] or '':>2} {a['n']:>4} | {b['mae']:>9.1f}% {b['bias']:>+6.1f}% | "
                     f"{a['mae']:>8.1f}% {a['bias']:>+6.1f}% {a['p90']:>5.1f}%{miss}")
    return "\n".join(lines)


def simulate(rows: list[Row], profile_fn: Callable[[Row], Profile] = new_profile
             ) -> tuple[dict[Row, float], dict[Row, StepTrace]]:
    pred, traces = {}, {}
    for r in rows:
        pred[r], traces[r] = replay(r, profile_fn(r))
    return pred, traces


# ---- fit -------------------------------------------------------------------------
# Weight streaming (mem_bw) and the per-layer floor are told apart only by how they scale
# with TP and layer count; the result also stays within 10% of Vidur's per-operator A100
# linear-layer medians (tests/cost/test_roofline.py's check of the roofline).
FIT_PARAMS = ("matmul_flops", "mem_bw", "attn_mem_bw", "attn_decode_flops", "layer_fixed_s",
              "interconnect_efficiency", "step_s", "tp_step_s", "per_seq_s")
FIT_START = (0.65, 0.75, 0.7, 0.05, 10e-6, 0.5, 1e-3, 1e-3, 50e-6)
FIT_LO = (0.2, 0.3, 0.2, 0.002, 0.0, 0.02, 0.0, 0.0, 0.0)
FIT_HI = (1.0, 1.0, 1.0, 1.0, 200e-6, 1.0, 20e-3, 20e-3, 1e-3)


def formula_latency(row: Row, trace: StepTrace, x: dict[str, float]) -> float:
    """Latency of a traced replay under the cost formulas with parameters ``x``."""
    eff = dataclasses.replace(
        Efficiency.for_engine(DEFAULT_ENGINE), matmul_flops=x["matmul_flops"], mem_bw=x["mem_bw"],
        attn_mem_bw=x["attn_mem_bw"], attn_decode_flops=x["attn_decode_flops"], layer_fixed_s=x["layer_fixed_s"],
        interconnect=x["interconnect_efficiency"], overhead_s=x["step_s"], tp_overhead_s=x["tp_step_s"],
        per_seq_s=x["per_seq_s"])
    rf = Roofline(row.shape(), GPU_PRESETS[row.gpu], row.tp, "fp16", eff)
    tok = np.asarray(trace.tokens, dtype=float)
    n = np.asarray(trace.decode_seqs, dtype=float)
    ctx = np.asarray(trace.decode_context, dtype=float)
    ch = np.asarray(trace.chunks, dtype=float).reshape(-1, 2)
    total = len(tok) * rf.overhead_s + float(np.sum(rf.linear_s(tok)))
    total += float(np.sum(rf.attn_prefill_s(ch[:, 0], ch[:, 1]))) if len(ch) else 0.0
    d = n > 0
    return total + float(np.sum(rf.attn_decode_s(n[d], ctx[d])))


def fit(rows: list[Row], traces: dict[Row, StepTrace]) -> dict[str, float]:
    """Least squares on log(sim / real) over the training rows (soft L1: a few
    odd runs do not pull the fit)."""
    from scipy.optimize import least_squares
    train = [r for r in rows if not r.held_out]

    def resid(v: np.ndarray) -> np.ndarray:
        x = dict(zip(FIT_PARAMS, v))
        return np.array([np.log(formula_latency(r, traces[r], x) / r.latency_s) for r in train])

    res = least_squares(resid, np.array(FIT_START), bounds=(FIT_LO, FIT_HI), loss="soft_l1", f_scale=0.1)
    return dict(zip(FIT_PARAMS, (float(v) for v in res.x)))


def errors_rows(rows: list[Row], pred: dict[Row, float]) -> list[dict[str, Any]]:
    held = error_table([r for r in rows if r.held_out], pred)
    every = error_table(rows, pred)
    presets = [{"gpu": g, "tensor_parallel": tp, "engine": DEFAULT_ENGINE, "held_out": HELD_OUT_RULE,
                "num_rows": held[(g, tp)]["n"], "mae_pct": round(held[(g, tp)]["mae"], 1),
                "bias_pct": round(held[(g, tp)]["bias"], 1), "p90_abs_pct": round(held[(g, tp)]["p90"], 1),
                "num_rows_all": every[(g, tp)]["n"], "mae_pct_all": round(every[(g, tp)]["mae"], 1),
                "source": "calibrate/profiles/public_vllm/argonne_llm_inference_bench_vllm.csv (vLLM 0.5, fp16)"}
               for (g, tp) in held if g != "all"]
    return presets


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit", action="store_true", help="refit the terms on the training models and print them")
    p.add_argument("--write-errors", action="store_true", help=f"write {PRESET_ERRORS_PATH.name}")
    p.add_argument("--serving", action="store_true",
                   help="the published vLLM >= 0.10 serving runs (TTFT, TPOT) instead of the vLLM 0.5 batches")
    args = p.parse_args()
    if args.serving:
        return serving_main(args.fit, args.write_errors)
    rows = load_rows()
    before = load_baseline()
    t0 = time.perf_counter()
    pred, traces = simulate(rows)
    print(f"replayed {len(rows)} batches in {time.perf_counter() - t0:.1f} s")
    for title, subset in (("held-out rows (" + HELD_OUT_RULE + ")", [r for r in rows if r.held_out]),
                          ("training rows", [r for r in rows if not r.held_out]), ("all rows", rows)):
        print()
        print(format_table(title, error_table(subset, before), error_table(subset, pred)))
    if args.fit:
        x = fit(rows, traces)
        print("\nfitted: " + ", ".join(f"{k}={v:.4g}" for k, v in x.items()))
    if args.write_errors:
        table = errors_rows(rows, pred)
        with PRESET_ERRORS_PATH.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
        print(f"wrote {PRESET_ERRORS_PATH}")
    return 0


def serving_main(refit: bool, write: bool) -> int:
    """Replay the public serving runs (benchmarks/public_serving.py): error tables per GPU x
    weight precision x TP, held-out models apart; ``refit``: the matmul fractions per
    (generation, GEMM class, model kind) from the training models; ``write``: the trust table."""
    import public_serving as ps
    rows, skipped = ps.load_rows()
    t0 = time.perf_counter()
    sims, logs = ps.replay_all(rows)
    print(f"replayed {len(rows)} runs in {time.perf_counter() - t0:.1f} s")
    ps.print_check(rows, skipped, sims)
    if refit:
        fitted = ps.fit_matmul_fractions(rows, logs)
        print("\nfitted (sim.cost.efficiency.MATMUL_FLOPS_FIT): " + ", ".join(
            f"{k}: {v} ({n} rows)" for k, (v, n) in fitted.items()))
    if write:
        ps.write_table(ps.SERVING_ERRORS_CSV, ps.error_rows(rows, sims))
    return 0


if __name__ == "__main__":
    sys.exit(main())
