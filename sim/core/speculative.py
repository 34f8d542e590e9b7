"""Speculative decoding: the workload's ``policy.speculative`` section, the acceptance model
and a run's draft bookkeeping.

A proposer drafts ``num_speculative_tokens`` (k) tokens for each request that sampled in a
step; the next step verifies them in one forward pass of 1 + d query tokens (d <= k: the
budget or the context may cut the drafts) and keeps the leading drafts the target model
accepts, plus one token it samples itself (the bonus token). ``acceptance_length`` is the mean
number of tokens a verify step of k drafts yields, the bonus included (vLLM's "mean acceptance
length", 1 + accepted / drafts events, as InferenceX and vLLM's spec-decode metrics report it);
``acceptance_rates`` gives, per draft position, the share of verify steps that accept that
position (vLLM's per-position acceptance rate, ``num_accepted_tokens_per_pos / num_drafts``).

The acceptance model: draft i is accepted, given drafts 1..i-1 were, with probability
``c_i``: from ``acceptance_rates``, ``c_i = a_i / a_(i-1)`` (a_0 = 1); from
``acceptance_length`` alone, the same ``c`` at every position (the geometric model of
Leviathan et al.), solved so that ``(1 - c^(k+1)) / (1 - c) = acceptance_length``. Each
verify step draws its accepted count from these with the run's seed (numpy's PCG64, one
stream per replica), so a run is reproducible and two runs of different seeds differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from sim.base.strict import ConfigError, did_you_mean

# vLLM 0.32's methods (SpeculativeConfig.method) that batchsim models, and how each one's
# proposer runs and reserves KV (vllm/config/vllm.py num_lookahead_tokens,
# vllm/config/speculative.py max_num_new_slots_for_drafting and use_eagle):
#   lookahead: KV slots reserved past the scheduled tokens, where the drafter writes its drafts' KV;
#   eagle: the prefix-cache hit drops its last block (EAGLE/MTP recompute its hidden states);
#   device: the proposer is model layers on the GPU (else host time: n-gram matching on the CPU).
METHODS = {
    "eagle": dict(lookahead=True, eagle=True, device=True),
    "eagle3": dict(lookahead=True, eagle=True, device=True),
    "mtp": dict(lookahead=True, eagle=True, device=True),
    "ngram": dict(lookahead=False, eagle=False, device=False),
}
NOT_MODELLED = {
    "draft_model": "a separate draft model needs its own profile to price its forward passes and its "
                   "own KV pool, neither of which batchsim models yet",
    "dflash": "DFlash's parallel drafting (k + 1 query slots per request) is not modelled",
    "dspark": "DSpark's parallel drafting is not modelled",
    "ngram_gpu": "the GPU n-gram proposer is not modelled (use ngram)",
    "suffix": "suffix decoding's dynamic draft length is not modelled",
    "medusa": "Medusa's tree of heads is not modelled",
}


@dataclass(frozen=True, slots=True)
class SpeculativeSpec:
    """``policy.speculative``, validated."""

    method: str
    num_speculative_tokens: int
    conditional: tuple[float, ...]       # c_1..c_k: P(draft i accepted | drafts < i accepted)
    acceptance_length: float             # the mean tokens per verify step of k drafts, bonus included
    draft_layers: int = 1                # EAGLE/MTP: the proposer's transformer layers
    ngram_host_s_per_seq: float = 0.0    # n-gram: host time per request drafted for
    ngram_match_rate: float = 1.0        # n-gram: the share of a request's steps its proposer drafts for

    @property
    def lookahead(self) -> int:
        """vLLM's num_lookahead_tokens: k for EAGLE/MTP, 0 for n-gram."""
        return self.num_speculative_tokens if METHODS[self.method]["lookahead"] else 0

    @property
    def drops_eagle_block(self) -> bool:
        return bool(METHODS[self.method]["eagle"])

    @property
    def on_device(self) -> bool:
        return bool(METHODS[self.method]["device"])

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "acceptance_length": self.acceptance_length,
                "acceptance_rates": [float(v) for v in np.cumprod(self.conditional)],
                **({"draft_layers": self.draft_layers} if self.on_device else
                   {"ngram_host_s_per_seq": self.ngram_host_s_per_seq, "ngram_match_rate": self.ngram_match_rate})}


def geometric_rate(k: int, length: float) -> float:
    """The per-position acceptance c with (1 - c^(k+1)) / (1 - c) = ``length`` (1 <= length <=
    k + 1): the mean tokens of a verify step of k drafts when each is accepted with probability
    c given the ones before it were. Bisection to 1e-12 (the left side grows with c)."""
    if length >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(k + 1)) < length:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2


def refuse_method(data: Any, method: str, why: str, src: str, where: str = "policy.speculative") -> None:
    """ConfigError where ``data`` asks for speculation by ``method`` (k > 0), which an engine's policy
    does not model: ``why`` says which engine and what it does instead."""
    if isinstance(data, dict) and data.get("method") == method and data.get("num_speculative_tokens") != 0:
        raise ConfigError(f"{src}: field '{where}.method' '{method}' is not modelled for {why}")


def parse_speculative(data: Any, src: str, where: str = "policy.speculative") -> SpeculativeSpec:
    """``data`` (the user's mapping) validated; ConfigError naming the field otherwise."""
    if not isinstance(data, dict):
        raise ConfigError(f"{src}: field '{where}' must be a mapping (method, num_speculative_tokens, "
                          f"acceptance_length or acceptance_rates), got {data!r}")
    allowed = ("method", "num_speculative_tokens", "acceptance_length", "acceptance_rates", "draft_layers",
               "ngram_host_s_per_seq", "ngram_match_rate")
    for key in data:
        if key not in allowed:
            raise ConfigError(f"{src}: unknown field '{where}.{key}'" + did_you_mean(key, list(allowed))
                              + f"; allowed: {', '.join(allowed)}")
    if (data.get("num_speculative_tokens") == 0 and set(data) <= {"num_speculative_tokens", "method"}
            and data.get("method") in (None, *METHODS)):
        return SpeculativeSpec(data.get("method") or "ngram", 0, (), 1.0)   # k = 0 alone: no speculation
    method = data.get("method")
    if method in NOT_MODELLED:
        raise ConfigError(f"{src}: field '{where}.method' {method!r} is not modelled: {NOT_MODELLED[method]}; "
                          f"modelled: {', '.join(METHODS)}")
    if method not in METHODS:
        raise ConfigError(f"{src}: field '{where}.method' must be one of {', '.join(METHODS)}, got {method!r}")
    k = data.get("num_speculative_tokens")
    if isinstance(k, float) and k.is_integer():
        k = int(k)
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 32:
        raise ConfigError(f"{src}: field '{where}.num_speculative_tokens' must be an integer from 0 (no "
                          f"speculation: a sweep's baseline) to 32, got {k!r}")
    length, rates = data.get("acceptance_length"), data.get("acceptance_rates")
    if (length is None) == (rates is None):
        raise ConfigError(f"{src}: field '{where}' needs exactly one of acceptance_length (mean tokens per "
                          f"verify step, the bonus token included, 1 to num_speculative_tokens + 1) or "
                          f"acceptance_rates (per draft position, the share of verify steps accepting it)")
    if rates is not None:
        if (not isinstance(rates, list) or len(rates) < k
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in rates)):
            raise ConfigError(f"{src}: field '{where}.acceptance_rates' must be a list of at least {k} numbers "
                              f"(num_speculative_tokens: one per draft position; a longer list's first {k} are "
                              f"used, so that a sweep can vary k), got {rates!r}")
        prev = 1.0
        conditional = []
        for i, v in enumerate(rates[:k]):
            if not 0.0 <= v <= prev:
                raise ConfigError(f"{src}: field '{where}.acceptance_rates' position {i + 1} is {v}: each rate "
                                  f"must lie in [0, 1] and not exceed the one before it (a draft is accepted "
                                  f"only after the ones before it)")
            conditional.append(v / prev if prev > 0 else 0.0)
            prev = v
        length = 1.0 + float(sum(rates[:k]))
    elif k:
        if not isinstance(length, (int, float)) or isinstance(length, bool) or not 1.0 <= length <= k + 1:
            raise ConfigError(f"{src}: field '{where}.acceptance_length' must be a number from 1 to {k + 1} "
                              f"(num_speculative_tokens + 1: every draft accepted), got {length!r}")
        c = geometric_rate(k, float(length))
        conditional = [c] * k
        length = float(length)
    else:
        conditional, length = [], 1.0          # k = 0: nothing drafted, the length unused
    layers = data.get("draft_layers", 1)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise ConfigError(f"{src}: field '{where}.draft_layers' must be an integer >= 1, got {layers!r}")
    if "draft_layers" in data and not METHODS[method]["device"]:
        raise ConfigError(f"{src}: field '{where}.draft_layers' applies to eagle, eagle3 and mtp, not {method}")
    host = data.get("ngram_host_s_per_seq", NGRAM_HOST_S_PER_SEQ)
    if not isinstance(host, (int, float)) or isinstance(host, bool) or not 0 <= host < 1:
        raise ConfigError(f"{src}: field '{where}.ngram_host_s_per_seq' must be a number of seconds from 0 "
                          f"to 1, got {host!r}")
    if "ngram_host_s_per_seq" in data and method != "ngram":
        raise ConfigError(f"{src}: field '{where}.ngram_host_s_per_seq' applies to method ngram only")
    match = data.get("ngram_match_rate", 1.0)
    if not isinstance(match, (int, float)) or isinstance(match, bool) or not 0 < match <= 1:
        raise ConfigError(f"{src}: field '{where}.ngram_match_rate' must be a number in (0, 1] (the share of "
                          f"decode steps whose n-gram lookup finds a match: vllm:spec_decode_num_drafts over "
                          f"the decode steps), got {match!r}")
    if "ngram_match_rate" in data and method != "ngram":
        raise ConfigError(f"{src}: field '{where}.ngram_match_rate' applies to method ngram only")
    return SpeculativeSpec(method, k, tuple(float(c) for c in conditional), float(length), layers,
                           float(host) if method == "ngram" else 0.0, float(match))


# vLLM 0.32's NgramProposer (numba, one thread) on this project's CPU, per request it drafts for:
# benchmarks/bench_ngram_proposer.py measured 5-6 us at 512-2,048 tokens of context and 42 us at
# 8,192 (it scans the request's tokens); 10 us is the typical chat context's. Per-request, so a
# long-context workload should set ngram_host_s_per_seq from that benchmark.
NGRAM_HOST_S_PER_SEQ = 10e-6


class Speculation:
    """A replica's speculative-decoding state: the drafts each request holds for its next
    step (vLLM's ``Request.spec_token_ids``, as counts), the acceptance draws and vLLM's
    spec-decode counters (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
    ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``)."""

    def __init__(self, spec: SpeculativeSpec, rng: np.random.Generator | None = None,
                 accept: Callable[[int, int, int], int] | None = None) -> None:
        """``accept(req_id, num_output_tokens, num_drafts)``, if given, decides every verify
        step (the differential test's fixed acceptance); else draws from ``spec``."""
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.drafts: dict[int, int] = {}
        # Requests of the step being chosen whose drafts are vLLM's placeholders (a new decode
        # padded to 1 + k tokens): they accept none. Cleared at the step's commit.
        self.padded: set[int] = set()
        # Under async scheduling, per pending batch (by id): the requests it samples for, as
        # chosen (a preempted request's stale output is delivered if its item sampled), and
        # those padded with placeholder drafts.
        self.sampling: dict[int, tuple[frozenset[int], frozenset[int]]] = {}
        self._rng = rng if rng is not None else np.random.default_rng(0)
        self._match_rng = np.random.default_rng(self._rng.integers(2**63))   # its own stream: same acceptances
        self._accept = accept
        self._draws = np.empty((0, self.k))
        self._next = 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k

    def num_new_drafts(self) -> int:
        """The drafts a request that sampled gets for its next step: k, or with n-gram's
        ``ngram_match_rate`` below 1, k with that probability and else none (its lookup found
        no match: vLLM's proposer then drafts nothing and the step is a plain decode)."""
        rate = self.spec.ngram_match_rate
        if rate >= 1.0:
            return self.k
        return self.k if self._match_rng.random() < rate else 0

    def accepted(self, req_id: int, num_output_tokens: int, num_drafts: int, padded: bool = False) -> int:
        """How many of ``num_drafts`` drafts a verify step accepts (0 for vLLM's padding
        placeholders, ``padded``), counted as vLLM counts them."""
        if padded:
            a = 0
        elif self._accept is not None:
            a = self._accept(req_id, num_output_tokens, num_drafts)
        else:
            if self._next >= len(self._draws):           # uniform draws in blocks: one numpy call per 4096
                self._draws = self._rng.random((4096, self.k))
                self._next = 0
            u = self._draws[self._next]
            self._next += 1
            a = 0
            cond = self.spec.conditional
            while a < num_drafts and u[a] < cond[a]:
                a += 1
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += a
        for i in range(a):
            self.accepted_per_pos[i] += 1
        return a

    def summary(self) -> dict[str, Any]:
        """The counters, with vLLM's derived acceptance rate and mean acceptance length."""
        return Speculation.totals([self])

    @staticmethod
    def totals(runs: Sequence[Speculation]) -> dict[str, Any]:
        """``summary`` of the counters summed over ``runs`` (replicas of one run): the
        acceptance rate is accepted / draft tokens, the mean acceptance length 1 + accepted /
        drafts, as vLLM derives them."""
        drafts = sum(r.num_drafts for r in runs)
        draft_tokens = sum(r.num_draft_tokens for r in runs)
        accepted = sum(r.num_accepted_tokens for r in runs)
        return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
                "num_accepted_tokens_per_pos": [sum(pos) for pos in zip(*(r.accepted_per_pos for r in runs))],
                "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None}
