"""Vidur's published profiling CSVs -> a batchsim Profile (fixture rows in Vidur's exact format)."""

from __future__ import annotations

import csv
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

from calibrate.vidur_import import VidurImportError, format_report, import_vidur
from calibrate.vidur_import import main as vidur_main
from sim.core.batch import Batch, BatchItem
from sim.cost.curves import CurveRepairWarning
from sim.cost.presets import GPU_PRESETS, MODEL_PRESETS
from sim.cost.profile import load_profile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vidur"
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


# ---- Vidur's real A100 Llama-2-7B data (tests/fixtures/vidur_a100, MIT; see its README) ----------
A100 = Path(__file__).resolve().parents[1] / "fixtures" / "vidur_a100"
A100_MLP = A100 / "mlp_tp1.csv"
A100_ATTN = A100 / "attention_reconstructed_tp1.csv.gz"      # Vidur's ragged grid, real rows + fitted cells
LAYERS = 32                                                  # Llama-2-7B; Vidur's times are per layer


def _real_points(name: str) -> list[tuple[int, int, float]]:
    with open(A100 / name, newline="") as f:
        return [(int(r[0]), int(r[1]), float(r[2])) for r in list(csv.reader(f))[1:]]


@pytest.fixture(scope="module")
def a100():
    with warnings.catch_warnings():
        warnings.simplefilter("error", CurveRepairWarning)      # the importer repairs; the curves never warn
        return import_vidur(A100_MLP, A100_ATTN, MODEL_PRESETS["llama-2-7b"], "a100-80gb")


def _decode_ms(prof, seqs: int, context: int) -> float:
    return prof.attn_decode(seqs, seqs * context) * 1e3


def test_a100_decode_step_is_what_vidur_measured(a100) -> None:
    # Real rows at batch_size 32 (real_decode_points.csv): kv 32 -> 0.048 ms, kv 3968 -> 1.204 ms per layer.
    # Linear between them at kv 1000: 0.048 + (1.204 - 0.048) x (1000 - 32) / (3968 - 32) = 0.33230 ms
    # x 32 layers = 10.634 ms. (Real rows at the same total context agree: 64 x 512 -> 0.329 x 32 = 10.53 ms.)
    measured_ms = LAYERS * (0.048 + (1.204 - 0.048) * (1000 - 32) / (3968 - 32))
    assert measured_ms == pytest.approx(10.634, abs=1e-3)
    assert _decode_ms(a100, 32, 1000) == pytest.approx(measured_ms, rel=0.10)   # stated tolerance: 10%
    # The whole step adds linear(32): mlp_tp1.csv row num_tokens 32, 32 layers x 0.298 ms + emb 0.004 = 9.540 ms.
    assert a100.linear(32) * 1e3 == pytest.approx(9.540, rel=1e-9)
    step_ms = a100.step_time_s(Batch(tuple(BatchItem(i, 1, 1000) for i in range(32)))) * 1e3
    assert step_ms == pytest.approx(9.540 + measured_ms, rel=0.05)
    assert step_ms < 25.0            # the old import (running max over extrapolated cells): 212.6 ms
    # One decode at small context: real rows (1, 32) 0.009 ms and (1, 544) 0.014 ms per layer, 0.288 and
    # 0.448 ms for 32 layers. The file's fitted cells just above kv 32 run lower (0.0079 ms at kv 64), and
    # the monotone repair lowers the real 0.009 toward them: 0.267 ms (-7%); (1, 544) comes out +3%.
    assert _decode_ms(a100, 1, 32) == pytest.approx(LAYERS * 0.009, rel=0.10)
    assert _decode_ms(a100, 1, 544) == pytest.approx(LAYERS * 0.014, rel=0.10)
    assert a100.num_out_of_range == 0


def test_a100_import_agrees_with_every_real_point(a100) -> None:
    dec = [abs(_decode_ms(a100, b, k) / (LAYERS * ms) - 1) for b, k, ms in _real_points("real_decode_points.csv")]
    pre = [abs(a100.attn_prefill(c, k) * 1e3 / (LAYERS * ms) - 1)
           for c, k, ms in _real_points("real_prefill_points.csv")]
    assert len(dec) == 350 and len(pre) == 489
    # Measured here: decode median 4.0%, p90 11%; prefill median 1.5%, p90 9%. The worst points are
    # few-sequence decodes (7 x 3968: a slower kernel regime than many short sequences at the same total
    # context, which the monotone curve cannot hold) and chunk 80, 10-50% below its fitted neighbours.
    assert np.median(dec) < 0.05 and np.percentile(dec, 90) < 0.15
    assert np.median(pre) < 0.03 and np.percentile(pre, 90) < 0.12


def _vidur_attention_from_real_rows(dst: Path) -> Path:
    """A Vidur-format attention.csv holding only the 839 measured rows (no fitted cells)."""
    head = ["n_embd", "n_q_head", "n_kv_head", "block_size", "num_tensor_parallel_workers", "max_model_len",
            "time_stats.attn_decode.median", "time_stats.attn_prefill.median", "batch_size",
            "prefill_chunk_size", "kv_cache_size", "is_prefill"]
    rows = [[4096, 32, 32, 16, 1, 4096, ms, "", b, 0, k, False] for b, k, ms in _real_points("real_decode_points.csv")]
    rows += [[4096, 32, 32, 16, 1, 4096, "", ms, 1, c, k, True] for c, k, ms in _real_points("real_prefill_points.csv")]
    with open(dst, "w", newline="") as f:
        csv.writer(f).writerows([head, *rows])
    return dst


def test_real_rows_alone_give_the_measured_values(tmp_path: Path) -> None:
    prof = import_vidur(A100_MLP, _vidur_attention_from_real_rows(tmp_path / "attention.csv"),
                        MODEL_PRESETS["llama-2-7b"], "a100-80gb")
    assert prof.provenance["num_rows"]["attention"] == 350 + 489
    # Row 32 holds only kv 32 and 3968, so 1,000 context is their linear mix: 10.634 ms (see above);
    # the total-context grid interpolates it within 1%.
    assert _decode_ms(prof, 32, 1000) == pytest.approx(10.634, rel=0.01)
    assert _decode_ms(prof, 1, 32) == pytest.approx(LAYERS * 0.009, rel=1e-9)     # a grid node, untouched
    dec = [abs(_decode_ms(prof, b, k) / (LAYERS * ms) - 1) for b, k, ms in _real_points("real_decode_points.csv")]
    assert np.median(dec) < 0.03                                                    # measured: 1.7%


def test_import_report_states_vidur_adjustments_and_repairs(a100, tmp_path: Path) -> None:
    report = a100.provenance["import_report"]
    adjustments = {a["adjustment"]: a for a in report["vidur_adjustments"]}
    assert {"attention batching factor x1.1", "context rounded up to a multiple of 64",
            "token count rounded up to a multiple of 8"} <= set(adjustments)
    assert all(a["import"] == "dropped" for a in adjustments.values())
    # Llama-2-7B has 32 q and 32 kv heads: Vidur applies its 1.1 only to GQA models.
    assert "not GQA" in adjustments["attention batching factor x1.1"]["why"]
    # Measured values the repair moved by > 5% are listed (the few-sequence decodes among them).
    assert any(line.startswith("attn_decode(seqs=7,") for line in report["monotone_repair"])
    assert "filled" in report and "measured" in report
    text = format_report(a100)
    assert "dropped: attention batching factor x1.1" in text and "monotone repair:" in text
    # The profile file keeps the report and reloads without any repair (its values are monotone).
    a100.save(tmp_path / "a100.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CurveRepairWarning)
        loaded = load_profile(tmp_path / "a100.yaml")
    assert loaded.provenance["import_report"] == report
    assert loaded.attn_decode.zs == a100.attn_decode.zs


def test_cli_writes_profile_and_prints_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "profile.yaml"
    attention = _vidur_attention_from_real_rows(tmp_path / "attention.csv")
    assert vidur_main(["--mlp", str(A100_MLP), "--attention", str(attention), "--out", str(out),
                       "--gpu", "a100-80gb"]) == 0
    printed = capsys.readouterr().out
    assert "Vidur's cost adjustments" in printed and f"wrote {out}" in printed
    prof = load_profile(out)
    assert prof.model == MODEL_PRESETS["llama-2-7b"]        # found from mlp.csv's shape (no --model given)
    assert prof.memory_bytes_per_gpu == GPU_PRESETS["a100-80gb"].memory_bytes


def _replace_cell(src: Path, dst: Path, column: str, value: str) -> Path:
    with open(src, newline="") as f:
        rows = list(csv.DictReader(f))
    rows[3][column] = value
    with open(dst, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return dst


@pytest.mark.parametrize("case, expected", [
    ("missing", r"nope.csv: file not found"),
    ("column", r"mlp.csv: missing column\(s\) \['time_stats.mlp_up_proj.median'\]"),
    ("value", r"mlp.csv: line 5: column 'time_stats.mlp_act.median' has non-numeric value 'fast'"),
    ("binary", r"mlp.csv: not a readable CSV file"),
    ("gpu", r"--gpu 'tpu-v9': unknown"),
    ("out", r"--out .*profile.txt: use a .yaml or .json file name"),
    ("out-folder", r"--out .*/no/such/p.yaml: its folder does not exist"),
    ("header-only", r"mlp.csv: the file has a header but no data rows"),
    ("tokens-fraction", r"mlp.csv: line 5: column 'num_tokens' must be a whole number >= 1, got '1.5'"),
    ("tokens-zero", r"mlp.csv: line 5: column 'num_tokens' must be a whole number >= 1, got '0'"),
    ("all-zero", r"mlp.csv: the MLP and norm times are all 0 for this model: nothing was measured"),
    ("overflow", r"mlp.csv: the MLP and norm times overflow when summed over 32 layers"),
])
def test_cli_bad_input_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         case: str, expected: str) -> None:
    mlp, gpu, out = A100_MLP, "a100-80gb", tmp_path / "profile.yaml"
    if case == "missing":
        mlp = tmp_path / "nope.csv"
    elif case == "column":
        mlp = _drop_column(A100_MLP, tmp_path / "mlp.csv", "time_stats.mlp_up_proj.median")
    elif case == "value":
        mlp = _replace_cell(A100_MLP, tmp_path / "mlp.csv", "time_stats.mlp_act.median", "fast")
    elif case == "binary":
        mlp = tmp_path / "mlp.csv"
        mlp.write_bytes(bytes(range(256)) * 4)
    elif case == "gpu":
        gpu = "tpu-v9"
    elif case == "out":
        out = tmp_path / "profile.txt"
    elif case == "out-folder":
        out = tmp_path / "no" / "such" / "p.yaml"
    elif case == "header-only":
        mlp = tmp_path / "mlp.csv"
        mlp.write_text(A100_MLP.read_text().splitlines()[0] + "\n")
    elif case in ("tokens-fraction", "tokens-zero"):
        mlp = _replace_cell(A100_MLP, tmp_path / "mlp.csv", "num_tokens", "1.5" if case == "tokens-fraction" else "0")
    elif case in ("all-zero", "overflow"):
        with open(A100_MLP, newline="") as f:
            rows = list(csv.DictReader(f))
        for row in rows:
            for col in row:
                if col.startswith("time_stats.") and row[col] != "":
                    row[col] = "0" if case == "all-zero" else "1e307"
        mlp = tmp_path / "mlp.csv"
        with open(mlp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    code = vidur_main(["--mlp", str(mlp), "--attention", str(A100_ATTN), "--out", str(out), "--gpu", gpu,
                       "--model", "llama-2-7b"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(expected, err), err
