"""Kernel profiles against the published serving runs, beside the analytic presets and
AIConfigurator's own static-batch estimate of the same rows:

    python benchmarks/bench_kernels_public.py                  # the error tables
    python benchmarks/bench_kernels_public.py --fit            # refit the host terms, print them
    python benchmarks/bench_kernels_public.py --write-errors   # write kernel_errors.csv (the trust table)

Rows (``calibrate/profiles/public_serving/measurements.csv``) are replayed under their own
engine's policy and kernel tables (``kernel_serving.py``); the host terms are fitted on the
training models only (``public_serving.TRAIN_MODELS``) and every table below reports the
held-out models apart. "analytic" is the vLLM preset replay of ``public_serving.py`` (vLLM rows
only); "AIC static" is the wheel's ``run_static`` at the row's concurrency (no request rate).
Targets on held-out rows: MAE <= 15% on TTFT and on TPOT, no group biased beyond 10%.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import kernel_serving as ks  # noqa: E402
import public_serving as ps  # noqa: E402
from sim.cost.kernels import HOST_TERMS, HostTerms  # noqa: E402

KERNEL_ERRORS_CSV = ps.DATA / "kernel_errors.csv"


def group_of(row: ps.ServingRow) -> tuple[str, str, str, int]:
    return row.engine, row.gpu, row.weight_dtype, row.tensor_parallel


def three_way(rows: list[ps.ServingRow], kernel: dict, analytic: dict, static: dict) -> str:
    """Per (engine, GPU, precision, TP): n, MAE and bias of TTFT and TPOT for each source."""
    lines = [f"{'group':<30} | {'src':<8} | {'TTFT n':>6} {'MAE':>7} {'bias':>7} | {'TPOT n':>6} {'MAE':>7} {'bias':>7}"]
    tables = {name: ps.errors([r for r in rows if r in sims], sims, group_of)
              for name, sims in (("kernels", kernel), ("analytic", analytic), ("AIC", static))}
    keys = sorted({k for t in tables.values() for k in t}, key=lambda k: (k == "all", str(k)))
    for key in keys:
        label = key if isinstance(key, str) else " ".join(str(k) for k in key)
        for name, table in tables.items():
            if key not in table:
                continue
            cells = []
            for fam in ("ttft", "tpot"):
                e = table[key].get(fam)
                cells.append(f"{e['n']:>6} {e['mae']:>6.1f}% {e['bias']:>+6.1f}%" if e else f"{'-':>6} {'':>7} {'':>7}")
            lines.append(f"{label:<30} | {name:<8} | {cells[0]} | {cells[1]}")
            label = ""
    return "\n".join(lines)


def error_rows(rows: list[ps.ServingRow], sims: dict) -> list[dict[str, Any]]:
    """The trust table of kernel profiles: per (engine, GPU, precision, TP), TTFT and TPOT
    error on the held-out models' rows and on every row."""
    return ps.error_rows(rows, sims, group_of, lambda key: {"engine": ks.TABLES[key[0]], "gpu": key[1],
                                                            "weight_dtype": key[2], "tensor_parallel": key[3]},
                         "calibrate/profiles/public_serving/measurements.csv (vLLM, SGLang, TensorRT-LLM)",
                         HELD_OUT_RULE)


# The kernel replays' held-out models: every model but the four the host terms were fitted on.
HELD_OUT_RULE = ("by model: fit on gpt-oss-120b, Qwen3-32B, Qwen3-235B-A22B, Mistral-Small-24B; held out "
                 "gpt-oss-20b, Qwen3-14B, Qwen3-8B, Qwen3-1.7B, Qwen3-0.6B, DeepSeek-R1, MiniMax-M2.5")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit", action="store_true", help="refit the host terms on the training models and print them")
    p.add_argument("--write-errors", action="store_true", help=f"write {KERNEL_ERRORS_CSV.name}")
    args = p.parse_args()
    rows, skipped = ks.load_rows()
    t0 = time.perf_counter()
    terms: dict[str, HostTerms] = dict(HOST_TERMS)
    sims, logs, failed = ks.replay_all(rows, terms)
    print(f"{len(rows)} published runs; replayed {len(sims)} on kernel profiles in {time.perf_counter() - t0:.0f} s; "
          f"left out: " + "; ".join(f"{n} {why}" for why, n in sorted(skipped.items(), key=lambda kv: -kv[1])))
    for r, why in failed.items():
        print(f"  not replayed: row {r.index} ({r.engine} {r.gpu} {r.model} {r.weight_dtype}): {why}")
    if args.fit:
        fitted = ks.fit_host(rows, logs)
        for engine, (x, n) in fitted.items():
            print(f"fitted {engine} on {n} training rows: " + ", ".join(f"{k}={v:.4g}" for k, v in x.items()))
            terms[engine] = HostTerms(engine, source=f"fitted on {n} public serving runs of the training models",
                                      overlapped=HOST_TERMS[engine].overlapped if engine in HOST_TERMS else False,
                                      **x)
        if "vllm" in fitted:
            for engine in terms:
                if engine not in fitted and engine != "vllm-async":
                    x, n = fitted["vllm"]
                    print(f"{engine}: fewer than {ks.MIN_FIT_ROWS} training rows; takes vLLM's fitted terms")
                    terms[engine] = HostTerms(engine, source=f"vLLM's, fitted on {n} public vLLM serving runs "
                                                             f"(too few public {engine} runs to fit its own)", **x)
        t0 = time.perf_counter()
        sims, logs, failed = ks.replay_all(rows, terms)
        print(f"replayed again with the fitted terms in {time.perf_counter() - t0:.0f} s")
    analytic_rows, _ = ps.load_rows()
    analytic, _ = ps.replay_all(analytic_rows)
    analytic = {r: analytic[a] for r in sims for a in analytic_rows if a.index == r.index}
    static = {}
    for r in sims:
        policy_knobs = logs[r]
        est = ks.aic_static(r, max_num_seqs=max(b.num_prefill_seqs + b.decode_seqs for b in policy_knobs.batches))
        if est is not None:
            static[r] = est
    by_arrivals = lambda r: (r.engine, "burst" if r.request_rate is None and r.max_concurrency is None  # noqa: E731
                             else "closed loop" if r.request_rate is None else "rate")
    print("\nall rows by arrivals: (sim - real) / real per engine and how requests arrive")
    for name, table in (("kernels", sims), ("analytic", analytic), ("AIC", static)):
        print(ps.format_errors(name, ps.errors([r for r in sims if r in table], table, by_arrivals)))
    held = [r for r in sims if r.model not in ps.TRAIN_MODELS]
    train = [r for r in sims if r.model in ps.TRAIN_MODELS]
    for title, subset in ((f"held-out models ({HELD_OUT_RULE})", held), ("training models", train),
                          ("all rows", list(sims))):
        print(f"\n{title}: (sim - real) / real per engine, GPU, weight precision, TP")
        print(three_way(subset, sims, analytic, static))
    if args.write_errors:
        ps.write_table(KERNEL_ERRORS_CSV, error_rows(rows, sims))
    return 0


if __name__ == "__main__":
    sys.exit(main())
