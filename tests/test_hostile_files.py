"""Hostile and broken converted-model files: each fails with a clean OdeifyError, quickly, and runs no code.

Among them, files whose tensors fit but whose recipe was altered to compute something else (another
activation, pooling, depth, input size, integrator or steps): their probe, what the model computed
when it was saved, tells them apart.

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
    assert len(cases) >= 162


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
        ("version_2e64", "newer odeify"),
        ("version_float", "must be an integer, not 1.0"),
        ("version_negative", "unknown format version -1"),
        ("version_1e999", "the format version must be an integer, not inf"),
        ("duplicate_key", "'dtype' appears twice"),
        ("nan_literal", "probe seed must be an integer"),
        ("stage_missing", "a point 'layer2', which is neither a stage"),
        ("stage_twice", "'layer1' is listed twice"),
        ("stage_name_newline", "a stage name is a module path of Python names"),
        ("name_newline", "a tableau name is a Python name"),
        ("name_markup", "a tableau name is a Python name"),
        ("stages_17", "1 to 16 stages"),
        ("entry_30_digits", "at most 20 digits"),
        ("pretrained_cfg_std_zero", "'std' must be 1 to 64 positive"),
        ("pretrained_cfg_mean_wrong_length", "mean has 2 entries for inputs of 1 channel"),
        ("pretrained_cfg_input_size_1e308", "'input_size' must be [C, H, W]"),
        ("pretrained_cfg_input_size_two", "'input_size' must be [C, H, W]"),
        ("pretrained_cfg_interpolation_unknown", "'interpolation' must be one of"),
        ("pretrained_cfg_crop_pct_negative", "'crop_pct' must be a number in [0.5, 2.0]"),
        ("pretrained_cfg_crop_nan", "'crop_pct' must be a number in [0.5, 2.0], not nan"),
        ("kwargs_act_layer_gelu", "does not compute what was saved: at stage 'layer1'"),
        ("kwargs_global_pool_max", "does not compute what was saved: at the model's output"),
        ("kwargs_layers_5_4", "does not compute what was saved: at stage 'layer1'"),
        ("stage_integrator_rk4", "does not compute what was saved: at stage 'layer1'"),
        ("stage_steps_2", "does not compute what was saved: at stage 'layer1'"),
        ("probe_values_shifted", "does not compute what was saved"),
        ("input_shape_64_1_1_1", "saved probe of stage 'layer1' does not fit"),
        ("input_shape_2_64_4096_4096", "ODEIFY_MAX_INPUT_BYTES"),
        ("input_shape_1_1_4096_4096", "the probe, on one 1x4096x4096 input (the size the model records),"),
        ("input_shape_8_1_4096_4096", "would hold 3.1 GiB at once, over the limit of 1.0 GiB"),
        ("module_points_at_extra_tensor", "is the module 'layer1_ode'"),
        ("one_bool", "fc.weight is torch.bool"),
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
        ("probe_allowance_1e300_gelu", "does not compute what was saved: at stage 'layer1'"),
        ("probe_allowance_1e300_rk4", "does not compute what was saved: at stage 'layer1'"),
        ("probe_deleted_gelu", "has no probe, which odeify.save always writes"),
        ("probe_null_gelu", "has no probe, which odeify.save always writes"),
        ("version_1_no_probe_gelu", "odeify.load(path, verify=False) (CLI: --no-verify)"),
        ("head_3e38", "round-off at the model's output is inf"),
        ("fold_inv_std_zero", "folds.bn1 holds inv_std from 0 to 0, which no BatchNorm gives"),
        ("fold_inv_std_1e30", "folds.bn1 holds inv_std from 1e+30 to 1e+30, which no BatchNorm gives"),
        ("fold_inv_std_negative", "which no BatchNorm gives"),
        ("fold_gamma_zero", "layer1_ode.folds.bn2 does not rebuild layer1_ode.knots.conv2_weight"),
        ("fold_offset_1e30", "folds.bn1 does not rebuild"),
        ("fold_records_removed", "holds no fold records (folds.*), which odeify.save writes"),
    ],
)
def test_refusals_name_the_problem(outcomes: dict[str, dict], case: str, message: str) -> None:
    assert message in outcomes[case]["detail"], outcomes[case]
