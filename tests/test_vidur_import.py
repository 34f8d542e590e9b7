"""Vidur's published profiling CSVs -> a batchsim Profile (fixture rows in Vidur's exact format)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from calibrate.vidur_import import VidurImportError, import_vidur
from sim.batch import Batch, BatchItem
from sim.profile import load_profile

FIXTURES = Path(__file__).parent / "fixtures" / "vidur"
MLP, ATTN = FIXTURES / "mlp.csv", FIXTURES / "attention.csv"
LLAMA_3_8B = {"name": "llama-3.1-8b", "hidden_size": 4096, "num_layers": 32, "num_heads": 32,
              "num_kv_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "max_position_embeddings": 131072}


def test_decode_batch_is_the_sum_of_the_fixture_rows(tmp_path: Path) -> None:
    prof = import_vidur(MLP, ATTN, LLAMA_3_8B, "a100")
    # 4 decodes at context 1024: 4 tokens, total decode context 4 x 1024 = 4096.
    batch = Batch(tuple(BatchItem(i, 1, 1024) for i in range(4)))
    # mlp.csv, row num_tokens=4, tp=1 (medians, ms):
    #   per layer: input_layernorm 0.008 + attn_pre_proj 0.060 + attn_rope 0.012
    #     + attn_post_proj 0.030 + post_attention_layernorm 0.008 + mlp_up_proj 0.180
    #     + mlp_act 0.010 + mlp_down_proj 0.090 + add 0.002 = 0.400
    #   linear = 32 layers x 0.400 + emb 0.010 = 12.810
    # attention.csv, row batch_size=4, prefill_chunk_size=0, kv_cache_size=1024 (per sequence):
    #   attn_decode = 32 layers x 0.025 = 0.800
    # overhead = 0 (no cpu_overheads.csv); total = 12.810 + 0.800 = 13.610 ms
    assert prof.step_time_s(batch) == pytest.approx(13.610e-3, rel=1e-9)
    assert prof.num_out_of_range == 0
    # The profile round-trips through its file form.
    prof.save(tmp_path / "vidur.yaml")
    assert load_profile(tmp_path / "vidur.yaml").step_time_s(batch) == pytest.approx(13.610e-3, rel=1e-9)


def test_prefill_chunk_and_provenance() -> None:
    prof = import_vidur(MLP, ATTN, LLAMA_3_8B, "a100")
    # chunk of 256 after 1024 context: mlp row 256 + attention row (256, 1024).
    # attn_prefill = 0.02 + 4e-7 x 256 x (128 + 1024) = 0.137966 -> file value 0.138 ms x 32
    # linear(256) = 32 x (0.400 + 252 x 0.00356) + (0.010 + 252 x 0.00001) = 41.51504 ms
    #   (per-layer slopes: 0.00002 + 0.0004 + 0.00002 + 0.0003 + 0.00002 + 0.0018
    #    + 0.00004 + 0.0009 + 0.00001 = 0.00351; emb slope 0.00001)
    expected_ms = 32 * (0.400 + 252 * 0.00351) + (0.010 + 252 * 0.00001) + 32 * 0.138
    batch = Batch((BatchItem(0, 256, 1024),))
    assert prof.step_time_s(batch) == pytest.approx(expected_ms * 1e-3, rel=1e-9)
    assert prof.provenance["source"] == "vidur-profiling"
    assert len(prof.provenance["sha256"]["mlp"]) == 64
    # Rows of the other model (n_embd 5120) and of tp=2 were left out.
    assert prof.provenance["num_rows"] == {"mlp": 10, "attention": 21}
    assert prof.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_tensor_parallel_degree_selects_rows() -> None:
    # mlp.csv has tp=2 rows for this model, attention.csv has none: the error says so.
    with pytest.raises(VidurImportError, match="attention.csv: no rows .*num_tensor_parallel_workers.: 2"):
        import_vidur(MLP, ATTN, LLAMA_3_8B, "a100", tensor_parallel=2)


def _drop_column(src: Path, dst: Path, column: str) -> Path:
    with open(src, newline="") as f:
        rows = list(csv.DictReader(f))
    with open(dst, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[c for c in rows[0] if c != column])
        w.writeheader()
        w.writerows({k: v for k, v in r.items() if k != column} for r in rows)
    return dst


def test_missing_column_names_file_and_column(tmp_path: Path) -> None:
    bad = _drop_column(MLP, tmp_path / "mlp.csv", "time_stats.mlp_up_proj.median")
    with pytest.raises(VidurImportError, match=r"mlp.csv: missing column\(s\) \['time_stats.mlp_up_proj.median'\]"):
        import_vidur(bad, ATTN, LLAMA_3_8B, "a100")
    bad = _drop_column(ATTN, tmp_path / "attention.csv", "kv_cache_size")
    with pytest.raises(ValueError, match=r"attention.csv: missing column\(s\) \['kv_cache_size'\]"):
        import_vidur(MLP, bad, LLAMA_3_8B, "a100")


def test_wrong_model_and_unknown_device_are_clear_errors() -> None:
    with pytest.raises(VidurImportError, match="no rows for .*n_embd.*8192"):
        import_vidur(MLP, ATTN, {**LLAMA_3_8B, "hidden_size": 8192}, "a100")
    with pytest.raises(VidurImportError, match="memory unknown; pass memory_bytes_per_gpu"):
        import_vidur(MLP, ATTN, LLAMA_3_8B, "tpu-v5")
    prof = import_vidur(MLP, ATTN, LLAMA_3_8B, "tpu-v5", memory_bytes_per_gpu=16 * 2**30)
    assert prof.memory_bytes_per_gpu == 16 * 2**30
