"""The examples run as a user would run them (the demo itself is ``make demo``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

import odeify
from odeify.digits import DEFAULT_MODEL_PATH

ROOT = Path(__file__).resolve().parents[1]


def test_torchrun_fine_tunes_memory_free_on_two_processes(tmp_path: Path) -> None:
    out = tmp_path / "digits_ode.safetensors"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(ROOT / "examples" / "finetune_ddp.py"), "--epochs", "1", "--max-steps", "3", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es) on cpu" in done.stdout and "epoch 1: test accuracy" in done.stdout

    trained = odeify.load(out)
    stages = odeify.converted_stages(trained)
    assert stages and all(s.integrator.name == "reversible_heun" and s.num_knots == 2 for s in stages)
    initial = odeify.retarget(
        odeify.convert(str(DEFAULT_MODEL_PATH)),
        knots=2,
        basis="linear",
        integrator="reversible_heun",
    )
    before = dict(initial.named_parameters())
    changed = [
        name
        for name, p in trained.named_parameters()
        if ".knots." in name and not torch.equal(p, before[name])
    ]
    assert changed, "the knots did not train"

    # resume from the saved model, in one process (no torchrun)
    again = tmp_path / "again.safetensors"
    resume = [sys.executable, str(ROOT / "examples" / "finetune_ddp.py"), "--converted", str(out)]
    done = subprocess.run(
        [*resume, "--epochs", "1", "--max-steps", "1", "--out", str(again)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 process(es) on cpu" in done.stdout and odeify.converted_stages(odeify.load(again))
