"""The plaintext demo keys whose hashes are in ``config/keys.toml``, one per tier.

Public by design (they are in the repository): for the demo and the tests only. A real
deployment replaces ``config/keys.toml`` with its own keys, and then these grant nothing.
"""

DEMO_KEYS: dict[str, str] = {
    "critical": "tf-demo-critical-eef5a1130ceda0ccb9b6d0ec",
    "standard": "tf-demo-standard-04dd6921d0d750ef0cd69e01",
    "batch": "tf-demo-batch-871ffc25fc728f63349c308b",
}
