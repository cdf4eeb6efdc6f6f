"""`moestream families`: every supported model type with its layout, its expert bytes at the published
shape and the formats it loads, then the refused ones with their reasons."""

import pytest

from moestream.cli import main
from moestream.families import FAMILIES, supported


@pytest.fixture(scope="module")
def listing():
    from moestream.families.listing import rows

    return rows()


def test_every_family_is_listed_once_supported_first(listing):
    assert [r.model_type for r in listing if r.reason is None] == supported()
    assert sorted(r.model_type for r in listing) == FAMILIES.names()
    refused = [r for r in listing if r.reason is not None]
    assert refused and all(r.reason == FAMILIES.get(r.model_type).reason() for r in refused)


def test_rows_say_the_layout_the_published_expert_bytes_and_the_formats(listing):
    row = {r.model_type: r for r in listing}
    assert row["mixtral"].layout == "per expert: w1+w3, w2"
    assert row["mixtral"].expert_bytes == 3 * 4096 * 14336 * 2  # Mixtral-8x7B's expert, bf16
    assert row["deepseek_v3"].expert_bytes == 3 * 7168 * 2048 * 2 and "fp8" in row["deepseek_v3"].published
    assert row["gpt_oss"].loads == ("mxfp4",) and row["gpt_oss"].layout.startswith("fused over experts")
    assert row["qwen3_vl_moe"].layout.endswith("(transposed)")


def test_the_command_prints_one_line_per_family(capsys, monkeypatch, listing):
    monkeypatch.setattr("moestream.families.listing.rows", lambda: listing)
    assert main(["families"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{len(supported())} model types load")
    assert any(line.split()[:1] == ["mixtral"] and "per expert: w1+w3, w2" in line for line in lines)
    assert any(line.split()[:1] == ["inkling2"] and "interleave" in line for line in lines)
    assert len(lines) == len(listing) + 2
