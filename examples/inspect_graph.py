"""Job 3: look inside a converted model: its stages, its Python code, its graph, its weight path.

    python examples/inspect_graph.py --out out/inspect

Writes the converted model's code (with each stage's integrator in every backward mode), a
Graphviz file of the converted graph (``dot -Tsvg graph.dot -o graph.svg``) and the weight path
over depth as a PNG. The same from the command line: ``odeify inspect FILE --code --dot graph.dot``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

import odeify
from odeify.inspection.dot import converted_to_dot
from odeify.inspection.plots import plot_weight_path
from odeify.inspection.report import describe, format_report_table
from odeify.models import DEFAULT_MODEL_PATH


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--integrator", default="rk4", help="integrator to inspect (default rk4)")
    parser.add_argument("--steps", default="2", help="steps per stage (default 2)")
    parser.add_argument("--out", type=Path, default=Path("out/inspect"), help="output folder")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    steps = int(args.steps) if args.steps.isdigit() else args.steps
    model = odeify.convert(str(DEFAULT_MODEL_PATH), integrator=args.integrator, steps=steps)
    Console().print(format_report_table(describe(model)))
    (args.out / "model.py").write_text(odeify.model_code(model))
    (args.out / "graph.dot").write_text(converted_to_dot(model, DEFAULT_MODEL_PATH.name))
    plot_weight_path(model, args.out / "weight_path.png")
    print(f"wrote {args.out / 'model.py'}, {args.out / 'graph.dot'}, {args.out / 'weight_path.png'}")


if __name__ == "__main__":
    main()
