"""Hostile and broken converted-model files: each fails with a clean OdeifyError, quickly, and runs no code.

The cases come from ``tests/hostile_files.py`` (derived from one valid saved model). They run in a
separate process that reports each outcome as it goes, so a case that never returns is caught and
named instead of hanging the suite.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hostile_files import write_cases

import odeify
from odeify.models.digits import DEFAULT_MODEL_PATH

LIMIT_S = 20.0  # per case; a clean refusal takes milliseconds, a refusal after a rebuild a few seconds
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("hostile")
    valid = folder / "valid.safetensors"
    odeify.save(odeify.convert(str(DEFAULT_MODEL_PATH)), valid)
    cases = {name: str(path) for name, (_, path) in write_cases(valid, folder / "cases").items()}
    todo = folder / "cases.json"
    todo.write_text(json.dumps({"control_valid_file": str(valid), **cases}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(HERE / "hostile_files.py"), str(todo), str(LIMIT_S)]
    try:
        result = subprocess.run(
            args, capture_output=True, text=True, env=env, timeout=LIMIT_S * len(cases) + 120
        )
        lines = result.stdout
    except subprocess.TimeoutExpired as exc:
        lines = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
    records = {r["case"]: r for r in map(json.loads, filter(None, lines.splitlines()))}
    for name in cases:  # a case the runner never finished: it hung or killed the process
        records.setdefault(name, {"case": name, "outcome": "hang or crash", "detail": ""})
    return records


def test_control_file_loads(outcomes: dict[str, dict]) -> None:
    assert outcomes["control_valid_file"]["outcome"] == "accepted"  # the runner can tell success


def test_every_hostile_file_fails_cleanly(outcomes: dict[str, dict]) -> None:
    cases = {k: v for k, v in outcomes.items() if k != "control_valid_file"}
    counts = collections.Counter(r["outcome"] for r in cases.values())
    print(f"\n{len(cases)} hostile files: {dict(counts)}")
    bad = {k: f"{v['outcome']}: {v['detail']}" for k, v in cases.items() if v["outcome"] != "clean"}
    assert not bad, bad
    assert len(cases) >= 100


@pytest.mark.parametrize(
    "case, message",
    [
        ("arch_absolute_path", "must be a name"),
        ("arch_hub_name", "must be a name"),
        ("kwargs_checkpoint_path", "'checkpoint_path' is refused"),
        ("kwargs_pretrained", "'pretrained' is refused"),
        ("kwargs_layers_20000", "'layers' must be"),
        ("kwargs_wide_within_ranges", "holds only"),
        ("legacy_path_source", "older odeify"),
        ("version_newer", "newer odeify"),
        ("steps_1e9", "steps must be an integer"),
        ("knots_4096", "says 4096 knots"),
        ("entry_1e999999999", "tableau entries"),
        ("one_fp64", "is torch.float64, the model needs torch.float32"),
        ("all_fp16", "is torch.float16"),
        ("one_inf", "non-finite"),
        ("all_nan", "non-finite"),
        ("knot_wrong_shape", "has shape"),
        ("missing_head", "missing fc.weight"),
        ("extra_tensor", "unexpected evil.weight"),
    ],
)
def test_refusals_name_the_problem(outcomes: dict[str, dict], case: str, message: str) -> None:
    assert message in outcomes[case]["detail"], outcomes[case]
