"""`moejax calc` on the glm-5.3 preset against Row-Meets-Experts's figures, rounded as it rounds them."""

import json

import pytest

from moejax.analysis import calc
from moejax.cli import main
from moejax.config import preset

GLM = preset("glm-5.3")
E, K = 256, 8


@pytest.fixture(scope="module")
def report():
    return calc.calc_report(GLM, [8, 16, 32], tokens=64, touched=188, expert_format="nvfp4")


def per_device(report, n):
    return next(d for d in report["devices"] if d["n"] == n)


def test_expert_has_37_7m_parameters(report):  # section 1
    assert round(report["expert_params"] / 1e6, 1) == 37.7


def test_expert_is_18_9_mb_of_4bit_values(report):  # section 1
    assert round(report["expert_bytes"]["nvfp4_values"] / 1e6, 1) == 18.9


def test_expert_is_21_mb_with_nvfp4_scales(report):  # section 2
    assert round(report["expert_bytes"]["nvfp4"] / 1e6) == 21


def test_nvfp4_scales_are_one_byte_per_16_values_plus_a_tensor_scale_per_matrix():
    assert calc.expert_bytes(GLM)["nvfp4"] - calc.expert_bytes(GLM)["nvfp4_values"] == 37748736 // 16 + 3 * 4


def test_mxfp4_scales_are_one_byte_per_32_values():
    assert calc.expert_bytes(GLM)["mxfp4"] - calc.expert_bytes(GLM)["nvfp4_values"] == 37748736 // 32


def test_shared_expert_in_bf16_is_75_mb(report):  # section 4.3: the shared expert has a routed expert's shape
    assert round(report["expert_bytes"]["bf16"] / 1e6) == 75


def test_layer_experts_are_4_83_gb_values_and_5_4_gb_with_scales(report):  # sections 1 and 2
    assert round(report["layer_expert_bytes"]["nvfp4_values"] / 1e9, 2) == 4.83
    assert round(report["layer_expert_bytes"]["nvfp4"] / 1e9, 1) == 5.4


def test_eighth_of_every_expert_is_0_68_gb_per_layer(report):  # section 2: slices on 8 devices
    assert round(report["layer_expert_bytes"]["nvfp4"] / 8 / 1e9, 2) == 0.68


def test_75_moe_layers_hold_362_gb(report):  # section 1
    assert len(GLM.moe_layers) == 75
    assert round(report["model_expert_bytes"]["nvfp4_values"] / 1e9) == 362


def test_row_is_12288_bytes_in_bf16_and_3456_in_nvfp4(report):  # section 4.3: 3,072 values + 384 scales
    assert report["row_bytes"] == {"bf16": 12288, "nvfp4": 3456}


def test_row_experts_sit_on_5_3_of_8_devices(report):  # section 4.3
    assert round(per_device(report, 8)["devices_per_row"], 1) == 5.3


def test_own_device_holds_one_of_its_experts_for_two_thirds_of_rows():  # section 4.3
    assert calc.devices_per_row(E, K, 8) / 8 == pytest.approx(2 / 3, abs=0.01)


@pytest.mark.parametrize("n, copies", [(8, 4.6), (16, 6.1), (32, 7.0)])
def test_traveling_row_sends_article_copies(report, n, copies):  # sections 4.3 and 7
    assert round(per_device(report, n)["copies_sent_per_row"], 1) == copies


@pytest.mark.parametrize("n", [8, 16, 32])
def test_replicated_rows_send_n_minus_1_copies(report, n):  # sections 4.1 and 7
    assert per_device(report, n)["copies_replicated"] == n - 1


def test_traveling_row_never_needs_more_than_k_copies():  # section 7
    assert calc.devices_per_row(E, K, 256) <= K


def test_even_router_touches_87_percent_at_64_tokens(report):  # section 1
    assert round(per_device(report, 8)["even_touched_fraction"] * 100) == 87


@pytest.mark.parametrize("n, width", [(8, 256), (16, 128), (32, 64)])
def test_slice_width(report, n, width):  # sections 4.1 and 7
    assert per_device(report, n)["slice_width"] == width


@pytest.mark.parametrize("n", [24, 48])
def test_slices_do_not_divide_2048_on_24_or_48_devices(n):  # section 7
    assert calc.slice_width(GLM.moe_intermediate_size, n) is None


def test_188_touched_experts_are_4_0_gb(report):  # section 7
    assert round(188 * report["expert_bytes"]["nvfp4"] / 1e9, 1) == 4.0


def test_188_touched_experts_read_0_50_gb_per_device_on_8_and_0_125_on_32(report):  # section 7
    assert round(per_device(report, 8)["expert_bytes_read_per_device"] / 1e9, 2) == 0.50
    assert round(per_device(report, 32)["expert_bytes_read_per_device"] / 1e9, 3) == 0.125


@pytest.mark.parametrize("n, balancedness", [(8, 0.85), (16, 0.76), (32, 0.65)])
def test_even_router_balancedness_at_512_picks(report, n, balancedness):  # sections 5.4 and 7
    assert round(per_device(report, n)["even_balancedness"], 2) == balancedness


def test_even_busiest_device_picks_agree_with_balancedness(report):
    d = per_device(report, 8)  # Jensen: E[max] >= mean / E[mean / max], and not by much
    assert 64 / d["even_balancedness"] <= d["even_busiest_picks"] < 64 / d["even_balancedness"] + 1


def test_even_monte_carlo_is_deterministic():
    assert calc.even_balance(E, K, 8, 64) == calc.even_balance(E, K, 8, 64)


def test_uneven_split_of_experts_over_devices_still_counts_every_expert():
    assert calc.experts_per_device(E, 24).sum() == E


def test_cli_json_has_exactly_the_issue_keys(capsys):
    assert main(["calc", "--preset", "glm-5.3", "--devices", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {
        "expert_params",
        "expert_bytes",
        "layer_expert_bytes",
        "model_expert_bytes",
        "row_bytes",
        "kv_cache_bytes_per_token",
        "devices",
    }
    for key in ("expert_bytes", "layer_expert_bytes", "model_expert_bytes"):
        assert set(doc[key]) == {"bf16", "nvfp4_values", "nvfp4", "mxfp4"}
    assert set(doc["row_bytes"]) == {"bf16", "nvfp4"}
    assert set(doc["devices"][0]) == {
        "n",
        "devices_per_row",
        "copies_sent_per_row",
        "copies_replicated",
        "slice_width",
        "even_touched_fraction",
        "even_balancedness",
        "even_busiest_picks",
        "expert_bytes_read_per_device",
        "two_batch_expert_bytes_read_per_device",
    }


def test_glm_kv_cache_per_token_is_the_mla_latent_rope_key_and_indexer_key_of_78_layers():
    """What a prefill-to-decode hand-over moves per prompt token: 78 x (512 + 64 + 128) bf16."""
    assert calc.kv_cache_bytes_per_token(preset("glm-5.3")) == 78 * (512 + 64 + 128) * 2


def test_two_micro_batches_of_a_decode_step_read_more_expert_bytes_than_one():
    """At 64 tokens an even router touches 87% of GLM's experts; each half touches 64%, so the
    two halves read 1.47x the bytes; at 256 tokens each half touches 98%: 1.97x."""
    (d64,) = calc.calc_report(preset("glm-5.3"), [8], 64, None, "nvfp4")["devices"]
    (d256,) = calc.calc_report(preset("glm-5.3"), [8], 256, None, "nvfp4")["devices"]
    assert d64["two_batch_expert_bytes_read_per_device"] / d64["expert_bytes_read_per_device"] == pytest.approx(
        1.47, abs=0.01
    )
    assert d256["two_batch_expert_bytes_read_per_device"] / d256["expert_bytes_read_per_device"] == pytest.approx(
        1.97, abs=0.01
    )


def test_cli_reads_hf_config_json(tmp_path, capsys):
    hf = {
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert main(["calc", "--hf", str(tmp_path), "--devices", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expert_params"] == 3 * 4096 * 14336


def test_cli_table_without_json(capsys):
    assert main(["calc", "--preset", "glm-5.3", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "37.7M parameters" in out and "12,288 B bf16" in out


def test_cli_rejects_bad_device_list(capsys):
    assert main(["calc", "--preset", "glm-5.3", "--devices", "8,x"]) == 2
    assert "--devices" in capsys.readouterr().err


def test_cli_rejects_missing_hf_config(tmp_path, capsys):
    assert main(["calc", "--hf", str(tmp_path)]) == 2
    assert "config.json does not exist" in capsys.readouterr().err
