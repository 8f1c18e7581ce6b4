"""`moejax compare`, the README's main job, run through the CLI as a user runs it."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from moejax.cli import main

pytestmark = pytest.mark.slow  # runs `moejax compare` end to end


@pytest.fixture(scope="module")
def ragged_report() -> dict:
    """One `compare` run of the ragged exchange: its plain row, its overlapped one and a prefill /
    decode pair on 4 + 4 devices (a run per test would build and compile the same engines again)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert (
            main(
                [
                    "compare",
                    "--placements",
                    "ragged_a2a",
                    "--two-batch-overlap",
                    "--pd",
                    "--prefill-devices",
                    "4",
                    "--decode-devices",
                    "4",
                    "--max-new-tokens",
                    "3",
                    "--json",
                ]
            )
            == 0
        )
    return json.loads(out.getvalue())


def test_compare_json_reports_the_ragged_exchange_sending_each_row_to_fewer_devices(ragged_report):
    report = ragged_report
    assert report["agree"] and report["devices"] == 8
    ragged = report["placements"][0]
    assert ragged["name"] == "ragged_a2a" and (ragged["ep"], ragged["tp"]) == (8, 1)
    assert len(ragged["tokens"]) == 8 and all(len(t) == 3 for t in ragged["tokens"])
    # An all-gather sends every row to the 7 other devices; the ragged exchange only to the
    # devices holding its picks.
    assert 1.0 <= ragged["copies_per_row"] < 7.0
    assert ragged["bytes_sent_per_device_per_moe_layer"] > 0
    # XLA:CPU has no ragged exchange: what it would send is counted from the plan, and says so.
    assert ragged["sent_counted_from"].startswith("exchange plan")
    assert ragged["expert_bytes_read_per_device_per_step"] > 0
    assert ragged["prefill_ms"] > 0 and ragged["decode_step_ms"] > 0


def test_compare_table_ends_saying_the_placements_agree(capsys):
    assert main(["compare", "--placements", "hybrid", "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("hybrid"))
    assert "4 x 2" in row and " yes " in row
    assert out.strip().endswith("all placements agree with the single-device run")


def test_compare_two_batch_overlap_adds_an_overlapped_row_with_the_same_bytes(ragged_report):
    report = ragged_report
    plain, tbo = report["placements"]
    assert report["agree"] and (plain["name"], tbo["name"]) == ("ragged_a2a", "ragged_a2a+tbo")
    assert tbo["bytes_sent_per_device_per_moe_layer"] == plain["bytes_sent_per_device_per_moe_layer"] > 0


def test_compare_pd_reports_each_pair_with_its_hand_over(ragged_report):
    report = ragged_report
    (pair,) = report["pairs"]
    assert report["agree"] and pair["prefill"]["devices"] == [0, 1, 2, 3] and pair["decode"]["devices"] == [4, 5, 6, 7]
    assert pair["handover_bytes"] > 0 and pair["handover_bytes_per_request"] == pair["handover_bytes"] // 8
