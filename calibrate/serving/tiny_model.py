"""A random-weight Hugging Face Llama folder that vLLM serves without a model hub.

``write_tiny_llama`` writes ``config.json`` (``LlamaForCausalLM``), seeded
random weights (``model.safetensors``; matrices normal with std
``calibrate.model.INIT_STD``, norms ones, embedding and LM head untied),
``generation_config.json`` and a word-level tokenizer: token id ``i`` is the
word ``w{i}``, except ids 0, 1, 2, which are ``<unk>``, ``<s>``, ``</s>``
(``SPECIAL_TOKEN_IDS``). Text is split on whitespace, so ``"w5 w17"`` encodes
to ``[5, 17]``. The default shape is batchsim's ``tiny-llama`` preset.

vLLM 0.32's CPU attention has kernels for head sizes 32, 64, 80, ... only:
``tiny-llama`` (head_dim 32) serves on CPU; a server on ``tiny-llama-2l``
(head_dim 16) starts, but its engine dies on the first request.

CLI: ``python -m calibrate.serving.tiny_model --out DIR [--preset NAME] [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from calibrate.model import INIT_STD, MODEL_PRESETS, RMS_NORM_EPS, check_buildable, get_model_shape
from sim.cost.profile import ModelShape

DEFAULT_PRESET = "tiny-llama"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
SPECIAL_TOKEN_IDS = (0, 1, 2)
UNK_ID, BOS_ID, EOS_ID = SPECIAL_TOKEN_IDS
SPEC_FILE = "batchsim_tiny_model.json"   # what the folder was written from (reuse check)
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json", SPEC_FILE)

_P = MODEL_PRESETS[DEFAULT_PRESET]


def write_tiny_llama(out_dir: str | os.PathLike[str], *, hidden_size: int = _P.hidden_size,
                     num_layers: int = _P.num_layers, num_heads: int = _P.num_heads,
                     num_kv_heads: int = _P.num_kv_heads,
                     intermediate_size: int = _P.intermediate_size,
                     vocab_size: int = _P.vocab_size,
                     max_position_embeddings: int = _P.max_position_embeddings,
                     seed: int = 0, dtype: str = "float32",
                     rope_theta: float = _P.rope_theta) -> Path:
    """Write the model folder at ``out_dir`` and return its path.

    Deterministic: the same arguments give byte-identical weights. If
    ``out_dir`` already holds a folder written with the same arguments it is
    reused untouched; one written with other arguments is replaced. Any other
    non-empty ``out_dir`` raises ``FileExistsError`` (nothing is deleted).
    The folder appears atomically (written beside it, then renamed).
    Raises ``ValueError`` for an invalid shape or dtype.
    """
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}, got {vocab_size}")
    dims = {"hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "intermediate_size": intermediate_size,
            "vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings,
            "rope_theta": rope_theta}
    shape = ModelShape("tiny-llama-hf", **dims)
    check_buildable(shape)
    spec: dict[str, Any] = {"shape": dims, "seed": seed, "dtype": dtype,
                            "special_tokens": list(SPECIAL_TOKENS)}
    out = Path(out_dir)
    if out.is_dir() and _read_spec(out) == spec and all((out / f).is_file() for f in FILES):
        return out
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and _read_spec(out) is None)):
        raise FileExistsError(f"{out} exists and was not written by write_tiny_llama; "
                              f"choose an empty or new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tmp.chmod(0o755)
        _write_config(tmp, shape, dtype)
        _write_weights(tmp, shape, seed, dtype)
        _write_tokenizer(tmp, vocab_size, max_position_embeddings)
        (tmp / SPEC_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_preset(out_dir: str | os.PathLike[str], preset: str = DEFAULT_PRESET, *, seed: int = 0,
                 dtype: str = "float32") -> Path:
    """``write_tiny_llama`` with the shape of a batchsim model preset (see ``calibrate.model``)."""
    cfg = get_model_shape(preset)
    return write_tiny_llama(out_dir, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                            intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                            max_position_embeddings=cfg.max_position_embeddings, seed=seed,
                            dtype=dtype, rope_theta=cfg.rope_theta)


def _read_spec(folder: Path) -> dict[str, Any] | None:
    try:
        spec = json.loads((folder / SPEC_FILE).read_text())
    except (OSError, ValueError):
        return None
    return spec if isinstance(spec, dict) else None


def _write_config(folder: Path, shape: ModelShape, dtype: str) -> None:
    from transformers import GenerationConfig, LlamaConfig

    config = LlamaConfig(
        architectures=["LlamaForCausalLM"], hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size, max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta, rms_norm_eps=RMS_NORM_EPS, initializer_range=INIT_STD,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False, dtype=dtype)
    config.save_pretrained(folder)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID).save_pretrained(folder)


def _write_weights(folder: Path, shape: ModelShape, seed: int, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file

    h, hd, inter = shape.hidden_size, shape.head_dim, shape.intermediate_size
    # (name, rows, cols) in a fixed order, so the generator's draws are reproducible
    mats: list[tuple[str, int, int]] = [("model.embed_tokens.weight", shape.vocab_size, h)]
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        mats += [(p + "self_attn.q_proj.weight", shape.num_heads * hd, h),
                 (p + "self_attn.k_proj.weight", shape.num_kv_heads * hd, h),
                 (p + "self_attn.v_proj.weight", shape.num_kv_heads * hd, h),
                 (p + "self_attn.o_proj.weight", h, shape.num_heads * hd),
                 (p + "mlp.gate_proj.weight", inter, h),
                 (p + "mlp.up_proj.weight", inter, h),
                 (p + "mlp.down_proj.weight", h, inter)]
    mats.append(("lm_head.weight", shape.vocab_size, h))
    norms = [f"model.layers.{i}.{n}.weight" for i in range(shape.num_layers)
             for n in ("input_layernorm", "post_attention_layernorm")] + ["model.norm.weight"]
    gen = torch.Generator().manual_seed(seed)
    out_dtype = getattr(torch, dtype)
    tensors = {name: (torch.randn(rows, cols, generator=gen) * INIT_STD).to(out_dtype)
               for name, rows, cols in mats}
    tensors.update({name: torch.ones(h, dtype=out_dtype) for name in norms})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _write_tokenizer(folder: Path, vocab_size: int, max_len: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    for tid, tok in zip(SPECIAL_TOKEN_IDS, SPECIAL_TOKENS):
        del vocab[f"w{tid}"]
        vocab[tok] = tid
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[UNK_ID]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(folder / "tokenizer.json"))
    names = {"unk_token": SPECIAL_TOKENS[UNK_ID], "bos_token": SPECIAL_TOKENS[BOS_ID],
             "eos_token": SPECIAL_TOKENS[EOS_ID]}
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
                  "clean_up_tokenization_spaces": False, **names}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(names, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints the folder written (or reused)."""
    parser = argparse.ArgumentParser(prog="python -m calibrate.serving.tiny_model",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write (reused if identical)")
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=["tiny-llama", "tiny-llama-2l"],
                        help="tiny-llama-2l (head_dim 16) does not run on vLLM's CPU backend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args(argv)
    try:
        print(write_preset(args.out, args.preset, seed=args.seed, dtype=args.dtype))
    except (ValueError, FileExistsError) as exc:
        parser.exit(2, f"error: {exc}\n")
    except ModuleNotFoundError as exc:
        parser.exit(2, f"error: writing a model folder needs {exc.name} (torch and transformers): "
                       f"pip install -e '.[calibrate,vllm]' (the README's Tests section)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
