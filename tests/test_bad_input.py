"""The CLI's answer to input a user got wrong: one line on stderr, exit code 2, no traceback,
nothing written. In-process (fast) for the table; a few as real processes for the exit code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moejax.cli import main

ROOT = Path(__file__).parent.parent
CONFIGS = {
    "wrong_type.yaml": "layout:\n  devices: two\n",
    "unknown_key.yaml": "layout:\n  experts: hybrid\n  bogus: 3\n",
    "not_yaml.yaml": "layout: [unclosed\n",
    "wrong_type_hf/config.json": '{"model_type": "mixtral", "num_hidden_layers": 2, "num_local_experts": "six"}',
}
GEN = ["generate", "--preset", "tiny"]

BAD_INPUT = {
    "unknown preset": (["generate", "--preset", "nope"], "unknown preset 'nope'"),
    "unknown placement": ([*GEN, "--placement", "nope"], "unknown placement 'nope'"),
    "ep times tp not the device count": (
        [*GEN, "--placement", "hybrid", "--ep", "3", "--tp", "2", "--devices", "8"],
        "ep * tp = devices",
    ),
    "more devices than the machine has": (
        [*GEN, "--placement", "expert_sharded", "--devices", "64"],
        "this machine has 8",
    ),
    "zero devices": ([*GEN, "--devices", "0"], "devices must be at least 1"),
    "a negative page size": ([*GEN, "--page-size", "-1"], "engine.page_size must be positive"),
    "a mesh the placement does not take": (
        [*GEN, "--placement", "expert_sharded", "--tp", "2", "--devices", "8"],
        "do not apply to it",
    ),
    "the Blackwell kernel without a Blackwell GPU": (
        [*GEN, "--kernel", "blackwell"],
        "needs an NVIDIA Blackwell (sm_100)",
    ),
    "the TPU kernel without a TPU": ([*GEN, "--kernel", "pallas_tpu"], "needs a TPU"),
    "config.json field of the wrong type": (
        ["generate", "--hf", "{configs}/wrong_type_hf"],
        "num_local_experts must be an integer, got 'six'",
    ),
    "slice width that does not divide": (
        [*GEN, "--placement", "tensor_sliced", "--devices", "3"],
        "cannot be sliced 3 ways",
    ),
    "token id out of range": ([*GEN, "--prompt-ids", "1,99999"], "token id 99999 outside the vocabulary"),
    "two-batch overlap where rows stay home": (
        [*GEN, "--placement", "weight_prefetch", "--devices", "8", "--two-batch-overlap"],
        "rows stay on their device",
    ),
    "plan of two-batch overlap where rows stay home": (
        ["plan", "--placement", "weight_prefetch", "--two-batch-overlap"],
        "rows stay on their device",
    ),
    "prefill devices without decode devices": (
        [*GEN, "--prefill-placement", "ragged_a2a", "--prefill-devices", "4"],
        "--prefill-devices and --decode-devices go together",
    ),
    "prefill and decode devices the machine lacks": (
        [*GEN, "--decode-placement", "hybrid", "--prefill-devices", "6", "--decode-devices", "6"],
        "--devices 12 asked for",
    ),
    "prefill and decode devices unequal over processes": (
        [
            *GEN,
            "--decode-placement",
            "hybrid",
            "--prefill-devices",
            "4",
            "--decode-devices",
            "2",
            "--num-processes",
            "2",
            "--coordinator",
            "127.0.0.1:1",
        ],
        "must be equal and divide by 2",
    ),
    "serving MTP drafts with prefill and decode apart": (
        ["bench", "--preset", "tiny", "--speculative", "mtp", "--decode-placement", "hybrid"],
        "decodes under one placement",
    ),
    "serving MTP drafts on a device split": (
        ["bench", "--preset", "tiny", "--speculative", "mtp", "--prefill-devices", "4", "--decode-devices", "4"],
        "decodes under one placement",
    ),
    "compare's prefill and decode flags without --pd": (
        ["compare", "--preset", "tiny", "--prefill-devices", "4", "--decode-devices", "4"],
        "add --pd",
    ),
    "recording the picks of MTP decoding": (
        ["serve", "--preset", "tiny", "--speculative", "mtp", "--record", "x.npz"],
        "drop --speculative or --record",
    ),
    "a target plan does not know": (
        ["plan", "--preset", "tiny", "--target", "mi300x"],
        "argument --target: invalid choice: 'mi300x'",
    ),
    "a TPU slice of no such size": (
        ["plan", "--preset", "tiny", "--target", "v5e", "--devices", "3"],
        "a v5e slice has 1, 4, 8, 16, 32, 64, 128, 256 chips, not 3",
    ),
    "negative token id": ([*GEN, "--prompt-ids", "1,-3"], "token id -3 outside the vocabulary"),
    "token id out of range when scoring": (["score", "--preset", "tiny", "--prompt-ids", "512"], "token id 512"),
    "empty prompt": ([*GEN, "--prompt-ids", ""], "--prompt-ids is empty"),
    "more new tokens than the context": ([*GEN, "--max-new-tokens", "100000"], "exceeds the model's context"),
    "no new tokens": ([*GEN, "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    "prompt ids with a gap": ([*GEN, "--prompt-ids", "1,,2"], "not a comma-separated list of integers"),
    "prompt ids not numbers": ([*GEN, "--prompt-ids", "a,b"], "not a comma-separated list of integers"),
    "non-numeric devices": ([*GEN, "--devices", "two"], "argument --devices: invalid int value"),
    "non-numeric max new tokens": ([*GEN, "--max-new-tokens", "x"], "argument --max-new-tokens: invalid int value"),
    "non-numeric temperature": ([*GEN, "--temperature", "hot"], "argument --temperature: invalid float value"),
    "negative temperature": ([*GEN, "--temperature", "-1"], "--temperature >= 0"),
    "top-p above one": ([*GEN, "--temperature", "1", "--top-p", "2"], "0 < --top-p <= 1"),
    "yaml value of the wrong type": (
        [*GEN, "--config", "{configs}/wrong_type.yaml"],
        "layout.devices must be an integer",
    ),
    "yaml unknown key": ([*GEN, "--config", "{configs}/unknown_key.yaml"], "unknown config key 'layout.bogus'"),
    "file that is not yaml": ([*GEN, "--config", "{configs}/not_yaml.yaml"], "is not valid YAML"),
    "missing config file": ([*GEN, "--config", "{configs}/absent.yaml"], "does not exist"),
    "missing transformers directory": (["generate", "--hf", "{configs}/absent"], "no such directory"),
    "missing checkpoint": (["generate", "--checkpoint", "{configs}/absent"], "no such checkpoint directory"),
    "convert from a missing directory": (["convert", "--hf", "{configs}/absent", "--out", "out"], "no such directory"),
    "convert to 4-bit a model the blocks do not divide": (
        ["convert", "--hf", str(ROOT / "tests/golden/deepseek_v3"), "--out", "out", "--expert-format", "mxfp4"],
        "cannot be stored as mxfp4",
    ),
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("configs")
    for name, text in CONFIGS.items():
        (directory / name).parent.mkdir(exist_ok=True)
        (directory / name).write_text(text)
    return directory


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own errors exit from inside parse_args
        return e.code


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_ends_in_one_line_and_exit_2_writing_nothing(case, configs, tmp_path, monkeypatch, capsys):
    argv, says = BAD_INPUT[case]
    monkeypatch.chdir(tmp_path)
    rc = run_cli([a.format(configs=configs) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("moejax: error: ") and err.count("\n") == 1 and says in err, err
    assert list(tmp_path.iterdir()) == []


def run_process(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # main() in this process set it: the CLI sets its own
    return subprocess.run(
        [sys.executable, "-m", "moejax", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--preset", "nope"],
        ["generate", "--devices", "two"],
        ["score", "--preset", "tiny", "--prompt-ids", "-1"],
    ],
    ids=["config error", "argparse error", "input data error"],
)
def test_bad_input_exits_2_without_traceback_from_a_real_process(argv, tmp_path):
    proc = run_process(argv, tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------- refusals of the target compilers


def tiny_trace(path: Path) -> str:
    """Two decode steps of 8 rows of the tiny preset, every row picking the first k experts."""
    from moejax.base.trace import save_trace
    from moejax.config import preset

    model = preset("tiny")
    k, layers = model.num_experts_per_tok, len(model.moe_layers)
    ids = np.broadcast_to(np.arange(k, dtype=np.int32), (2, layers, 8, k))
    save_trace(path, ids, np.ones((2, 8), bool), ["decode"] * 2, model.moe_layers, model.num_experts, "tiny")
    return str(path)


def test_advise_refuses_with_the_first_line_of_the_compilers_reason(tmp_path, monkeypatch, capsys):
    """A compiler's reason may run to many lines; the refusal is its first."""
    import jax

    def refuse(self, *args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm.\n\nTotal hbm usage:\n  a")

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
    trace = tiny_trace(tmp_path / "t.npz")
    argv = ["advise", trace, "--preset", "tiny", "--target", "h100", "--devices", "8", "--placements", "expert_sharded"]
    assert run_cli(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("moejax: error: no layout compiles for 8 h100: expert_sharded its decode does not compile")
    assert err.endswith("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm.\n")


TPU_REFUSALS = {
    # the TPU compiler's own reason: a KV cache larger than a v6e's memory
    "advise of a model the target cannot hold": (
        ["advise", "{trace}", "--preset", "tiny", "--target", "v6e", "--devices", "8"]
        + ["--placements", "expert_sharded", "--context", "400000000"],
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM",
    ),
    "plan of a batch the target's devices do not divide": (
        ["plan", "--preset", "tiny", "--target", "v5e", "--devices", "8", "--placement", "expert_sharded"]
        + ["--batch", "3"],
        "--batch 3 must be a multiple of 8",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", TPU_REFUSALS)
def test_a_refusal_on_a_tpu_target_is_one_line_from_a_real_process(case, tmp_path):
    """The refusal is the one line on stderr: none of libtpu's start-up logs (it finds no TPU on
    this host) before it."""
    argv, says = TPU_REFUSALS[case]
    trace = tiny_trace(tmp_path / "t.npz")
    proc = run_process([a.format(trace=trace) for a in argv], tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("moejax: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert says in proc.stderr
