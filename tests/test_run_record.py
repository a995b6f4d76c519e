"""The record a fine-tuning run leaves (issue 21, s4): the end summary, summary.csv, line-oriented
progress, resuming a finished run with more epochs, naming the setting a resume differs in, and what
Ctrl-C says.

The oracle of summary.csv is history.json, written from the same records by another writer, and the
run's own evaluation of best.safetensors.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from odeify.cli import finetune_command
from odeify.cli.parser import main
from odeify.train.progress import BatchProgress, plural
from odeify.train.recipe import DEFAULT_LR

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def converted_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("record") / "digits_ode.safetensors"
    assert main(["convert", "-o", str(path)]) == 0
    return path


def _tune(model: Path, run: Path, *extra: str) -> list[str]:
    return ["finetune", str(model), "--data", "digits", "--steps", "1", "--max-batches", "3", "--batch-size",
            "16", "--out", str(run), "--log-interval", "2", *extra]  # fmt: skip


def test_a_run_writes_summary_csv_prints_its_end_and_progress_lines(
    converted_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main(_tune(converted_file, run, "--epochs", "1")) == 0
    out = capsys.readouterr().out
    # stdout is not a terminal under pytest: a line every 2 batches and at the last (3), no \r bar
    assert "\r" not in out
    progress = [line for line in out.splitlines() if line.startswith("epoch 1/1 [")]
    assert [line.split("]")[0] for line in progress] == ["epoch 1/1 [2/3", "epoch 1/1 [3/3"]
    history = json.loads((run / "history.json").read_text())
    rows = list(csv.DictReader((run / "summary.csv").open()))
    assert [int(r["epoch"]) for r in rows] == [h["epoch"] for h in history] == [0, 1]
    for row, record in zip(rows, history, strict=True):
        assert float(row["eval_top1"]) == pytest.approx(100 * record["val_accuracy"])
        assert float(row["eval_loss"]) == pytest.approx(record["val_loss"])
    assert rows[0]["train_loss"] == "" and float(rows[1]["train_loss"]) == pytest.approx(
        history[1]["train_loss"]
    )
    assert float(rows[1]["lr"]) == pytest.approx(history[1]["lr"]) and float(rows[1]["seconds"]) > 0
    # the epoch's peak memory (the process's peak RSS on the CPU): in the CSV, the history and the log
    assert rows[0]["peak_memory_mib"] == "" and float(rows[1]["peak_memory_mib"]) == pytest.approx(
        history[1]["peak_memory_mib"], rel=1e-7
    )
    assert history[1]["peak_memory_mib"] > 0
    assert f"peak memory {history[1]['peak_memory_mib']:.0f} MiB" in out
    # the end: the best epoch and what best.safetensors holds, checked against the file itself
    done = next(line for line in out.splitlines() if line.startswith("done: 1 epoch trained"))
    best = max(history, key=lambda r: (r["val_accuracy"], -r["epoch"]))
    assert main(["eval", str(run / "best.safetensors"), "--data", "digits", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == pytest.approx(best["val_accuracy"])
    if best["epoch"] == 0:
        assert "no epoch improved" in done and "holds that model, unchanged" in done
    else:
        assert f"best: epoch {best['epoch']}, val accuracy {best['val_accuracy']:.2%}" in done
    assert "summary.csv" in out and "--resume" in out
    assert "1 process on" in out and "1 steps" not in out and "1 constant knots" not in out


def test_resume_of_a_finished_run_with_more_epochs_continues_it(
    converted_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main(_tune(converted_file, run, "--epochs", "1")) == 0
    capsys.readouterr()
    assert main(["finetune", "--resume", "--out", str(run)]) == 0  # finished: says so, trains nothing
    out = capsys.readouterr().out
    assert "has finished its 1 epoch: nothing to train" in out and "--epochs 2" in out
    assert len(json.loads((run / "history.json").read_text())) == 2
    assert main(["finetune", "--resume", "--out", str(run), "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "extending the run from 1 to 2 epochs" in out and "done: 2 epochs trained" in out
    history = json.loads((run / "history.json").read_text())
    assert [h["epoch"] for h in history] == [0, 1, 2] and history[2]["train_loss"] is not None
    assert len(list(csv.DictReader((run / "summary.csv").open()))) == 3
    # the extended run is what resumes now: its recorded epochs are 2
    assert main(["finetune", "--resume", "--out", str(run)]) == 0
    assert "has finished its 2 epochs" in capsys.readouterr().out
    # fewer epochs than recorded is another run, and the message names the one setting
    assert main(["finetune", "--resume", "--out", str(run), "--epochs", "1", "--lr", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "recipe.epochs: recorded 2, now 1" in err
    assert f"recipe.lr: recorded {DEFAULT_LR}, now 0.5" in err  # --steps 1: Euler's default peak
    assert "'batch_size'" not in err  # the settings that agree are not printed


def test_an_extension_killed_in_its_first_epoch_resumes_extended_at_its_log_interval(
    converted_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from odeify.train.trainer import Trainer

    class Killed(Exception):
        pass

    def killed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise Killed

    run = tmp_path / "run"
    assert main(_tune(converted_file, run, "--epochs", "1")) == 0  # --log-interval 2
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "train_epoch", killed)
        with pytest.raises(Killed):
            main(["finetune", "--resume", "--out", str(run), "--epochs", "2"])
    capsys.readouterr()
    assert main(["finetune", "--resume", "--out", str(run)]) == 0
    out = capsys.readouterr().out
    assert "has finished" not in out and "done: 2 epochs trained" in out
    progress = [line.split("]")[0] for line in out.splitlines() if line.startswith("epoch 2/2 [")]
    assert progress == ["epoch 2/2 [2/3", "epoch 2/2 [3/3"]  # every 2 batches, as recorded; not 50


def test_the_loss_shown_says_what_it_is_and_a_smoothing_without_effect_is_named(
    converted_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_tune(converted_file, tmp_path / "run", "--epochs", "1", "--smoothing", "0.1")) == 0
    out = capsys.readouterr().out
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert "epoch 1/1 [3/3]: loss (distillation) " in out  # the default recipe: distill 1
    assert f"train loss (distillation) {history[1]['train_loss']:.4f}" in out
    assert "--smoothing 0.1 smooths the cross-entropy term, which has weight 0 here" in out
    assert main(_tune(converted_file, tmp_path / "mixed", "--epochs", "1", "--distill", "0.5")) == 0
    out = capsys.readouterr().out
    assert "train loss (0.5 cross-entropy + 0.5 distillation) " in out and "--smoothing" not in out


def test_ctrl_c_in_finetune_says_how_to_resume(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(args):  # noqa: ANN001, ANN202
        raise KeyboardInterrupt

    from odeify.train.state import STATE_FILE

    monkeypatch.setattr(finetune_command, "run_finetune", interrupted)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / STATE_FILE).write_bytes(b"")  # an epoch was saved: there is a run to resume
    assert main(["finetune", "--data", "digits", "--out", str(tmp_path / "r")]) == 130
    err = capsys.readouterr().err
    assert f"odeify finetune --resume --out {tmp_path / 'r'}" in err


@pytest.mark.parametrize(
    "tty, env, bar", [(True, "", True), (True, "1", False), (False, "", False), (True, "0", True)]
)
def test_progress_is_a_bar_only_on_a_terminal_and_honours_tqdm_disable(
    monkeypatch: pytest.MonkeyPatch, tty: bool, env: str, bar: bool
) -> None:
    monkeypatch.setenv("TQDM_DISABLE", env)
    monkeypatch.setattr("sys.stderr.isatty", lambda: tty)
    progress = BatchProgress(4, 1, 1, show=True, interval=2)
    assert (progress.bar is not None) == bar and progress.lines == (not bar)
    progress.close()
    assert BatchProgress(4, 1, 1, show=False, interval=2).lines is False


def test_plural() -> None:
    assert [plural(1, "knot"), plural(2, "epoch"), plural(1, "process"), plural(3, "process")] == [
        "1 knot", "2 epochs", "1 process", "3 processes",
    ]  # fmt: skip
