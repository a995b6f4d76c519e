"""Benchmark: one file for every depth against LayerDrop and against a file per depth (issue 48).

On the corpus of ``benchmarks/corpus.py`` (the digits models, and ``vit_user``, a user's quick ViT
the recipes were not chosen on), at native depth, half of it and
a quarter (a third where a quarter gives the same steps; depths that give the same steps as one
before are dropped), each method at budgets of 0 (calibration only), 1 and 3 epochs of the default
recipe, distilling from the source network, for each seed:

- ``any-depth``: one file: the converted model calibrated for every depth at once
  (``odeify.calibrate(steps=[...])``: native keeps the blocks, each other depth gets a correction of
  its own, fitted as that depth's own file is), then one fine-tuning run with ``Recipe.depths`` (a
  depth drawn per batch: native's batches train the knots, another depth's its correction) at the
  default recipe's peak for several depths (``odeify.train.recipe.DEPTHS_LR``, 1e-4), read at each
  depth with ``odeify.set_steps`` (no re-conversion, no copy);
- ``any-depth, lr 3e-4``: the same file fine-tuned at 3e-4, the default peak of a run for one depth
  (and of a multi-depth run before this benchmark chose 1e-4); budget 0 is ``any-depth``'s, and is not
  repeated;
- ``single depth``: today's: a file per depth, retargeted, calibrated and fine-tuned for it alone
  (at native depth the source itself, which it computes exactly);
- ``LayerDrop`` (Fan et al. 2019): the source network trained with whole blocks of its runs skipped
  at random (each block, each batch, with probability p = the fraction of blocks the depth prunes),
  with the same optimizer, schedule, distillation and budget, then pruned to the blocks the coarse
  steps read (every other one at half the depth), converted at native depth (exact); budget 0 is
  the pruned source as it is;
- ``layer drop calibrated``: the pruned source calibrated to the source's stages
  (``calibrate(student, data, source=...)``, the compression benchmark's row), then fine-tuned.

Reported: validation accuracy (359 images; one image is 0.28 point) per seed and in the mean, the
forward time per image (batch 64, median of 5), and what switching a loaded file's depth costs
(time, and bytes of tensors it allocates that the model then holds) beside ``odeify.retarget``'s
copy. Runs are cached, one JSON line each, in ``--cache``; ``--report`` rewrites the results file,
CSV and plot from the cache.

    python benchmarks/any_depth.py --models digits_seed0 digits_seed1 --epochs 0,1,3 --seeds 2
    python benchmarks/any_depth.py --report
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from compression import _accuracy, _calibration_data, _forward_ms, layer_dropped
from finetune import CORPUS, RESULTS, native_model, source_accuracy
from machine import command_line, describe_machine, write_results
from tables import markdown_table
from torch import nn

METHODS = ("any-depth", "any-depth, lr 3e-4", "single depth", "LayerDrop", "layer drop calibrated")
ANY_DEPTH = {"any-depth": None, "any-depth, lr 3e-4": 3e-4}
"""The any-depth methods and the peak learning rate each fine-tunes at (None: the recipe's default)."""
DEPTHS = ("native", "x0.5", "x0.25", "x0.33")
CACHE = Path(__file__).resolve().parents[1] / "out" / "any_depth_bench" / "runs.jsonl"
HALF_POINT = 0.5  # the margins, in points
NATIVE_POINT = 0.2
ONE_IMAGE = 100 / 359  # one validation image, in points: a gap of one image is a tie (the rule)


# -- the depths a model is compared at -------------------------------------------------------------
def depths_of(native: nn.Module) -> list[str]:
    """native, x0.5 and x0.25 (x0.33 where x0.25 gives the steps of x0.5); a depth is dropped where it
    gives the steps of one before it or changes nothing."""
    import odeify

    chosen: list[str] = []
    seen: list[dict[str, int]] = []
    for depth in DEPTHS:
        if depth == "x0.33" and len(chosen) == 3:
            break
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                steps = {
                    s.stage_name: s.steps
                    for s in odeify.converted_stages(odeify.retarget(native, steps=depth))
                }
        except odeify.ConfigError:  # every stage has one block: the depth changes nothing
            continue
        if steps not in seen:
            chosen.append(depth)
            seen.append(steps)
    return chosen


def pruned_fraction(native: nn.Module, depth: str) -> float:
    """The fraction of the runs' blocks that ``depth`` leaves out (LayerDrop's rate p)."""
    import odeify

    coarse = odeify.retarget(native, steps=depth)
    stages = odeify.converted_stages(coarse)
    return 1 - sum(s.steps for s in stages) / sum(s.depth for s in stages)


# -- LayerDrop -------------------------------------------------------------------------------------
class LayerDropBlock(nn.Module):
    """A block skipped whole (the identity) with probability ``p`` at each training forward."""

    def __init__(self, block: nn.Module, p: float, generator: torch.Generator) -> None:
        super().__init__()
        self.block, self.p, self.generator = block, p, generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and float(torch.rand((), generator=self.generator)) < self.p:
            return x
        return self.block(x)


def _run_blocks(model: nn.Module) -> list[str]:
    """The module paths of the blocks of the model's runs (what a stage replaces)."""
    import odeify

    return [
        scope for run in odeify.analyze(model).runs for scope in dict.fromkeys(b.scope for b in run.blocks)
    ]


def _swap(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def train_layer_drop(
    source: nn.Module, teacher: nn.Module, data, epochs: int, p: float, seed: int,
    score: Callable[[nn.Module], float],
) -> nn.Module:  # fmt: skip
    """``source`` trained with LayerDrop at rate ``p`` for ``epochs``: the default recipe's optimizer
    (timm's AdamW, weight decay 0.05), peak learning rate, warm-up and cosine, gradient clipping,
    batch and distillation (T=2) as odeify's fine-tuning runs them; BatchNorm statistics frozen, as
    odeify's folded BatchNorm trains. Returns the best of its epochs by ``score`` (the pruned
    network's validation accuracy), the source as given counting as epoch 0, as a fine-tuning run's
    best.safetensors is chosen (the convention every row is judged by)."""
    from timm.optim import create_optimizer_v2

    from odeify.train.datasets import make_loader
    from odeify.train.recipe import DEFAULT_LR, DEFAULT_RECIPE
    from odeify.train.schedule import learning_rate_factor

    recipe = DEFAULT_RECIPE
    model = copy.deepcopy(source)
    paths = _run_blocks(model)
    generator = torch.Generator().manual_seed(seed)
    for path in paths:
        _swap(model, path, LayerDropBlock(model.get_submodule(path), p, generator))
    torch.manual_seed(seed)
    loader = make_loader(data.train, recipe.batch_size, train=True, seed=seed)
    optimizer = create_optimizer_v2(model, recipe.optimizer, lr=DEFAULT_LR, weight_decay=recipe.weight_decay)
    total, step, temperature = epochs * len(loader), 0, recipe.temperature
    best, best_score = copy.deepcopy(source).eval(), score(source.eval())
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        model.train()
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
        for x, _ in loader:
            for group in optimizer.param_groups:
                group["lr"] = DEFAULT_LR * learning_rate_factor(step, total, recipe.warmup)
            with torch.no_grad():
                target = F.log_softmax(teacher(x) / temperature, dim=1)
            student = F.log_softmax(model(x) / temperature, dim=1)
            loss = F.kl_div(student, target, log_target=True, reduction="batchmean") * temperature**2
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad_norm)
            optimizer.step()
            step += 1
        trained = copy.deepcopy(model)
        for path in paths:
            _swap(trained, path, trained.get_submodule(path).block)
        if (now := score(trained.eval())) > best_score:  # a tie keeps the earlier epoch, as finetune does
            best, best_score = trained, now
    return best


# -- one run ---------------------------------------------------------------------------------------
def _finetuned(
    model: nn.Module, data, teacher: nn.Module, epochs: int, seed: int, depths: str | None = None,
    lr: float | None = None, architecture: nn.Module | None = None,
):  # fmt: skip
    """The file the run hands its user: best.safetensors, by the run's own rule (the worst listed
    depth's validation accuracy with ``depths``), its start counting as epoch 0; ``architecture``:
    the network a model converted from a custom module was (``odeify.load(model=...)``)."""
    import odeify
    from odeify.train.finetune import BEST_FILE, DEFAULT_RECIPE, finetune

    if not epochs:
        return model
    recipe = replace(DEFAULT_RECIPE, epochs=epochs, depths=depths, lr=lr)
    with tempfile.TemporaryDirectory() as folder:
        finetune(
            model, data, recipe, seed=seed, teacher=teacher, progress=False, calibrate_first=False, out=folder
        )
        return odeify.load(Path(folder) / BEST_FILE, model=architecture)


def _scores(model: nn.Module, data) -> dict[str, float]:
    return {"accuracy": _accuracy(model, data), "forward_ms": _forward_ms(model, data)}


def run(key: dict[str, Any], corpus: Path, loaded) -> dict[str, Any]:
    """One cached run: a method at one depth (any-depth: at all its depths) and budget, for a seed."""
    import odeify

    native, data, path = loaded
    depths, method, epochs, seed = depths_of(native), key["method"], key["epochs"], key["seed"]
    calibration_data = _calibration_data(key["model"], corpus)
    euler = odeify.retarget(native, backward="checkpoint")  # runs at every depth (ALF needs multiples)
    started = time.perf_counter()
    if method in ANY_DEPTH:
        model, _ = odeify.calibrate(euler, calibration_data, steps=depths, seed=seed, progress=False)
        model = _finetuned(model, data, native, epochs, seed, ",".join(depths), ANY_DEPTH[method])
        result: dict[str, Any] = {"depths": {}}
        for depth in depths:
            odeify.set_steps(model, depth)
            result["depths"][depth] = _scores(model, data)
        return {**result, "seconds": time.perf_counter() - started}
    depth = key["depth"]
    if method == "single depth":
        model = odeify.retarget(euler, steps=depth)
        model, _ = odeify.calibrate(model, calibration_data, seed=seed, progress=False)
        model = _finetuned(model, data, native, epochs, seed)
    else:
        source = odeify.load_model(path).eval()
        coarse = odeify.retarget(native, steps=depth)
        input_size = native.meta["odeify"]["input_shape"][1:]

        def pruned(network: nn.Module) -> nn.Module:
            model = odeify.convert(
                layer_dropped(network, coarse), input_size=input_size, backward="checkpoint"
            )
            model.pretrained_cfg = native.pretrained_cfg
            return model

        if method == "LayerDrop" and epochs:
            rate, score = pruned_fraction(native, depth), lambda network: _accuracy(pruned(network), data)
            source = train_layer_drop(source, native, data, epochs, rate, seed, score)
        model = pruned(source)
        if method == "layer drop calibrated":
            model, _ = odeify.calibrate(model, calibration_data, source=native, seed=seed, progress=False)
            model = _finetuned(model, data, native, epochs, seed, architecture=layer_dropped(source, coarse))
    return {"depths": {depth: _scores(model, data)}, "seconds": time.perf_counter() - started}


def switch_cost(native: nn.Module, depths: list[str]) -> dict[str, Any]:
    """What changing a loaded model's depth costs: ``set_steps`` in place against ``retarget``'s copy
    (median seconds of 5 switches through the depths; bytes of tensors the result holds that the
    model did not)."""
    import odeify

    model = odeify.retarget(native, backward="checkpoint")
    held = {t.data_ptr() for t in (*model.parameters(), *model.buffers())}

    def new_bytes(result: nn.Module) -> int:
        tensors = {t.data_ptr(): t for t in (*result.parameters(), *result.buffers())}
        return sum(t.numel() * t.element_size() for ptr, t in tensors.items() if ptr not in held)

    cost: dict[str, Any] = {"knot_bytes": sum(t.numel() * t.element_size() for t in model.parameters())}
    for name, change in (
        ("set_steps", odeify.set_steps),
        ("retarget", lambda m, d: odeify.retarget(m, steps=d)),
    ):
        times, allocated = [], 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(5):
                for depth in depths:
                    started = time.perf_counter()
                    result = change(model, depth)
                    times.append(time.perf_counter() - started)
                    allocated = max(allocated, new_bytes(result))
        cost[name] = {"seconds": statistics.median(times), "bytes": allocated}
    return cost


# -- the sweep and the report ----------------------------------------------------------------------
def _keys(args: argparse.Namespace, model: str, depths: list[str]) -> list[dict[str, Any]]:
    keys = []
    for seed in range(args.seeds):
        for epochs in args.epochs:
            for method in ANY_DEPTH:
                if epochs or ANY_DEPTH[method] is None:  # before fine-tuning, the learning rate is moot
                    keys.append(
                        {"model": model, "method": method, "depth": "all", "epochs": epochs, "seed": seed}
                    )
            for method in (m for m in METHODS if m not in ANY_DEPTH):
                for depth in depths[1:]:
                    keys.append(
                        {"model": model, "method": method, "depth": depth, "epochs": epochs, "seed": seed}
                    )
    return keys


def _key_text(entry: dict[str, Any]) -> str:
    return json.dumps({k: entry[k] for k in ("model", "method", "depth", "epochs", "seed")}, sort_keys=True)


def read_cache(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {_key_text(e): e for e in entries}


def sweep(args: argparse.Namespace, argv: list[str] | None) -> None:
    cache = read_cache(args.cache)
    args.cache.parent.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        loaded = native_model(model, args.corpus)
        depths = depths_of(loaded[0])
        extra = {"model": model, "method": "switch", "depth": "all", "epochs": 0, "seed": 0}
        todo = [k for k in [extra, *_keys(args, model, depths)] if _key_text(k) not in cache]
        for index, key in enumerate(todo):
            print(f"[{index + 1}/{len(todo)}] {_key_text(key)}", file=sys.stderr, flush=True)
            if key["method"] == "switch":
                entry = {**key, **switch_cost(loaded[0], depths), "depth_list": depths}
            else:
                entry = {**key, **run(key, args.corpus, loaded)}
            entry["command"] = command_line(__file__, argv)
            with args.cache.open("a") as handle:
                handle.write(json.dumps(entry) + "\n")
            cache[_key_text(entry)] = entry


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _cell(values: list[float]) -> str:
    if not values:
        return ""
    seeds = " / ".join(f"{v:.2f}" for v in values)
    return f"{seeds} ({_mean(values):.2f})" if len(values) > 1 else seeds


def table_rows(entries: list[dict[str, Any]], model: str, budgets: list[int]):
    """(method, depth, steps, ms, accuracy per budget as cells, means per budget) for one model."""
    switch = next(e for e in entries if e["model"] == model and e["method"] == "switch")
    rows = []
    for depth in switch["depth_list"]:
        for method in METHODS:
            found = [
                e for e in entries if e["model"] == model and e["method"] == method and depth in e["depths"]
            ]
            if not found:
                continue
            per_budget = [
                [
                    e["depths"][depth]["accuracy"]
                    for e in sorted(found, key=lambda e: e["seed"])
                    if e["epochs"] == b
                ]
                for b in budgets
            ]
            ms = _mean([e["depths"][depth]["forward_ms"] for e in found])
            rows.append((method, depth, ms, per_budget))
    return rows


def verdicts(entries: list[dict[str, Any]], model: str, source: float, budgets: list[int]) -> list[str]:
    """The issue's targets, checked on the seed means of this model, for each any-depth method."""
    means: dict[tuple[str, str, int], float] = {}
    for method, depth, _, per_budget in table_rows(entries, model, budgets):
        for budget, values in zip(budgets, per_budget, strict=True):
            if values:
                means[method, depth, budget] = _mean(values)
    lines = []
    for (method, depth, budget), value in sorted(means.items()):
        if method not in ANY_DEPTH:
            continue
        single = source if depth == "native" else means.get(("single depth", depth, budget))
        margin = NATIVE_POINT if depth == "native" and budget == 0 else HALF_POINT
        checks = []
        if single is not None:
            gap = value - single
            met = gap >= -max(margin, ONE_IMAGE) - 1e-9
            checks.append(
                f"{gap:+.2f} points against {'the source' if depth == 'native' else 'single depth'} "
                f"({'met' if met else 'not met'}, margin {margin} or one image)"
            )
        drop = means.get(("LayerDrop", depth, budget))
        if drop is not None and budget > 0:
            met = value >= drop - ONE_IMAGE - 1e-9
            checks.append(f"{value - drop:+.2f} against LayerDrop ({'met' if met else 'not met'})")
        if checks:
            lines.append(f"- {depth}, budget {budget}: {method} {value:.2f}%: " + "; ".join(checks))
    return lines


def report(args: argparse.Namespace, argv: list[str] | None) -> None:
    entries = list(read_cache(args.cache).values())
    models = list(dict.fromkeys(e["model"] for e in entries))
    budgets = sorted({e["epochs"] for e in entries if e["method"] != "switch"})
    seeds = " / ".join(f"seed {s}" for s in sorted({e["seed"] for e in entries if e["method"] != "switch"}))
    lines = [
        "# One file for every depth, against LayerDrop and a file per depth",
        "",
        f"Validation accuracy (359 images; one image is 0.28 point) by seed ({seeds}, mean in "
        "brackets); budget 0 is before fine-tuning (calibration only), 1 and 3 after that many epochs of "
        "the default recipe (each budget its own run). `ms`: forward time per image at that depth (batch "
        "64, median of 5). `any-depth` is one file per model, seed and budget, read at each depth with "
        "`odeify.set_steps`; the other methods are a file (or a pruned network) per depth. Methods: "
        "benchmarks/any_depth.py's docstring.",
        "",
    ]
    csv_rows: list[list[Any]] = []
    for model in models:
        source = 100 * source_accuracy(model, args.corpus)
        lines += [f"## {model} (source {source:.2f}%)", ""]
        rows = []
        for method, depth, ms, per_budget in table_rows(entries, model, budgets):
            rows.append([method, depth, f"{ms:.3f}", *(_cell(v) for v in per_budget)])
            for budget, values in zip(budgets, per_budget, strict=True):
                for seed, value in enumerate(values):
                    csv_rows.append([model, method, depth, budget, seed, f"{value:.4f}", f"{ms:.4f}"])
        lines += [*markdown_table(["method", "depth", "ms", *map(str, budgets)], rows), ""]
        lines += ["Against the targets (seed means):", "", *verdicts(entries, model, source, budgets), ""]
        switch = next(e for e in entries if e["model"] == model and e["method"] == "switch")
        lines += [
            f"Changing the depth of the loaded model ({switch['knot_bytes']:,} bytes of parameters), "
            f"median of 5 passes through {', '.join(switch['depth_list'])}: `odeify.set_steps` "
            f"{1000 * switch['set_steps']['seconds']:.1f} ms, {switch['set_steps']['bytes']:,} bytes of new "
            f"tensors; `odeify.retarget` {1000 * switch['retarget']['seconds']:.1f} ms, "
            f"{switch['retarget']['bytes']:,} bytes.",
            "",
        ]
    lines += kept_section(args.output)
    sweeps = dict.fromkeys(e["command"] for e in entries if "command" in e)
    lines += ["The runs: " + "; ".join(f"`{c}`" for c in sweeps) + ".", ""] if sweeps else []
    lines += [f"Command: `{command_line(__file__, argv)}`", "", f"Machine: {describe_machine()}.", ""]
    write_results(args.output, "\n".join(lines))
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerows([["model", "method", "depth", "epochs", "seed", "accuracy", "forward_ms"], *csv_rows])
    write_results(args.output.with_suffix(".csv"), buffer.getvalue())
    plot(entries, models, budgets, args.output.with_suffix(".png"))


TRIED = "## What was tried"


def kept_section(path: Path) -> list[str]:
    """The results file's hand-written "What was tried" section (levers measured outside the sweep,
    by hand, with their figures), kept as it is when the report rewrites the file: the lines from
    its heading to the next heading or the list of runs; none where the file has no such section."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    if TRIED not in lines:
        return []
    start = lines.index(TRIED)
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].startswith(("## ", "The runs: "))), len(lines)
    )
    return [*lines[start:end]] if lines[end - 1] == "" else [*lines[start:end], ""]


def plot(entries: list[dict[str, Any]], models: list[str], budgets: list[int], path: Path) -> None:
    """Accuracy (seed mean) against forward time per image: one curve per method and budget, a panel
    per model."""
    from matplotlib.figure import Figure

    from odeify.core.fileio import atomic_path

    fig = Figure(figsize=(5 * len(models), 4))
    for index, model in enumerate(models):
        ax = fig.add_subplot(1, len(models), index + 1)
        rows = table_rows(entries, model, budgets)
        for method in METHODS:
            for b, budget in enumerate(budgets):
                points = sorted((ms, _mean(v[b])) for m, _, ms, v in rows if m == method and v[b])
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", label=f"{method}, {budget} ep.")
        ax.set_xlabel("forward ms per image")
        ax.set_ylabel("validation accuracy (%)")
        ax.set_title(model)
        ax.legend(fontsize=6)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", nargs="+", default=["digits_seed0"], help="corpus names (default: digits_seed0)"
    )
    parser.add_argument("--epochs", type=lambda s: [int(v) for v in s.split(",")], default=[0, 1, 3],
                        help="comma-separated fine-tuning budgets (default 0,1,3)")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=2, help="seeds per run (default 2)")
    parser.add_argument("--corpus", type=Path, default=CORPUS, help=f"the corpus folder (default {CORPUS})")
    parser.add_argument(
        "--cache", type=Path, default=CACHE, help=f"the runs, one JSON line each (default {CACHE})"
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "any_depth.md", help="the results file")
    parser.add_argument("--report", action="store_true", help="only rewrite the results from the cache")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one thread, as the corpus was measured: a run does not depend on the load
    if args.report:
        report(args, argv)
        return
    sweep(args, argv)
    report(args, argv)


if __name__ == "__main__":
    main()
