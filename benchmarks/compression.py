"""Benchmark: odeify's cheaper models against the usual alternative, dropping blocks.

On the corpus of ``benchmarks/corpus.py`` (docs/corpus.md), for each model and each compression
below, four rows are compared at the same depth:

- ``odeify``: the converted model retargeted (its knots fitted to the blocks' weights);
- ``odeify calibrated``: the same, then ``odeify.calibrate`` on 256 unlabelled training images;
- ``layer drop``: a timm model of the source's entry blocks and, in each run of L identity blocks,
  the blocks the coarse steps read (block ``floor(i L / s)`` for step ``i`` of ``s``), converted at
  native depth: the student a user builds by hand;
- ``layer drop calibrated``: that student calibrated the same way, fitted to the source's stage
  outputs, so that the comparison is fair;
- only when ``--rows`` names them, ``odeify calibrated to the output`` and ``layer drop calibrated
  to the output``: the two calibrated rows with ``objective="output"`` (the network's last stage
  fitted to the source's output too).

The compressions: half and a third of the steps (Euler; the ViT's split stage Lie-Trotter and
Strang), and 2 linear knots per stage at native steps (its student keeps 2 blocks per run: the same
parameters). Each row is evaluated before fine-tuning (budget 0) and after the default recipe at
the epoch budgets given (each budget its own run, the schedule fitted to it), distilling from the
source network, for each seed. Reported: validation accuracy in points and images (359; one image
is 0.28 point), parameters, per-image forward time (batch 64, median of 5), the calibration's wall
time and one fine-tuning epoch's.

Runs are cached, one JSON line each, in ``--cache``; ``--report`` rewrites the results file and the
plot from the cache (``compression.md`` for the default cache, ``compression_NAME.md`` for
``--cache out/compression_bench/NAME.jsonl``: the fine-tuning budgets are in ``budgets.jsonl``).

    python benchmarks/compression.py --epochs 0                   # before fine-tuning, every model
    python benchmarks/compression.py --models digits_seed0 --epochs 0,1,3,6 --seeds 2
    python benchmarks/compression.py --report
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from finetune import CORPUS, RESULTS, SPLIT_MODELS, native_model, source_accuracy
from machine import command_line, describe_machine, write_results
from tables import markdown_table
from torch import nn

MODELS = (
    "resnet18",
    "resnetv2_18",
    "resnet50",
    "resnet101",
    "digits_seed0",
    "digits_seed1",
    "digits_seed2",
    "vit6",
)
COMPRESSIONS: dict[str, dict[str, Any]] = {
    "half steps": {"steps": "x0.5"},
    "third of steps": {"steps": "x0.33"},
    "2 knots": {"knots": 2, "basis": "linear"},
}
SPLIT_COMPRESSIONS: dict[str, dict[str, Any]] = {
    "Lie-Trotter, half steps": {"steps": "x0.5"},
    "Strang, half steps": {"integrator": "strang", "steps": "x0.5"},
    "Lie-Trotter, third of steps": {"steps": "x0.33"},
    "Strang, third of steps": {"integrator": "strang", "steps": "x0.33"},
    "2 knots": {"knots": 2, "basis": "linear"},
}
ROWS = ("odeify", "odeify calibrated", "layer drop", "layer drop calibrated")
OUTPUT_ROWS = ("odeify calibrated to the output", "layer drop calibrated to the output")
"""Rows run only when ``--rows`` names them: calibrated with ``objective="output"`` (the last stage
fitted to the network's output too)."""
VAL_IMAGES = 359
CACHE = Path(__file__).resolve().parents[1] / "out" / "compression_bench" / "runs.jsonl"


def compressions(model: str) -> dict[str, dict[str, Any]]:
    return SPLIT_COMPRESSIONS if model in SPLIT_MODELS else COMPRESSIONS


def kept_blocks(depth: int, steps: int) -> list[int]:
    """The blocks of a run of ``depth`` that ``steps`` Euler steps read: ``floor(i * depth / steps)``."""
    return sorted({i * depth // steps for i in range(steps)})


def layer_dropped(source: nn.Module, coarse: nn.Module) -> nn.Module:
    """A copy of ``source`` that runs, in each run of identity blocks, only as many blocks as the
    stage of ``coarse`` (the compressed model) takes steps, or keeps knots when fewer (a run of
    period p drops whole periods: a transformer block). Each sequence of blocks is rebuilt without
    the dropped ones, the kept ones under their names."""
    import odeify

    depth_of = {
        s.stage_name: min(s.steps, s.num_knots) if s.num_knots < s.depth else s.steps
        for s in odeify.converted_stages(coarse)
    }
    student = copy.deepcopy(source)
    dropped: dict[str, set[str]] = {}
    for run in odeify.analyze(source).runs:
        if run.name not in depth_of:
            continue
        scopes = list(dict.fromkeys(block.scope for block in run.blocks))
        kept = set(kept_blocks(len(scopes), depth_of[run.name]))
        for index, scope in enumerate(scopes):
            if index not in kept:
                parent, _, child = scope.rpartition(".")
                dropped.setdefault(parent, set()).add(child)
    for parent, children in dropped.items():
        sequence = student.get_submodule(parent)
        if not isinstance(sequence, nn.Sequential):
            raise TypeError(f"{parent} is a {type(sequence).__name__}, not a sequence of blocks to drop from")
        rebuilt = nn.Sequential(
            OrderedDict((n, m) for n, m in sequence.named_children() if n not in children)
        )
        grand, _, name = parent.rpartition(".")
        setattr(student.get_submodule(grand) if grand else student, name, rebuilt)
    return student


def _per_stage(native: nn.Module, settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with a steps multiplier that would leave a stage less than one step given as 1
    step for that stage (odeify refuses to round x0.33 of one block up)."""
    import odeify

    steps = settings.get("steps")
    if not isinstance(steps, str) or not steps.startswith("x"):
        return settings
    factor = float(steps[1:])
    per_stage = {s.stage_name: 1 if s.depth * factor < 1 else steps for s in odeify.converted_stages(native)}
    return {**settings, "steps": per_stage}


def _accuracy(model: nn.Module, data) -> float:
    from odeify.train.datasets import make_loader
    from odeify.train.evaluate import evaluate

    return 100 * evaluate(model.eval(), make_loader(data.val, 256, train=False)).accuracy


def _forward_ms(model: nn.Module, data) -> float:
    """Milliseconds per image of a batch of 64 validation images, eval, median of 5."""
    x = torch.stack([data.val[i][0] for i in range(64)])
    model.eval()
    times = []
    with torch.no_grad():
        model(x)
        for _ in range(5):
            started = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times) / 64


def _calibration_data(model_name: str, corpus: Path) -> str:
    return "digits" if model_name.startswith("digits") else str(corpus / "digits_png")


def build_row(row: str, model_name: str, settings: dict[str, Any], seed: int, corpus: Path, loaded) -> dict:
    """The row's model before fine-tuning, its teacher and what building it cost."""
    import odeify
    from odeify.core.errors import ConfigError

    native, data, source = loaded
    coarse = odeify.retarget(native, **_per_stage(native, settings))
    model = coarse
    if row.startswith("layer drop"):
        model = odeify.convert(
            layer_dropped(source, coarse), input_size=native.meta["odeify"]["input_shape"][1:]
        )
        model.pretrained_cfg = native.pretrained_cfg
    seconds = None
    if "calibrated" in row:
        started = time.perf_counter()
        try:
            model, _ = odeify.calibrate(
                model, _calibration_data(model_name, corpus), seed=seed, progress=False,
                source=native if row.startswith("layer drop") else None,
                objective="output" if row in OUTPUT_ROWS else "stage",
            )  # fmt: skip
        except ConfigError as exc:  # a compression that leaves the model as converted: nothing to fit
            print(f"  not calibrated: {exc}", file=sys.stderr)
        seconds = time.perf_counter() - started
    return {"model": model, "teacher": native, "calibration_s": seconds}


def run(key: dict[str, Any], corpus: Path, loaded) -> dict[str, Any]:
    """One cached run: a row of one compression of one model, fine-tuned for ``key['epochs']``."""
    import odeify
    from odeify.train.finetune import DEFAULT_RECIPE, finetune

    settings = compressions(key["model"])[key["compression"]]
    built = build_row(key["row"], key["model"], settings, key["seed"], corpus, loaded)
    model, data = built["model"], loaded[1]
    result = {
        "start": _accuracy(model, data),
        "parameters": sum(p.numel() for p in model.parameters()),
        "forward_ms": _forward_ms(model, data),
        "calibration_s": built["calibration_s"],
        "depth": {s.stage_name: s.steps for s in odeify.converted_stages(model)},
    }
    result["end"] = result["start"]
    if key["epochs"]:
        started = time.perf_counter()
        recipe = replace(DEFAULT_RECIPE, epochs=key["epochs"])
        teacher = built["teacher"]
        trained = finetune(
            model, data, recipe, seed=key["seed"], teacher=teacher, progress=False, calibrate_first=False
        )
        result["end"] = 100 * trained.history[-1].val_accuracy
        result["epoch_s"] = (time.perf_counter() - started) / key["epochs"]
    return result


def _read_cache(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _key_of(entry: dict[str, Any]) -> tuple:
    return tuple(entry[k] for k in ("model", "compression", "row", "epochs", "seed"))


def sweep(args: argparse.Namespace) -> None:
    """Run every planned (model, compression, row, budget, seed) not in the cache yet."""
    import odeify

    done = {_key_of(e) for path in args.cache for e in _read_cache(path)}
    args.cache[0].parent.mkdir(parents=True, exist_ok=True)
    for model_name in args.models or MODELS:
        loaded = None
        for compression in compressions(model_name):
            if args.compressions and compression not in args.compressions:
                continue
            for row in args.rows:
                for epochs in args.epochs:
                    seeds = range(args.seeds) if (epochs or "calibrated" in row) else range(1)
                    for seed in seeds:
                        key = {"model": model_name, "compression": compression, "row": row,
                               "epochs": epochs, "seed": seed}  # fmt: skip
                        if _key_of(key) in done:
                            continue
                        if loaded is None:
                            native, data, path = native_model(model_name, args.corpus, "as trained")
                            loaded = (native, data, odeify.load_model(path).eval())
                        started = time.perf_counter()
                        result = run(key, args.corpus, loaded)
                        entry = {**key, **result, "seconds": time.perf_counter() - started}
                        with args.cache[0].open("a") as handle:
                            handle.write(json.dumps(entry) + "\n")
                        print(
                            f"{model_name} | {compression} | {row} | {epochs} ep | seed {seed}: "
                            f"{result['start']:.2f} -> {result['end']:.2f} ({entry['seconds']:.0f} s)",
                            flush=True,
                        )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def report(args: argparse.Namespace, argv: list[str] | None) -> None:
    """The results file and plot from the cache."""
    unique: dict[tuple, dict[str, Any]] = {}  # a sweep's report is the whole cache; --report --models, some
    for path in args.cache:  # a run found in two caches counts once: the first cache's
        for entry in _read_cache(path):
            if not (args.report and args.models) or entry["model"] in args.models:
                unique.setdefault(_key_of(entry), entry)
    entries = list(unique.values())
    sources = {
        name: 100 * source_accuracy(name, args.corpus) for name in dict.fromkeys(e["model"] for e in entries)
    }
    lines = [
        "# Compression: odeify's coarse manifestations against dropping blocks",
        "",
        f"Command: `{command_line(__file__, argv)}`  ",
        f"Machine: {describe_machine()}",
        "",
        "Accuracy on the 359 validation images (one image is 0.28 point), by seed in order (seed 0 / "
        "seed 1 / ..., and their mean where more than two; a row as built without calibration is one "
        "run); `0` is before fine-tuning, `1`, `3`, `6` after that many "
        "epochs of the default recipe. `ms` is the forward time per image (batch 64), `cal. s` the "
        "calibration's wall time, `epoch s` one fine-tuning epoch's (from the shortest run). "
        '`calibrated`: `odeify.calibrate(objective="stage")`, each stage fitted to the source\'s '
        'activation there; `calibrated to the output`: the default, `objective="output"`, the last '
        "stage fitted to the network's output too.",
        "",
    ]
    budgets = sorted({e["epochs"] for e in entries})
    for name, source in sources.items():
        lines += [f"## {name} (source {source:.2f}%)", ""]
        rows = []
        for compression in compressions(name):
            for row in (*ROWS, *OUTPUT_ROWS):
                found = [
                    e
                    for e in entries
                    if e["model"] == name and e["compression"] == compression and e["row"] == row
                ]
                if not found:
                    continue
                cells = []
                for budget in budgets:
                    at = [e["end"] if budget else e["start"] for e in sorted(found, key=lambda e: e["seed"])
                          if e["epochs"] == budget]  # fmt: skip
                    mean = f" (mean {_mean(at):.2f})" if len(at) > 2 else ""
                    cells.append(" / ".join(f"{a:.2f}" for a in at) + mean)
                first = found[0]
                calibration = [e["calibration_s"] for e in found if e.get("calibration_s") is not None]
                epoch = [e["epoch_s"] for e in found if e.get("epoch_s")]
                rows.append([
                    compression, row, "+".join(map(str, first["depth"].values())), f"{first['parameters']:,}",
                    f"{first['forward_ms']:.3f}", f"{_mean(calibration):.1f}" if calibration else "",
                    f"{min(epoch):.1f}" if epoch else "", *cells,
                ])  # fmt: skip
        header = ["compression", "row", "steps", "parameters", "ms", "cal. s", "epoch s", *map(str, budgets)]
        lines += [*markdown_table(header, rows), ""]
    write_results(args.output, "\n".join(lines))
    plot(entries, sources, args.output.with_suffix(".png"))


def plot(entries: list[dict[str, Any]], sources: dict[str, float], path: Path) -> None:
    """Before fine-tuning, at half the depth: each model's rows as bars (mean over seeds), the output
    objective's beside the others where the cache has them."""
    from matplotlib.figure import Figure

    from odeify.core.fileio import atomic_path

    half = {name: "Lie-Trotter, half steps" if name in SPLIT_MODELS else "half steps" for name in sources}
    names = [n for n in sources if any(e["model"] == n and e["compression"] == half[n] for e in entries)]
    fig = Figure(figsize=(max(6, 1.6 * len(names)), 4))
    ax = fig.add_subplot()
    rows = [row for row in (*ROWS, *OUTPUT_ROWS) if any(e["row"] == row for e in entries)]
    width = 0.8 / len(rows)
    for index, row in enumerate(rows):
        heights = []
        for name in names:
            at = [e["start"] for e in entries if (e["model"], e["compression"], e["row"], e["epochs"])
                  == (name, half[name], row, 0)]  # fmt: skip
            heights.append(_mean(at) if at else 0.0)
        offset = (index - (len(rows) - 1) / 2) * width
        ax.bar([i + offset for i in range(len(names))], heights, width, label=row)
    ax.scatter(
        range(len(names)), [sources[n] for n in names], color="black", marker="_", s=400, label="source"
    )
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("validation accuracy before fine-tuning (%)")
    ax.set_ylim(0, 100)
    ax.set_title("half the depth: odeify and dropping blocks, as built and calibrated")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=(len(rows) + 2) // 2, fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        type=lambda s: s.split(","),
        default=None,
        help="','-separated (default: the whole corpus; with --report: every model in the caches)",
    )
    parser.add_argument(
        "--compressions", type=lambda s: s.split(";"), default=None, help="';'-separated names"
    )
    parser.add_argument(
        "--rows",
        type=lambda s: s.split(";"),
        default=list(ROWS),
        help=f"';'-separated rows (default: the first four of {'; '.join((*ROWS, *OUTPUT_ROWS))})",
    )
    parser.add_argument("--epochs", type=lambda s: [int(e) for e in s.split(",")], default=[0, 1, 3, 6])
    parser.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 (default 2)")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument(
        "--cache",
        type=Path,
        nargs="+",
        default=[CACHE],
        help="run caches: runs go to the first, the report reads all",
    )
    parser.add_argument(
        "--output", type=Path, default=None,
        help="results file (default: compression.md for the default cache, compression_NAME.md for a "
        "cache NAME.jsonl)",
    )  # fmt: skip
    parser.add_argument("--report", action="store_true", help="only write the results file from the cache")
    args = parser.parse_args(argv)
    unknown = [row for row in args.rows if row not in (*ROWS, *OUTPUT_ROWS)]
    if unknown:
        parser.error(f"no row {unknown[0]!r}; the rows: {'; '.join((*ROWS, *OUTPUT_ROWS))}")
    if args.output is None:  # one cache, one results file: a sweep into another cache leaves the others
        name = "compression" if args.cache[0] == CACHE else f"compression_{args.cache[0].stem}"
        args.output = RESULTS / f"{name}.md"
    torch.set_num_threads(1)
    if not args.report:
        sweep(args)
    report(args, argv)


if __name__ == "__main__":
    main()
