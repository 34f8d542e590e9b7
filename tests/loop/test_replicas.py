"""Replicas do not interact: each runs a policy object of its own (``sim.run.runner.drive``).

Under round robin, request i goes to replica i mod N whatever the replicas
do, so replica k's requests, run alone on one replica, must get exactly the
results they got in the fleet, request for request. Every registered policy
(``tests/policies/cases.py``) runs so, stepped with the fast-path check too.
Before each replica had its own policy, one object served them all: sglang
with chunked prefill died (``KeyError``: a chunked request of another
replica), tgi and lmdeploy mixed their step counters.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from cases import CASES, KINDS

from sim.run.config import workload_from_dict
from sim.run.runner import run_workload
from workloads.generate import RequestSpecs, generate

NUM_REPLICAS = 3


def fleet_workload(kind: str) -> dict:
    """90 requests over 3 shared 200-token prefixes at 40 req/s: queues form under the case's
    small knobs (4 running, 64-token steps), prefix caches hit, chunks span steps."""
    return {"name": "fleet", "seed": 5, "num_requests": 90, "arrivals": {"kind": "poisson", "rate": 40.0},
            "lengths": {"kind": "prefix_repetition", "prefix_len": 200, "suffix_len": 60, "num_prefixes": 3,
                        "output_len": 40},
            "server": {"max_model_len": 1024}, "policy": {"kind": kind, **CASES[kind].small},
            "profile": {"model": "llama-3.1-8b", "gpu": "h100-sxm"}}


def subset(specs: RequestSpecs, index: np.ndarray) -> RequestSpecs:
    """The requests ``index`` of ``specs``, in order, as a workload of their own."""
    return RequestSpecs(specs.arrival_s[index], specs.prompt_tokens[index], specs.output_tokens[index],
                        max_tokens=None if specs.max_tokens is None else specs.max_tokens[index],
                        contents=None if specs.contents is None else specs.contents.take(index))


def per_request(requests: pd.DataFrame) -> pd.DataFrame:
    """A run's requests in id order, without what names them (id, replica)."""
    return requests.sort_values("req_id").drop(columns=["req_id", "replica"]).reset_index(drop=True)


@pytest.mark.parametrize("check", [False, True], ids=["fast", "checked"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_replica_runs_as_if_alone(kind: str, check: bool) -> None:
    cfg = workload_from_dict(fleet_workload(kind))
    specs = generate(cfg)
    fleet = run_workload(cfg, num_replicas=NUM_REPLICAS, router="round_robin", check_stretch=check).requests
    assert sorted(fleet["replica"].unique()) == list(range(NUM_REPLICAS))
    for k in range(NUM_REPLICAS):
        index = np.arange(k, len(specs), NUM_REPLICAS)                 # round robin: i mod N
        alone = run_workload(cfg, specs=subset(specs, index), check_stretch=check).requests
        mine = fleet[fleet["replica"] == k]
        assert mine["req_id"].tolist() == index.tolist()
        pd.testing.assert_frame_equal(per_request(mine), per_request(alone), check_exact=True,
                                      obj=f"{kind}: replica {k} in the fleet vs alone")
    assert fleet["finished_s"].notna().all()
