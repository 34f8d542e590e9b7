"""The measured CUDA kernel tables of NVIDIA's AIConfigurator (the ``aiconfigurator-core``
wheel, Apache-2.0), as batchsim reads them: the wheel's own loaders, interpolation and
op graphs, queried one op family at a time (``KernelTables``).

What the wheel holds: per GPU (``SYSTEMS``), per serving engine (``ENGINES``) and engine
version, latency tables measured with the engine's own kernels: GEMM (m, n, k, per
precision), context and generation attention (batch, length, heads, KV heads, head_dim, KV
dtype, window), MoE, all-reduce and all-to-all. ``aiconfigurator_core`` builds a model's
op graph from its Hugging Face config (per TP shard, in the precision's own kernels) and
answers each op at a shape from those tables. Nothing here rewrites that: ``KernelTables``
compiles the graph once and asks it for

- the token-parallel ops at T tokens (embedding, norms, QKV/O and MLP GEMMs, MoE and its
  dispatch, the TP all-reduces at their message sizes): ``linear_ms``;
- the LM head's GEMM at one row per sequence sampled: ``lm_head_ms``;
- context attention of one prefill chunk over its context, or of ``b`` chunks at once:
  ``prefill_attention_ms``;
- generation attention of ``n`` decodes at a KV length: ``decode_attention_ms``.

``sim.cost.kernels`` tabulates these into a ``Profile``. The wheel is an optional
dependency (``pip install -e '.[kernels]'``); ``require_wheel`` says so in one line.

Never read here: the wheel's ``systems/silicon_sample.csv`` (end-to-end serving runs, kept
for an independent check). Only kernel tables, system specs and model configs are used.
"""

from __future__ import annotations

import contextlib
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

WHEEL = "aiconfigurator-core"
WHEEL_VERSION = "0.12.0"                # the pinned version of the kernels extra (pyproject.toml)
EXTRA_HINT = "pip install -e '.[kernels]' (aiconfigurator-core==0.12.0)"

# batchsim GPU preset -> the wheel's system name (systems/<name>.yaml, data/<name>/).
SYSTEMS = {
    "a100-80gb": "a100_sxm", "h100-sxm": "h100_sxm", "h200": "h200_sxm", "b200-sxm": "b200_sxm",
    "b300-sxm": "b300_sxm", "gb200": "gb200", "gb300": "gb300", "l40s": "l40s",
    "rtx-pro-6000": "rtx_pro_6000_server", "arc-pro-b60": "b60",
}
# The wheel's engine names (its "backends") and how batchsim writes them.
ENGINES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}
# The attention classes of the graphs batchsim composes; any other attention op (DSA, linear
# attention, state spaces) is a mechanism batchsim does not model yet. Multi-head latent
# attention comes as one block per phase (``_MLA_BLOCK``: the wheel's measured MLA module, its
# projections included, with a graph of GEMMs and MLA kernels where the module was not measured).
_ATTENTION = {"ContextAttention": "prefill", "GenerationAttention": "decode"}
_MLA_BLOCK = "mla_block"
# DeepSeek sparse attention: one measured module per phase (indexer, top-k and sparse MLA,
# the projections included), keyed by the query heads per GPU as MLA's.
_DSA_MODULES = {"ContextDSAModule": "prefill", "GenerationDSAModule": "decode"}
# SGLang's MLA under DeepEP (the wheel's large-EP graph: the attention module of its DeepEP stack,
# measured as one op a phase).
_WIDEEP_MLA = {"WideEPContextMLA": "prefill", "WideEPGenerationMLA": "decode"}
# The MLA tables, by the engine's kernels: the whole module (vLLM, TensorRT-LLM), else the
# attention kernels of the fallback graph (SGLang).
_MLA_TABLES = {"prefill": ("dsa_context_module_perf.parquet", "mla_context_module_perf.parquet",
                           "wideep_context_mla_perf.parquet", "context_mla_perf.parquet"),
               "decode": ("dsa_generation_module_perf.parquet", "mla_generation_module_perf.parquet",
                          "wideep_generation_mla_perf.parquet", "generation_mla_perf.parquet")}
# Gated DeltaNet's ops (the conv1d and the chunked scan / recurrent update of its linear layers):
# priced beside attention, the wheel's cost of a prefill chunk depending on its length and batch
# only (no context: the state carries it), of a decode on the batch only.
_LINEAR_ATTENTION = ("GDNKernel",)
_UNMODELLED = (("MLA", "multi-head latent attention (MLA)"), ("Dsa", "DeepSeek sparse attention"),
               ("DSA", "DeepSeek sparse attention"), ("Msa", "sparse attention (MSA)"),
               ("Gdn", "linear attention (Gated DeltaNet)"), ("GDN", "linear attention (Gated DeltaNet)"),
               ("Mamba", "state-space layers (Mamba2)"), ("Kda", "linear attention (KDA)"),
               ("Mhc", "hyper-connections (mHC)"))


class KernelsError(ValueError):
    """A kernel profile that cannot be built: the wheel is missing, or the GPU, engine,
    version or model is not in its tables. The message says which and what to do."""


def require_wheel() -> Any:
    """The ``aiconfigurator_core`` module, or KernelsError naming the extra to install."""
    try:
        import aiconfigurator_core  # noqa: F401
        from aiconfigurator_core.sdk import engine  # noqa: F401
    except ImportError:
        raise KernelsError(f"kernels: aiconfigurator needs the {WHEEL} wheel: {EXTRA_HINT}") from None
    return aiconfigurator_core


def wheel_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(WHEEL)
    except PackageNotFoundError:
        raise KernelsError(f"kernels: aiconfigurator needs the {WHEEL} wheel: {EXTRA_HINT}") from None


def systems_root() -> Path:
    """The wheel's systems/ folder, found without importing the wheel (a cached kernel
    profile is read with no more than this: the import costs a second or two)."""
    from importlib.util import find_spec
    spec = find_spec("aiconfigurator_core")
    if spec is None or spec.origin is None:
        raise KernelsError(f"kernels: aiconfigurator needs the {WHEEL} wheel: {EXTRA_HINT}")
    return Path(spec.origin).resolve().parent / "systems"


def model_ids() -> tuple[str, ...]:
    """The Hugging Face ids whose configs the wheel bundles (model_configs/)."""
    root = systems_root().parent / "model_configs"
    return tuple(sorted(p.name[:-len("_config.json")].replace("--", "/", 1)
                        for p in root.glob("*_config.json") if not p.name.endswith("_hf_quant_config.json")))


def model_config(model_id: str) -> dict[str, Any]:
    """The bundled config.json of ``model_id`` (its quantization folded in, as the wheel reads
    it: an hf_quant_config.json beside it becomes ``quantization_config``); KernelsError
    listing the bundled ids otherwise (nothing is fetched from the Hub)."""
    import json
    root = systems_root().parent / "model_configs"
    path = root / f"{model_id.replace('/', '--')}_config.json"
    if not path.is_file():
        raise KernelsError(f"model {model_id!r} is not among the {len(model_ids())} configs the {WHEEL} wheel "
                           f"bundles (nothing is fetched from the Hub); bundled: {', '.join(model_ids())}")
    cfg = json.loads(path.read_text())
    quant = root / f"{model_id.replace('/', '--')}_hf_quant_config.json"
    if "quantization_config" not in cfg and quant.is_file():
        algo = (json.loads(quant.read_text()).get("quantization") or {}).get("quant_algo")
        if algo:
            cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": algo}
    return {"name": model_id, **cfg}


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The wheel logs each fallback table it loads at WARNING: keep them off the terminal
    (what was loaded from where is in ``KernelTables.tables``)."""
    log = logging.getLogger("aiconfigurator_core")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def system_of(gpu: str) -> str:
    """The wheel's system for a batchsim GPU preset; KernelsError listing the measured ones."""
    system = SYSTEMS.get(str(gpu).lower())
    if system is None:
        raise KernelsError(f"gpu {gpu!r} has no measured kernel tables; measured: {', '.join(SYSTEMS)}")
    return system


def version_key(version: str) -> tuple:
    """A comparable tuple for '0.24.0', '1.3.0rc20', '0.5.6.post2' (the wheel's own ordering)."""
    from aiconfigurator_core.sdk.perf_database import _version_sort_tuple
    return _version_sort_tuple(version)


@lru_cache(maxsize=64)
def measured_versions(system: str, engine: str) -> tuple[str, ...]:
    """The engine versions of ``system`` that the wheel serves (its queryable slots) and
    whose GEMM or attention tables were measured on this system, oldest first (a version
    whose only new table is, say, one collective is served from an older one's kernels)."""
    from aiconfigurator_core.sdk import perf_database
    with quiet():
        slots = perf_database.get_version_slots(system, engine) or {}
    data = systems_root() / "data" / system
    held = {p.name for family in ("gemm", "attention") for p in data.glob(f"{family}/{engine}/*")
            if p.is_dir() and any(p.glob("*.parquet"))}
    return tuple(sorted({v for v in slots.values() if v in held}, key=version_key))


def resolve_version(system: str, engine: str, asked: str | None) -> str:
    """The measured version nearest to ``asked`` (None: the newest); KernelsError if the
    engine has none on this system. "Nearest" compares (major, minor, patch, pre-release)
    in turn; a tie goes to the newer."""
    versions = measured_versions(system, engine)
    if not versions:
        raise KernelsError(f"no {ENGINES[engine]} kernel tables were measured on {system}; "
                           f"try another policy's engine or another gpu")
    if asked is None:
        return versions[-1]
    want = version_key(str(asked))
    if want == (0, 0, 0, 0, 0, 0):
        raise KernelsError(f"engine_version {asked!r} is not a version number (e.g. {versions[-1]})")

    def distance(v: str) -> tuple:
        return tuple(abs(a - b) for a, b in zip(version_key(v), want)) + (-version_key(v)[0],)
    return min(reversed(versions), key=distance)


# profile.moe_a2a_backend -> the wheel's MoE comm backend (context, generation): vLLM's
# --all2all-backend deepep_high_throughput / deepep_low_latency, SGLang's --moe-a2a-backend
# deepep with --deepep-mode normal / low_latency (one kernel for every step). SGLang's
# --deepep-mode auto (normal kernels for a step that extends, low-latency for decode-only ones)
# is not offered: the wheel measured SGLang's DeepEP tables at versions outside its queryable
# ones (0.5.12 and earlier; 0.5.14 is current), so no profile could be built for it.
DEEPEP_MODES = {"deepep_high_throughput": ("deepep_ht", "deepep_ht"),
                "deepep_low_latency": ("deepep_ll", "deepep_ll")}


class KernelTables:
    """One model's op graph on one GPU, engine and version, per TP shard, answering each
    op family at a shape in milliseconds (the wheel's unit) from the measured tables.

    ``model_path``: a Hugging Face id among the wheel's bundled configs, or a local folder
    holding a config.json (never fetched: the wheel would try the Hub for other ids).
    Quant modes None: as the checkpoint's config states them (the wheel infers them).
    """

    def __init__(self, model_path: str, system: str, engine: str, version: str, tensor_parallel: int, *,
                 expert_parallel: bool = False, gemm_quant_mode: str | None = None,
                 moe_quant_mode: str | None = None, kvcache_quant_mode: str | None = None,
                 fmha_quant_mode: str | None = None, data_parallel: int = 1, moe_a2a: str | None = None) -> None:
        import aiconfigurator_core
        from aiconfigurator_core.sdk import perf_database
        from aiconfigurator_core.sdk.config_builders import apply_nextn, build_model_config
        from aiconfigurator_core.sdk.engine import EngineHandle, build_engine_spec_json
        from aiconfigurator_core.sdk.models import get_model

        self.model_path, self.system, self.engine, self.version = model_path, system, engine, version
        t, d = tensor_parallel, data_parallel
        # Attention data parallelism: d ranks of t GPUs, the MoE layers over all d x t GPUs (by
        # experts with EP, else by each expert's width), as vLLM's --data-parallel-size lays them out.
        with quiet():
            config = build_model_config(
                tp_size=t, pp_size=1, attention_dp_size=d, moe_tp_size=1 if expert_parallel else t * d,
                moe_ep_size=t * d if expert_parallel else 1, gemm_quant_mode=gemm_quant_mode,
                moe_quant_mode=moe_quant_mode, kvcache_quant_mode=kvcache_quant_mode, fmha_quant_mode=fmha_quant_mode)
            apply_nextn(config, 0)
            try:
                database = perf_database.get_database(system, engine, version)
                if moe_a2a is not None:
                    # DeepEP's all-to-all (the wheel's large-EP graph: MoEAllToAll dispatch and combine
                    # around MoEExpertCompute), its kernels per phase, over the node's GPUs
                    config.moe_comm_backend = dict(zip(("context", "generation"), DEEPEP_MODES[moe_a2a]))
                    config.num_gpus_per_node = int(database.system_spec["node"]["num_gpus_per_node"])
                model = get_model(model_path, config, engine)
            except (ValueError, KeyError, NotImplementedError) as exc:
                raise KernelsError(f"the kernel tables cannot build {model_path} on {system} "
                                   f"({ENGINES[engine]} {version}, TP {t}" + (f", DP {d}" if d > 1 else "")
                                   + f"): {exc}") from None
            spec = build_engine_spec_json(model, model_path=model_path, system=system, backend=engine,
                                          backend_version=version, kv_block_size=None, systems_path=None,
                                          nextn=0, database=database)
            self.handle = EngineHandle(bytes(aiconfigurator_core.engine_spec_bincode_from_json(spec)))
        self.model, self.database = model, database
        self.mla = False                          # set by _classify: an MLA model's attention blocks
        self.dsa = False                          # ... and DeepSeek sparse attention's modules
        self.linear = False                       # ... and Gated DeltaNet's linear-attention ops
        # Data-parallel MoE ranks: the MoE ops (experts, dispatch and combine) on a curve of their own
        # (``moe_ms``), which meets every rank's tokens where the rest meets a rank's own.
        self.splits_moe = data_parallel > 1 and any(type(op).__name__.startswith("MoE") for op in model.context_ops)
        self.quant_modes = {name: getattr(model.config, f"{name}_quant_mode").name
                            for name in ("gemm", "moe", "kvcache", "fmha", "comm")}
        self._check_gemm_precision()
        self._context = self._classify(model.context_ops, "context")
        self._generation = self._classify(model.generation_ops, "generation")

    def _check_gemm_precision(self) -> None:
        """KernelsError when the GEMM table measured no kernel of the model's GEMM precision
        (the wheel would fall back to a roofline, or fail deep inside a step)."""
        import pandas as pd
        entry = self.tables().get("gemm_perf.parquet")
        if entry is None:
            return
        dtypes = set(pd.read_parquet(systems_root().parent / entry["path"], columns=["gemm_dtype"])["gemm_dtype"])
        if self.quant_modes["gemm"] not in dtypes:
            raise KernelsError(f"the {ENGINES[self.engine]} {self.version} GEMM tables on {self.system} measured "
                               f"{', '.join(sorted(dtypes))} kernels, not {self.quant_modes['gemm']} (this model's "
                               f"weights); pick another weight_dtype, gpu or engine")

    def _classify(self, ops: list[Any], phase: str) -> dict[str, list[int]]:
        """Indices of the phase's ops by role: attention, LM head, the rest (token-parallel)."""
        roles: dict[str, list[int]] = {"attention": [], "lm_head": [], "linear": [], "moe": []}
        for i, op in enumerate(ops):
            kind = type(op).__name__
            name = getattr(op, "_name", "")
            if (kind == "FallbackOp" and name.endswith(_MLA_BLOCK)) or kind in _DSA_MODULES or kind in _WIDEEP_MLA:
                roles["attention"].append(i)      # MLA / DSA: its projections ride with it
                self.mla = True
                self.dsa = self.dsa or kind in _DSA_MODULES
                continue
            if kind in _LINEAR_ATTENTION:
                roles["attention"].append(i)      # Gated DeltaNet: chunk length (prefill) or batch (decode)
                self.linear = True
                continue
            if kind == "Mamba2Kernel":
                raise KernelsError(f"{self.model_path}: its {phase} graph has Mamba2 ops, which the {WHEEL} "
                                   f"{WHEEL_VERSION} tables do not measure for {ENGINES[self.engine]}: its "
                                   f"mamba2_perf tables hold TensorRT-LLM's causal_conv1d kernels only, not the "
                                   f"SSD scan or selective_state_update, and nothing for vLLM or SGLang (the wheel "
                                   f"would estimate them); use the analytic profile (leave out profile.kernels), "
                                   f"whose roofline prices Mamba2's layers")
            for marker, mechanism in _UNMODELLED:
                if marker in kind:
                    raise KernelsError(f"{self.model_path}: its {phase} graph has {kind} ops: {mechanism} "
                                       f"is not modelled by batchsim yet")
            if kind in _ATTENTION:
                roles["attention"].append(i)
            elif self.splits_moe and kind.startswith("MoE"):
                roles["moe"].append(i)
            elif name.endswith("logits_gemm"):
                roles["lm_head"].append(i)
            else:
                roles["linear"].append(i)
        if not roles["attention"]:
            raise KernelsError(f"{self.model_path}: no attention op in its {phase} graph")
        return roles

    # ---- op families, in ms (the wheel's unit) ---------------------------------------
    def linear_ms(self, num_tokens: int) -> float:
        """Every token-parallel op of the context graph at ``num_tokens`` tokens in one step
        (the LM head apart: ``lm_head_ms``)."""
        return sum(v[1] for v in self.handle.evaluate_context_ops(
            self._context["linear"], batch_size=1, s=int(num_tokens)))

    def moe_ms(self, num_tokens: int) -> float:
        """The context graph's MoE ops (experts, dispatch, combine) when every data-parallel rank
        runs ``num_tokens`` tokens (``splits_moe`` only; else they are in ``linear_ms``)."""
        return sum(v[1] for v in self.handle.evaluate_context_ops(
            self._context["moe"], batch_size=1, s=int(num_tokens)))

    def lm_head_ms(self, num_seqs: int) -> float:
        """The LM head's GEMM for one row per sampled sequence (the generation graph's)."""
        return sum(v[1] for v in self.handle.evaluate_generation_ops(
            self._generation["lm_head"], batch_size=int(num_seqs), s=1))

    def prefill_attention_ms(self, chunk: int, context: int, batch: int = 1) -> float:
        """Context attention of ``batch`` chunks of ``chunk`` new tokens over ``context``
        earlier ones each (the wheel's prefix), QK-norm, RoPE and KV writes included."""
        return sum(v[1] for v in self.handle.evaluate_context_ops(
            self._context["attention"], batch_size=int(batch), s=int(chunk), prefix=int(context)))

    def decode_attention_ms(self, num_seqs: int, kv_len: int) -> float:
        """Generation attention of ``num_seqs`` one-token decodes each over ``kv_len`` keys."""
        return sum(v[1] for v in self.handle.evaluate_generation_ops(
            self._generation["attention"], batch_size=int(num_seqs), s=max(1, int(kv_len))))

    # ---- what was measured -----------------------------------------------------------
    def tables(self) -> dict[str, dict[str, str]]:
        """Per table file the model's ops read: the engine version and how the wheel chose
        it (primary: measured at this version; fallback / cross_backend: filled from another)."""
        with quiet():
            self.database._materialize_source_reports()
        out = {}
        for name, records in sorted(self.database.data_provenance.items()):
            found = next((r for r in records if r["exists"]), None)
            if found is not None and name.replace("_perf.parquet", "") in self._families():
                out[name] = {"version": str(found["version"]), "channel": str(found["channel"]),
                             "path": str(Path(found["path"]).relative_to(systems_root().parent))}
        return out

    def _families(self) -> set[str]:
        used = {"gemm", "context_attention", "generation_attention", "custom_allreduce", "nccl"}
        if self.mla:
            used |= {"mla_context_module", "mla_generation_module", "context_mla", "generation_mla", "mla_bmm",
                     "wideep_context_mla", "wideep_generation_mla"}
        if self.dsa:
            used |= {"dsa_context_module", "dsa_generation_module"}
        if self.linear:
            used |= {"gdn"}
        if any(type(op).__name__.startswith("MoE") for op in self.model.context_ops):
            used |= {"moe", "moe_a2a", "wideep_deepep_normal", "wideep_deepep_ll"}
        return used

    def measured_axes(self) -> dict[str, list[int]]:
        """The shapes the tables measured for this model's ops (read from the tables the
        wheel loaded), per axis: ``tokens`` (GEMM rows, and MoE tokens where the model has
        experts: the GEMM rows up to the largest MoE row), ``prefill_len`` (a context
        attention's sequence length), ``decode_seqs`` and ``decode_len`` (a generation
        attention's batch and KV length). Attention rows are those of the model's (heads,
        KV heads, head_dim) per GPU where measured, else of its head_dim."""
        import pandas as pd
        tables = self.tables()
        root = systems_root().parent

        def read(name: str) -> pd.DataFrame | None:
            entry = tables.get(name)
            return pd.read_parquet(root / entry["path"]) if entry else None

        axes: dict[str, list[int]] = {}
        gemm = read("gemm_perf.parquet")
        if gemm is not None:
            axes["tokens"] = sorted({int(m) for m in gemm["m"].unique()})
        moe = read("moe_perf.parquet") if "moe" in self._families() else None
        if moe is not None:
            top = int(moe["num_tokens"].max())
            axes["tokens"] = sorted({m for m in axes.get("tokens", []) if m <= top}
                                    | {int(m) for m in moe["num_tokens"].unique()})
        heads = self._attention_heads()
        phases = (("context_attention_perf.parquet", "prefill"), ("generation_attention_perf.parquet", "decode"))
        if self.mla:
            phases = tuple((next((n for n in _MLA_TABLES[phase] if n in tables), ""), phase) for phase in
                           ("prefill", "decode"))
        for name, phase in phases:
            table = read(name) if name else None
            if table is None:
                continue
            rows = table
            if self.mla:
                # the rows of this model's query heads per GPU (MLA's only head count)
                local = table[table["num_heads"] == self._mla_heads()]
                rows = local if len(local) else table
            elif heads is not None:
                exact = table[(table["num_heads"] == heads[0]) & (table["num_key_value_heads"] == heads[1])
                              & (table["head_dim"] == heads[2])]
                rows = exact if len(exact) else table[table["head_dim"] == heads[2]]
            if not len(rows):
                rows = table
            if phase == "prefill":
                axes["prefill_len"] = sorted({int(v) for v in rows["isl"].unique()})
            else:
                axes["decode_seqs"] = sorted({int(v) for v in rows["batch_size"].unique()})
                axes["decode_len"] = sorted({int(v) for v in (rows["isl"] + rows["step"]).unique()})
        return axes

    def measured_limits(self) -> dict[str, float]:
        """The largest measured value on each of ``measured_axes``."""
        return {axis: float(max(values)) for axis, values in self.measured_axes().items() if values}

    def _mla_heads(self) -> int:
        """An MLA model's query heads per GPU, as its MLA module's spec keys them."""
        import json
        op = self.model.context_ops[self._context["attention"][0]]
        spec = next(iter(json.loads(op._spec_json()).values()))
        if "primary" in spec:                     # MLA's fallback block: its module's heads
            spec = next(iter(spec["primary"].values()))
        return int(spec["num_heads"])

    def _attention_heads(self) -> tuple[int, int, int] | None:
        """(query heads, KV heads, head_dim) per GPU, as the attention tables key them."""
        import json
        op = self.model.context_ops[self._context["attention"][0]]
        fields = next(iter(json.loads(op._spec_json()).values()))
        if not all(k in fields for k in ("n", "n_kv", "head_size")):
            return None                      # another layout: the table-wide range
        return int(fields["n"]), int(fields["n_kv"]), int(fields["head_size"])
