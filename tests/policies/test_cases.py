"""The table of policies the policy-wide tests read (``cases.py``) holds every registered policy."""

from __future__ import annotations

import dataclasses

from cases import CASES

from policies import POLICIES


def test_every_registered_policy_has_a_case() -> None:
    missing = sorted(set(POLICIES) - set(CASES))
    assert missing == [], f"add {missing} to tests/policies/cases.py: the policy-wide tests read it"
    assert sorted(set(CASES) - set(POLICIES)) == [], "a case for a policy that is not registered"


def test_cases_name_only_their_policys_knobs() -> None:
    for kind, case in CASES.items():
        knobs = {f.name for f in dataclasses.fields(POLICIES[kind][0])} - {"kind"}
        assert set(case.small) <= knobs and set(case.ranges) <= knobs, kind
