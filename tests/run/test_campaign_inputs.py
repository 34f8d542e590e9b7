"""The second campaign of bad and odd inputs (issue 35; the table is tests/run/campaign_inputs.py):
each of its inputs refused with one line holding its words, warned about, or run as its knobs
say; never a traceback, a hang or a silent success."""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest

from campaign_inputs import CASES, Case, outcome, write_case
from sim.cli import main


def test_the_campaign_is_large_and_covers_every_class() -> None:
    counts = collections.Counter(case.cls for case in CASES)
    assert len(CASES) >= 150 and len({case.name for case in CASES}) == len(CASES)
    assert set(counts) == {"engine knobs", "prefix caching", "start-up limits", "HF configs", "ranges",
                           "trace files", "model and overrides"}
    assert all(case.words for case in CASES if case.expect in ("refused", "warns"))


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_input_is_refused_warned_or_run_as_it_says(tmp_path: Path, capsys, case: Case) -> None:
    argv = write_case(case, tmp_path)
    try:
        rc = main(argv)
        err = capsys.readouterr().err
    except Exception:                            # noqa: BLE001 - the campaign counts it, as a traceback
        rc, err = 1, capsys.readouterr().err + traceback.format_exc()
    status, why = outcome(case, tmp_path, rc, err)
    assert status == "ok", f"{case.name}: {status}: {why}"
