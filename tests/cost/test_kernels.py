"""Kernel profiles against the real aiconfigurator-core wheel (the kernels extra; no mock of
its tables): the differential check against the wheel's own step estimates on every
(GPU, engine) the wheel measures, version resolution, the cache, host terms, and the
refusals a user meets."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

aic_core = pytest.importorskip("aiconfigurator_core", reason="the kernels extra (aiconfigurator-core) is not installed")

from sim.cost import aic, kernels  # noqa: E402
from sim.cost.kernel_check import KINDS, TOLERANCE, check, summary  # noqa: E402
from sim.cost.kernels import HostTerms, KernelSpec, KernelsError, kernel_profile  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NO_HOST = HostTerms("none", 0.0, 0.0, 0.0, 0.0, "kernels only")
# Every (GPU, engine) the wheel measures, each with a model that runs on it: a dense 8B at TP 1,
# a dense 32B at TP 2, a mixture of experts (Qwen3-30B-A3B) and gpt-oss (sliding windows,
# mxfp4 experts) where the engine's tables hold its MoE kernel.
PAIRS = [(gpu, engine) for gpu in ("a100-80gb", "h100-sxm", "h200", "b200-sxm", "b300-sxm", "gb200", "gb300",
                                   "l40s", "rtx-pro-6000") for engine in ("vllm", "sglang", "trtllm")]
PAIRS.append(("arc-pro-b60", "vllm"))
MODELS = {("h100-sxm", "vllm"): ("qwen3-32b", 2), ("h200", "trtllm"): ("qwen3-30b-a3b", 1),
          ("b200-sxm", "sglang"): ("qwen3-30b-a3b", 1), ("b300-sxm", "vllm"): ("gpt-oss-20b", 1),
          ("gb200", "vllm"): ("qwen3-30b-a3b", 1)}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kernel-cache")


def tables_only(gpu: str, engine: str, cache: Path, model: str = "qwen3-8b", tp: int = 1, **kw):
    spec = KernelSpec(model=model, gpu=gpu, engine=engine, tensor_parallel=tp, **kw)
    return spec, kernel_profile(spec, NO_HOST, cache)


@pytest.mark.parametrize("gpu, engine", PAIRS)
def test_differential_against_the_wheels_own_step_estimate(gpu: str, engine: str, cache: Path) -> None:
    model, tp = MODELS.get((gpu, engine), ("qwen3-8b", 1))
    spec, profile = tables_only(gpu, engine, cache, model, tp)
    system = aic.system_of(gpu)
    version = profile.provenance["engine_version"]
    model_path = kernels.resolve_model(model, cache).wheel_path
    tables = aic.KernelTables(model_path, system, engine, version, tp)
    results = check(profile, tables, count=200, seed=7)
    s = summary(results)
    # 200 shapes, 50 of each kind; every difference beyond 3% is one the composition explains
    # (sim.cost.kernel_check: LM head rows, the context-0 floor, the monotone repair, one
    # launch for a step's prompts): once those are taken out, every shape agrees within 3%.
    assert len(results) == 200 and {r.kind for r in results} == set(KINDS)
    assert s["all"]["max_residual_pct"] <= 100 * TOLERANCE, (s, sorted(results, key=lambda r: -abs(r.residual))[:3])
    for r in results:
        if abs(r.rel_err) > TOLERANCE:
            assert r.explained_by, r
    # and the raw agreement is close on average
    assert s["all"]["mean_abs_pct"] <= 3.0, s


def test_versions_resolve_to_the_nearest_measured(cache: Path) -> None:
    assert aic.measured_versions("h100_sxm", "vllm") == ("0.24.0",)
    assert aic.measured_versions("a100_sxm", "vllm") == ("0.14.0",)
    assert aic.resolve_version("h100_sxm", "sglang", None) == "0.5.14"       # the newest with kernels measured
    assert aic.resolve_version("h100_sxm", "sglang", "0.5.3") == "0.5.14"
    assert aic.resolve_version("b60", "vllm", "0.21") == "0.20.0"            # 0.21 is nearer 0.20 than 0.26
    assert aic.resolve_version("b60", "vllm", "0.25.1") == "0.26.0"
    assert aic.resolve_version("b60", "vllm", None) == "0.26.0"
    with pytest.raises(KernelsError, match="no SGLang kernel tables were measured on b60"):
        aic.resolve_version("b60", "sglang", None)
    with pytest.raises(KernelsError, match="'latest' is not a version number"):
        aic.resolve_version("h100_sxm", "vllm", "latest")
    spec, profile = tables_only("h100-sxm", "sglang", cache, engine_version="0.5.3")
    assert profile.provenance["engine_version"] == "0.5.14" and profile.provenance["engine_version_asked"] == "0.5.3"
    tables = profile.provenance["tables"]
    assert tables["gemm_perf.parquet"]["version"] == "0.5.14" and tables["gemm_perf.parquet"]["channel"] == "primary"
    assert "SGLang 0.5.14 kernel tables on h100_sxm, aiconfigurator-core 0.12.0" == profile.provenance["label"]


def test_tables_are_built_once_and_read_from_the_cache(cache: Path, monkeypatch) -> None:
    spec, first = tables_only("h200", "vllm", cache)
    files = sorted((cache / "kernels").glob("*.json"))
    monkeypatch.setattr(kernels, "build_tables", lambda *a, **k: pytest.fail("rebuilt a cached profile"))
    again = kernel_profile(spec, NO_HOST, cache)
    assert sorted((cache / "kernels").glob("*.json")) == files
    assert again.to_dict() == first.to_dict()
    # another precision is another key
    monkeypatch.undo()
    fp8 = kernel_profile(dataclasses.replace(spec, kv_cache_dtype="fp8"), NO_HOST, cache)
    assert len(list((cache / "kernels").glob("*.json"))) == len(files) + 1
    assert fp8.kv_bytes_per_token * 2 == first.kv_bytes_per_token
    assert fp8.provenance["quant_modes"]["kvcache"] == "fp8"


def test_host_terms_go_on_top_of_the_kernels(cache: Path) -> None:
    spec, bare = tables_only("h100-sxm", "vllm", cache, "qwen3-32b", 2)
    host = HostTerms("test", step_s=1e-3, tp_step_s=2e-4, per_seq_s=3e-5, request_s=0.05, source="by hand")
    p = kernels.with_host(bare, host)
    from sim.core.batch import Batch, BatchItem
    batch = Batch((BatchItem(0, 500, 0), *(BatchItem(1 + i, 1, 1000) for i in range(10))))
    # 1 ms a step + 0.2 ms at TP 2 + 30 us x 11 sequences (one prompt, ten decodes)
    assert p.step_time_s(batch) - bare.step_time_s(batch) == pytest.approx(1e-3 + 2e-4 + 11 * 3e-5, rel=1e-9)
    assert p.engine["request_overhead_s"] == 0.05 and p.provenance["host"]["source"] == "by hand"


def test_presets_and_wheel_ids_give_the_same_model(cache: Path) -> None:
    from sim.cost.hf_config import model_shape_from_hf
    from sim.cost.presets import MODEL_PRESETS
    for name, model_id in kernels.PRESET_IDS.items():
        assert dataclasses.replace(model_shape_from_hf(aic.model_config(model_id)), name=name) == MODEL_PRESETS[name]
    for name in kernels.PRESET_ARCHITECTURES:       # no bundled config: written from the preset
        assert model_shape_from_hf(kernels.preset_hf_config(name), name) == MODEL_PRESETS[name]
    by_id = kernels.resolve_model("Qwen/Qwen3-32B", cache)
    by_preset = kernels.resolve_model("qwen3-32b", cache)
    assert by_id.wheel_path == by_preset.wheel_path == "Qwen/Qwen3-32B"


@pytest.mark.parametrize("model, message", [
    ("deepseek-ai/DeepSeek-V4-Pro", "uses compressed sparse attention (DeepSeek-V4), which batchsim does not model yet"),
    # Mamba2's state is modelled, but the wheel measured none of its kernels for vLLM (tests/cost/test_mamba.py)
    ("nvidia/Nemotron-H-56B-Base-8K", "its context graph has Mamba2 ops, which the aiconfigurator-core 0.12.0 "
                                      "tables do not measure for vLLM"),
    ("nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-FP8", "uses latent MoE projections (Nemotron-3 Super, Ultra)"),
    ("Qwen/Qwen9-1T", "'Qwen/Qwen9-1T' is not among the"),
    ("opt-13b", "the kernel tables' graphs are for gated (SwiGLU) decoders"),
    ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
      "vocab_size": 100, "max_position_embeddings": 512, "hidden_act": "silu"}, "has no 'architectures' field"),
])
def test_models_the_kernels_cannot_express_are_refused(model, message, cache: Path) -> None:
    with pytest.raises(KernelsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kernel_profile(KernelSpec(model=model, gpu="h100-sxm", engine="vllm"), NO_HOST, cache)


def test_gpu_and_engine_without_tables_are_refused(cache: Path) -> None:
    with pytest.raises(KernelsError, match="gpu 'a100-40gb' has no measured kernel tables; measured: a100-80gb, h100-sxm"):
        kernel_profile(KernelSpec(model="qwen3-8b", gpu="a100-40gb", engine="vllm"), NO_HOST, cache)
    with pytest.raises(KernelsError, match="engine 'tgi' has no kernel tables; tables exist for vllm, sglang, trtllm"):
        kernel_profile(KernelSpec(model="qwen3-8b", gpu="h100-sxm", engine="tgi"), NO_HOST, cache)


def test_curves_know_where_the_tables_measured(cache: Path) -> None:
    spec, p = tables_only("h100-sxm", "vllm", cache)
    limits = p.provenance["measured_ranges"]
    # h100_sxm vLLM 0.24.0: GEMMs measured to m = 32768, context attention to 16384 tokens,
    # generation attention to batch 2048
    assert limits["tokens"] == 32768 and limits["prefill_len"] == 16384 and limits["decode_seqs"] == 2048
    assert p.linear.measured_max == 32768 and p.attn_prefill.measured.y_max == 16384
    from sim.core.batch import Batch, BatchItem
    p.step_time_s(Batch((BatchItem(0, 8192, 12000),)))       # 8,192 + 12,000 > 16,384: extrapolated
    assert p.attn_prefill.num_out_of_range == 1 and p.linear.num_out_of_range == 0
    assert json.loads(json.dumps(p.provenance))             # provenance is plain JSON


def test_missing_wheel_names_the_extra(monkeypatch) -> None:
    import builtins
    real_import = builtins.__import__

    def no_wheel(name, *args, **kwargs):
        if name.startswith("aiconfigurator_core"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_wheel)
    with pytest.raises(KernelsError, match=r"pip install -e '\.\[kernels\]' \(aiconfigurator-core==0\.12\.0\)"):
        aic.require_wheel()


def test_random_shapes_are_what_they_say() -> None:
    from sim.cost.kernel_check import batch_of, random_shapes
    shapes = random_shapes(np.random.default_rng(0), 40, 40960)
    for kind, shape in shapes:
        b = batch_of(kind, shape)
        if kind == "decode":
            assert b.decode_seqs == shape[0] and b.decode_context == shape[0] * shape[1] and not b.prefill_chunks
        elif kind == "prefix":
            assert b.prefill_chunks == ((shape[0] - shape[1], shape[1]),)
        elif kind == "prompts":
            assert b.num_prefill_seqs == shape[0] and b.decode_seqs == shape[2]
