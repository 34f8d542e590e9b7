"""DistServe's headline (Zhong et al., OSDI 2024) on its own setting: per-GPU goodput of
disaggregated prefill/decode against colocated vLLM, chatbot (ShareGPT), OPT on A100-80GB.

    python benchmarks/distserve_goodput.py                       # OPT-13B and OPT-66B
    python benchmarks/distserve_goodput.py --models opt-13b --num-requests 1000

Per-GPU goodput: the highest Poisson rate at which at least 90% of the requests meet both the
TTFT and the TPOT SLO (and the queue is stable: ``reports.experiments.capacity.judge``), found
by ``find_capacity``'s bracketing and bisection, divided by the GPUs the deployment uses.

Where each number of the setting comes from (LLMServe/DistServe, read, not copied):

- SLOs, GPU counts, attainment target and the published ratios: DistServe's plotting notebook
  ``distserve/evaluation/2-benchmark-serving/plot.ipynb`` at commit cc3096f5 (2024-04-30,
  "Update plotting script"), cell ``plot_fig8_upper(90)`` (Figure 8, chatbot, rate at 90%
  attainment) and its printed outputs: OPT-13B TTFT 0.25 s, TPOT 0.1 s, DistServe on 3 GPUs,
  vLLM on 1, "DistServe compared to vLLM: 4.6"; OPT-66B TTFT 2.5 s, TPOT 0.15 s, 8 GPUs
  against 4, "2.7504" (OPT-175B: 4 s, 0.2 s, 21 against 8, 1.99; not run here). Figure 8 lower
  (``plot_fig8_lower(90)``): the SLOs scaled at a per-GPU rate of 1.5 (OPT-13B) and 0.75
  (OPT-66B); the tightest scale vLLM meets over DistServe's: 1.7357 and 3.1439.
- Placements: ``evaluation/2-benchmark-serving/2-start-api-server.py`` (HEAD 82831f1),
  MODEL_TO_PARALLEL_PARAMS as (context_tp, context_pp, decoding_tp, decoding_pp): OPT-13B
  (2, 1, 1, 1), OPT-66B (4, 1, 2, 2); vLLM TP 1 and TP 4. DistServe's simulator finds the same
  OPT-13B placement (``simdistserve/README.md``: tp_prefill=2, pp_prefill=1, tp_decode=1,
  pp_decode=1, "Best per GPU rate: 1.56" under 200 ms / 100 ms at 90% each).
- Engine knobs: the same script. vLLM: block 16, gpu_memory_utilization 0.92,
  max_num_batched_tokens 65536, max_num_seqs 1024; DistServe's context stage FCFS, at most 128
  requests and 32768 tokens a batch; its decoding stage at most 1024 requests.
- Hardware and link: ``evaluation/docs/README-AE.md``: the OPT-13B and OPT-66B runs take one
  8x A100-SXM-80GB machine, so prefill and decode talk over NVLink within the node.
- Lengths: ShareGPT filtered to prompt + output < 2048 tokens (OPT's context;
  ``0-prepare-dataset.py`` prunes longer ones). batchsim's ShareGPT lengths
  (``workloads/traces/sharegpt_8k_lengths.csv``, Llama-2 tokenizer, etalon's prompt building)
  filtered the same way: 14,561 of 30,731 rows.
- Models: the public HF configs of facebook/opt-13b and facebook/opt-66b (OPTForCausalLM).

What batchsim cannot express: pipeline parallelism. OPT-66B's decode instance (TP 2 x PP 2,
4 GPUs) runs here as TP 4 on the same 4 GPUs (the same memory for weights and KV; a shorter
step than a two-stage pipeline, no pipeline bubbles).

Two readings of a disaggregated request's latencies: DistServe streams the first token when
the prefill instance produces it (its ``ftl``), so the KV transfer and the wait for a decode
slot fall in TPOT; vLLM's NixlConnector proxy takes the first token from the decode instance,
so they fall in TTFT (batchsim's ``ttft_s``). The headline uses DistServe's reading; the other
is printed beside it. Colocated, the two are the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
SHAREGPT = ROOT / "workloads" / "traces" / "sharegpt_8k_lengths.csv"
OPT_MAX_TOKENS = 2048          # OPT's max_position_embeddings; DistServe keeps prompt + output < 2048
ATTAINMENT = 0.90              # DistServe's target: 90% of requests within both SLOs

# The fields batchsim reads from the public HF config.json of each model (OPTForCausalLM;
# activation_function relu: a two-matrix MLP). Not priced: OPT's learned position embeddings
# (2,050 x hidden) and its biases and LayerNorms, 0.1% of OPT-13B's weights.
OPT_CONFIGS: dict[str, dict[str, Any]] = {
    "opt-13b": {"name": "opt-13b", "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40,
                "ffn_dim": 20480, "vocab_size": 50272, "max_position_embeddings": 2048,
                "activation_function": "relu", "model_type": "opt"},
    "opt-66b": {"name": "opt-66b", "hidden_size": 9216, "num_hidden_layers": 64, "num_attention_heads": 72,
                "ffn_dim": 36864, "vocab_size": 50272, "max_position_embeddings": 2048,
                "activation_function": "relu", "model_type": "opt"},
}
# A100's NVLink 3: 600 GB/s both ways = 300 GB/s each way = 2,400 Gb/s per GPU port (the
# link presets are H100's nvlink4 and later); 2 us before data flows, as the nvlink presets.
NVLINK3_GBPS = 2400.0
NVLINK3_LATENCY_US = 2.0


@dataclass(frozen=True)
class Setting:
    model: str
    ttft_ms: float
    tpot_ms: float
    colocated_tp: int          # vLLM: one replica of this TP degree
    prefill_tp: int
    decode_tp: int             # DistServe's decode TP x PP (batchsim: TP over the same GPUs)
    published_ratio: float     # DistServe / vLLM per-GPU rate at 90% attainment (plot.ipynb output)
    placement: str             # DistServe's placement, as it reports it
    slo_rate: float            # Figure 8 lower: the per-GPU rate at which the SLOs are scaled
    published_slo_ratio: float  # vLLM's tightest SLO scale over DistServe's at that rate (plot.ipynb)

    @property
    def disagg_gpus(self) -> int:
        return self.prefill_tp + self.decode_tp


# Per-GPU rates of DistServe's Figure 8 (plot.ipynb, plot_fig8_upper): the attainment curves'
# x axis, printed here for both deployments.
RATE_GRIDS = {
    "opt-13b": (0.25, 0.5, 1.0, 1.5, 2.0, 2.25, 2.5, 3.0),
    "opt-66b": (0.0625, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0),
}
# DistServe's simulator on this OPT-13B placement (simdistserve/README.md): "Best per GPU rate: 1.56"
# at TTFT 200 ms and TPOT 100 ms, 90% of requests within each, 300 requests.
SIMULATOR_13B = {"ttft_ms": 200.0, "tpot_ms": 100.0, "per_gpu_rate": 1.56}

SETTINGS = {
    "opt-13b": Setting("opt-13b", 250.0, 100.0, 1, 2, 1, 4.6, "prefill TP2, decode TP1", 1.5, 1.7357),
    "opt-66b": Setting("opt-66b", 2500.0, 150.0, 4, 4, 4, 2.7504, "prefill TP4, decode TP2xPP2 (as TP4)", 0.75,
                       3.1439),
}


def lengths_file(folder: Path) -> Path:
    """ShareGPT lengths with prompt + output < 2048 (OPT's context), as DistServe prunes them."""
    table = pd.read_csv(SHAREGPT)
    kept = table[table["prompt_tokens"] + table["output_tokens"] < OPT_MAX_TOKENS]
    path = folder / "sharegpt_opt2k_lengths.csv"
    kept.to_csv(path, index=False)
    return path


def workload(s: Setting, kind: str, rate: float, num_requests: int, lengths: Path, seed: int) -> dict[str, Any]:
    """The workload mapping of one deployment: kind colocated-vllm, colocated-vllm_v1 or disaggregated."""
    vllm_knobs = {"max_num_batched_tokens": 65536, "max_num_seqs": 1024}
    raw: dict[str, Any] = {
        "name": f"distserve-{s.model}-{kind}", "seed": seed, "num_requests": num_requests,
        "arrivals": {"kind": "poisson", "rate": rate},
        "lengths": {"kind": "empirical", "path": str(lengths)},
        "profile": {"model": OPT_CONFIGS[s.model], "gpu": "a100-80gb", "dtype": "fp16",
                    "tensor_parallel": s.colocated_tp},
        "server": {"block_size": 16, "gpu_memory_utilization": 0.92},
        "slo": {"ttft_ms": s.ttft_ms, "tpot_ms": s.tpot_ms},
    }
    if kind == "colocated-vllm":
        raw["policy"] = {"kind": "vllm", **vllm_knobs}
    elif kind == "colocated-vllm_v1":
        raw["policy"] = {"kind": "vllm_v1", **vllm_knobs}
    else:
        # Decode: vllm_v1, the side of vLLM's KV handoff batchsim models, DistServe's knobs.
        raw["policy"] = {"kind": "vllm_v1", **vllm_knobs}
        raw["disaggregation"] = {
            # Prefill: whole prompts, FCFS, batched up to 128 requests / 32768 tokens (vLLM v0's
            # prefill-only iteration is that schedule).
            "prefill": {"replicas": 1, "profile": {"tensor_parallel": s.prefill_tp},
                        "policy": {"kind": "vllm", "max_num_batched_tokens": 32768, "max_num_seqs": 128}},
            "decode": {"replicas": 1, "profile": {"tensor_parallel": s.decode_tp}},
            "link": {"bandwidth_gbps": NVLINK3_GBPS, "latency_us": NVLINK3_LATENCY_US},
        }
    return raw


def simulate(raw: dict[str, Any], folder: Path) -> pd.DataFrame:
    from sim.run.config import workload_from_dict
    from sim.run.disagg import run_disaggregated
    from sim.run.runner import run_workload
    cfg = workload_from_dict(raw, "distserve_goodput", str(folder))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_disaggregated(cfg) if cfg.disaggregation is not None else run_workload(cfg)
    return result.requests


def distserve_reading(requests: pd.DataFrame) -> pd.DataFrame:
    """TTFT at the prefill's end (DistServe streams that token), TPOT from there to the last token."""
    if "prefill_s" not in requests:
        return requests
    out = requests.copy()
    prefill_end_s = out["arrival_s"] + out["prefill_queue_s"] + out["prefill_s"]
    out["ttft_s"] = prefill_end_s - out["arrival_s"]
    steps = out["output_tokens"] - 1
    out["tpot_s"] = np.where(steps > 0, (out["finished_s"] - prefill_end_s) / steps.clip(lower=1), np.nan)
    return out


def verdict(requests: pd.DataFrame, s: Setting, each: bool = False) -> dict[str, Any]:
    """judge()'s stability, and the share of requests within both SLOs (a one-token request has no
    TPOT: DistServe counts it 0); ``each``: pass on judge()'s per-metric attainment instead (90%
    within TTFT and 90% within TPOT, not necessarily the same requests), as DistServe's simulator
    searches (simdistserve's --prefill-percentage / --decode-percentage)."""
    from reports.experiments.capacity import judge
    from sim.run.config import Slo
    v = judge(requests, pd.DataFrame({"req_id": [], "t_s": []}), Slo(s.ttft_ms, s.tpot_ms, attainment=ATTAINMENT))
    finished = (requests["status"] == "finished").to_numpy()
    ttft_ok = requests["ttft_s"].to_numpy(dtype=float) * 1e3 <= s.ttft_ms
    tpot_ok = np.nan_to_num(requests["tpot_s"].to_numpy(dtype=float), nan=0.0) * 1e3 <= s.tpot_ms
    both = float(np.mean(finished & ttft_ok & tpot_ok)) if len(requests) else 0.0
    passed = v["passed"] if each else both >= ATTAINMENT and v["stable"]
    return {"passed": passed, "both_attainment": both, "stable": v["stable"]}


def tightest_scale(requests: pd.DataFrame, s: Setting) -> float:
    """The smallest factor on both SLOs at which 90% of the requests meet both (inf: never): each
    request needs max(TTFT / TTFT SLO, TPOT / TPOT SLO), and the scale is the 90% order statistic of
    that (exact; DistServe reads it off a grid of scales)."""
    finished = (requests["status"] == "finished").to_numpy()
    need = np.maximum(requests["ttft_s"].to_numpy(dtype=float) * 1e3 / s.ttft_ms,
                      np.nan_to_num(requests["tpot_s"].to_numpy(dtype=float), nan=0.0) * 1e3 / s.tpot_ms)
    need = np.sort(np.where(finished, np.nan_to_num(need, nan=np.inf), np.inf))
    return float(need[math.ceil(ATTAINMENT * len(need)) - 1]) if len(need) else math.inf


@dataclass
class Runs:
    """The runs of one invocation, each simulated once: the capacity searches, both readings and
    the rate grids share them."""

    num_requests: int
    seed: int
    rel_tol: float
    lengths: Path
    folder: Path
    cache: dict = field(default_factory=dict)

    def requests(self, s: Setting, kind: str, rate: float) -> pd.DataFrame:
        key = (s.model, kind, round(rate, 9))
        if key not in self.cache:
            self.cache[key] = simulate(workload(s, kind, rate, self.num_requests, self.lengths, self.seed),
                                       self.folder)
        return self.cache[key]

    def capacity(self, s: Setting, kind: str, reading: str = "distserve",
                 each: bool = False) -> tuple[float, int, str]:
        """(highest passing rate in req/s, trial runs, find_capacity's note) of one deployment."""
        from reports.experiments.capacity import SearchSettings, find_capacity

        def evaluate(rate: float) -> dict[str, Any]:
            requests = self.requests(s, kind, rate)
            return verdict(distserve_reading(requests) if reading == "distserve" else requests, s, each)

        settings = SearchSettings(num_requests=self.num_requests, min_rate=0.01, max_rate=200.0,
                                  rel_tol=self.rel_tol, max_runs=16)
        rate, trials, note = find_capacity(evaluate, settings, start_rate=0.5 * gpus_of(s, kind))
        return rate, len(trials), note


def gpus_of(s: Setting, kind: str) -> int:
    return s.disagg_gpus if kind == "disaggregated" else s.colocated_tp


COLOCATED = ("colocated-vllm", "colocated-vllm_v1")
DEPLOYMENTS = (*COLOCATED, "disaggregated")


def measure(s: Setting, runs: Runs, slo_scales: list[float]) -> tuple[dict, dict]:
    """Per-GPU goodputs by (deployment, reading) and tightest SLO scales by deployment of one
    setting; prints the searches, the attainment curves and the scaled-SLO goodputs as it goes."""
    found = {}
    for kind, reading in ((COLOCATED[0], "distserve"), (COLOCATED[1], "distserve"),
                          ("disaggregated", "distserve"), ("disaggregated", "vllm")):
        found[(kind, reading)] = runs.capacity(s, kind, reading)
        rate, num_runs, note = found[(kind, reading)]
        print(f"  {s.model} {kind:<18} ({reading} reading): {rate:.3f} req/s in {num_runs} runs; {note}", flush=True)
    per_gpu = {k: found[k][0] / gpus_of(s, k[0]) for k in found}
    print(f"\n  {s.model}: share of {runs.num_requests} requests within both SLOs at DistServe's per-GPU rates "
          f"(Figure 8's x axis; DistServe's reading)")
    print(f"  {'req/s/GPU':<18}" + "".join(f"{r:>8g}" for r in RATE_GRIDS[s.model]))
    for kind in DEPLOYMENTS:
        shares = [verdict(distserve_reading(runs.requests(s, kind, r * gpus_of(s, kind))), s)["both_attainment"]
                  for r in RATE_GRIDS[s.model]]
        print(f"  {kind:<18}" + "".join(f"{100 * x:>7.1f}%" for x in shares))
    if s.model == "opt-13b":
        sim_setting = dataclasses.replace(s, ttft_ms=SIMULATOR_13B["ttft_ms"], tpot_ms=SIMULATOR_13B["tpot_ms"])
        rate, num_runs, _ = runs.capacity(sim_setting, "disaggregated", each=True)
        per = rate / s.disagg_gpus
        print(f"\n  {s.model} disaggregated at DistServe's simulator's SLOs (TTFT 200 ms, TPOT 100 ms, 90% each): "
              f"{rate:.3f} req/s = {per:.3f} per GPU in {num_runs} runs; DistServe's simulator: "
              f"{SIMULATOR_13B['per_gpu_rate']:g} per GPU ({100 * per / SIMULATOR_13B['per_gpu_rate']:.0f}%)")
    scales = {kind: tightest_scale(distserve_reading(runs.requests(s, kind, s.slo_rate * gpus_of(s, kind))), s)
              for kind in DEPLOYMENTS}
    for factor in slo_scales:
        scaled = dataclasses.replace(s, ttft_ms=s.ttft_ms * factor, tpot_ms=s.tpot_ms * factor)
        c = runs.capacity(scaled, COLOCATED[0])[0] / s.colocated_tp
        d = runs.capacity(scaled, "disaggregated")[0] / s.disagg_gpus
        ratio = f"{d / c:.2f}x" if c > 0 else "vllm meets them at no rate"
        print(f"  {s.model} SLOs x {factor:g} ({scaled.ttft_ms / 1e3:g} s / {scaled.tpot_ms / 1e3:g} s): vllm "
              f"{c:.3f}, disaggregated {d:.3f} req/s/GPU: {ratio}", flush=True)
    print(flush=True)
    return per_gpu, scales


def _over(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def print_tables(rows: list, num_requests: int) -> None:
    print()
    print(f"DistServe's chatbot setting: ShareGPT (prompt + output < 2048), Poisson arrivals, A100-80GB, fp16; "
          f"goodput = highest rate with >= {100 * ATTAINMENT:g}% of {num_requests} requests within both SLOs, "
          f"per GPU (req/s/GPU)\n")
    print(f"{'setting':<40}{'SLO TTFT/TPOT':>15}{'vllm/GPU':>10}{'disagg/GPU':>12}{'ratio':>8}"
          f"{'DistServe':>11}{'how close':>11}{'| v1/GPU':>10}{'ratio':>7}{'vLLM-P/D read':>15}{'ratio':>7}")
    for s, g, _, _ in rows:
        coloc, coloc_v1 = g[(COLOCATED[0], "distserve")], g[(COLOCATED[1], "distserve")]
        dis, dis_vllm = g[("disaggregated", "distserve")], g[("disaggregated", "vllm")]
        ratio = _over(dis, coloc)
        setting = f"{s.model} {s.colocated_tp}x vs {s.placement}"
        slo = f"{s.ttft_ms / 1e3:g}s/{s.tpot_ms / 1e3:g}s"
        print(f"{setting:<40}{slo:>15}{coloc:>10.3f}{dis:>12.3f}{ratio:>7.2f}x{s.published_ratio:>10.2f}x"
              f"{100.0 * ratio / s.published_ratio:>10.0f}%{coloc_v1:>10.3f}{_over(dis, coloc_v1):>6.2f}x"
              f"{dis_vllm:>15.3f}{_over(dis_vllm, coloc):>6.2f}x")
    print("\n(vllm: batchsim's vLLM v0 scheduler, DistServe's 2023 baseline; ratio = disagg/GPU over vllm/GPU; how "
          "close = ratio / DistServe's published ratio; v1: today's vllm_v1 (chunked prefill) colocated, and the "
          "disaggregated goodput over it; vLLM-P/D read: the disaggregated goodput with TTFT taken at the decode "
          "instance's first token, as vLLM's P/D proxy streams it)")
    print(f"\nTighter SLOs (Figure 8 lower): the smallest factor on both SLOs at which {100 * ATTAINMENT:g}% of the "
          f"requests meet both, at DistServe's per-GPU rate; ratio = vllm's factor over the disaggregated one\n")
    print(f"{'setting':<40}{'req/s/GPU':>10}{'vllm':>8}{'v1':>8}{'disagg':>8}{'ratio':>8}{'DistServe':>11}"
          f"{'how close':>11}")
    for s, _, sc, _ in rows:
        v0, v1, dis = sc[COLOCATED[0]], sc[COLOCATED[1]], sc["disaggregated"]
        ratio = _over(v0, dis)
        close = f"{100 * ratio / s.published_slo_ratio:.0f}%" if math.isfinite(ratio) else "-"
        print(f"{s.model + ' ' + s.placement:<40}{s.slo_rate:>10g}{v0:>8.2f}{v1:>8.2f}{dis:>8.2f}{ratio:>7.2f}x"
              f"{s.published_slo_ratio:>10.2f}x{close:>11}")
    print("(a factor far above 1: the deployment is past its capacity at that rate, and its factor grows with the "
          "run; inf: over 10% of the requests never finish)")
    print("(wall s: " + ", ".join(f"{s.model} {wall:.0f}" for s, _, _, wall in rows) + ")")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="opt-13b,opt-66b", help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--num-requests", type=int, default=2000, help="requests per trial run")
    ap.add_argument("--rel-tol", type=float, default=0.02, help="bisection stops at hi / lo - 1 <= this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-scales", default="", help="also the goodputs with both SLOs times each of these "
                    "factors (comma-separated, e.g. 0.8,0.6): where the crossover lies")
    args = ap.parse_args()
    models = args.models.split(",")
    for m in models:
        if m not in SETTINGS:
            ap.error(f"--models: unknown model {m!r}; choose from {', '.join(SETTINGS)}")
    slo_scales = [float(x) for x in args.slo_scales.split(",") if x]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = Runs(args.num_requests, args.seed, args.rel_tol, lengths_file(Path(tmp)), Path(tmp))
        for m in models:
            t0 = time.perf_counter()
            per_gpu, scales = measure(SETTINGS[m], runs, slo_scales)
            rows.append((SETTINGS[m], per_gpu, scales, time.perf_counter() - t0))
    print_tables(rows, args.num_requests)


if __name__ == "__main__":
    main()
