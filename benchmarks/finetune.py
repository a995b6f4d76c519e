"""Benchmark: which fine-tuning recipe brings coarse manifestations of user-like models back.

On the corpus of ``benchmarks/corpus.py`` (docs/corpus.md: timm resnet18, resnet26d, resnetv2_18
and a 6-block ViT-Tiny trained as a user's quick train.py run, on an ImageFolder of 32x32 digits,
and the three digits models of ``examples/train_digits.py``), for each model and each
manifestation below that its stages can take, each candidate recipe runs
``odeify.train.finetune.finetune`` (the loop ``odeify finetune`` runs) from the model's coarse
manifestation, with no teacher argument (the default teacher: the source network the model keeps):

- Euler, 1 step per stage, ``backward='checkpoint'`` (on the ViT's split stage: one Lie-Trotter
  step);
- rk4, 1 step per stage, ``backward='reverse'``;
- reversible Heun, half the native steps, ``backward='reversible'``;
- linear basis, 2 knots per stage, Euler (Lie-Trotter) at native steps, ``backward='reverse'``;
- ALF at the native steps, ``backward='reversible'``, where this odeify has the integrator (at half
  the steps ALF's one midpoint evaluation falls on a jump of the constant weight path, which
  odeify refuses);
- Strang splitting at half the native steps, ``backward='checkpoint'``: the ViT only.

The ViT's blocks become one split stage (dx/dt = F_attn + F_mlp), which runs splitting schemes
only and no ``reversible`` backward (docs/backward-modes.md); the ResNets' stages run no splitting
scheme. ``SPLIT_MODELS`` names the models with split stages; a manifestation their stages cannot
take is not planned for them.

and the one-step check: one optimizer step of the recipe (``epochs=1, max_batches=1``: the whole
schedule is that step, at the peak learning rate) on the converted model at native depth; named
with ``--manifestations``, the same on ALF's manifestation (``'one step, ALF native'``). Every run
reports validation accuracy before and after (the last epoch's model: the validation split selects
nothing). Target: every run ends within 0.5 point of the source and never below its start; one
step changes accuracy by less than 1 point. The image-folder models train with the augmentation
the corpus was trained with (``--augmentation "as trained"``: train.py's ``--hflip 0``; digits are
not mirror-symmetric) or timm's defaults (``"timm's defaults"``: the runs before this option).
``--via cli`` runs the same through ``odeify finetune FILE --data DIR --out RUN`` plus the
manifestation flags and nothing else: FILE is a digits model saved, or a timm model converted as a
user converts train.py's output (``odeify convert model_best.pth.tar --ema -o FILE``), which
records the input size and the training augmentation from the checkpoint's ``args``.

Runs are cached, one JSON line each, in ``--cache`` (default out/finetune_bench/runs.jsonl): an
interrupted sweep resumes where it stopped, and ``--report`` rewrites the results file from the
cache without running anything. Each run is its own process with one torch thread; ``--jobs 2``
runs two at a time.

    python benchmarks/finetune.py --recipes all --seeds 1            # every candidate, seed 0
    python benchmarks/finetune.py --recipes default --seeds 4        # the acceptance runs (Python)
    python benchmarks/finetune.py --recipes default --seeds 4 --via cli
    python benchmarks/finetune.py --report                           # the results file, from the cache
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from corpus import TRAIN_PY_RECIPE
from machine import command_line, describe_machine
from tables import markdown_table

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CORPUS = REPO / "out" / "corpus"
CACHE = REPO / "out" / "finetune_bench" / "runs.jsonl"
MODELS = (
    "resnet18",
    "resnet26d",
    "resnetv2_18",
    "resnet50",
    "resnet101",
    "vit6",
    "digits_seed0",
    "digits_seed1",
    "digits_seed2",
)
SPLIT_MODELS = ("vit6",)  # its residual runs are period-2 (attention, MLP): one split stage
TARGET_GAP = 0.5  # points: within 0.5 point of the source's accuracy
ONE_STEP_LIMIT = 1.0  # points: one step changes accuracy by less than this
ONE_STEP = "one step, native depth"
ONE_STEP_ALF = "one step, ALF native"
MANIFESTATIONS: dict[str, dict[str, Any]] = {
    "Euler, 1 step": {"steps": 1, "backward": "checkpoint"},
    "rk4, 1 step": {"integrator": "rk4", "steps": 1, "backward": "reverse"},
    "rev. Heun, half steps": {"integrator": "reversible_heun", "steps": "x0.5", "backward": "reversible"},
    "linear, 2 knots": {"basis": "linear", "knots": 2, "backward": "reverse"},
    "ALF, native steps": {"integrator": "alf", "steps": "native", "backward": "reversible"},
    "Euler, native steps": {"integrator": "euler", "steps": "native", "backward": "checkpoint"},
    "Strang, half steps": {"integrator": "strang", "steps": "x0.5", "backward": "checkpoint"},
    "Lie-Trotter, native, checkpoint": {"integrator": "lie_trotter", "backward": "checkpoint"},
}
ONE_STEPS: dict[str, dict[str, Any]] = {ONE_STEP: {}, ONE_STEP_ALF: MANIFESTATIONS["ALF, native steps"]}
"""The one-step checks: one optimizer step of the recipe on the model as converted, or on its ALF
manifestation at the native steps (what ``odeify finetune`` trains a model as converted with where
ALF's training step peaks lower than checkpointing's: odeify.train.manifestations.PEAK_MARGIN)."""
CLI_FLAGS = {"integrator": "--integrator", "steps": "--steps", "knots": "--knots", "basis": "--basis"}
AUGMENTATIONS = {
    "as trained": {"hflip": float(TRAIN_PY_RECIPE["--hflip"])},
    "timm's defaults": {},
    "none": {"no_aug": True},
}
"""The image-folder models' training augmentation, by label: the flags the corpus's train.py runs
were trained with where they differ from timm's defaults (``--hflip 0``: digits are not
mirror-symmetric), as a train.py user passes them again; or timm's defaults (flip half the images).
``none`` is train.py's ``--no-aug`` (resize and centre-crop only): the ViT's experiments (issue 23).
The digits models train on tensors, unaugmented, under every label."""


def candidates() -> dict[str, Any]:
    """The recipes compared, by label: odeify's DEFAULT_RECIPE and variants of the recipe before issue 20.

    The variants are spelled out, not derived from DEFAULT_RECIPE, so that cached runs keep their
    labels when the default changes.
    """
    from odeify.train.finetune import DEFAULT_RECIPE, Recipe

    before = Recipe(epochs=3, batch_size=64, lr=1e-3, warmup=0.1, weight_decay=0.05, distill=1.0)
    return {
        "default": DEFAULT_RECIPE,
        "lr 1e-3 (before)": before,
        "lr 3e-4": replace(before, lr=3e-4),
        "lr 2e-4": replace(before, lr=2e-4),
        "lr 1e-4": replace(before, lr=1e-4),
        "lr 5e-5": replace(before, lr=5e-5),
        "lr 1e-4, 5 epochs": replace(before, lr=1e-4, epochs=5),
        "lr 1e-4, 6 epochs": replace(before, lr=1e-4, epochs=6),  # ALF's one-step check (issue 22)
        "lr 5e-5, 6 epochs": replace(before, lr=5e-5, epochs=6),
        "lr 7e-5, 6 epochs": replace(before, lr=7e-5, epochs=6),
        "lr 5e-5, 10 epochs": replace(before, lr=5e-5, epochs=10),  # ALF's misses at 5e-5 (issue 22)
        "lr 2e-4, 6 epochs": replace(before, lr=2e-4, epochs=6),
        "lr 2e-4, half distillation": replace(before, lr=2e-4, distill=0.5),
        "lr 2e-4, no warm-up": replace(before, lr=2e-4, warmup=0.0),
        "lr 2e-4, warm-up 0.3": replace(before, lr=2e-4, warmup=0.3),
        "lr 5e-4": replace(before, lr=5e-4),
        "lr 3e-4, 6 epochs": replace(before, lr=3e-4, epochs=6),
        "lr 5e-4, 6 epochs": replace(before, lr=5e-4, epochs=6),
        "lr 3e-4, 10 epochs": replace(before, lr=3e-4, epochs=10),
        "lr 3e-4, 6 epochs, EMA": replace(before, lr=3e-4, epochs=6, ema_decay=0.998),
        "lr 3e-4, 6 epochs, temperature 1": replace(before, lr=3e-4, epochs=6, temperature=1.0),
        "lr 3e-4, 6 epochs, labels only": replace(before, lr=3e-4, epochs=6, distill=0.0),
        "lr 3e-4, 6 epochs, AdamW eps 1e-6": replace(before, lr=3e-4, epochs=6, opt_eps=1e-6),
        "lr 1e-3, 6 epochs": replace(before, lr=1e-3, epochs=6),  # the ViT (issue 23)
        "lr 3e-4, 20 epochs": replace(before, lr=3e-4, epochs=20),
        "lr 3e-4, 20 epochs, EMA": replace(before, lr=3e-4, epochs=20, ema_decay=0.998),
        "lr 3e-4, 40 epochs": replace(before, lr=3e-4, epochs=40),  # the ViT's schedule, to its end
        "lr 3e-4, 40 epochs, EMA": replace(before, lr=3e-4, epochs=40, ema_decay=0.998),
        "lr 3e-4, 6 epochs, batch 32": replace(before, lr=3e-4, epochs=6, batch_size=32),
        "lr 3e-4, 6 epochs, batch 16": replace(before, lr=3e-4, epochs=6, batch_size=16),
    }


# ---------------------------------------------------------------------------------------------------
# One run, in its own process


def native_model(model: str, corpus: Path, augmentation: str | None = None):
    """The converted model at native depth and its data; the timm models get their 32x32 data config
    and the training augmentation labelled ``augmentation`` (:data:`AUGMENTATIONS`)."""
    import odeify
    from odeify.models import DEFAULT_MODEL_PATH
    from odeify.train.datasets import Augmentation, open_data

    if model.startswith("digits"):
        path = DEFAULT_MODEL_PATH if model == "digits_seed0" else corpus / f"{model}.safetensors"
        native = odeify.convert(str(path))
        return native, open_data("digits", native), path
    entry = json.loads((corpus / "corpus.json").read_text())["models"][model]
    path = corpus / entry["forms"]["hf"]
    native = odeify.convert(str(path), input_size=tuple(entry["data_config"]["input_size"]))
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in entry["data_config"].items()}
    native.pretrained_cfg = {**native.pretrained_cfg, **config}  # issue 21: timm's 224 otherwise
    flags = AUGMENTATIONS[augmentation or "timm's defaults"]
    return native, open_data(corpus / "digits_png", native, Augmentation(**flags)), path


def source_accuracy(model: str, corpus: Path) -> float:
    import odeify
    from odeify.train.datasets import make_loader
    from odeify.train.evaluate import evaluate

    native, data, path = native_model(model, corpus)
    source = odeify.load_model(path).eval()
    return evaluate(source, make_loader(data.val, 256, train=False)).accuracy


def run_python(key: dict[str, Any], corpus: Path) -> dict[str, Any]:
    """One fine-tuning run through the Python API, no teacher argument."""
    import odeify
    from odeify.train.finetune import Recipe, finetune

    recipe = Recipe(**key["recipe"])
    native, data, _ = native_model(key["model"], corpus, key["augmentation"])
    one_step = key["manifestation"] in ONE_STEPS
    settings = ONE_STEPS[key["manifestation"]] if one_step else MANIFESTATIONS[key["manifestation"]]
    model = odeify.retarget(native, **settings) if settings else native
    recipe, batches = (replace(recipe, epochs=1), 1) if one_step else (recipe, None)
    result = finetune(model, data, recipe, seed=key["seed"], max_batches=batches, progress=False)
    return {"history": [asdict(r) for r in result.history]}


def run_cli(key: dict[str, Any], corpus: Path, work: Path) -> dict[str, Any]:
    """One run of ``odeify finetune FILE --data DIR --out RUN`` with the manifestation's flags."""
    from odeify.train.datasets import Augmentation

    file, data = _cli_file(key["model"], corpus, work)
    run = work / "cli" / "_".join(str(key[k]) for k in ("model", "manifestation", "seed")).replace(" ", "")
    run = run.with_name(run.name.replace(",", "").replace(".", ""))
    if run.exists():
        shutil.rmtree(run)
    command = [sys.executable, "-m", "odeify", "finetune", str(file), "--data", data, "--out", str(run)]
    command += ["--seed", str(key["seed"])]
    if key["augmentation"] == "timm's defaults":  # else the file's: train.py's --hflip 0, recorded
        command += ["--hflip", f"{Augmentation().hflip:g}"]
    if key["recipe"]["batch_size"] != _default_recipe()["batch_size"]:
        command += ["--batch-size", str(key["recipe"]["batch_size"])]
    if key["manifestation"] in ONE_STEPS:
        command += ["--epochs", "1", "--max-batches", "1"]
    settings = _settings(key["manifestation"])
    if not settings:
        settings = {"integrator": "euler"}  # the model as converted, as converted (not the default)
    command += [x for k, v in settings.items() for x in ((CLI_FLAGS.get(k, f"--{k}"), str(v)))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    history = json.loads((run / "history.json").read_text())
    shutil.rmtree(run)  # its checkpoints are 60-300 MB a run; the cache keeps what the report reads
    return {"history": history, "command": command[1:]}


def _cli_file(model: str, corpus: Path, work: Path) -> tuple[Path, str]:
    """The converted model the CLI runs start from (made once) and its --data.

    A timm model is converted as a user converts train.py's output: ``odeify convert
    model_best.pth.tar --ema -o FILE`` (the EMA weights, which every corpus form holds; the input
    size and the training augmentation from the checkpoint's ``args``). A digits model is the
    Python runs' native model, saved.
    """
    import odeify
    from odeify.core.fileio import atomic_path

    file = work / "files" / f"{model}.safetensors"
    file.parent.mkdir(parents=True, exist_ok=True)
    data = "digits" if model.startswith("digits") else str(corpus / "digits_png")
    if file.exists():
        return file, data
    if model.startswith("digits"):
        native, _, _ = native_model(model, corpus)
        with atomic_path(file) as tmp:
            odeify.save(native, tmp)
    else:
        entry = json.loads((corpus / "corpus.json").read_text())["models"][model]
        command = ["convert", str(corpus / entry["forms"]["train_py"]), "--ema", "-o", str(file)]
        subprocess.run([sys.executable, "-m", "odeify", *command], check=True, stdout=subprocess.DEVNULL)
    return file, data


def _child(argv: list[str]) -> None:
    """``--child KEY CORPUS WORK``: one run; prints its result as one JSON line."""
    import torch

    torch.set_num_threads(1)
    key, corpus, work = json.loads(argv[0]), Path(argv[1]), Path(argv[2])
    wall, cpu = time.perf_counter(), time.process_time()
    if key["via"] == "source":
        result = {"accuracy": source_accuracy(key["model"], corpus)}
    elif key["via"] == "cli":
        result = run_cli(key, corpus, work)
    else:
        result = run_python(key, corpus)
    result.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu)
    print(json.dumps(result))


# ---------------------------------------------------------------------------------------------------
# The sweep: which runs, the cache, two processes at a time


KEY_PARTS = ("via", "model", "recipe", "augmentation", "manifestation", "seed")


def _key(**parts: Any) -> dict[str, Any]:
    return {k: parts.get(k) for k in KEY_PARTS}


def _key_text(key: dict[str, Any]) -> str:
    return json.dumps(key, sort_keys=True)


def read_cache(path: Path) -> dict[str, dict[str, Any]]:
    """Every completed run in the cache, by key (a line cut short by a kill is skipped)."""
    found = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            entry["key"] = _spelled_out(entry["key"])
            found[_key_text(entry["key"])] = entry
    return found


def _spelled_out(key: dict[str, Any]) -> dict[str, Any]:
    """``key`` with every part spelled out, so that runs cached before a part existed keep matching:
    Recipe fields added later at their defaults (what those runs trained with), and the augmentation
    those runs used (timm's defaults on an image folder, none on the digits tensors)."""
    if key["recipe"] is None:
        return _key(**key)
    from odeify.train.finetune import Recipe

    augmentation = key.get("augmentation", _default_augmentation(key["model"], "timm's defaults"))
    return _key(**{**key, "recipe": asdict(Recipe(**key["recipe"])), "augmentation": augmentation})


def _default_augmentation(model: str, label: str) -> str | None:
    """``label`` for an image-folder model; None for a digits model (tensors, never augmented)."""
    return None if model.startswith("digits") else label


def _available_manifestations(model: str) -> list[str]:
    """The manifestations this odeify has and ``model``'s stages can take, the one-step checks first.

    A split stage runs splitting schemes (``euler`` is read as ``lie_trotter``, ``alf`` and
    ``reversible_heun`` as their Lie-Trotter splittings), ``reversible`` with a reversible one; any
    other stage runs tableaus and reversible schemes, no splitting scheme.
    """
    from odeify.numerics.schemes import REVERSIBLE_SCHEMES
    from odeify.numerics.splitting import SPLITTINGS
    from odeify.numerics.tableaus import KNOWN_INTEGRATORS

    def takes(settings: dict[str, Any]) -> bool:
        integrator = settings.get("integrator", "euler")
        if model in SPLIT_MODELS:
            reversible = (
                integrator in REVERSIBLE_SCHEMES
                or SPLITTINGS.get(integrator, SPLITTINGS["strang"]).reversible
            )
            split = integrator in {*SPLITTINGS, "euler", *REVERSIBLE_SCHEMES}
            return split and (settings.get("backward") != "reversible" or reversible)
        return integrator not in SPLITTINGS

    every = {**ONE_STEPS, **MANIFESTATIONS}
    known = [m for m, s in every.items() if s.get("integrator", "euler") in KNOWN_INTEGRATORS]
    return [m for m in known if takes(every[m])]


def planned(args: argparse.Namespace) -> list[dict[str, Any]]:
    labels = list(candidates()) if args.recipes == ["all"] else args.recipes
    recipes = [candidates()[label] for label in labels]
    if args.batch_size is not None:  # quick tries on a tiny corpus (benchmarks/corpus.py --quick)
        recipes = [replace(r, batch_size=args.batch_size) for r in recipes]
    recipes = [asdict(r) for r in recipes]
    keys = [_key(via="source", model=m) for m in args.models]
    wanted = args.manifestations or [ONE_STEP, *MANIFESTATIONS]  # ONE_STEP_ALF when named
    for via in args.via:
        for recipe in recipes:
            for seed in range(args.seeds):
                for model in args.models:
                    runs = [m for m in _available_manifestations(model) if m in wanted]
                    augmentation = _default_augmentation(model, args.augmentation)
                    parts = {"via": via, "model": model, "recipe": recipe, "seed": seed}
                    for manifestation in runs:
                        key = {**parts, "recipe": _with_peak(recipe, manifestation)}
                        keys.append(_key(**key, manifestation=manifestation, augmentation=augmentation))
    return list({_key_text(key): key for key in keys}.values())  # a candidate may equal the default


def sweep(args: argparse.Namespace) -> None:
    done = read_cache(args.cache)
    todo = [key for key in planned(args) if _key_text(key) not in done]
    print(f"{len(todo)} runs to do ({len(done)} cached in {args.cache})", file=sys.stderr)
    args.cache.parent.mkdir(parents=True, exist_ok=True)
    work = args.cache.parent

    sweep_command = command_line(__file__)  # recorded with each run: the report lists what made its runs

    def one(key: dict[str, Any]) -> None:
        command = [sys.executable, __file__, "--child", json.dumps(key), str(args.corpus), str(work)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
        if out.returncode != 0:
            print(f"FAILED {key}: {out.stderr[-2000:]}", file=sys.stderr)
            return
        entry = {"key": key, "sweep": sweep_command, **json.loads(out.stdout.strip().splitlines()[-1])}
        with args.cache.open("a") as handle:  # one line per run, appended whole
            handle.write(json.dumps(entry) + "\n")
        print(f"{_label(key)}: {_change(entry)} ({entry['wall']:.0f} s)", file=sys.stderr)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, todo))


def _label(key: dict[str, Any]) -> str:
    parts = {**key, "recipe": recipe_label(key["recipe"]) if key["recipe"] else None}
    return " | ".join(str(parts[k]) for k in KEY_PARTS if parts[k] is not None)


def _settings(manifestation: str) -> dict[str, Any]:
    return {**ONE_STEPS, **MANIFESTATIONS}[manifestation]


def _with_peak(recipe: dict[str, Any], manifestation: str) -> dict[str, Any]:
    """``recipe`` with the peak learning rate a run of ``manifestation`` trains at: its own, else the
    default for the manifestation's integrator (``odeify.train.recipe.default_lr``), as finetune sets it."""
    from odeify.numerics.tableaus import resolve_integrator
    from odeify.train.recipe import default_lr

    if recipe["lr"] is not None:
        return recipe
    integrator = resolve_integrator(_settings(manifestation).get("integrator", "euler"))
    return {**recipe, "lr": default_lr([integrator])}


def recipe_label(recipe: dict[str, Any]) -> str:
    """The candidate's label for a recipe (runs are cached by the recipe itself, not its label): the
    default recipe at each integrator's peak is ``default (lr X)``.

    A batch size set by ``--batch-size`` is named after the label.
    """
    from odeify.train.recipe import ALF_LR, DEFAULT_LR

    batch = recipe["batch_size"]
    suffix = "" if batch == _default_recipe()["batch_size"] else f", batch {batch}"
    for lr in (DEFAULT_LR, ALF_LR):
        if {**_default_recipe(), "lr": lr, "batch_size": batch} == recipe:
            return f"default (lr {lr:.0e}){suffix}".replace("e-0", "e-")  # default (lr 5e-5)
    found = [label for label, r in candidates().items() if asdict(replace(r, batch_size=batch)) == recipe]
    return found[0] + suffix if found else json.dumps(recipe)


def _default_recipe() -> dict[str, Any]:
    from odeify.train.finetune import DEFAULT_RECIPE

    return asdict(DEFAULT_RECIPE)


# ---------------------------------------------------------------------------------------------------
# The report


def _accuracies(entry: dict[str, Any]) -> tuple[float, float]:
    history = entry["history"]
    return 100 * history[0]["val_accuracy"], 100 * history[-1]["val_accuracy"]


def _change(entry: dict[str, Any]) -> str:
    if "accuracy" in entry:
        return f"{100 * entry['accuracy']:.2f}"
    before, after = _accuracies(entry)
    return f"{before:.2f} -> {after:.2f}"


def _meets(entry: dict[str, Any], source: float) -> bool:
    before, after = _accuracies(entry)
    if entry["key"]["manifestation"] in ONE_STEPS:
        return abs(after - before) < ONE_STEP_LIMIT
    return after >= source - TARGET_GAP - 1e-9 and after >= before - 1e-9


def _corpus_origin(index: dict[str, Any]) -> str:
    """Where the corpus was trained: another machine's float32 kernels train other weights
    (docs/corpus.md), so a results file says which corpus its cells are of."""
    if "kernels" not in index:  # an index from before the kernels were recorded
        return f"(corpus trained on {index.get('cpu', 'an unrecorded CPU')})."
    return f"(corpus trained on {index['cpu']}, {index['kernels']} kernels)."


def report(cache: dict[str, dict[str, Any]], corpus: Path, seconds: float | None) -> list[str]:
    entries = list(cache.values())
    sources = _sources(entries)
    runs = [e for e in entries if e["key"]["via"] != "source" and e["key"]["model"] in sources]
    index = json.loads((corpus / "corpus.json").read_text())
    val = index["data"]["val"]
    made = {e["key"]["manifestation"] for e in runs}
    columns = [ONE_STEP, *[m for m in [ONE_STEP_ALF, *MANIFESTATIONS] if m in made]]
    lines = [
        "# Fine-tuning recipe on the corpus of user-like models",
        "",
        f"Command: `{command_line(__file__)}`" + (f" ({seconds / 60:.0f} min)" if seconds else "") + "  ",
        _made_by(entries) + "  ",
        f"Machine: {describe_machine()}",
        "",
        "Each run starts from the converted model in the column's manifestation and runs "
        "`odeify.train.finetune.finetune` (Python) or `odeify finetune FILE --data DIR --out RUN` plus the "
        "manifestation's flags (CLI), with no teacher given: the default teacher is the source network the "
        f"model keeps. Cells: validation accuracy before -> after (the last epoch's model, %; {val} "
        f"validation images, one is {100 / val:.2f} point). Target: within {TARGET_GAP} point of the source "
        "and never below the start; "
        f"'{ONE_STEP}' (and '{ONE_STEP_ALF}', on ALF's manifestation): one optimizer step at the peak "
        "learning rate changes accuracy by less than "
        f"{ONE_STEP_LIMIT} point. A bold cell misses its target. Sources: "
        + ", ".join(f"{m} {a:.2f}%" for m, a in sources.items())
        + f" {_corpus_origin(index)}",
        "",
    ]
    for via, recipe, augmentation in _sections(runs):
        chosen = [
            e for e in runs if e["key"]["via"] == via and e["key"]["recipe"] == recipe
            and e["key"]["augmentation"] in (augmentation, None)
        ]  # fmt: skip
        seeds = sorted({e["key"]["seed"] for e in chosen})
        met = sum(_meets(e, sources[e["key"]["model"]]) for e in chosen)
        where = "Python API" if via == "python" else "command line"
        lines += [f"## {recipe_label(recipe)} ({where}; seeds {', '.join(map(str, seeds))})", ""]
        aug = augmentation or "none"
        lines += [f"Recipe: `{_recipe_text(recipe)}`; image-folder augmentation: {aug}.", ""]
        lines += [f"{met} of {len(chosen)} runs meet their target.", ""]
        rows = []
        for model in sources:
            for seed in seeds:
                cells = []
                for column in columns:
                    found = [e for e in chosen if e["key"]["model"] == model and e["key"]["seed"] == seed
                             and e["key"]["manifestation"] == column]  # fmt: skip
                    if not found:
                        cells.append("")
                        continue
                    text = _change(found[0])
                    cells.append(text if _meets(found[0], sources[model]) else f"**{text}**")
                if any(cells):
                    rows.append((model, str(seed), *cells))
        lines += markdown_table(("model", "seed", *columns), rows, text_columns=2)
        lines.append("")
        times = [e["wall"] for e in chosen if e["key"]["manifestation"] not in ONE_STEPS]
        if times:
            lines += [
                f"Wall seconds per run: median {statistics.median(times):.0f}, max {max(times):.0f}.",
                "",
            ]
    lines += _cli_agreement(runs)
    return lines


def plot(cache: dict[str, dict[str, Any]], path: Path) -> bool:
    """The default recipe's Python runs as validation accuracy per epoch: one panel per model, a
    colour per manifestation, a line per seed; the source dashed, the target dotted. False (nothing
    written) when the cache holds no such run."""
    entries = list(cache.values())
    sources = _sources(entries)
    runs = [
        e for e in entries if e["key"]["via"] == "python" and e["key"]["model"] in sources
        and e["key"]["manifestation"] in MANIFESTATIONS  # not a one-step check, nor one no longer run
        and e["key"]["recipe"] == _with_peak(_default_recipe(), e["key"]["manifestation"])
        and e["key"]["augmentation"] in ("as trained", None)
    ]  # fmt: skip
    models = [m for m in sources if any(e["key"]["model"] == m for e in runs)]
    if not models:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {m: f"C{i}" for i, m in enumerate(MANIFESTATIONS)}
    columns = min(3, len(models))
    rows = -(-len(models) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    for ax in axes.flat[len(models) :]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models, strict=False):
        source = sources[model]
        mine = [e for e in runs if e["key"]["model"] == model]
        first_seed = min(e["key"]["seed"] for e in mine)
        for e in mine:
            manifestation = e["key"]["manifestation"]
            label = manifestation if e["key"]["seed"] == first_seed else None
            accuracy = [100 * h["val_accuracy"] for h in e["history"]]
            ax.plot(accuracy, color=colours[manifestation], lw=1, marker=".", label=label)
        ax.axhline(source, color="k", ls="--", lw=1, label="source")
        ax.axhline(source - TARGET_GAP, color="k", ls=":", lw=1, label="target")
        ax.set(title=model, xlabel="epoch (0 = before)", ylabel="validation accuracy (%)")
        ax.set_ylim(source - 6, 100.3)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Fine-tuning coarse manifestations back with the default recipe (one line per seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _sources(entries: list[dict[str, Any]]) -> dict[str, float]:
    """Each model's source accuracy (%), from the cache's source entries."""
    return {e["key"]["model"]: 100 * e["accuracy"] for e in entries if e["key"]["via"] == "source"}


def _made_by(entries: list[dict[str, Any]]) -> str:
    """The sweep commands that made the cached runs, as each run recorded it."""
    commands = list(dict.fromkeys(e["sweep"] for e in entries if "sweep" in e))
    unrecorded = sum("sweep" not in e for e in entries)
    text = "Runs made by: " + (", ".join(f"`{c}`" for c in commands) or "-")
    if unrecorded:
        text += f"; {unrecorded} runs by earlier sweeps, which did not record their command"
    return text


def _sections(runs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], str | None]]:
    """The report's sections: (via, recipe, image-folder augmentation), Python's first. The digits
    runs (never augmented) join every section of their via and recipe; alone, they make their own."""
    found = {}
    for entry in runs:
        key = entry["key"]
        part = (key["via"], key["recipe"], key["augmentation"])
        found.setdefault(json.dumps(part, sort_keys=True), part)
    sections = list(found.values())
    augmented = {(via, json.dumps(recipe)) for via, recipe, augmentation in sections if augmentation}
    sections = [s for s in sections if s[2] or (s[0], json.dumps(s[1])) not in augmented]
    return sorted(sections, key=lambda section: section[0] != "python")


def _recipe_text(recipe: dict[str, Any]) -> str:
    changed = {k: v for k, v in recipe.items() if v != _default_recipe()[k]}
    return "Recipe(" + ", ".join(f"{k}={v!r}" for k, v in (changed or recipe).items()) + ")"


def _cli_agreement(runs: list[dict[str, Any]]) -> list[str]:
    """Whether each CLI run's accuracies equal the Python run's with the same key."""
    python = {_key_text({**e["key"], "via": None}): e for e in runs if e["key"]["via"] == "python"}
    pairs = [(e, python.get(_key_text({**e["key"], "via": None}))) for e in runs if e["key"]["via"] == "cli"]
    pairs = [(c, p) for c, p in pairs if p is not None]
    if not pairs:
        return []
    same = sum(
        [h["val_accuracy"] for h in c["history"]] == [h["val_accuracy"] for h in p["history"]]
        for c, p in pairs
    )
    return [
        f"CLI and Python runs of the same model, recipe, manifestation and seed: {same} of {len(pairs)} have "
        "identical validation accuracies at every epoch.",
        "",
    ]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--recipes",
        type=lambda s: s.split(";"),
        default=["default"],
        help="labels separated by ';' (labels hold commas), or 'all'",
    )
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument(
        "--manifestations",
        type=lambda s: s.split(";"),
        help=f"labels separated by ';' (default: all but {ONE_STEP_ALF!r}): "
        + "; ".join(map(repr, [*ONE_STEPS, *MANIFESTATIONS])),
    )
    parser.add_argument("--seeds", type=int, default=4, help="seeds 0..N-1 (default 4)")
    parser.add_argument("--via", type=lambda s: s.split(","), default=["python"], help="python, cli or both")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one torch thread each")
    parser.add_argument(
        "--augmentation",
        choices=list(AUGMENTATIONS),
        default="as trained",
        help="the image-folder models' training augmentation (default: as the corpus was trained, --hflip 0)",
    )
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--output", type=Path, default=RESULTS / "finetune.md")
    parser.add_argument(
        "--batch-size", type=int, help="every recipe's batch size (quick tries on a tiny corpus)"
    )
    parser.add_argument("--report", action="store_true", help="only write the results file from the cache")
    args = parser.parse_args(argv)
    unknown_manifestations = set(args.manifestations or []) - {*ONE_STEPS, *MANIFESTATIONS}
    if unknown_manifestations:
        parser.error(f"unknown manifestation(s) {sorted(unknown_manifestations)}")
    unknown = [r for r in args.recipes if r != "all" and r not in candidates()]
    if unknown:
        parser.error(f"unknown recipe(s) {unknown}; known: {', '.join(candidates())}")
    if "cli" in args.via and args.recipes != ["default"]:
        parser.error(
            "--via cli runs the default recipe only (the command line's defaults): --recipes default"
        )
    started = time.perf_counter()
    if not args.report:
        sweep(args)
    cache = read_cache(args.cache)
    lines = report(cache, args.corpus, None if args.report else time.perf_counter() - started)
    from odeify.core.fileio import atomic_write_bytes

    args.output.parent.mkdir(parents=True, exist_ok=True)
    png = args.output.with_suffix(".png")
    if plot(cache, png):
        lines += [f"![the default recipe's runs, epoch by epoch]({png.name})", ""]
    atomic_write_bytes(args.output, ("\n".join(lines) + "\n").encode())
    print("\n".join(lines))


if __name__ == "__main__":
    main()
