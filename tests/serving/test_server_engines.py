"""Which engine answers ``--server`` (vLLM, SGLang, trtllm-serve), the knobs read
from it, the profile's ``engine`` mapping and the policy chosen to simulate it.

The fakes answer like the real servers, transcribed from their source (field
names and shapes; the values are made up):

* SGLANG_SERVER_INFO: sglang 0.5.23 (the wheel), ``GET /get_server_info`` =
  ``server_info()`` in python/sglang/srt/entrypoints/http_server.py:
  ``build_server_info`` (python/sglang/srt/utils/common.py) merges
  ``ServerArgs.resolved_dict()`` (flat, the fields of
  python/sglang/srt/arg_groups/fields/*.py) with the scheduler's
  ``get_init_info`` (python/sglang/srt/managers/scheduler.py:
  ``max_total_num_tokens``, ``max_req_input_len``), then ``internal_states``
  (python/sglang/srt/managers/scheduler_components/internal_state.py),
  ``version`` and ``frontend``. SGLANG_MODELS: ``available_models`` there
  (``ModelCard``: owned_by "sglang", max_model_len = the context length);
  SGLANG_MODEL_INFO: ``model_info`` there.
* TRTLLM_STATS: NVIDIA/TensorRT-LLM ``tensorrt_llm/serve/openai_server.py``
  ``get_iteration_stats`` (``GET /metrics``: a JSON list), each entry the
  ``IterationStats`` JSON of ``cpp/tensorrt_llm/executor/jsonSerialization.cpp``
  as the PyTorch executor fills it (``tensorrt_llm/_torch/pyexecutor/
  py_executor.py`` ``_update_iter_stats``: maxNumActiveRequests and kvCacheStats
  set, the *Static fields left 0); TRTLLM_MODELS: ``get_model``
  (``ModelCard`` in ``openai_protocol.py``: owned_by "tensorrt_llm", no
  max_model_len); ``/version``: ``{"version": VERSION}``. Read from the source
  stored in the search index, not from the 1.2.1 wheel.
* vLLM: ``test_serving_client.METRICS`` (vLLM 0.32's gauges), as before.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from test_serving_client import METRICS, FakeServer

import policies
from calibrate.serving import engines
from calibrate.serving.client import server_info
from calibrate.serving.probes import Knobs
from sim.run.config import ConfigError, workload_from_dict
from sim.cost.profile import load_profile

from conftest import ROOT

PROFILE = ROOT / "calibrate" / "profiles" / "cpu" / "tiny-llama" / "float32.yaml"

SGLANG_SERVER_INFO: dict[str, Any] = {
    "model_path": "/models/tiny-llama", "served_model_name": "ok", "context_length": None, "tp_size": 1,
    "dtype": "auto", "kv_cache_dtype": "auto", "device": "cuda",
    "max_running_requests": 64, "max_total_tokens": None, "chunked_prefill_size": 512,
    "max_prefill_tokens": 16384, "schedule_policy": "fcfs", "schedule_conservativeness": 1.0,
    "page_size": 16, "mem_fraction_static": 0.8, "disable_radix_cache": False, "enable_mixed_chunk": False,
    "enable_metrics": False, "launch_command": "python -m sglang.launch_server --model-path /models/tiny-llama",
    "status": "ready", "max_total_num_tokens": 20480, "max_req_input_len": 2042, "startup_time": 1.7e9,
    "kv_events": None,
    "internal_states": [{"effective_max_running_requests_per_dp": 48, "last_gen_throughput": 0.0,
                         "memory_usage": {"weight": 0.1, "kvcache": 0.3, "token_capacity": 20480}}],
    "version": "0.5.23", "frontend": "python",
}
SGLANG_MODELS = {"object": "list", "data": [{"id": "ok", "object": "model", "created": 1, "owned_by": "sglang",
                                             "root": "ok", "parent": None, "max_model_len": 2048}]}
SGLANG_MODEL_INFO = {"model_path": "/models/tiny-llama", "served_model_name": "ok", "is_generation": True,
                     "model_type": "llama", "architectures": ["LlamaForCausalLM"]}


def trtllm_stat(it: int) -> dict[str, Any]:
    return {"timestamp": "12-01-2026 19:00:00.000000", "iter": it, "iterLatencyMS": 4.2,
            "newActiveRequestsQueueLatencyMS": 0.1, "numNewActiveRequests": 1, "numActiveRequests": 1,
            "numQueuedRequests": 0, "numCompletedRequests": 0, "maxNumActiveRequests": 96,
            "maxBatchSizeStatic": 0, "maxBatchSizeTunerRecommended": 0, "maxBatchSizeRuntime": 0,
            "maxNumTokensStatic": 0, "maxNumTokensTunerRecommended": 0, "maxNumTokensRuntime": 0,
            "gpuMemUsage": 1 << 30, "cpuMemUsage": 0, "pinnedMemUsage": 0,
            "kvCacheStats": {"maxNumBlocks": 3000, "freeNumBlocks": 2999, "usedNumBlocks": 1, "tokensPerBlock": 32,
                             "allocTotalBlocks": 1, "allocNewBlocks": 1, "reusedBlocks": 0, "missedBlocks": 1,
                             "cacheHitRate": 0.0},
            "inflightBatchingStats": {"numScheduledRequests": 1, "numContextRequests": 1, "numGenRequests": 0,
                                      "numPausedRequests": 0, "numCtxTokens": 4, "microBatchId": 0,
                                      "avgNumDecodedTokensPerIter": 0.0}}


TRTLLM_STATS = [trtllm_stat(7), trtllm_stat(8)]
TRTLLM_MODELS = {"object": "list", "data": [{"id": "ok", "object": "model", "created": 1,
                                             "owned_by": "tensorrt_llm"}]}


class EngineServer(FakeServer):
    """``FakeServer`` (its completions: the body's model picks the behaviour, "ok" streams)
    answering GETs from ``answers`` (path -> body; a callable is asked each time);
    every GET path is kept in ``gets``."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers, self.gets = answers, []
        super().__init__()

    async def _get(self, path: str, writer: Any) -> None:
        self.gets.append(path)
        answer = self.answers.get(path)
        answer = answer() if callable(answer) else answer
        if answer is None:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            return
        data = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)


def sglang_answers() -> dict[str, Any]:
    return {"/v1/models": SGLANG_MODELS, "/get_server_info": SGLANG_SERVER_INFO, "/server_info": SGLANG_SERVER_INFO,
            "/get_model_info": SGLANG_MODEL_INFO, "/health": ""}


def trtllm_answers() -> dict[str, Any]:
    return {"/v1/models": TRTLLM_MODELS, "/metrics": TRTLLM_STATS, "/version": {"version": "1.2.1"},
            "/health": "", "/server_info": {"disaggregated_params": None}}


def vllm_answers() -> dict[str, Any]:
    return {"/v1/models": {"data": [{"id": "ok", "owned_by": "vllm", "max_model_len": 4096}]}, "/metrics": METRICS,
            "/version": {"version": "0.32.0"}}


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[EngineServer] = []

    def start(answers: dict[str, Any]) -> EngineServer:
        started.append(EngineServer(answers))
        return started[-1]
    yield start
    for server in started:
        server.close()


# ---- detection -------------------------------------------------------------------------------------
@pytest.mark.parametrize("models, metrics, sglang, kind", [
    ({}, METRICS, None, "vllm"),                                          # vllm: series
    ({}, None, SGLANG_SERVER_INFO, "sglang"),                             # /get_server_info answered
    ({}, json.dumps(TRTLLM_STATS), None, "tensorrt_llm"),                 # iteration stats on /metrics
    ({}, "[]", None, "tensorrt_llm"),                                     # ... even when none queued
    ({}, "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 0\n", None, "sglang"),
    (TRTLLM_MODELS, None, None, "tensorrt_llm"),                          # only the card says
    (SGLANG_MODELS, None, {"detail": "Not Found"}, "sglang"),
    ({"data": [{"id": "m", "owned_by": "vllm"}]}, None, None, "vllm"),
    ({"data": [{"id": "m", "owned_by": "someone"}]}, "up 1\n", None, "unknown"),
])
def test_detect_names_the_engine_from_what_answers(models, metrics, sglang, kind):
    assert engines.detect(models, metrics, sglang) == kind


def test_vllm_detection_and_facts_are_unchanged(serve):
    fake = serve(vllm_answers())
    info = server_info(fake.url)
    assert info.engine_kind == "vllm" and info.engine_version == "0.32.0"
    assert (info.model, info.max_model_len, info.num_gpu_blocks, info.block_size) == ("ok", 4096, 2048, 128)
    assert info.enable_prefix_caching is False and info.max_num_seqs is info.max_num_batched_tokens is None
    assert info.engine_knobs == {"num_gpu_blocks": 2048, "block_size": 128, "enable_prefix_caching": False,
                                 "max_model_len": 4096}
    assert "/get_server_info" not in fake.gets                         # a vLLM server is not asked SGLang's


def test_sglang_knobs_under_its_names_and_batchsim_keys(serve):
    fake = serve(sglang_answers())
    info = server_info(fake.url)
    assert (info.engine_kind, info.engine_version, info.model) == ("sglang", "0.5.23", "ok")
    k = info.engine_knobs
    # the scheduler's effective cap (48, internal_states) wins over the arg (64)
    assert k["max_running_requests"] == 48 and k["chunked_prefill_size"] == 512 and k["page_size"] == 16
    assert (k["max_prefill_tokens"], k["mem_fraction_static"], k["schedule_policy"]) == (16384, 0.8, "fcfs")
    assert (k["schedule_conservativeness"], k["disable_radix_cache"], k["enable_mixed_chunk"]) == (1.0, False, False)
    assert (k["tp_size"], k["max_total_num_tokens"]) == (1, 20480)
    # 20480 pool tokens / page 16 = 1280 pages; budget min(chunk 512, prefill 16384) = 512
    assert (info.num_gpu_blocks, info.block_size, info.max_model_len) == (1280, 16, 2048)
    assert (info.max_num_seqs, info.max_num_batched_tokens, info.enable_prefix_caching) == (48, 512, True)
    assert info.raw["sglang_server_info"]["launch_command"].startswith("python -m sglang.launch_server")


def test_sglang_without_chunked_prefill_and_with_the_radix_cache_off():
    facts = engines.sglang_facts({**SGLANG_SERVER_INFO, "chunked_prefill_size": -1, "disable_radix_cache": True,
                                  "internal_states": [], "context_length": 1024})
    # no card length: context_length; no effective cap: the arg; no chunking: max_prefill_tokens
    b = facts.batchsim
    assert (b["max_model_len"], b["max_num_seqs"], b["max_num_batched_tokens"]) == (1024, 64, 16384)
    assert b["enable_prefix_caching"] is False and facts.knobs["chunked_prefill_size"] == -1


def test_trtllm_knobs_from_iteration_stats(serve):
    fake = serve(trtllm_answers())
    info = server_info(fake.url)
    assert (info.engine_kind, info.engine_version, info.model) == ("tensorrt_llm", "1.2.1", "ok")
    assert info.engine_knobs == {"max_batch_size": 96, "tokens_per_block": 32, "max_num_blocks": 3000}
    assert (info.num_gpu_blocks, info.block_size, info.max_num_seqs) == (3000, 32, 96)
    # what the PyTorch executor's stats do not say: the model length, the token budget, block reuse
    assert info.max_model_len is info.max_num_batched_tokens is info.enable_prefix_caching is None
    assert fake.bodies == []                                              # stats were there: no warm-up


def test_trtllm_with_no_stats_queued_is_read_again_after_one_request(serve):
    answers = trtllm_answers()
    fake = serve(answers)
    answers["/metrics"] = lambda: TRTLLM_STATS if fake.bodies else []
    info = server_info(fake.url)
    assert info.max_num_seqs == 96 and len(fake.bodies) == 1 and fake.bodies[0]["max_tokens"] == 2
    assert fake.gets.count("/metrics") == 2
    answers["/metrics"] = "[]"
    cold = server_info(fake.url, warm=False)
    assert cold.engine_kind == "tensorrt_llm" and cold.num_gpu_blocks is None and len(fake.bodies) == 1


def test_trtllm_cpp_executor_fills_the_static_limits():
    stat = {**trtllm_stat(1), "maxBatchSizeStatic": 64, "maxNumTokensStatic": 8192}
    facts = engines.trtllm_facts([trtllm_stat(0), stat, {"iter": 2}], "1.2.1")
    assert facts.knobs == {"max_batch_size": 64, "max_num_tokens": 8192, "tokens_per_block": 32, "max_num_blocks": 3000}
    assert (facts.batchsim["max_num_seqs"], facts.batchsim["max_num_batched_tokens"]) == (64, 8192)
    assert engines.trtllm_facts([]).knobs == {} and engines.trtllm_facts(None).batchsim["num_gpu_blocks"] is None


# ---- the profile's engine mapping ------------------------------------------------------------------
def test_calibrated_profile_keeps_engine_knobs_under_their_names_and_batchsim_keys(tmp_path):
    sglang = engines.sglang_facts(SGLANG_SERVER_INFO, 2048)
    knobs = Knobs(48, 512, 2048, 1280, 16, True, 64, {"max_num_seqs": "server"}, "sglang", sglang.knobs)
    prof = load_profile(PROFILE)
    prof.engine = knobs.engine_dict()
    prof.save(tmp_path / "p.yaml")
    eng = load_profile(tmp_path / "p.yaml").engine
    assert eng["kind"] == eng["engine_kind"] == "sglang"
    assert (eng["max_running_requests"], eng["chunked_prefill_size"], eng["page_size"]) == (48, 512, 16)
    assert (eng["mem_fraction_static"], eng["schedule_policy"], eng["disable_radix_cache"]) == (0.8, "fcfs", False)
    assert {k: eng[k] for k in engines.BATCHSIM_KEYS} == {
        "max_num_seqs": 48, "max_num_batched_tokens": 512, "num_gpu_blocks": 1280, "block_size": 16,
        "max_model_len": 2048}
    assert eng["knob_source"] == {"max_num_seqs": "server"}
    vllm = Knobs(8, 256, 1024, 64, 128, False, 64, {}).engine_dict()
    assert vllm["kind"] == vllm["engine_kind"] == "vllm" and vllm["max_num_seqs"] == 8


def test_trtllm_profile_engine_has_inferred_budget_under_the_batchsim_key():
    facts = engines.trtllm_facts(TRTLLM_STATS)
    eng = Knobs(96, 1024, 4096, 3000, 32, None, 64, {"max_num_batched_tokens": "inferred"}, "tensorrt_llm",
                facts.knobs).engine_dict()
    assert (eng["engine_kind"], eng["max_batch_size"], eng["tokens_per_block"]) == ("tensorrt_llm", 96, 32)
    assert eng["max_num_batched_tokens"] == 1024 and "max_num_tokens" not in eng   # never said: not invented


# ---- the policy chosen -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sglang", "tensorrt_llm"])
def test_an_engine_whose_policy_is_not_here_is_one_clear_error(kind, monkeypatch):
    monkeypatch.delitem(policies.POLICIES, kind)          # a batchsim without that engine's policy
    with pytest.raises(ConfigError, match=f"policy {kind} is not available"):
        engines.policy_for(kind, {})


def test_policy_for_each_engine_takes_its_knobs_under_its_names():
    assert engines.policy_for("vllm", {"max_num_seqs": 8, "page_size": 16}, True) == {
        "kind": "vllm_v1", "max_num_seqs": 8, "enable_prefix_caching": True}
    assert engines.policy_for("unknown", {})["kind"] == "vllm_v1"
    sglang = engines.sglang_facts(SGLANG_SERVER_INFO, 2048)
    assert engines.policy_for("sglang", sglang.knobs, prefix_caching=False) == {
        "kind": "sglang", "max_running_requests": 48, "chunked_prefill_size": 512, "max_prefill_tokens": 16384,
        "page_size": 16, "mem_fraction_static": 0.8, "schedule_policy": "fcfs", "schedule_conservativeness": 1.0,
        "disable_radix_cache": True, "enable_mixed_chunk": False}        # caching off = the radix cache disabled
    trt = engines.trtllm_facts([{**trtllm_stat(1), "maxNumTokensStatic": 4096}])
    assert engines.policy_for("tensorrt_llm", trt.knobs, prefix_caching=True) == {
        "kind": "tensorrt_llm", "max_batch_size": 96, "max_num_tokens": 4096, "tokens_per_block": 32,
        "enable_block_reuse": True}


def test_validation_policy_section_per_engine():
    from calibrate.serving.validate_server import sim_policy

    cfg = workload_from_dict({"name": "w", "num_requests": 2, "arrivals": {"kind": "poisson", "rate": 1},
                              "lengths": {"kind": "fixed", "prompt_tokens": 8, "output_tokens": 2},
                              "policy": {"kind": "vllm_v1", "max_num_seqs": 4, "watermark": 0.01}}, "w.yaml")
    knobs = {"max_num_seqs": 16, "max_num_batched_tokens": 256}
    # vLLM, as before: the workload's own vllm_v1 knobs, then the server's
    assert sim_policy(cfg, knobs, False) == {"kind": "vllm_v1", "max_num_seqs": 16, "max_num_batched_tokens": 256,
                                             "watermark": 0.01, "enable_prefix_caching": False}
    # SGLang: the server's knobs under its names, caching on = the radix cache not disabled
    got = sim_policy(cfg, knobs, True, engine="sglang", engine_knobs={"max_running_requests": 48, "page_size": 16})
    assert got == {"kind": "sglang", "max_running_requests": 48, "page_size": 16, "disable_radix_cache": False}


def test_validate_against_sglang_refuses_before_replaying(serve, tmp_path, monkeypatch):
    from calibrate.serving.validate_server import validate_server

    monkeypatch.delitem(policies.POLICIES, "sglang")      # a batchsim without the sglang policy
    fake = serve(sglang_answers())
    cfg = workload_from_dict({"name": "w", "num_requests": 2, "arrivals": {"kind": "poisson", "rate": 1},
                              "lengths": {"kind": "fixed", "prompt_tokens": 8, "output_tokens": 2},
                              "policy": "vllm_v1"}, str(tmp_path / "w.yaml"), tmp_path)
    with pytest.raises(ConfigError, match="policy sglang is not available") as exc:
        validate_server(cfg, profile=str(PROFILE), server=fake.url)
    assert "SGLang" in str(exc.value) and fake.bodies == []


def test_calibrate_against_trtllm_refuses_before_probing(serve, tmp_path, monkeypatch):
    import argparse

    monkeypatch.delitem(policies.POLICIES, "tensorrt_llm")     # a batchsim without the tensorrt_llm policy
    from calibrate.serving.calibrate_server import main

    fake = serve(trtllm_answers())
    args = argparse.Namespace(server=fake.url, out=str(tmp_path / "p.yaml"), budget_s=5.0, quiet=True, seed=0)
    with pytest.raises(ConfigError, match="does not give its model length"):        # no max_model_len
        main(args)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"max_position_embeddings": 4096}))
    with pytest.raises(ConfigError, match="policy tensorrt_llm is not available"):
        main(argparse.Namespace(**vars(args), model_config=str(config)))
    assert fake.bodies == [] and not (tmp_path / "p.yaml").exists()


def test_validate_against_a_vllm_like_fake_simulates_vllm_v1(serve, tmp_path):
    """The whole --server path against the vLLM-like fake (its "ok" model streams): the
    engine found, policy vllm_v1 at the server's pool, the engine in report.json's body."""
    from calibrate.serving.validate_server import validate_server

    fake = serve(vllm_answers())
    cfg = workload_from_dict({"name": "w", "num_requests": 3, "arrivals": {"kind": "poisson", "rate": 20},
                              "lengths": {"kind": "fixed", "prompt_tokens": 16, "output_tokens": 4},
                              "policy": {"kind": "sarathi", "max_num_seqs": 8}}, str(tmp_path / "w.yaml"), tmp_path)
    v = validate_server(cfg, profile=str(PROFILE), server=fake.url)
    assert v.engine == "vllm" and v.sim_cfg.policy.kind == "vllm_v1"
    assert v.sim_cfg.policy.enable_prefix_caching is False                # the server's gauge says off
    assert (v.knobs["num_blocks"], v.knobs["block_size"]) == (2048, 128)
    assert any("sarathi is replaced by vllm_v1, the scheduler of the vLLM server" in n for n in v.notes)
    assert v.body()["engine"] == "vllm" and v.measurement.run.summary["completed"] == 3


def test_validate_against_an_sglang_like_fake_simulates_sglang(serve, tmp_path):
    """With the sglang policy merged, the SGLang-like fake is simulated under it, with the knobs
    its /get_server_info gives under SGLang's names (48 running requests, 512-token chunks,
    16-token pages, the radix cache as the server has it)."""
    from calibrate.serving.validate_server import validate_server

    fake = serve(sglang_answers())
    cfg = workload_from_dict({"name": "w", "num_requests": 3, "arrivals": {"kind": "poisson", "rate": 20},
                              "lengths": {"kind": "fixed", "prompt_tokens": 16, "output_tokens": 4},
                              "policy": "vllm_v1"}, str(tmp_path / "w.yaml"), tmp_path)
    v = validate_server(cfg, profile=str(PROFILE), server=fake.url)
    assert v.engine == "sglang" and v.sim_cfg.policy.kind == "sglang"
    p = v.sim_cfg.policy
    assert (p.max_running_requests, p.chunked_prefill_size, p.page_size) == (48, 512, 16)
    assert v.body()["engine"] == "sglang" and v.measurement.run.summary["completed"] == 3


def test_prefix_caching_of_reads_the_policys_own_switch():
    # Policy.prefix_switch: SGLang's cache is on unless disable_radix_cache (on by default), TGI's
    # prefix_caching is off by default here, vllm_v1 and tensorrt_llm are on; orca has none.
    from policies.config import policy_config
    expected = [({"kind": "sglang"}, True), ({"kind": "sglang", "disable_radix_cache": True}, False),
                ({"kind": "tgi"}, False), ({"kind": "tgi", "prefix_caching": True}, True),
                ({"kind": "vllm_v1"}, True), ({"kind": "tensorrt_llm", "enable_block_reuse": False}, False),
                ({"kind": "lmdeploy"}, False), ({"kind": "orca"}, None)]
    for section, caching in expected:
        assert engines.prefix_caching_of(policy_config(section, "w.yaml")) is caching, section
