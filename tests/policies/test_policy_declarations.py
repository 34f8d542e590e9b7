"""Every registered policy is built one way and declares what others read.

``PolicyClass(config, context)``; ``token_budget``, ``max_num_seqs``,
``holds_batch``, ``max_prompt_tokens``, ``decode_stretch``, ``chunk_stretch`` and ``knobs()``
with the same names everywhere, each with a safe default in ``PolicyBase`` but
``max_num_seqs``, and a policy restates none of them; a one-line doc on every
config field.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
from conftest import linear_profile

from cases import CASES, KINDS

from policies import POLICIES, knob_docs, make_policy
from policies.base import PolicyBase
from sim.run.runner import policy_context
from sim.core.kv import BlockManager, KVPool
from sim.core.policy import KV_MEMORY_SHARES, KvMemory, Policy, PolicyContext

GIB = 1024**3


DECLARATIONS = [name for name in typing.get_type_hints(Policy) if name != "max_num_seqs"]


def test_the_base_holds_a_default_for_every_declaration_but_the_sequence_limit():
    missing = [name for name in DECLARATIONS if not hasattr(PolicyBase, name)]
    assert missing == [], f"policies.base.PolicyBase has no default for {missing}"
    assert not hasattr(PolicyBase, "max_num_seqs")                     # every policy sets its own
    assert PolicyBase.decode_stretch is False and PolicyBase.kv_pool_class is BlockManager   # the safe ones


@pytest.mark.parametrize("kind", KINDS)
def test_a_policy_declares_only_what_differs_from_the_base(kind):
    cls = POLICIES[kind][1]
    assert issubclass(cls, PolicyBase)
    restated = [name for name in DECLARATIONS if name in vars(cls) and vars(cls)[name] == getattr(PolicyBase, name)]
    assert restated == [], f"{cls.__name__} restates the base's default of {restated}"


@pytest.mark.parametrize("kind", KINDS)
def test_class_level_declarations_name_real_knobs_and_kinds(kind):
    # What the config's checks read from the class, before any policy is built (policies.config).
    cfg_cls, cls = POLICIES[kind]
    hints = typing.get_type_hints(cfg_cls)
    if cls.prefix_switch is not None:
        assert hints[cls.prefix_switch.knob] is bool, cls.prefix_switch
    if cls.full_batch_knob is not None:
        assert hints[cls.full_batch_knob] is int, cls.full_batch_knob
    assert cls.chunked_variant is None or cls.chunked_variant in POLICIES
    assert type(cls.always_chunks) is bool and not (cls.always_chunks and cls.chunked_variant)
    from sim.cost.aic import ENGINES
    assert cls.kernel_tables in ENGINES           # the engines whose kernel tables the wheel measures


@pytest.mark.parametrize("kind", KINDS)
def test_declarations_exist_with_their_types(kind):
    cfg_cls, policy_cls = POLICIES[kind]
    policy = policy_cls(cfg_cls(), PolicyContext(max_model_len=4096))
    assert policy.token_budget is None or (type(policy.token_budget) is int and policy.token_budget > 0)
    assert type(policy.max_num_seqs) is int and policy.max_num_seqs > 0
    assert type(policy.holds_batch) is bool
    assert type(policy.decode_stretch) is bool
    assert type(policy.chunk_stretch) is bool
    assert policy.max_prompt_tokens is None or type(policy.max_prompt_tokens) is int
    assert issubclass(policy.kv_pool_class, KVPool)
    assert type(policy.kv_pool_class.caching) is bool                 # what a run's summary and files read
    assert policy.block_size is None or (type(policy.block_size) is int and policy.block_size > 0)
    assert policy.kv_memory is None or (isinstance(policy.kv_memory, KvMemory)
                                        and 0 < policy.kv_memory.fraction <= 1
                                        and policy.kv_memory.share_of in KV_MEMORY_SHARES)
    # holds_batch is readable from the class too (a report knows only the kind)
    assert policy_cls.holds_batch is policy.holds_batch


@pytest.mark.parametrize("kind", KINDS)
def test_server_knobs_agree_with_what_sizes_the_pool(kind):
    # A policy that pages or sizes its pool by a knob of its own (block_size, kv_memory set) does
    # not read the server field, and says which of its knobs means it; one that reads the field
    # does not declare it. The knob named is a field of its config; the fields are ServerConfig's.
    from sim.run.config import ServerConfig
    from sim.core.policy import EngineKnob
    cfg_cls, cls = POLICIES[kind]
    policy = make_policy(cfg_cls(), 4096)
    knobs = {f.name for f in dataclasses.fields(cfg_cls)}
    assert set(cls.server_knobs) <= {f.name for f in dataclasses.fields(ServerConfig)}
    assert ("block_size" in cls.server_knobs) == (policy.block_size is not None)
    assert ("gpu_memory_utilization" in cls.server_knobs) == (policy.kv_memory is not None)
    for name, engine_knob in cls.server_knobs.items():
        assert isinstance(engine_knob, EngineKnob) and engine_knob.note, (kind, name)
        assert engine_knob.knob is None or engine_knob.knob in knobs, (kind, name)
    # the watermark is read only by the policies that ask for it (vLLM v0's block manager)
    assert ("watermark" not in cls.server_knobs) == cls.refuses_by_prompt


@pytest.mark.parametrize("kind", KINDS)
def test_a_lone_request_up_to_its_stated_limit_is_scheduled(kind):
    # max_request_tokens of an empty pool of 256 blocks of 16 = 4,096 tokens: the whole pool but
    # for SGLang, whose PrefillAdder wants prompt + max_tokens + one page < the pool's tokens:
    # 4,096 - 16 - 1 = 4,079 (with ignore_eos and no cache: 4,096 - 2 x 16 - 1 = 4,063)
    policy = make_policy(POLICIES[kind][0](), 4096)
    assert policy.max_request_tokens(256, 16) == (4079 if kind == "sglang" else 4096)
    if kind == "sglang":
        lean = make_policy(POLICIES[kind][0](ignore_eos=True, disable_radix_cache=True), 4096)
        assert lean.max_request_tokens(256, 16) == 4063
        assert policy.max_request_tokens(4096, 1) == 4094          # 4,096 - 1 - 1


@pytest.mark.parametrize("kind", KINDS)
def test_default_declarations(kind):
    # (token_budget, max_num_seqs, holds_batch) at max_model_len 4096, no profile: the case's
    # ``defaults``, worked out there
    policy = make_policy(POLICIES[kind][0](), 4096)
    assert (policy.token_budget, policy.max_num_seqs, policy.holds_batch) == CASES[kind].defaults


@pytest.mark.parametrize("kind", KINDS)
def test_knobs_round_trip_through_the_config(kind):
    cfg_cls = POLICIES[kind][0]
    policy = make_policy(cfg_cls(), 4096)
    knobs = policy.knobs()
    assert list(knobs) == [f.name for f in dataclasses.fields(cfg_cls)]
    assert None not in knobs.values(), knobs                 # every default resolved
    again = make_policy(cfg_cls(**knobs), 4096)
    assert again.knobs() == knobs
    assert (again.token_budget, again.max_num_seqs) == (policy.token_budget, policy.max_num_seqs)


def test_vllm_v1_defaults_follow_the_profiles_device_and_server():
    cfg = POLICIES["vllm_v1"][0]()
    profile = linear_profile()
    h200 = dataclasses.replace(profile, device="NVIDIA H200", memory_bytes_per_gpu=141 * GIB)
    b200 = dataclasses.replace(profile, device="NVIDIA B200", memory_bytes_per_gpu=180 * GIB)
    a100 = dataclasses.replace(profile, device="NVIDIA A100-SXM4-80GB", memory_bytes_per_gpu=80 * GIB)
    cpu = dataclasses.replace(profile, device="cpu", tensor_parallel=2)
    served = dataclasses.replace(h200, engine={"max_num_seqs": 64, "max_num_batched_tokens": 1024})
    # >= 70 GiB, not an A100: 8192 / 1024; >= 160 GiB: 16384 / 1024; an A100: 2048 / 256;
    # CPU: 2048 x 2 / 128 x 2 = 4096 / 256; a measured server's knobs win over the device's
    expected = [(h200, 8192, 1024), (b200, 16384, 1024), (a100, 2048, 256), (cpu, 4096, 256), (served, 1024, 64)]
    for prof, tokens, seqs in expected:
        policy = make_policy(cfg, policy_context(4096, prof))
        assert (policy.token_budget, policy.max_num_seqs) == (tokens, seqs), prof.device
        assert policy.knobs()["max_num_batched_tokens"] == tokens and policy.knobs()["max_num_seqs"] == seqs
    # the budget is capped at max_num_seqs x max_model_len: 1024 x 4 = 4096 < 8192
    assert make_policy(cfg, policy_context(4, h200)).token_budget == 4096


@pytest.mark.parametrize("kind", KINDS)
def test_every_knob_has_a_one_line_doc(kind):
    cfg_cls = POLICIES[kind][0]
    docs = knob_docs(kind)
    fields = [f for f in dataclasses.fields(cfg_cls) if f.name != "kind"]
    assert [(name, default) for name, default, _ in docs] == [(f.name, f.default) for f in fields]
    for name, _, doc in docs:
        assert doc.strip() and "\n" not in doc, (kind, name)


def test_sim_run_help_lists_every_policys_knobs_with_defaults(capsys):
    from sim.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    out = capsys.readouterr().out
    for kind in POLICIES:
        assert f"\n  {kind}\n" in out, kind
    assert "    max_queue_delay_s (0.1): a batch launches once its oldest request waited" in out
    assert "    max_num_batched_tokens (unset): most tokens per step; unset: max(max_model_len, 2048)" in out
