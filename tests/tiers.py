"""Tier tables fixed by the tests, so that tuning config/*.toml cannot change what they check."""

from tierflow.tiers import TierPolicy, TierTable

# Scheduler unit tests: with their predictor, 1000 prompt tokens = 1 s of prefill.
UNIT_TIERS = TierTable(
    [
        TierPolicy("critical", 0, 1.0),
        TierPolicy("standard", 1, 5.0),
        TierPolicy("batch", 2, 100.0, sheddable=True),
    ]
)

# Services under test on 2 shared CI cores: SLOs generous enough to assert "within SLO".
SERVICE_TIERS_TOML = """
[tiers.critical]
rank = 0
ttft_slo_s = 2.0
[tiers.standard]
rank = 1
ttft_slo_s = 10.0
[tiers.batch]
rank = 2
ttft_slo_s = 600.0
sheddable = true
"""
