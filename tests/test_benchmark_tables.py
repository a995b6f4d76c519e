"""benchmarks/tables.py: the one layout of a results file around its table, and the terminal table.

The oracle is the layout the benchmarks wrote inline before they shared it (prose, a blank line,
the markdown table, a blank line, the lines after it and a blank line, then the provenance), built
here from the library's own `markdown_table` and `provenance`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from machine import provenance, save_figure  # noqa: E402
from tables import bullets, markdown_table, print_table, results_document  # noqa: E402

HEADERS = ("model", "rows", "time (s)")
ROWS = [("resnet18", "4", "0.120"), ("resnet50", "16", "1.500")]


@pytest.mark.parametrize("after", [[], ["Target < 1 s: met."]])
def test_results_document_is_the_inline_layout(after: list[str]) -> None:
    prose = ["# Title", "", "What the table measures."]
    inline = [
        *prose,
        "",
        *markdown_table(HEADERS, ROWS, text_columns=1),
        "",
        *([*after, ""] if after else []),
        *provenance("python benchmarks/x.py"),
    ]
    text = results_document(prose, HEADERS, iter(ROWS), "python benchmarks/x.py", text_columns=1, after=after)
    assert text == "\n".join(inline)
    assert "| resnet18 | 4 | 0.120 |" in text and text.count("Command: `python benchmarks/x.py`") == 1


def test_print_table_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    print_table("title", "caption", HEADERS, iter(ROWS), text_columns=1, width=120)
    out = capsys.readouterr().out
    assert all(cell in out for row in ROWS for cell in row) and "caption" in out


def test_bullets_and_a_named_machine_close_a_results_file() -> None:
    """The layout adjoint_memory.py and train_step.py wrote inline: a titled list, then provenance."""
    assert bullets("Targets:", iter(["a: met", "b: not met"])) == [
        "Targets:",
        "",
        "- a: met",
        "- b: not met",
        "",
    ]
    assert provenance("python benchmarks/x.py", "GPU box") == [
        "Command: `python benchmarks/x.py`",
        "",
        "Machine: GPU box.",
        "",
    ]
    assert provenance("c")[2].startswith("Machine: ") and provenance("c")[2] != "Machine: None."


def test_save_figure_writes_a_png_into_a_new_folder(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = tmp_path / "results" / "p.png"
    save_figure(fig, path)
    plt.close(fig)
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert [p.name for p in path.parent.iterdir()] == ["p.png"]  # no temporary file left
