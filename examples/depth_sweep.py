"""How accuracy trades against depth: one converted model, many integrators and step counts.

    python examples/depth_sweep.py --plot sweep.png

No training: ``odeify.retarget`` re-emits the same continuous model for each (integrator, steps),
and each is evaluated on the digits test split. The same from the command line:
``odeify sweep --data digits --integrators euler,heun,rk4 --steps 1,2,4,native,x2``.
"""

from __future__ import annotations

import argparse

from torch.utils.data import DataLoader

import odeify
from odeify.inspection.plots import plot_sweep
from odeify.models import DEFAULT_MODEL_PATH
from odeify.train.datasets import open_data
from odeify.train.sweep import sweep, sweep_markdown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--integrators", default="euler,heun,rk4", help="comma-separated integrators")
    parser.add_argument("--steps", default="1,2,4,native,x2", help="comma-separated steps per stage")
    parser.add_argument("--plot", default="out/depth_sweep.png", help="where to draw accuracy vs NFE")
    args = parser.parse_args(argv)

    model = odeify.convert(str(DEFAULT_MODEL_PATH))
    test = DataLoader(open_data("digits", model).val, batch_size=256)
    steps = [int(s) if s.isdigit() else s for s in args.steps.split(",")]
    points = sweep(model, lambda: test, args.integrators.split(","), steps)
    print("\n".join(sweep_markdown(points)))
    plot_sweep(points, args.plot)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
