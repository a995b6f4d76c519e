"""Job 1: convert a trained checkpoint into an ODE model, check it against the original, save it.

    python examples/convert_checkpoint.py                          # the shipped digits ResNet
    python examples/convert_checkpoint.py model_best.pth.tar --arch resnet50 --num-classes 10

The same from the command line: ``odeify convert CHECKPOINT -o OUT.safetensors``.
"""

from __future__ import annotations

import argparse
import copy

import timm.data
import torch

import odeify
from odeify.models import DEFAULT_MODEL_PATH


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "checkpoint", nargs="?", default=str(DEFAULT_MODEL_PATH), help="checkpoint or timm name"
    )
    parser.add_argument("--arch", help="timm architecture, when the checkpoint does not record it")
    parser.add_argument("--num-classes", type=int, help="classifier size of the checkpoint's model")
    parser.add_argument("-o", "--output", default="out/converted.safetensors", help="where to save")
    args = parser.parse_args(argv)
    build = {k: v for k, v in {"arch": args.arch, "num_classes": args.num_classes}.items() if v is not None}

    original = odeify.load_model(args.checkpoint, **build)
    converted = odeify.convert(args.checkpoint, **build)  # Euler at native depth: the same function
    x = torch.randn(2, *timm.data.resolve_model_data_config(original)["input_size"])
    with torch.no_grad():
        expected, got = original(x), converted(x)
        # the same function: converted in float64, the two agree to float64 round-off
        original64 = copy.deepcopy(original).double()
        exact = original64(x.double())
        exact_error = relative_error(odeify.convert(original64)(x.double()), exact)
    print(
        f"converted {len(odeify.converted_stages(converted))} stages; in float64 max relative error "
        f"{exact_error:.2e}; in {got.dtype} {relative_error(got, expected):.2e} (eager itself: "
        f"{relative_error(expected.double(), exact):.2e} from float64)"
    )

    odeify.save(converted, args.output)  # self-contained: odeify.load needs only this file
    with torch.no_grad():
        reloaded = odeify.load(args.output)(x)
    print(f"saved {args.output}; reloaded output identical: {torch.equal(reloaded, got)}")


if __name__ == "__main__":
    main()
