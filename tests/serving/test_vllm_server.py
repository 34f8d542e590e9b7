"""The vLLM launcher, and the streaming client against a real vLLM server (skipped without vllm).

The launcher's failure paths run everywhere with a stand-in "python" script;
the real-server tests start one tiny-llama server per session (about 30 s on
2 CPU cores, see ``conftest_vllm``).
"""

from __future__ import annotations

import importlib.util
import json
import re
import stat
from pathlib import Path

import pytest

from calibrate.serving.client import prompt_ids, replay, run, server_info, stream_completion
from calibrate.serving.launch import VllmServer, VllmServerError

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed")


def _stand_in(tmp_path: Path, ending: str) -> str:
    """An executable that logs its arguments, leaves a child in its process group, then ``ending``."""
    script = tmp_path / "fake-python"
    script.write_text(f'#!/bin/sh\necho "stand-in vllm: $*"\nsleep 60 &\necho "child=$!"\n{ending}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _child_pid(server: VllmServer) -> int:
    match = re.search(r"child=(\d+)", server.log_path.read_text())
    assert match, server.log_path.read_text()
    return int(match.group(1))


def test_command_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    server = VllmServer("/models/m", max_num_seqs=8, max_num_batched_tokens=256, block_size=32,
                        seed=3, kv_cache_space_gib=2, extra_args=["--foo", "1"], python="/py")
    cmd = server.command
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(cmd[3::], cmd[4::]))
    assert pairs["--model"] == "/models/m" and pairs["--max-num-seqs"] == "8"
    assert pairs["--max-num-batched-tokens"] == "256" and pairs["--block-size"] == "32"
    assert pairs["--dtype"] == "float32" and pairs["--seed"] == "3"
    assert pairs["--port"] == str(server.port) and server.url == f"http://127.0.0.1:{server.port}"
    assert "--no-enable-prefix-caching" in cmd and cmd[-2:] == ["--foo", "1"]
    assert "--max-model-len" not in cmd and "--enforce-eager" not in cmd
    assert server.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert server.env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    assert "OMP_NUM_THREADS" not in server.env  # None: vLLM's binding decides

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "9")
    exact = VllmServer("/m", kv_cache_bytes=1 << 20, omp_num_threads=2, enforce_eager=True)
    assert exact.command[exact.command.index("--kv-cache-memory-bytes") + 1] == str(1 << 20)
    assert "VLLM_CPU_KVCACHE_SPACE" not in exact.env and exact.env["OMP_NUM_THREADS"] == "2"
    assert "--enforce-eager" in exact.command
    cached = VllmServer("/m", prefix_caching=True).command
    assert "--enable-prefix-caching" in cached and "--no-enable-prefix-caching" not in cached
    with pytest.raises(ValueError):
        VllmServer("/m", kv_cache_space_gib=0)


def test_server_that_dies_reports_its_log_and_leaves_no_process(tmp_path: Path) -> None:
    server = VllmServer("/m", python=_stand_in(tmp_path, "exit 3"), log_path=tmp_path / "log",
                        stop_grace_s=5)
    with pytest.raises(VllmServerError, match=r"exited with code 3(.|\n)*stand-in vllm: -m"):
        server.start()
    assert not server.running and not _alive(_child_pid(server))


def test_server_that_never_answers_times_out_and_is_killed(tmp_path: Path) -> None:
    server = VllmServer("/m", python=_stand_in(tmp_path, "wait"), log_path=tmp_path / "log",
                        startup_timeout_s=1.0, stop_grace_s=5)
    with pytest.raises(VllmServerError, match=r"did not answer(.|\n)*child="), server:
        pass
    assert not server.running and not _alive(_child_pid(server))


def test_tiny_model_folder_is_reused_and_tokenizes_words(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from calibrate.model import get_model_shape
    from calibrate.serving.tiny_model import SPECIAL_TOKEN_IDS, write_preset, write_tiny_llama
    from sim.cost.presets import model_shape_from_hf

    out = write_tiny_llama(tmp_path / "m", num_layers=1)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert write_tiny_llama(out, num_layers=1) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("w5 w17 w4095").input_ids == [5, 17, 4095]
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == SPECIAL_TOKEN_IDS
    config = transformers.AutoConfig.from_pretrained(out)
    preset = get_model_shape("tiny-llama")
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (1, preset.hidden_size,
                                                                               preset.vocab_size)
    write_preset(out, "tiny-llama-2l")  # other arguments: rewritten in place
    small = get_model_shape("tiny-llama-2l")
    assert transformers.AutoConfig.from_pretrained(out).hidden_size == small.hidden_size
    # the config.json written reads back, through the one HF importer, as the preset's shape
    hf = json.loads((out / "config.json").read_text())
    assert model_shape_from_hf(hf, "tiny-llama-2l") == small
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        write_tiny_llama(tmp_path / "foreign")
    with pytest.raises(FileExistsError):
        write_tiny_llama(tmp_path / "foreign" / "keep.txt")


@needs_vllm
@pytest.mark.slow
def test_server_info_reports_capacity_and_knobs(vllm_server: VllmServer) -> None:
    from conftest_vllm import (
        VLLM_KV_CACHE_BYTES,
        VLLM_MAX_MODEL_LEN,
        VLLM_MAX_NUM_BATCHED_TOKENS,
        VLLM_MAX_NUM_SEQS,
        VLLM_PREFIX_CACHING,
    )

    from calibrate.model import get_model_shape

    info = server_info(vllm_server.url)
    assert info.model == vllm_server.model
    assert info.max_model_len == VLLM_MAX_MODEL_LEN
    assert info.max_num_seqs == VLLM_MAX_NUM_SEQS
    assert info.max_num_batched_tokens == VLLM_MAX_NUM_BATCHED_TOKENS
    assert info.enable_prefix_caching is VLLM_PREFIX_CACHING
    assert info.block_size is not None and info.block_size > 0
    assert info.block_size == info.raw["vllm_config"]["cache_config"]["block_size"]
    # float32 K and V for every layer: the KV budget divides into whole blocks
    per_block = info.block_size * get_model_shape("tiny-llama").kv_bytes_per_token(4)
    assert info.num_gpu_blocks == VLLM_KV_CACHE_BYTES // per_block


@needs_vllm
@pytest.mark.slow
def test_every_request_streams_exactly_max_tokens(vllm_server: VllmServer) -> None:
    prompts = [1, 17, 100, 300, 64, 5]  # 300 > the 256-token budget: a chunked prefill
    outputs = [1, 3, 32, 8, 16, 2]
    offsets = [0.0, 0.0, 0.05, 0.1, 0.1, 0.2]
    schedule = [(off, prompt_ids(p, seed, 4096, avoid=range(3)), n)
                for seed, (off, p, n) in enumerate(zip(offsets, prompts, outputs))]
    results = run(replay(vllm_server.url, vllm_server.model, schedule))
    for res, p, n in zip(results, prompts, outputs):
        assert res.error is None, res.error
        assert (res.num_prompt_tokens, res.num_output_tokens, len(res.token_times_s)) == (p, n, n)
        times = [res.send_s, *res.token_times_s]
        assert all(a <= b for a, b in zip(times, times[1:]))
        assert times[-1] > times[0]


@needs_vllm
@pytest.mark.slow
def test_server_errors_come_back_as_messages(vllm_server: VllmServer) -> None:
    from conftest_vllm import VLLM_MAX_MODEL_LEN

    too_long = run(stream_completion(vllm_server.url, vllm_server.model, [5, 6], 2 * VLLM_MAX_MODEL_LEN))
    assert too_long.error is not None and too_long.error.startswith("HTTP 400")
    assert "max_model_len" in too_long.error
    unknown = run(stream_completion(vllm_server.url, "no-such-model", [5, 6], 2))
    assert unknown.error is not None and unknown.error.startswith("HTTP 404")
