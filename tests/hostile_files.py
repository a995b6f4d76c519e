"""Crafted and broken converted-model files, and a runner that loads each one with a time limit.

``write_cases(valid, folder)`` derives every case from one valid file written by ``odeify.save``:
damaged containers (truncated, wrong header, not safetensors), hostile or broken recipes (huge
numbers, bad types, extra keys, path sources, hub names, build kwargs that read files or fetch),
and tensors that do not fit (wrong shapes, fp16/int32/fp64, NaN/inf, missing, extra), and files whose
tensors fit but whose recipe was changed so that the rebuilt model computes something else (the
probe catches those). ``run_cases``
loads each in this process under a per-case alarm and classifies the outcome: ``clean`` (an
OdeifyError), ``raw`` (any other exception), ``accepted`` (it loaded) or ``hang`` (over the limit).

Run as a script (``python hostile_files.py CASES.json LIMIT_S``), it prints one JSON line per case,
so a caller in another process sees how far it got even if something never returns.
"""

from __future__ import annotations

import copy
import json
import signal
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open

RECIPE_KEY = "odeify_converted"
PROBE = "@probe/"


def _read(valid: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    with safe_open(str(valid), framework="pt") as handle:
        recipe = json.loads(handle.metadata()[RECIPE_KEY])
    return recipe, safetensors.torch.load_file(str(valid))


def write_cases(valid: Path, folder: Path) -> dict[str, tuple[str, Path]]:
    """Write every case into ``folder``; return {case name: (category, path)}."""
    folder.mkdir(parents=True, exist_ok=True)
    recipe, tensors = _read(valid)
    raw = valid.read_bytes()
    head = "fc.weight"
    header_len = struct.unpack("<Q", raw[:8])[0]
    cases: dict[str, tuple[str, Path]] = {}

    def put_bytes(category: str, name: str, data: bytes) -> None:
        path = folder / f"{name}.safetensors"
        path.write_bytes(data)
        cases[name] = (category, path)

    def put(category: str, name: str, edit: Callable[[dict], Any] | None = None, text: str | None = None,
            state: dict[str, torch.Tensor] | None = None) -> None:  # fmt: skip
        body = copy.deepcopy(recipe)
        if edit is not None:
            edit(body)
        metadata = {RECIPE_KEY: text if text is not None else json.dumps(body)}
        put_bytes(
            category, name, safetensors.torch.save(state if state is not None else tensors, metadata=metadata)
        )

    def stage(key: str, value: Any) -> Callable[[dict], None]:
        return lambda body: body["stages"][0].__setitem__(key, value)

    def top(key: str, value: Any) -> Callable[[dict], None]:
        return lambda body: body.__setitem__(key, value)

    def kwargs(**extra: Any) -> Callable[[dict], None]:
        return lambda body: body["arch"]["kwargs"].update(extra)

    def tableau(**fields: Any) -> Callable[[dict], None]:
        base = {"name": "mine", "a": [["0", "0"], ["1", "0"]], "b": ["1/2", "1/2"], "order": 2}
        return stage("integrator", {**base, **fields})

    # --- the container
    for name, data in {
        "empty": b"",
        "truncated_8_bytes": raw[:8],
        "truncated_in_header": raw[: 8 + header_len // 2],
        "truncated_in_tensors": raw[: len(raw) - 1000],
        "header_length_2e63": struct.pack("<Q", 2**63) + raw[8:],
        "header_length_past_end": struct.pack("<Q", len(raw)) + raw[8:],
        "header_not_json": raw[:8] + b"{not json" + raw[8 + 9 :],
        "zero_bytes": bytes(len(raw)),
        "random_bytes": bytes((i * 7919 + 13) % 256 for i in range(4096)),
        "a_torch_pickle": b"PK\x03\x04" + raw[4:],
    }.items():
        put_bytes("container", name, data)
    # --- the recipe as text
    put_bytes("recipe text", "no_recipe", safetensors.torch.save(tensors, metadata={"other": "x"}))
    put("recipe text", "recipe_not_json", text="{'format': odeify")
    put("recipe text", "recipe_a_list", text="[1, 2, 3]")
    put("recipe text", "recipe_deeply_nested", text="[" * 100_000 + "]" * 100_000)
    put("recipe text", "recipe_300_kib", text=json.dumps({**recipe, "pad": "x" * 300_000}))
    # --- format, versions, keys
    put("recipe schema", "version_newer", top("version", recipe["version"] + 1))
    put("recipe schema", "version_2e64", top("version", 2**64))
    put("recipe schema", "version_float", top("version", 1.0))
    put("recipe schema", "version_negative", top("version", -1))
    put(
        "recipe schema",
        "version_1e999",
        text=json.dumps(recipe).replace(f'"version": {recipe["version"]}', '"version": 1e999'),
    )
    put("recipe schema", "duplicate_key", text=json.dumps(recipe)[:-1] + ', "dtype": "float64"}')
    put("recipe schema", "nan_literal", text=json.dumps(recipe).replace('"seed": 0', '"seed": NaN'))
    put("recipe schema", "version_missing", lambda b: b.pop("version"))
    put("recipe schema", "version_string", top("version", "1"))
    put("recipe schema", "version_bool", top("version", True))
    put("recipe schema", "format_other", top("format", "pickle"))
    put("recipe schema", "extra_top_key", top("exec", "import os"))
    legacy = {"source": "/etc/passwd", "load_kwargs": {}, "input_shape": [1, 1, 32, 32], "stages": []}
    put("recipe schema", "legacy_path_source", text=json.dumps(legacy))
    put("recipe schema", "legacy_source_key", top("source", "/etc/passwd"))
    put("recipe schema", "stages_empty", top("stages", []))
    put("recipe schema", "stages_a_dict", top("stages", {"layer1": 4}))
    put("recipe schema", "stages_200", lambda b: b.__setitem__("stages", b["stages"] * 100))
    put("recipe schema", "stage_missing_key", lambda b: b["stages"][0].pop("basis"))
    put("recipe schema", "stage_extra_key", stage("device", "cuda"))
    put("recipe schema", "stage_not_object", lambda b: b["stages"].__setitem__(0, "layer1"))
    put("recipe schema", "stage_missing", lambda b: b["stages"].pop())
    put("recipe schema", "stage_twice", lambda b: b.__setitem__("stages", [b["stages"][0]] * 2))
    put("recipe schema", "stage_name_newline", stage("name", "layer1\nimport os"))
    # --- numbers
    steps = {"1e9": 10**9, "1e5": 100_000, "float_1e9": 1e9, "2e70": 2**70, "negative": -1, "zero": 0,
             "string": "4", "bool": True, "null": None, "nan": float("nan")}  # fmt: skip
    for label, value in steps.items():
        put("numbers", f"steps_{label}", stage("steps", value))
    for value, label in ((4096, "4096"), (10**6, "1e6"), (0, "zero"), (2.0, "float"), ("native", "native")):
        put("numbers", f"knots_{label}", stage("knots", value))
    put("numbers", "checkpoint_every_zero", stage("checkpoint_every", 0))
    put("numbers", "checkpoint_every_past_steps", stage("checkpoint_every", 10**6))
    shapes = {"3_dims": [1, 1, 32], "huge": [1, 1, 10**6, 10**6], "zero_batch": [0, 1, 32, 32],
              "strings": ["1", "1", "32", "32"], "float": [1, 1, 32.5, 32]}  # fmt: skip
    for label, value in shapes.items():
        put("numbers", f"input_shape_{label}", top("input_shape", value))
    # --- manifestation names
    put("settings", "basis_unknown", stage("basis", "fourier"))
    put("settings", "backward_unknown", stage("backward", "exec"))
    put("settings", "integrator_unknown", stage("integrator", "__import__('os')"))
    put("settings", "integrator_reversible_with_reverse", lambda b: b["stages"][0].update(
        integrator="reversible_heun", backward="reverse"))  # fmt: skip
    put("settings", "whole_model_string", top("whole_model", "yes"))
    put("settings", "dtype_float128", top("dtype", "float128"))
    put("settings", "dtype_int32", top("dtype", "int32"))
    put("settings", "stage_renamed", stage("name", "layer9"))
    put("settings", "stage_module_elsewhere", stage("module", "layer9_ode"))
    put("settings", "stage_module_path", stage("module", "../../etc/passwd"))
    # --- tableaus
    put("tableau", "entry_1e999999999", tableau(b=["1e999999999", "0"]))
    put("tableau", "entry_5000_digits", tableau(b=["9" * 5000, "0"]))
    put("tableau", "entry_division_by_zero", tableau(b=["1/0", "1"]))
    put("tableau", "entry_nan", tableau(b=["nan", "1"]))
    put("tableau", "entry_float_number", tableau(b=[0.5, 0.5]))
    put("tableau", "order_99", tableau(order=99))
    put("tableau", "stages_100", tableau(a=[["0"] * 100] * 100, b=["1/100"] * 100))
    put("tableau", "not_square", tableau(a=[["0"], ["1", "0"]]))
    put("tableau", "wrong_order_claim", tableau(order=3, a=[["0", "0"], ["1", "0"]], b=["1/2", "1/2"]))
    put("tableau", "name_10k", tableau(name="x" * 10_000))
    put("tableau", "name_newline", tableau(name="mine\nimport os"))
    put("tableau", "name_markup", tableau(name="[/x]"))
    put("tableau", "name_65", tableau(name="x" * 65))
    put("tableau", "stages_17", tableau(a=[["0"] * 17] * 17, b=["1/17"] * 17, order=1))
    put("tableau", "entry_30_digits", tableau(b=["1/" + "9" * 30, "0"]))
    # --- architecture and build kwargs
    for value, label in (("hf-hub:timm/resnet18.a1_in1k", "hub_name"), ("local-dir:/etc", "local_dir"),
                         ("/etc/passwd", "absolute_path"), ("../../etc/passwd", "relative_path"),
                         ("resnet9999", "unknown_name"), (42, "number")):  # fmt: skip
        put("architecture", f"arch_{label}", lambda b, v=value: b["arch"].__setitem__("name", v))
    put(
        "architecture",
        "arch_other_timm_model",
        lambda b: b.__setitem__("arch", {"name": "resnet18", "kwargs": {}}),
    )
    put("architecture", "arch_missing_kwargs", lambda b: b["arch"].pop("kwargs"))
    put("architecture", "arch_a_string", top("arch", "odeify.digits_resnet"))
    for name, extra in {
        "kwargs_checkpoint_path": {"checkpoint_path": "/etc/passwd"},
        "kwargs_pretrained": {"pretrained": True},
        "kwargs_pretrained_cfg_overlay": {"pretrained_cfg_overlay": {"file": "/etc/passwd"}},
        "kwargs_cache_dir": {"cache_dir": "/"},
        "kwargs_layers_20000": {"layers": [20000, 4]},
        "kwargs_layers_64x8": {"layers": [64] * 8},
        "kwargs_channels_1e6": {"channels": [10**6, 32]},
        "kwargs_wide_within_ranges": {"layers": [32, 32], "channels": [4096, 4096]},
        "kwargs_num_classes_1e9": {"num_classes": 10**9},
        "kwargs_unknown": {"block_fn": "os.system"},
        "kwargs_act_layer_module_path": {"act_layer": "os.system"},
    }.items():
        put("architecture", name, kwargs(**extra))
    put("architecture", "kwargs_a_list", lambda b: b["arch"].__setitem__("kwargs", ["num_classes", 10]))
    put(
        "architecture",
        "pretrained_cfg_unknown_key",
        lambda b: b["pretrained_cfg"].__setitem__("file", "/etc/passwd"),
    )
    put(
        "architecture",
        "pretrained_cfg_huge_mean",
        lambda b: b["pretrained_cfg"].__setitem__("mean", [0.5] * 10**5),
    )
    bad_data_config = {
        "std_zero": ("std", [0.0]),
        "std_negative": ("std", [-0.3]),
        "mean_wrong_length": ("mean", [0.1, 0.2]),
        "input_size_zero": ("input_size", [1, 0, 32]),
        "input_size_negative": ("input_size", [1, -32, 32]),
        "input_size_1e308": ("input_size", [1, 1e308, 32]),
        "input_size_strings": ("input_size", ["1", "32", "32"]),
        "input_size_two": ("input_size", [32, 32]),
        "interpolation_unknown": ("interpolation", "magic"),
        "crop_pct_negative": ("crop_pct", -0.5),
        "crop_pct_zero": ("crop_pct", 0.0),
        "license_5k": ("license", "x" * 5000),
    }
    for label, (key, value) in bad_data_config.items():
        put(
            "data config",
            f"pretrained_cfg_{label}",
            lambda b, k=key, v=value: b["pretrained_cfg"].update({k: v}),
        )
    nan_crop = {**recipe, "pretrained_cfg": {**recipe["pretrained_cfg"], "crop_pct": float("nan")}}
    put("data config", "pretrained_cfg_crop_nan", text=json.dumps(nan_crop))
    # --- tensors fit, the function differs: only the probe tells (or the schema, where it can)
    put("computes otherwise", "kwargs_act_layer_gelu", kwargs(act_layer="gelu"))
    put("computes otherwise", "kwargs_global_pool_max", kwargs(global_pool="max"))
    put("computes otherwise", "kwargs_layers_5_4", kwargs(layers=[5, 4]))
    put("computes otherwise", "input_shape_64_1_1_1", top("input_shape", [64, 1, 1, 1]))
    put("computes otherwise", "stage_integrator_rk4", stage("integrator", "rk4"))
    put("computes otherwise", "stage_steps_2", lambda b: b["stages"][0].update(steps=2, checkpoint_every=1))
    put("computes otherwise", "probe_seed_other", lambda b: b["probe"].__setitem__("seed", 1))
    shifted = {k: v + 1 if k.startswith(PROBE) else v for k, v in tensors.items()}
    put("computes otherwise", "probe_values_shifted", state=shifted)
    put(
        "computes otherwise",
        "probe_tensor_missing",
        state={k: v for k, v in tensors.items() if k != PROBE + "output"},
    )
    put("computes otherwise", "probe_point_unknown", lambda b: b["probe"]["points"].append(["evil", 0.0]))
    put("computes otherwise", "probe_error_negative", lambda b: b["probe"]["points"][0].__setitem__(1, -1.0))
    # --- the file switching its own check off: it names no allowance, drops no probe, skips no check
    unprobed = {k: v for k, v in tensors.items() if not k.startswith(PROBE)}

    def lax(*edits: Callable[[dict], None]) -> Callable[[dict], None]:
        def edit(body: dict) -> None:
            body["probe"]["points"] = [[name, 1e300] for name, _ in body["probe"]["points"]]
            for more in edits:
                more(body)

        return edit

    gelu = kwargs(act_layer="gelu")
    put("own check", "probe_allowance_1e300_gelu", lax(gelu))
    put("own check", "probe_allowance_1e300_rk4", lax(stage("integrator", "rk4")))
    put("own check", "probe_deleted_gelu", lambda b: (b.pop("probe"), gelu(b)), state=unprobed)
    put("own check", "probe_null_gelu", lambda b: (b.update(probe=None), gelu(b)), state=unprobed)
    put("own check", "version_1_no_probe_gelu", lambda b: (b.pop("probe"), b.update(version=1), gelu(b)),
        state=unprobed)  # fmt: skip
    put("own check", "head_3e38", state={**tensors, head: torch.full_like(tensors[head], 3e38)})
    for label, value in (("zero", 0.0), ("1e30", 1e30), ("negative", -1.0)):
        inv_std = torch.full_like(tensors["folds.bn1.inv_std"], value)
        put("own check", f"fold_inv_std_{label}", state={**tensors, "folds.bn1.inv_std": inv_std})
    zero_gamma = torch.zeros_like(tensors["layer1_ode.folds.bn2.gamma"])
    put("own check", "fold_gamma_zero", state={**tensors, "layer1_ode.folds.bn2.gamma": zero_gamma})
    huge_offset = torch.full_like(tensors["folds.bn1.offset"], 1e30)
    put("own check", "fold_offset_1e30", state={**tensors, "folds.bn1.offset": huge_offset})
    no_records = {k: v for k, v in tensors.items() if ".folds." not in f".{k}"}
    put("own check", "fold_records_removed", state=no_records)
    # --- sizes a few bytes can ask for: refused against a budget, before anything is allocated
    put("resources", "input_shape_2_64_4096_4096", top("input_shape", [2, 64, 4096, 4096]))
    put("resources", "input_shape_1_1_4096_4096", top("input_shape", [1, 1, 4096, 4096]))  # the probe's
    put("resources", "input_shape_8_1_4096_4096", top("input_shape", [8, 1, 4096, 4096]))  # 3.1 GiB
    put(
        "resources",
        "module_points_at_extra_tensor",
        lambda b: b["stages"][0].update(module="evil", knots=4096),
        state={**tensors, "evil.knots.x": torch.zeros(4096, 1)},
    )
    # --- tensors
    knot = next(k for k in tensors if ".knots." in k and tensors[k].ndim == 5)

    def changed(**edits: torch.Tensor | None) -> dict[str, torch.Tensor]:
        state = dict(tensors)
        for key, value in edits.items():
            key = key.replace("__", ".")
            if value is None:
                state.pop(key)
            else:
                state[key] = value
        return state

    put("tensors", "knot_wrong_shape", state={**tensors, knot: tensors[knot][..., :2].contiguous()})
    put("tensors", "knot_count_differs", state={**tensors, knot: tensors[knot][:2].contiguous()})
    put("tensors", "head_wrong_shape", state={**tensors, head: torch.zeros(3, tensors[head].shape[1])})
    put("tensors", "all_fp16", state={k: v.half() for k, v in tensors.items()})
    put("tensors", "one_fp64", state={**tensors, head: tensors[head].double()})
    put("tensors", "one_int32", state={**tensors, head: tensors[head].to(torch.int32)})
    put("tensors", "one_bfloat16", state={**tensors, knot: tensors[knot].bfloat16()})
    put("tensors", "all_nan", state={k: torch.full_like(v, float("nan")) for k, v in tensors.items()})
    put("tensors", "one_inf", state={**tensors, knot: tensors[knot].clone().fill_(float("inf"))})
    put("tensors", "missing_head", state={k: v for k, v in tensors.items() if k != head})
    put("tensors", "extra_tensor", state={**tensors, "evil.weight": torch.zeros(3)})
    put("tensors", "no_tensors", state={})
    put("tensors", "scalar_for_knots", state={**tensors, knot: torch.tensor(1.0)})
    put("tensors", "one_bool", state={**tensors, head: tensors[head] > 0})
    return cases


class _Hang(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise _Hang


def run_cases(cases: dict[str, str], limit_s: float, emit: Callable[[dict], None]) -> None:
    """Load each case (name -> path) with ``odeify.load``; ``emit`` one outcome record per case."""
    import odeify
    import odeify.serialization.io  # imported before the clock starts
    from odeify.core.errors import OdeifyError

    signal.signal(signal.SIGALRM, _alarm)
    for name, path in cases.items():
        started = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, limit_s)
        try:
            odeify.load(path)
            outcome, detail = "accepted", ""
        except _Hang:
            outcome, detail = "hang", f"over {limit_s} s"
        except OdeifyError as exc:
            outcome, detail = "clean", str(exc)[:1000]
        except BaseException as exc:  # noqa: BLE001 - the point is to see which other errors escape
            outcome, detail = "raw", f"{type(exc).__name__}: {str(exc)[:1000]}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        emit(
            {
                "case": name,
                "outcome": outcome,
                "seconds": round(time.perf_counter() - started, 3),
                "detail": detail,
            }
        )


if __name__ == "__main__":
    torch.set_num_threads(1)
    todo = json.loads(Path(sys.argv[1]).read_text())
    run_cases(todo, float(sys.argv[2]), lambda record: print(json.dumps(record), flush=True))
