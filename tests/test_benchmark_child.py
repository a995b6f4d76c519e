"""benchmarks/child.py's stepped children: the protocol train_step.py interleaves its rows with."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from child import SteppedChild  # noqa: E402

CHILD = textwrap.dedent(
    f"""
    import sys
    sys.path.insert(0, {str(BENCHMARKS)!r})
    from child import report_to_parent, requests

    fail_at = int(sys.argv[2])
    print("a line that is not a report")  # skipped by the parent
    report_to_parent({{"ready": True}})
    steps = 0
    for request in requests():
        steps += 1
        if steps == fail_at:
            sys.exit(f"failed on step {{steps}}")
        report_to_parent({{"step": steps, "request": request}})
    report_to_parent({{"steps": steps}})
    """
)


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "stepped.py"
    path.write_text(CHILD)
    return str(path)


def test_a_stepped_child_answers_each_step_then_reports(script: str) -> None:
    child = SteppedChild(script, ["0"], "the test child")  # argv: --child 0
    assert [child.step() for _ in range(3)] == [{"step": k, "request": "step"} for k in (1, 2, 3)]
    assert child.finish() == {"steps": 3}


def test_a_child_that_dies_raises_with_its_stderr(script: str) -> None:
    child = SteppedChild(script, ["2"], "the test child")
    assert child.step() == {"step": 1, "request": "step"}
    with pytest.raises(RuntimeError, match="the test child failed:\nfailed on step 2"):
        child.step()
    child.kill()  # nothing left to end: harmless
