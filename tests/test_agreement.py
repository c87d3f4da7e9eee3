"""The guard against a silent return of a precision bug: no corpus program agrees with float32
worse than tests/agreement_baseline.json records (tests/agreement.py says how it measures and
how to rewrite the baseline after a change whose worse cells are explained)."""

import agreement
import pytest


# Every family measures its programs at six cells: minutes in all, so with the slow checks.
@pytest.mark.slow
@pytest.mark.parametrize("family", agreement.FAMILIES)
def test_no_program_agrees_worse_with_float32_than_the_baseline(family):
    baseline = agreement.load_baseline()
    new = agreement.measure((family,))
    missing = sorted(set(new) - set(baseline))
    assert not missing, (
        f"{missing} have no baseline: run `python tests/agreement.py --family {family} --write`"
    )
    worse = agreement.worse(new, baseline)
    assert not worse, "agreement with float32 got worse:\n" + "\n".join(worse)


def test_worse_means_grown_past_the_noise():
    old = {"p": {"O2-bfloat16": {"value": 1e-3}, "O2-float16": {"value": 0.0}}}
    same = {"p": {"O2-bfloat16": {"value": 1.2e-3}, "O2-float16": {"value": 1e-5}}}
    assert agreement.worse(same, old) == []
    grown = {"p": {"O2-bfloat16": {"value": 2e-3}, "O2-float16": {"value": 1e-4}}}
    assert len(agreement.worse(grown, old)) == 2
    assert agreement.worse({"p": {"O2-float16": {"value": float("inf")}}}, old)
