"""Kernel profiles from the command line, with the real aiconfigurator-core wheel: `sim run`
with ``profile.kernels``, its terminal line, meta.json and trust line; `sim calibrate
--kernels`; models by Hugging Face id; and the errors a user meets (one line, exit 2,
nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("aiconfigurator_core", reason="the kernels extra (aiconfigurator-core) is not installed")

from conftest import WORKLOADS  # noqa: E402

from sim.cli import main  # noqa: E402
from sim.cost.profile import load_profile  # noqa: E402


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch) -> Path:
    folder = tmp_path_factory.getbasetemp() / "kernel-cache-runs"
    monkeypatch.setenv("BATCHSIM_CACHE_DIR", str(folder))
    return folder


def run(tmp_path: Path, capsys, *sets: str, workload: str = "azure_conv.yaml") -> tuple[int, str, str, Path]:
    out = tmp_path / "out"
    args = ["run", str(WORKLOADS / workload), "--out", str(out), "--set", "num_requests=150"]
    for s in sets:
        args += ["--set", s]
    rc = main(args)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err, out


@pytest.mark.parametrize("policy, engine, version", [("vllm_v1", "vLLM", "0.24.0"), ("sglang", "SGLang", "0.5.14"),
                                                     ("tensorrt_llm", "TensorRT-LLM", "1.3.0rc20")])
def test_sim_run_on_kernel_tables_names_engine_and_version(tmp_path, capsys, policy, engine, version) -> None:
    rc, out, err, folder = run(tmp_path, capsys, "profile.kernels=aiconfigurator", f"policy.kind={policy}")
    assert rc == 0, err
    label = f"{engine} {version} kernel tables on h100_sxm, aiconfigurator-core 0.12.0"
    assert label in out.splitlines()[0]                       # the terminal line names engine and version
    assert "kernels measured" in out and "host time" in out   # the trust line says what is measured
    meta = json.loads((folder / "meta.json").read_text())
    prov = meta["profile_provenance"]
    assert prov["engine_version"] == version and prov["label"] == label and prov["kernels"] == "aiconfigurator"
    assert prov["tables"]["gemm_perf.parquet"]["version"] == version
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["profile_source"] == label and summary["completed"] == 150
    # the trust line reads the kernel profiles' check (kernel_errors.csv) for the engine's group
    trust = summary["profile_trust"]
    if policy == "sglang":       # SGLang on one H100 in bf16: 8 held-out public values
        assert "vs 8 held-out public SGLang serving values on h100-sxm TP 1 bf16" in trust["basis"]
        assert trust["error_pct"] == pytest.approx(55.4)


def test_the_other_policies_use_vllms_tables(tmp_path, capsys) -> None:
    rc, out, err, folder = run(tmp_path, capsys, "profile.kernels=aiconfigurator", "policy.kind=sarathi")
    assert rc == 0, err
    assert json.loads((folder / "meta.json").read_text())["profile_provenance"]["engine"] == "vllm"


def test_engine_version_picks_the_nearest_measured(tmp_path, capsys) -> None:
    rc, out, err, folder = run(tmp_path, capsys, "profile.kernels=aiconfigurator", "policy.kind=sglang",
                               "profile.engine_version=0.5.5")
    assert rc == 0, err
    prov = json.loads((folder / "meta.json").read_text())["profile_provenance"]
    assert (prov["engine_version"], prov["engine_version_asked"]) == ("0.5.14", "0.5.5")


def test_a_hugging_face_id_resolves_through_the_wheel(tmp_path, capsys) -> None:
    # Qwen/Qwen3-8B's bundled config is the qwen3-8b preset's shape: the same run, under another name
    rc, out, err, by_id = run(tmp_path / "a", capsys, "profile.model=Qwen/Qwen3-8B")
    assert rc == 0, err
    rc, out, err, by_preset = run(tmp_path / "b", capsys, "profile.model=qwen3-8b")
    assert rc == 0, err
    a, b = (json.loads((d / "summary.json").read_text()) for d in (by_id, by_preset))
    assert a["mean_ttft_ms"] == b["mean_ttft_ms"] and a["mean_tpot_ms"] == b["mean_tpot_ms"]


@pytest.mark.parametrize("sets, message", [
    (("profile.kernels=measured",), "field 'profile.kernels' is 'measured'; expected one of aiconfigurator"),
    (("profile.engine_version=0.24.0",), "field 'profile.engine_version' picks a version of measured kernel tables"),
    (("profile.kernels=aiconfigurator", "profile.gpu=a100-40gb"), "gpu 'a100-40gb' has no measured kernel tables"),
    (("profile.kernels=aiconfigurator", "profile.model=deepseek-ai/DeepSeek-V4-Pro"),
     "uses compressed sparse attention (DeepSeek-V4), which batchsim does not model yet"),
    (("profile.kernels=aiconfigurator", "policy.kind=sglang", "profile.gpu=arc-pro-b60"),
     "no SGLang kernel tables were measured on b60"),
    (("profile.model=Qwen/Qwen9-1T",), "'Qwen/Qwen9-1T' is not a preset; as a Hugging Face id it resolves"),
])
def test_bad_kernel_input_is_one_clear_line(tmp_path, capsys, sets, message) -> None:
    rc, out, err, folder = run(tmp_path, capsys, *sets)
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert not folder.exists()                              # nothing half-written


def test_calibrate_kernels_writes_profile_check_and_figure(tmp_path, capsys) -> None:
    out = tmp_path / "qwen3-8b-h200.json"
    rc = main(["calibrate", "--kernels", "aiconfigurator", "--gpu", "h200", "--model", "qwen3-8b",
               "--engine", "sglang", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    p = load_profile(out)
    assert p.provenance["engine"] == "sglang" and p.decode_per_seq and p.lm_head is not None
    shares = p.provenance["measured_share"]
    assert set(shares) == {"linear", "lm_head", "attn_prefill", "attn_decode"}
    assert all(0 < s["measured_share"] <= 1 for s in shares.values())
    check = p.fit_error["differential_check"]["all"]
    assert check["n"] == 200 and check["max_residual_pct"] <= 3.0
    assert (tmp_path / "qwen3-8b-h200.png").stat().st_size > 10_000
    assert "check against the wheel's own step estimate: 200 shapes" in captured.out
    # the written file runs as a profile path, like any measured profile
    workload = tmp_path / "w.yaml"
    workload.write_text(f"name: w\nnum_requests: 30\narrivals: {{kind: poisson, rate: 5}}\n"
                        f"lengths: {{kind: fixed, prompt_tokens: 300, output_tokens: 20}}\n"
                        f"policy: {{kind: sglang}}\nprofile: {{path: {out}}}\n")
    assert main(["run", str(workload), "--out", str(tmp_path / "run"), "--quiet"]) == 0


def test_a_sweep_varies_gpus_on_kernel_profiles(tmp_path, capsys) -> None:
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"name: k\nbase: {WORKLOADS / 'azure_conv.yaml'}\n"
                     "set: {num_requests: 80, policy: {kind: vllm_v1}, profile.kernels: aiconfigurator}\n"
                     "vary: {profile.gpu: [h100-sxm, h200]}\n")
    rc = main(["sweep", str(sweep), "--out", str(tmp_path / "out"), "-j", "1", "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    import csv
    rows = list(csv.DictReader((tmp_path / "out" / "results.csv").open()))
    assert sorted(r["profile_source"] for r in rows) == [
        "vLLM 0.24.0 kernel tables on h100_sxm, aiconfigurator-core 0.12.0",
        "vLLM 0.24.0 kernel tables on h200_sxm, aiconfigurator-core 0.12.0"]
