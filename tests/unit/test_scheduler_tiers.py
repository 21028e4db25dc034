"""The tier table and its TOML file (config/tiers.toml)."""

from __future__ import annotations

import pytest

from tierflow.tiers import DEFAULT_TIERS_PATH, TierPolicy, TierTable, load_tiers, loads_tiers


def test_default_file_defines_the_three_tiers_in_rank_order():
    tiers = load_tiers(DEFAULT_TIERS_PATH)
    assert tiers.names == ("critical", "standard", "batch")
    assert [t.rank for t in tiers] == [0, 1, 2]
    assert not tiers["critical"].sheddable and tiers["batch"].sheddable
    assert tiers["critical"].ttft_slo_s < tiers["standard"].ttft_slo_s < tiers["batch"].ttft_slo_s
    assert tiers["critical"].tbt_slo_s < tiers["standard"].tbt_slo_s < tiers["batch"].tbt_slo_s


def test_tbt_slo_is_optional():
    tiers = loads_tiers("[tiers.a]\nrank = 0\nttft_slo_s = 1\n")
    assert tiers["a"].tbt_slo_s is None
    assert (
        loads_tiers("[tiers.a]\nrank = 0\nttft_slo_s = 1\ntbt_slo_s = 0.25\n")["a"].tbt_slo_s
        == 0.25
    )


def test_unknown_tier_is_a_clear_value_error():
    tiers = load_tiers(DEFAULT_TIERS_PATH)
    with pytest.raises(ValueError, match=r"unknown tier 'gold'; known tiers: critical, standard"):
        tiers.get("gold")
    assert "gold" not in tiers


def test_other_sections_are_ignored_and_file_is_chosen_by_env(tmp_path, monkeypatch):
    path = tmp_path / "tiers.toml"
    path.write_text(
        "[tiers.gold]\nrank = 1\nttft_slo_s = 0.2\n\n[tiers.lead]\nrank = 7\nttft_slo_s = 60\n"
        'sheddable = true\n\n[api_keys.abc123]\ntier = "gold"\n'
    )
    monkeypatch.setenv("TIERFLOW_TIERS_FILE", str(path))
    tiers = load_tiers()
    assert tiers.names == ("gold", "lead")
    assert tiers["gold"] == TierPolicy("gold", 1, 0.2, sheddable=False)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[tiers.a]\nrank = 0\nttft_slo_s = 1\nshedable = true\n", "unknown key"),
        ("[tiers.a]\nrank = 0\n", "missing key"),
        (
            "[tiers.a]\nrank = 0\nttft_slo_s = 1\n[tiers.b]\nrank = 0\nttft_slo_s = 2\n",
            "share rank",
        ),
        ("[tiers.a]\nrank = 0\nttft_slo_s = 0\n", "must be > 0"),
        ("[tiers.a]\nrank = 0\nttft_slo_s = 1\ntbt_slo_s = 0\n", "tbt_slo_s must be"),
        ("[tiers.a]\nrank = 0\nttft_slo_s = 1\ntbt_slo_s = true\n", "tbt_slo_s must be"),
        ("[tiers.a]\nrank = -1\nttft_slo_s = 1\n", "rank"),
        ("[tiers.A]\nrank = 0\nttft_slo_s = 1\n", "lower-case"),
        ("[other]\nx = 1\n", "no \\[tiers"),
        ("[tiers.a\n", "invalid TOML"),
    ],
)
def test_invalid_files_are_rejected_with_a_reason(text, message):
    with pytest.raises(ValueError, match=message):
        loads_tiers(text)


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.toml"):
        load_tiers(tmp_path / "nope.toml")


def test_table_is_ordered_by_rank_whatever_the_input_order():
    table = TierTable([TierPolicy("z", 2, 1.0), TierPolicy("y", 0, 1.0)])
    assert table.names == ("y", "z") and len(table) == 2
