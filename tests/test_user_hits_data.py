"""Cases that still ended badly (issue 49, cases 1 to 7): data folders, a bfloat16 model, a saved
file's input size, and a head that load could not rebuild.

Oracles: the same command on the layout that already worked (accuracy and sample count of the
validation split read through train/ + val/), the same run with ``-j 0``, the source model's own
round-off measured against its float64 copy, the byte count of the activations the probe would make,
and what ``odeify.load`` does with the file that ``odeify.save`` wrote.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hostile_files import RECIPE_KEY
from safetensors import safe_open
from test_datasets import image_folder

import odeify
from odeify.cli.parser import main
from odeify.compiler.verification import VERIFY_SEED
from odeify.core.errors import ModelLoadError, OdeifyError
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models.loading import load_model
from odeify.train.evaluate import evaluate

pytestmark = pytest.mark.usefixtures("one_thread")


def _eval(capsys: pytest.CaptureFixture[str], data: Path, *flags: str) -> tuple[int, dict, str]:
    code = main(["eval", "--data", str(data), "--json", *flags])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else {}, err


# -- case 1: more classes than the model's head -------------------------------------------------------
def test_case1_eval_on_more_classes_than_the_head_names_the_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = image_folder(tmp_path, train=1, val=1)
    for split in ("train", "val"):
        for label in range(2, 12):  # 12 classes against the digits model's 10
            shutil.copytree(root / split / "digit_0", root / split / f"digit_{label}")
    code, _, err = _eval(capsys, root)
    assert code == 2 and err.count("\n") == 1  # was a raw IndexError: Target 10 is out of bounds
    for words in (f"{root / 'val'} holds 12 class folders", "predicts 10 classes", "labels 10 to 11",
                  "odeify finetune", "resets its classifier to 12 classes"):  # fmt: skip
        assert words in err


# -- case 2: an unreadable image reads the same with loader workers -----------------------------------
def test_case2_finetune_with_workers_names_an_unreadable_image_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = image_folder(tmp_path / "data", train=4, val=2)
    broken = root / "train" / "digit_1" / "2.png"
    broken.write_bytes(broken.read_bytes()[:60])
    errors = {}
    for workers in ("0", "2"):
        run = ["finetune", "--data", str(root), "--out", str(tmp_path / f"run{workers}"), "--epochs", "1"]
        assert main([*run, "-b", "2", "-j", workers]) == 2
        errors[workers] = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors["0"]) == 1 and f"cannot read the image {broken}" in errors["0"][0]
    assert errors["2"] == errors["0"]  # was the worker's whole traceback inside the message


# -- case 3: a bfloat16 model converts; its check's tolerance follows bfloat16's round-off -----------
def test_case3_a_bfloat16_model_converts_and_a_wrong_weight_is_still_caught(
    digits,  # noqa: ANN001
) -> None:
    source = load_model(DEFAULT_MODEL_PATH).bfloat16()
    converted = odeify.convert(source)  # raised VerificationError: 0.0142 over a tolerance of 1e-2
    check = converted.meta["odeify"]["verification"]
    x = torch.randn(check.input_shape, generator=torch.Generator().manual_seed(VERIFY_SEED))
    with torch.no_grad():
        exact = load_model(DEFAULT_MODEL_PATH).double()(x.double())
        roundoff = float((source(x.bfloat16()).double() - exact).abs().max() / exact.abs().max())
    assert check.passed
    assert check.tolerance == pytest.approx(4 * max(roundoff, torch.finfo(torch.bfloat16).eps))
    batches = [(digits.val.tensors[0], digits.val.tensors[1])]
    scores = [evaluate(model, batches).accuracy for model in (source, converted)]
    assert abs(scores[0] - scores[1]) <= 2 / len(digits.val)  # the converted model scores the source's

    wrong = copy.deepcopy(converted)  # one knot bias shifted: a conversion that is wrong
    with torch.no_grad():
        wrong.get_parameter("layer1_ode.knots.conv2_bias")[1] += 0.5
    wrong = odeify.verify(wrong, source)  # the check convert runs, on the same input
    assert wrong.tolerance == check.tolerance and wrong.relative_error > 5 * wrong.tolerance


# -- case 4: what a file's input size asks the load probe to hold is bounded before it is allocated -----
def test_case4_the_probe_of_a_huge_recorded_input_is_refused_before_it_runs(
    native: torch.nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from odeify.serialization import probe

    valid = tmp_path / "valid.safetensors"
    odeify.save(native, valid)
    with safe_open(str(valid), framework="pt") as handle:
        recipe = json.loads(handle.metadata()[RECIPE_KEY])
    tensors = safetensors.torch.load_file(str(valid))

    def ran(*args: object) -> None:
        raise AssertionError("the probe ran")

    monkeypatch.setattr(probe, "_points", ran)  # before: 22-25 s and 3-4 GB in here, then a refusal
    for batch in (1, 8):  # the probe runs batch 1 whatever the file says; 8 ended in an allocator error
        path = tmp_path / f"input_{batch}.safetensors"
        metadata = {RECIPE_KEY: json.dumps({**recipe, "input_shape": [batch, 1, 4096, 4096]})}
        path.write_bytes(safetensors.torch.save(tensors, metadata=metadata))
        refused = r"the probe, on one 1x4096x4096 input .* would hold [\d.]+ GiB at once, over the limit"
        with pytest.raises(ModelLoadError, match=refused):
            odeify.load(path)
    monkeypatch.setenv("ODEIFY_MAX_INPUT_BYTES", str(2**34))  # the bound alone stopped it
    with pytest.raises(AssertionError, match="the probe ran"):
        odeify.load(path)
    monkeypatch.delenv("ODEIFY_MAX_INPUT_BYTES")
    large = odeify.convert(str(DEFAULT_MODEL_PATH), input_size=(1, 1, 4096, 4096), verify=False)
    with pytest.raises(OdeifyError, match="odeify.save refuses to write .* would hold") as refused:
        odeify.save(large, tmp_path / "large.safetensors")  # save refuses what load would
    assert ".;" not in str(refused.value)  # the check's sentence and save's clause read as one
    assert not (tmp_path / "large.safetensors").exists()


# -- case 5: eval reads val/ (or test/, or a flat folder) without a train/ ----------------------------
def test_case5_eval_needs_no_train_folder_and_says_which_it_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = image_folder(tmp_path / "full", train=2, val=3)
    code, expected, _ = _eval(capsys, full)
    assert code == 0 and expected["read"] == str(full / "val")
    layouts = {}  # --data DIR: the folder it should read
    for name, split in (("val_only", "val"), ("test_only", "test"), ("flat", "")):
        shutil.copytree(full / "val", tmp_path / name / split)
        layouts[tmp_path / name] = tmp_path / name / split
    linked = tmp_path / "train_linked"
    shutil.copytree(full / "val", linked / "val")
    os.symlink("val", linked / "train")  # refused before: train/ and val/ read the same images
    layouts[linked] = linked / "val"
    for data, read in layouts.items():
        code, result, err = _eval(capsys, data)
        assert code == 0, err  # before: "has no train/ subfolder"
        assert result["read"] == str(read)
        assert (result["samples"], result["accuracy"]) == (expected["samples"], expected["accuracy"])
    assert main(["eval", "--data", str(tmp_path / "flat")]) == 0
    assert f"on {tmp_path / 'flat'} (6 samples)" in capsys.readouterr().out
    shutil.rmtree(full / "val")  # train/ alone: evaluation does not read the training images
    code, _, err = _eval(capsys, full)
    assert code == 2 and "has train/ but no val/" in err


# -- case 6: what save writes, load reads: a classifier replaced after conversion is refused by save ---
def test_case6_save_refuses_a_classifier_that_load_could_not_rebuild(
    native: torch.nn.Module,
    tmp_path: Path,
    image,  # noqa: ANN001
) -> None:
    for replaced, words in ((torch.nn.Linear(32, 10, bias=False), "fc (Linear: weight 10x32)"),
                            (torch.nn.Linear(32, 12), "fc (Linear: weight 12x32, bias 12)")):  # fmt: skip
        model = copy.deepcopy(native)
        model.fc = replaced
        path = tmp_path / "replaced.safetensors"
        with pytest.raises(OdeifyError, match="odeify.save refuses to write") as refused:
            odeify.save(model, path)  # was written, then load said "missing fc.bias"
        assert not path.exists()
        for said in (words, "is not the one its recipe rebuilds", "Linear: weight 10x32, bias 10",
                     "reset_classifier"):  # fmt: skip
            assert said in str(refused.value)
    model = copy.deepcopy(native)
    model.reset_classifier(12)  # the way to change the head: recorded, so saved and rebuilt
    odeify.save(model, tmp_path / "reset.safetensors")
    x = image((2, 1, 32, 32))
    torch.testing.assert_close(
        odeify.load(tmp_path / "reset.safetensors")(x), model.eval()(x), rtol=0, atol=0
    )
    source = load_model(DEFAULT_MODEL_PATH)
    source.fc = torch.nn.Linear(32, 10, bias=False)  # replaced before conversion: load takes the module
    with pytest.warns(UserWarning, match="cannot rebuild this model's source by name"):
        odeify.save(odeify.convert(source), tmp_path / "custom.safetensors")
    odeify.load(tmp_path / "custom.safetensors", model=source)


# -- case 7: which split of val/ and validation/ is read; a folder inside a class folder -----------
def test_case7_two_validation_folders_say_which_is_read(
    native: torch.nn.Module, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from odeify.train.datasets import open_data

    root = image_folder(tmp_path, train=2, val=2)
    shutil.copytree(root / "val", root / "validation")
    (root / "validation" / "digit_0" / "0.png").unlink()  # the two differ: which one counts matters
    said = r"has val/ and validation/: val/ is read as the validation split, validation/ is not"
    with pytest.warns(UserWarning, match=said):
        assert len(open_data(root, native).val) == 4
    code, result, err = _eval(capsys, root)
    assert code == 0 and result["read"] == str(root / "val") and result["samples"] == 4
    assert "val/ is read as the evaluation split, validation/ is not" in err


def test_case7_a_folder_inside_a_class_folder_says_what_it_would_become(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = image_folder(tmp_path, train=2, val=2)
    for split in ("train", "val"):  # the same in both splits: before, it became a class silently
        (root / split / "digit_0" / "extra").mkdir()
        shutil.copy(root / split / "digit_1" / "0.png", root / split / "digit_0" / "extra" / "9.png")
    code, _, err = _eval(capsys, root)
    assert code == 2 and err.count("\n") == 1
    nested = root / "val" / "digit_0" / "extra"
    for words in (f"{nested} is a folder of images inside the class folder {nested.parent}",
                  "would become a class 'extra' of their own, not images of 'digit_0'"):  # fmt: skip
        assert words in err
