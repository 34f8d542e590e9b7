"""Session fixtures for tests that talk to a real local vLLM server.

``tests/conftest.py`` loads them for every test module. Every user shares
one model folder and one server, started on first use and stopped at the end
of the session. Each fixture skips when what it needs is not installed.

``vllm_server``: the ``tiny-llama`` model with ``max_num_seqs`` 8,
``max_num_batched_tokens`` 256, ``max_model_len`` 1024, a 64 MiB KV cache
(128 blocks of 128 tokens), prefix caching on (vLLM's default: calibration
probes must miss it, validation compares its hit rate) and ``enforce_eager``
(no 30 s compilation).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from calibrate.serving.launch import VllmServer

VLLM_MAX_NUM_SEQS = 8
VLLM_MAX_NUM_BATCHED_TOKENS = 256
VLLM_MAX_MODEL_LEN = 1024
VLLM_KV_CACHE_BYTES = 64 * 1024**2
VLLM_PREFIX_CACHING = True

# One model folder and one server per session, even where several modules define the
# fixtures (by importing them rather than loading the plugin).
_shared_dir: dict[str, Path] = {}
_shared_server: dict[str, VllmServer] = {}


def _model_dir(factory: pytest.TempPathFactory) -> Path:
    if "dir" not in _shared_dir:
        for module in ("torch", "transformers", "tokenizers", "safetensors"):
            pytest.importorskip(module)
        from calibrate.serving.tiny_model import write_preset

        _shared_dir["dir"] = write_preset(factory.mktemp("vllm-model") / "tiny-llama")
    return _shared_dir["dir"]


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``tiny-llama`` Hugging Face folder (random weights, word-level tokenizer)."""
    return _model_dir(tmp_path_factory)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A running server on ``vllm_model_dir`` (``.url``, ``.model``, ``.log_path``)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    server = _shared_server.get("server")
    owner = server is None or not server.running
    if server is None or not server.running:
        server = _shared_server["server"] = VllmServer(
            _model_dir(tmp_path_factory), max_num_seqs=VLLM_MAX_NUM_SEQS,
            max_num_batched_tokens=VLLM_MAX_NUM_BATCHED_TOKENS, max_model_len=VLLM_MAX_MODEL_LEN,
            kv_cache_bytes=VLLM_KV_CACHE_BYTES, enforce_eager=True, prefix_caching=VLLM_PREFIX_CACHING,
            log_path=tmp_path_factory.mktemp("vllm-log") / "server.log").start()
    yield server
    if owner:
        server.stop()
        _shared_server.pop("server", None)
