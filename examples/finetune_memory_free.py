"""Job 2: fine-tune a coarse manifestation of a converted model with a memory-free backward pass.

    python examples/finetune_memory_free.py --epochs 3
    torchrun --nproc_per_node 2 examples/finetune_memory_free.py      # the same, data-parallel

The shipped digits ResNet is converted, then run as reversible Heun with 2 steps and 2 linear
knots per stage and ``backward='reversible'`` (exact gradients, no step states kept), which loses
accuracy; ``odeify.train.finetune.finetune`` (the loop behind ``odeify finetune``) gets it back with
the default recipe, distilling from the converted model at native depth.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace

import odeify
from odeify.models import DEFAULT_MODEL_PATH
from odeify.train.datasets import open_data
from odeify.train.finetune import DEFAULT_RECIPE, finetune, start_processes, stop_processes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--epochs", type=int, default=DEFAULT_RECIPE.epochs, help="epochs (default: recipe's)"
    )
    parser.add_argument("--max-batches", type=int, help="stop each epoch after this many batches")
    parser.add_argument("--out", default="out/finetune_memory_free", help="checkpoint folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the run's epoch lines

    processes = start_processes()  # torchrun's environment, or one process
    try:
        native = odeify.convert(str(DEFAULT_MODEL_PATH))
        coarse = odeify.retarget(
            native, integrator="reversible_heun", steps=2, knots=2, basis="linear", backward="reversible"
        )
        result = finetune(
            coarse,
            open_data("digits", coarse),
            replace(DEFAULT_RECIPE, epochs=args.epochs),
            out=args.out,
            max_batches=args.max_batches,
            processes=processes,
            teacher=native,
        )
        if processes.is_main:
            first, last = result.history[0], result.history[-1]
            print(f"test accuracy {first.val_accuracy:.2%} -> {last.val_accuracy:.2%}; saved {args.out}/")
    finally:
        stop_processes()


if __name__ == "__main__":
    main()
