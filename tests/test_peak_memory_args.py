"""benchmarks/peak_memory.py refuses, before any model is built, a run it cannot size: a user's
checkpoint without one architecture and a batch, or a model with no batch known."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import peak_memory  # noqa: E402  (benchmarks/ is not a package)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--checkpoint", "model.pth.tar", "--models", "resnet18"], "--checkpoint measures one model"),
        (["--checkpoint", "m.pth.tar", "--models", "resnet18", "resnet50", "--batch", "8"], "one model"),
        (["--models", "resnet18"], "no batch known for resnet18"),
    ],
)
def test_a_run_it_cannot_size_is_refused(argv, says, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        peak_memory.main(argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err
