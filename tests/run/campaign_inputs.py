"""The second campaign of bad and odd inputs (issue 35): engines' knobs, start-up limits,
HF configs read strictly, ranges, trace files, plans and sweeps, as a new user would try
them. Each case is one input and what must come of it: refused with one line holding
its words (file, field, the engine's own knob), a warning holding them, or a run that
does what the knob says. ``outcome`` classifies what happened (ok, traceback, silent,
unclear, wrong, hang); ``tests/run/test_campaign_inputs.py`` wants ok for all.

Self-contained (it imports nothing of batchsim but through ``run``) so that the same
table can be run against another checkout to count what it did before.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

ROOT = Path(__file__).resolve().parents[2]
HF = ROOT / "tests" / "fixtures" / "hf_configs"

GOOD: dict[str, Any] = {
    "name": "t", "num_requests": 20,
    "arrivals": {"kind": "poisson", "rate": 5},
    "lengths": {"kind": "fixed", "prompt_tokens": 100, "output_tokens": 10},
    "policy": {"kind": "vllm"},
}
ENGINES = ("sglang", "tensorrt_llm", "tgi", "lmdeploy")


@dataclass(frozen=True)
class Case:
    name: str
    cls: str                                   # the class of input, for the counts
    expect: str                                # refused | warns | runs
    words: tuple[str, ...] = ()                # what the message (or the warnings) must hold
    workload: dict[str, Any] = field(default_factory=dict)    # merged into GOOD (None drops a key)
    sets: tuple[str, ...] = ()                 # --set KEY=VALUE
    files: dict[str, str] = field(default_factory=dict)       # more files beside the workload
    command: str = "run"                       # run | sweep | plan (files["s.yaml"] is the file)
    check: Callable[[Path], bool] | None = None                # on the run's folder, for expect runs
    absent: tuple[str, ...] = ()               # words the output must not hold (a wrong knob's name)
    args: tuple[str, ...] = ()                 # more command-line arguments


def merged(extra: dict[str, Any]) -> dict[str, Any]:
    """GOOD with ``extra``'s sections in place of its own (None drops one)."""
    data = copy.deepcopy(GOOD)
    for key, value in extra.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = copy.deepcopy(value)
    return data


def hf(name: str, **changes: Any) -> dict[str, Any]:
    """A fixture's config.json with ``changes`` (None removes a key)."""
    cfg = json.loads((HF / name / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


def on(model: dict[str, Any], **profile: Any) -> dict[str, Any]:
    """A workload on ``model`` (an HF config) with a context the GPU's pool holds."""
    return {"profile": {"model": model, "gpu": profile.pop("gpu", "h200"), **profile},
            "server": {"max_model_len": 4096}}


def lone(kind: str, prompt: int, output: int, num_blocks: int, max_model_len: int, **knobs: Any) -> dict[str, Any]:
    """One request on a pool of ``num_blocks`` of the policy's pages."""
    return {"num_requests": 1, "arrivals": {"kind": "all_at_once"},
            "lengths": {"kind": "fixed", "prompt_tokens": prompt, "output_tokens": output},
            "server": {"num_blocks": num_blocks, "max_model_len": max_model_len},
            "policy": {"kind": kind, **knobs}}


def trace(text: str, name: str = "trace.jsonl") -> dict[str, Any]:
    return {"workload": {"num_requests": None, "arrivals": {"kind": "trace", "path": name},
                         "lengths": {"kind": "trace"}}, "files": {name: text}}


MOONCAKE_ROW = '{"timestamp": 0, "input_length": 100, "output_length": 10}\n'
CSV_HEAD = "arrival_time_s,prompt_tokens,output_tokens\n"
PREFIX = {"num_requests": 60, "arrivals": {"kind": "poisson", "rate": 20},
          "lengths": {"kind": "prefix_repetition", "prefix_len": 512, "suffix_len": 64, "num_prefixes": 2,
                      "output_len": 8}}


def summary(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "out" / "summary.json").read_text())


def hits(folder: Path) -> int:
    return int(summary(folder).get("prefix_cache_hits") or 0)


def finished(n: int) -> Callable[[Path], bool]:
    return lambda folder: summary(folder)["completed"] + summary(folder)["failed"] == n


def pool_as_lower_case(folder: Path) -> bool:
    """The run's KV pool is the one of the same workload with its precisions in lower case."""
    from sim.run.config import load_workload
    from sim.run.runner import build_profile, kv_blocks, resolve_server
    cfg = load_workload(folder / "w.yaml")
    lower = {k: v.lower() for k, v in cfg.raw["profile"].items() if k.endswith("dtype") and isinstance(v, str)}
    cfg = load_workload(folder / "w.yaml", {f"profile.{k}": v for k, v in lower.items()})
    profile = build_profile(cfg)
    meta = json.loads((folder / "out" / "meta.json").read_text())
    return meta["num_blocks"] == kv_blocks(resolve_server(cfg, profile), profile)[0]


def _cases() -> list[Case]:
    c: list[Case] = []
    add = c.append

    # ---- 1. server fields an engine does not read: refused, naming its own knob -------------
    own = {"sglang": {"block_size": "page_size", "gpu_memory_utilization": "mem_fraction_static"},
           "tensorrt_llm": {"block_size": "tokens_per_block", "gpu_memory_utilization": "free_gpu_memory_fraction"},
           "lmdeploy": {"block_size": "block_size", "gpu_memory_utilization": "cache_max_entry_count"},
           "tgi": {"block_size": "attention", "gpu_memory_utilization": None}}
    values = {"block_size": 32, "gpu_memory_utilization": 0.5, "watermark": 0.05}
    for kind in ENGINES:
        for name, value in values.items():
            knob = own[kind].get(name)
            words = (f"'server.{name}' is not read by policy {kind}",
                     f"'policy.{knob}'" if knob else "has no knob for it")
            add(Case(f"{kind}-server-{name}", "engine knobs", "refused", words,
                     {"policy": {"kind": kind}, "server": {name: value}}))
    add(Case("vllm_v1-server-watermark", "engine knobs", "refused",
             ("'server.watermark' is not read by policy vllm_v1", "'policy.watermark'"),
             {"policy": {"kind": "vllm_v1"}, "server": {"watermark": 0.05}}))
    for kind in ("static", "dynamic", "orca"):
        add(Case(f"{kind}-server-watermark", "engine knobs", "refused",
                 (f"'server.watermark' is not read by policy {kind}", "has no knob"),
                 {"policy": {"kind": kind}, "server": {"watermark": 0.05}}))
    add(Case("sglang-server-block-size-by-set", "engine knobs", "refused",
             ("'server.block_size' is not read by policy sglang", "'policy.page_size'", "--set"),
             {"policy": {"kind": "sglang"}}, ("server.block_size=64",)))
    for kind, name in (("vllm", "watermark"), ("sarathi", "watermark"), ("vllm_v1", "block_size"),
                       ("orca", "block_size"), ("static", "gpu_memory_utilization")):
        add(Case(f"{kind}-reads-server-{name}", "engine knobs", "runs", (),
                 {"policy": {"kind": kind}, "server": {name: values[name]}}))
    add(Case("tgi-attention-paged-with-prefix-caching", "engine knobs", "refused",
             ("prefix_caching needs attention flashinfer or flashdecoding",),
             {"policy": {"kind": "tgi", "attention": "paged", "prefix_caching": True}}))
    add(Case("lmdeploy-block-size-not-a-power-of-two", "engine knobs", "refused",
             ("block_size must be a power of 2 >= 16",), {"policy": {"kind": "lmdeploy", "block_size": 24}}))
    add(Case("sglang-schedule-policy-upper-case", "engine knobs", "refused",
             ("schedule_policy must be fcfs or lpm", "'LPM'"),
             {"policy": {"kind": "sglang", "schedule_policy": "LPM"}}))
    add(Case("tensorrt-capacity-policy-unknown", "engine knobs", "refused",
             ("capacity_scheduler_policy must be one of", "GUARANTEED_NO_EVICT"),
             {"policy": {"kind": "tensorrt_llm", "capacity_scheduler_policy": "no_evict"}}))
    add(Case("plan-candidate-server-field-sglang", "engine knobs", "refused",
             ("'server.gpu_memory_utilization' is not read by policy sglang", "'policy.mem_fraction_static'"),
             command="plan", files={"s.yaml": yaml.safe_dump({
                 "name": "p", "base": "w.yaml", "target_rate": 5, "slo": {"ttft_ms": 2000, "itl_ms": 100},
                 "policies": [{"kind": "sglang"}],
                 "candidates": [{"name": "x", "profile": {"gpu": "h100-sxm"}, "price_per_gpu_hour": 3.0,
                                 "server": {"gpu_memory_utilization": 0.8}}]})}))
    add(Case("sweep-over-kinds-with-server-block-size", "engine knobs", "refused",
             ("[run policy.kind=\"tgi\"]", "'server.block_size' is not read by policy tgi", "'policy.attention'"),
             {"server": {"block_size": 32}}, command="sweep", files={"s.yaml": yaml.safe_dump({
                 "name": "s", "base": "w.yaml", "vary": {"policy.kind": ["vllm", "tgi"]}, "save_runs": False})}))

    # ---- 2. prefix caching: the engine's switch, by its name; off means off ------------------
    switch = {"sglang": "disable_radix_cache", "tensorrt_llm": "enable_block_reuse", "tgi": "prefix_caching"}
    for kind, knob in switch.items():
        for flag in (True, False):
            add(Case(f"{kind}-enable-prefix-caching-{str(flag).lower()}", "prefix caching", "refused",
                     ("'policy.enable_prefix_caching'", f"policy {kind} names it 'policy.{knob}'"),
                     {"policy": {"kind": kind, "enable_prefix_caching": flag}}, absent=("has no prefix cache",)))
    for kind in ("vllm", "sarathi", "orca"):
        add(Case(f"{kind}-enable-prefix-caching-true", "prefix caching", "refused",
                 ("'policy.enable_prefix_caching'", f"policy {kind} has no prefix cache"),
                 {"policy": {"kind": kind, "enable_prefix_caching": True}}))
        add(Case(f"{kind}-enable-prefix-caching-false", "prefix caching", "runs", (),
                 {"policy": {"kind": kind, "enable_prefix_caching": False}}))
    for kind, knobs, cached in (("sglang", {"disable_radix_cache": True}, False), ("sglang", {}, True),
                                ("tensorrt_llm", {"enable_block_reuse": False}, False), ("tensorrt_llm", {}, True),
                                ("vllm_v1", {"enable_prefix_caching": False}, False), ("vllm_v1", {}, True),
                                ("lmdeploy", {"enable_prefix_caching": True}, True), ("lmdeploy", {}, False),
                                ("tgi", {"prefix_caching": True}, True), ("tgi", {}, False)):
        label = "-".join(f"{k}-{str(v).lower()}" for k, v in knobs.items()) or "default"
        add(Case(f"{kind}-cache-{label}-{'hits' if cached else 'no-hits'}", "prefix caching", "runs", (),
                 {**PREFIX, "policy": {"kind": kind, **knobs}},
                 check=(lambda f: hits(f) > 0) if cached else (lambda f: hits(f) == 0)))
    add(Case("sweep-over-kinds-with-caching-off", "prefix caching", "refused",
             ("[run policy.kind=\"sglang\"]", "names it 'policy.disable_radix_cache'"),
             {"policy": {"kind": "vllm_v1", "enable_prefix_caching": False}}, command="sweep",
             files={"s.yaml": yaml.safe_dump({"name": "s", "base": "w.yaml",
                                              "vary": {"policy.kind": ["vllm_v1", "sglang"]}, "save_runs": False})}))

    # ---- 3. pool errors name the knob that sized the pool -------------------------------------
    for kind, knob, value, words in (
            ("sglang", "page_size", 10**9, "'policy.page_size' (1,000,000,000 tokens) is larger than the whole KV"),
            ("tensorrt_llm", "tokens_per_block", 10**9, "'policy.tokens_per_block' (1,000,000,000 tokens)"),
            ("lmdeploy", "block_size", 2**30, "'policy.block_size' (1,073,741,824 tokens)"),
            ("sglang", "mem_fraction_static", 0.0001, "'policy.mem_fraction_static': the model's weights do not fit"),
            ("tensorrt_llm", "free_gpu_memory_fraction", 0.00001,
             "'policy.free_gpu_memory_fraction': the KV cache it leaves holds"),
            ("lmdeploy", "cache_max_entry_count", 0.00001, "'policy.cache_max_entry_count': the KV cache it leaves")):
        add(Case(f"{kind}-{knob}-pool", "engine knobs", "refused", (words,),
                 {"policy": {"kind": kind, knob: value}}, absent=("server.block_size", "field 'profile'")))
    add(Case("vllm-gpu-memory-utilization-pool", "engine knobs", "refused",
             ("'server.gpu_memory_utilization': the model's weights do not fit",),
             {"server": {"gpu_memory_utilization": 0.0001}}))
    add(Case("vllm-block-size-pool", "engine knobs", "refused",
             ("'server.block_size' (1,000,000 tokens) is larger than the whole KV cache",),
             {"server": {"block_size": 10**6}}))
    add(Case("sglang-mem-fraction-short-of-context", "engine knobs", "refused",
             ("'policy.mem_fraction_static'", "fewer than one request of max_model_len", "raise policy.mem_fraction_static"),
             {"policy": {"kind": "sglang", "mem_fraction_static": 0.2}}))
    add(Case("num-blocks-short-of-context", "engine knobs", "refused",
             ("'server.num_blocks': KV cache holds 64 tokens", "raise server.num_blocks"),
             {"server": {"num_blocks": 4, "max_model_len": 4096}}))

    # ---- 4. a knob the policy's other knobs leave unread: a warning that says why --------------
    for kind, knobs, words in (
            ("tgi", {"waiting_served_ratio": 0.5}, "policy.waiting_served_ratio is ignored by policy tgi with attention flashinfer"),
            ("tgi", {"max_waiting_tokens": 5, "attention": "flashdecoding"}, "policy.max_waiting_tokens is ignored"),
            ("sglang", {"schedule_policy": "lpm", "disable_radix_cache": True}, "policy.schedule_policy is ignored"),
            ("sglang", {"enable_mixed_chunk": True, "chunked_prefill_size": -1}, "policy.enable_mixed_chunk is ignored"),
            ("tensorrt_llm", {"context_chunking_policy": "EQUAL_PROGRESS"}, "policy.context_chunking_policy is ignored")):
        add(Case(f"{kind}-unread-{next(iter(knobs))}", "engine knobs", "warns", (words,),
                 {"policy": {"kind": kind, **knobs}}))
    for kind, knobs in (("tgi", {"waiting_served_ratio": 0.5, "attention": "paged"}),
                        ("tensorrt_llm", {"context_chunking_policy": "EQUAL_PROGRESS", "enable_chunked_prefill": True}),
                        ("sglang", {"schedule_policy": "lpm"})):
        add(Case(f"{kind}-read-{next(iter(knobs))}", "engine knobs", "runs", (), {"policy": {"kind": kind, **knobs}},
                 absent=("is ignored",)))

    # ---- 5. start-up limits: no request that passes them waits forever ------------------------
    # SGLang's PrefillAdder admits a lone request while prompt + max_tokens + one page < the pool:
    # 4,096 one-token pages hold 4,096 - 1 - 1 = 4,094 (4,000 + 95 = 4,095 waited forever); 256
    # pages of 16, 4,096 - 16 - 1 = 4,079; ignore_eos without the cache also ceils the prompt to
    # pages and keeps a token to spare: 4,096 - 2 - 1 = 4,093. The others hold the whole pool.
    add(Case("sglang-4000+95-on-4096", "start-up limits", "refused",
             ("policy sglang can schedule at most 4,094 tokens", "set server.max_model_len <= 4,094"),
             lone("sglang", 4000, 95, 4096, 4096)))
    add(Case("sglang-page-16-limit", "start-up limits", "refused",
             ("at most 4,079 tokens", "policy.page_size 16"), lone("sglang", 4000, 79, 256, 4096, page_size=16)))
    add(Case("sglang-ignore-eos-no-cache-limit", "start-up limits", "refused", ("at most 4,093 tokens",),
             lone("sglang", 4000, 94, 4096, 4094, ignore_eos=True, disable_radix_cache=True)))
    add(Case("sglang-at-its-limit", "start-up limits", "runs", (), lone("sglang", 4000, 94, 4096, 4094),
             check=finished(1)))
    add(Case("sglang-page-16-at-its-limit", "start-up limits", "runs", (),
             lone("sglang", 4000, 79, 256, 4079, page_size=16), check=finished(1)))
    for kind in ("static", "dynamic", "orca", "vllm", "sarathi", "vllm_v1", "tensorrt_llm", "lmdeploy"):
        blocks = {"tensorrt_llm": 128, "lmdeploy": 64}.get(kind, 256)
        add(Case(f"{kind}-fills-its-pool", "start-up limits", "runs", (), lone(kind, 4000, 96, blocks, 4096),
                 check=finished(1)))
    add(Case("tgi-fills-its-pool", "start-up limits", "runs", (), lone("tgi", 4000, 96, 4096, 4096),
             check=finished(1)))
    add(Case("request-past-the-context-strict", "start-up limits", "refused",
             ("1 of 1 requests were rejected", "--strict"), lone("vllm", 5000, 10, 1024, 4096), args=("--strict",)))

    # ---- 6. HF configs, read strictly ---------------------------------------------------------
    q32, moe = "Qwen3-32B", "Qwen3-30B-A3B"
    for key, value, words in (
            ("tie_word_embeddings", "false", "field 'tie_word_embeddings' must be true or false, got 'false'"),
            ("tie_word_embeddings", 0, "field 'tie_word_embeddings' must be true or false, got 0"),
            ("tie_word_embeddings", "true", "must be true or false"),
            ("use_sliding_window", "no", "field 'use_sliding_window' must be true or false"),
            ("max_window_layers", "all", "field 'max_window_layers' must be an integer >= 0"),
            ("max_window_layers", -1, "field 'max_window_layers' must be an integer >= 0"),
            ("num_key_value_heads", 0, "field 'num_key_value_heads' must be a positive integer"),
            ("num_key_value_heads", "8", "field 'num_key_value_heads' must be a positive integer"),
            ("head_dim", 0, "field 'head_dim' must be a positive integer"),
            ("sliding_window", -5, "field 'sliding_window' must be a positive integer or null"),
            ("hidden_act", "swishy", "field 'hidden_act' is 'swishy', an activation batchsim does not know"),
            ("hidden_act", 7, "field 'hidden_act' must be the activation's name"),
            ("rope_theta", "big", "rope_theta must be a positive number"),
            ("num_hidden_layers", 0, "field 'num_hidden_layers' must be a positive integer"),
            ("vocab_size", 1.5, "field 'vocab_size' must be a positive integer"),
            ("layer_types", ["linear_attention"] * 64, "uses linear attention in every layer (attention-free models)"),
            ("layer_types", ["mamba"] * 64, "uses hybrid Mamba2 state-space layers"),
            ("layer_types", ["chunked_attention"] * 64, "layers of type 'chunked_attention', which batchsim does not model"),
            ("layer_types", ["full_attention"] * 3, "field 'layer_types' must list one type per layer (64)"),
            ("kv_lora_rank", 512, "multi-head latent attention needs kv_lora_rank, qk_nope_head_dim, "
                                  "qk_rope_head_dim, v_head_dim; qk_nope_head_dim, qk_rope_head_dim, v_head_dim missing"),
            ("index_topk", 2048, "DeepSeek sparse attention needs index_topk, index_head_dim, index_n_heads"),
            ("compress_ratios", [4, 128], "uses compressed sparse attention (DeepSeek-V4)"),
            ("hybrid_override_pattern", "M-M*", "uses hybrid Mamba2 state-space layers"),
            ("block_configs", [{}], "uses per-layer heterogeneous blocks (Nemotron NAS)"),
            ("interleave_moe_layer_step", 2, "uses interleaved MoE and chunked-attention layers (Llama 4)"),
            ("linear_num_value_heads", 32, "field 'linear_num_value_heads' describes linear-attention layers"),
            ("quantization_config", {"quant_method": "awq"}, "quantization_config.quant_method 'awq' is not supported"),
            ("quantization_config", "fp8", "field 'quantization_config' must be a mapping")):
        add(Case(f"hf-{key}-{json.dumps(value)[:24]}", "HF configs", "refused", (words,), on(hf(q32, **{key: value}))))
    for key, value, words in (
            ("decoder_sparse_step", 0, "field 'decoder_sparse_step' must be a positive integer, got 0"),
            ("decoder_sparse_step", -2, "field 'decoder_sparse_step' must be a positive integer"),
            ("decoder_sparse_step", "1", "field 'decoder_sparse_step' must be a positive integer"),
            ("mlp_only_layers", [99], "field 'mlp_only_layers' must list layer indices in [0, 48)"),
            ("mlp_only_layers", "none", "field 'mlp_only_layers' must list layer indices"),
            ("first_k_dense_replace", "3", "field 'first_k_dense_replace' must be an integer >= 0"),
            ("n_shared_experts", -1, "field 'n_shared_experts' must be an integer >= 0"),
            ("num_experts_per_tok", None, "the routing width is missing"),
            ("moe_intermediate_size", 0, "field 'moe_intermediate_size' must be a positive integer")):
        add(Case(f"hf-moe-{key}-{json.dumps(value)[:24]}", "HF configs", "refused", (words,), on(hf(moe, **{key: value}))))
    add(Case("hf-wrapped-csa", "HF configs", "refused", ("uses compressed sparse attention (DeepSeek-V4)",),
             on({"text_config": hf(q32, compress_ratios=[4, 128]), "architectures": ["X"]})))
    add(Case("hf-wrapped-partial-mla", "HF configs", "refused", ("qk_nope_head_dim, qk_rope_head_dim, v_head_dim missing",),
             on({"text_config": hf(q32, kv_lora_rank=512), "architectures": ["X"]})))
    for key, wrong in (("num_key_value_heads", "num_key_value_head"), ("num_attention_heads", "num_attention_head"),
                       ("max_position_embeddings", "max_position_embedding"), ("head_dim", "head_dims")):
        cfg = hf(q32, **{key: None})
        cfg[wrong] = json.loads((HF / q32 / "config.json").read_text())[key]
        expect = "warns" if key in ("num_key_value_heads", "head_dim") else "refused"
        add(Case(f"hf-typo-{wrong}", "HF configs", expect, (f"'{wrong}'", f"did you mean '{key}'") if expect == "warns"
                 else (f"'{key}' is missing",), on(cfg)))
    for key, value in (("hidden_act", "SiLU"), ("layer_types", ["Full_Attention"] * 64), ("mlp", "SwiGLU"),
                       ("tie_word_embeddings", None), ("rope_theta", None)):
        add(Case(f"hf-accepts-{key}-{json.dumps(value)[:16]}", "HF configs", "runs", (), on(hf(q32, **{key: value})),
                 absent=("did you mean",)))
    add(Case("hf-weight-dtype-MXFP4-as-mxfp4", "HF configs", "runs", (), on(hf("gpt-oss-120b"), weight_dtype="MXFP4"),
             check=pool_as_lower_case))
    for key, value, words in (("dtype", "BF16", None), ("kv_cache_dtype", "FP8", None), ("weight_dtype", "FP8", None),
                              ("weight_dtype", "fp6", "field 'profile.weight_dtype' is 'fp6'"),
                              ("dtype", "bfloat16", "field 'profile.dtype' is 'bfloat16'"),
                              ("kv_cache_dtype", "int8", "field 'profile.kv_cache_dtype' is 'int8'")):
        add(Case(f"precision-{key}-{value}", "HF configs", "refused" if words else "runs", (words,) if words else (),
                 {"profile": {key: value}}, check=None if words else pool_as_lower_case))

    # ---- 7. ranges: times, spans, durations and counts a run can mean ---------------------------
    for path, value, words, extra in (
            ("duration_s", 1e12, "field 'duration_s' must be at most 1e+09 s", {"num_requests": None}),
            ("slo", {"ttft_ms": 1e300}, "field 'slo.ttft_ms' must be at most 1e+12 ms", {}),
            ("slo", {"e2el_ms": 1e13}, "field 'slo.e2el_ms' must be at most", {}),
            ("server", {"num_blocks": 10**15}, "field 'server.num_blocks' must be at most 2,147,483,647", {}),
            ("server", {"block_size": 10**12}, "field 'server.block_size' must be at most 2,147,483,647", {}),
            ("lengths", {"kind": "fixed", "prompt_tokens": 10**15, "output_tokens": 10},
             "field 'lengths.prompt_tokens' must be at most 2,147,483,647", {}),
            ("lengths", {"kind": "fixed", "prompt_tokens": 100, "output_tokens": 10**15},
             "field 'lengths.output_tokens' must be at most", {}),
            ("lengths", {"kind": "uniform", "prompt_max": 10**15, "output_max": 10},
             "field 'lengths.prompt_max' must be at most", {}),
            ("lengths", {"kind": "lognormal", "prompt_mean": 1e15, "output_mean": 10},
             "field 'lengths.prompt_mean' must be at most", {}),
            ("policy", {"kind": "vllm", "max_num_seqs": 10**15}, "field 'policy.max_num_seqs' must be at most 2,147,483,647", {}),
            ("policy", {"kind": "vllm", "max_num_batched_tokens": 10**15}, "field 'policy.max_num_batched_tokens' must be at most", {}),
            ("policy", {"kind": "dynamic", "max_queue_delay_s": 1e300}, "field 'policy.max_queue_delay_s' must be at most 1e+09 s", {}),
            ("policy", {"kind": "sglang", "max_prefill_tokens": 10**15}, "field 'policy.max_prefill_tokens' must be at most", {}),
            ("policy", {"kind": "tgi", "max_batch_prefill_tokens": 10**12}, "field 'policy.max_batch_prefill_tokens' must be at most", {}),
            ("policy", {"kind": "lmdeploy", "prefill_interval": 10**15}, "field 'policy.prefill_interval' must be at most", {}),
            ("policy", {"kind": "sglang", "page_size": 10**15}, "field 'policy.page_size' must be at most", {}),
            ("policy", {"kind": "tensorrt_llm", "max_batch_size": 10**10}, "field 'policy.max_batch_size' must be at most", {}),
            ("arrivals", {"kind": "poisson", "rate": 1e300}, "field 'arrivals.rate' must be in [1e-06, 1e+06]", {}),
            ("arrivals", {"kind": "concurrency", "max_concurrency": 2, "think_time_s": 1e300},
             "field 'arrivals.think_time_s' must be at most", {}),
            ("max_tokens", 10**15, "field 'max_tokens' must be at most 2,147,483,647", {})):
        add(Case(f"range-{path}-{json.dumps(value)[:40]}", "ranges", "refused", (words,), {path: value, **extra}))
    azure = {"num_requests": None, "lengths": {"kind": "trace"}}
    for name, value, words in (("start_s", 1e300, "field 'arrivals.start_s' must be at most 1e+09 s"),
                               ("time_scale", 1e300, "field 'arrivals.time_scale' must be in [1e-06, 1e+06]"),
                               ("time_scale", 1e-300, "field 'arrivals.time_scale' must be in [1e-06, 1e+06]"),
                               ("rate_scale", 1e-300, "field 'arrivals.rate_scale' must be in [1e-06, 1e+06]"),
                               ("rate_scale", 1e300, "field 'arrivals.rate_scale' must be in")):
        add(Case(f"range-arrivals-{name}-{value:g}", "ranges", "refused", (words,),
                 {**azure, "arrivals": {"kind": "trace", "path": "azure_llm_2023_conv.csv", name: value}}))
    add(Case("range-trace-replayed-over-31-years", "ranges", "refused",
             ("'arrivals.repeat', 'arrivals.time_scale'", "past the 1e+09 s (31 years)"),
             **trace(CSV_HEAD + "0,100,10\n100000,100,10\n", "t.csv") | {"workload": {
                 "num_requests": None, "lengths": {"kind": "trace"},
                 "arrivals": {"kind": "trace", "path": "t.csv", "time_scale": 1e6, "repeat": 20}}}))
    for text, name, words in (
            (MOONCAKE_ROW + '{"timestamp": 1e300, "input_length": 100, "output_length": 10}\n', "big.jsonl",
             "column 'timestamp' line 2: '1e+300' (read as ms) arrives 1e+297 s after the first request"),
            (CSV_HEAD + "0,100,10\n1e300,100,10\n", "big.csv", "column 'arrival_time_s' row 3"),
            (CSV_HEAD + "0,100,10\n2e9,100,10\n", "late.csv", "past the 1e+09 s (31 years) a run can span"),
            ("TIMESTAMP,ContextTokens,GeneratedTokens\n1900-01-01 00:00:00,100,10\n2024-01-01 00:00:00,100,10\n",
             "dates.csv", "column 'TIMESTAMP' row 3")):
        add(Case(f"range-trace-{name}", "ranges", "refused", (words, "past the 1e+09 s"), **trace(text, name)))
    add(Case("range-trace-epoch-ms-runs", "ranges", "runs", (),
             **trace(CSV_HEAD + "1715000000000,100,10\n1715000001000,100,10\n", "epoch.csv")))

    # ---- 8. trace files: every malformed one refused where it is ------------------------------
    for text, name, *words in (
            ("", "empty.jsonl", "the file holds no requests"),
            ("\n\n  \n", "blank.jsonl", "the file holds no requests"),
            ("[]", "none.json", "the file holds no requests"),
            (MOONCAKE_ROW + "[1, 2]\n", "array.jsonl", "line 2: expected a JSON object", "got an array"),
            (MOONCAKE_ROW + "null\n", "null.jsonl", "line 2: expected a JSON object", "got null"),
            (MOONCAKE_ROW + "7\n", "number.jsonl", "line 2: expected a JSON object", "got the number 7"),
            (MOONCAKE_ROW + '"x"\n', "string.jsonl", "line 2: expected a JSON object", 'got the string "x"'),
            ("[" + MOONCAKE_ROW.strip() + ", null]", "items.json", "item 2: expected a JSON object", "got null"),
            (MOONCAKE_ROW + "true\n", "bool.jsonl", "line 2: expected a JSON object", "got true"),
            ("", "empty.csv", "the file is empty"),
            (CSV_HEAD, "header.csv", "the file has a header but no rows"),
            (MOONCAKE_ROW + "{oops\n", "broken.jsonl", "line 2: cannot parse as JSON")):
        add(Case(f"trace-{name}", "trace files", "refused", tuple(words), **trace(text, name)))

    # ---- 9. the model, the parallelism and the overrides --------------------------------------
    add(Case("tp-above-the-heads", "model and overrides", "refused",
             ("tensor_parallel=64 is more than llama-3.1-8b's 32 attention heads",),
             {"profile": {"tensor_parallel": 64}}, absent=("num_kv_heads 64",)))
    add(Case("tp-not-a-divisor", "model and overrides", "refused", ("tensor_parallel=3 does not divide",),
             {"profile": {"tensor_parallel": 3}}))
    add(Case("set-into-a-preset-name", "model and overrides", "refused",
             ("field 'profile.model.hidden_size' cannot be set", "'profile.model' is 'llama-3.1-8b' (its default)"),
             sets=("profile.model.hidden_size=1",)))
    add(Case("set-into-a-named-preset", "model and overrides", "refused",
             ("'profile.model' is 'qwen3-8b'",), {"profile": {"model": "qwen3-8b"}}, ("profile.model.num_layers=2",)))
    add(Case("set-into-the-gpu", "model and overrides", "refused", ("'profile.gpu' is 'h100-sxm' (its default)",),
             sets=("profile.gpu.memory=80",)))
    add(Case("set-into-a-number", "model and overrides", "refused", ("'num_requests' is 20",),
             sets=("num_requests.x=1",)))
    add(Case("set-a-new-mapping-runs", "model and overrides", "runs", (), sets=("policy.max_num_seqs=8",)))
    plan = {"name": "p", "base": "w.yaml", "target_rate": 5, "slo": {"ttft_ms": 2000, "itl_ms": 100},
            "policies": [{"kind": "vllm"}]}
    add(Case("plan-gpu-typo-without-price", "model and overrides", "refused",
             ("'candidates[0].profile.gpu' is 'h100-sxmm', not a GPU preset", "did you mean 'h100-sxm'"),
             command="plan", files={"s.yaml": yaml.safe_dump({**plan, "candidates": [
                 {"name": "x", "profile": {"gpu": "h100-sxmm"}}]})}, absent=("price_per_gpu_hour' is missing",)))
    add(Case("plan-gpu-typo-with-price", "model and overrides", "refused", ("h100-sxmm",),
             command="plan", files={"s.yaml": yaml.safe_dump({**plan, "candidates": [
                 {"name": "x", "profile": {"gpu": "h100-sxmm"}, "price_per_gpu_hour": 2.0}]})}))
    add(Case("plan-price-missing-for-a-real-gpu", "model and overrides", "refused",
             ("price_per_gpu_hour' is missing and GPU 'arc-pro-b60' has no preset price",),
             command="plan", files={"s.yaml": yaml.safe_dump({**plan, "candidates": [
                 {"name": "x", "profile": {"gpu": "arc-pro-b60"}}]})}))
    return c


CASES = _cases()


def write_case(case: Case, folder: Path) -> list[str]:
    """Write ``case``'s files into ``folder``; the command line (after ``sim``) that runs it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "w.yaml").write_text(yaml.safe_dump(merged(case.workload)))
    for name, text in case.files.items():
        (folder / name).write_text(text)
    target = folder / ("s.yaml" if case.command != "run" else "w.yaml")
    argv = [case.command, str(target), "--out", str(folder / "out")]
    if case.command == "run":
        argv.append("--quiet")
    for setting in case.sets:
        argv += ["--set", setting]
    return argv + list(case.args)


def outcome(case: Case, folder: Path, rc: int | None, err: str) -> tuple[str, str]:
    """(ok | traceback | hang | silent | unclear | wrong, why) of one case's run: ``rc`` its
    exit status (None: it did not end in time), ``err`` what it printed to stderr."""
    if rc is None:
        return "hang", "did not end in time"
    if "Traceback" in err or rc not in (0, 1, 2):
        return "traceback", err.strip().splitlines()[-1] if err.strip() else f"exit {rc}"
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
    if any(w in err for w in case.absent):
        return "unclear", f"names {[w for w in case.absent if w in err]}: {err.strip()[-300:]}"
    if case.expect == "refused":
        if rc == 0:
            return "silent", "accepted"
        if len(lines) != 1:
            return "unclear", f"not one error line: {err.strip()[-300:]}"
        missing = [w for w in case.words if w not in lines[0]]
        if missing:
            return "unclear", f"lacks {missing}: {lines[0][:300]}"
        if (folder / "out" / "summary.json").exists():
            return "unclear", "refused but left a summary.json"
        return "ok", ""
    if rc != 0:
        return "wrong", f"refused: {err.strip()[-300:]}"
    missing = [w for w in case.words if w not in err]
    if missing:
        return ("silent" if case.expect == "warns" else "unclear"), f"no warning holding {missing}"
    if case.check is not None and case.command == "run" and not case.check(folder):
        return "silent", "ran, but not as the knob says"
    return "ok", ""
