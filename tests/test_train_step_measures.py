"""benchmarks/train_step.py's measures for compiled rows: the step peak counts what a compiled graph
allocates, the compiled rows map back to the eager rows they compile, and a run it cannot make is
refused before any model is built."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch._C._dynamo.guards import _empty_strided_cpu

from odeify.inspection.tensor_peak import TensorPeak

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import train_step  # noqa: E402  (benchmarks/ is not a package)

MIB = 2**20


def test_the_step_peak_counts_a_steps_tensors_not_those_alive_before() -> None:
    kept = torch.ones(MIB)  # 4 MiB alive before the step: not the step's

    def step() -> None:
        a = torch.ones(MIB)
        b = a + kept  # 8 MiB alive at once, then freed
        del a, b

    assert train_step.allocator_peak(step) == 8 * MIB


def test_the_step_peak_sees_a_compiled_graphs_buffers_where_tensor_peak_does_not() -> None:
    """inductor's generated code allocates its buffers with ``_empty_strided_cpu``, outside the
    dispatcher: a TorchDispatchMode (TensorPeak) never sees them, the allocator's events do."""

    def step() -> None:
        buffer = _empty_strided_cpu((MIB,), (1,), torch.float32)
        del buffer

    with TensorPeak() as peak:
        step()
    assert peak.peak == 0
    assert train_step.allocator_peak(step) == 4 * MIB


def test_every_compiled_row_compiles_an_eager_row_the_other_benchmarks_build() -> None:
    compiled = {name: row for name, row in train_step.ALL_ROWS.items() if row.compiled}
    assert len(compiled) == 2 * len(train_step.ROWS)
    assert not any(row.compiled for row in train_step.ROWS.values())  # step_ratios.py etc. build these
    for name, row in compiled.items():
        eager = train_step.ROWS[train_step.eager_twin(name)]
        assert (row.integrator, row.backward, row.basis) == (eager.integrator, eager.backward, eager.basis)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--batch", "0"], "must be at least 1"),
        (["--threads", "-1"], "--threads >= 0"),
        (["--rows", "odeify checkpoint + torch.compile"], "the ratios need the 'timm' row"),
    ],
)
def test_a_run_it_cannot_make_is_refused(argv: list[str], says: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        train_step.main(argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err
