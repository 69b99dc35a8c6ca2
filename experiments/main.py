"""The main job: the grid of grids/main.yaml on the embedded target, then the leaderboard and the findings report,
ending with the report's verdict (grids/main.yaml says which cells and why).

    python -m experiments.main                       # the grid, the leaderboard files, REPORT.md, the verdict
    python -m experiments.main max_new_tokens=24 results.dir=results/quick
    python -m experiments.main --dry-run             # print the commands it runs (paste them as they are)
    python -m experiments.main size=full             # the publication-size grid (grids/full.yaml)
    python -m experiments.main kv=off                # without the KV-retention curve (`kv:` of the grid)
    python -m experiments.main prediction=off        # without the interactions predicted before the cells

Owns the grids (`size=NAME`): their blocks (Hydra multiruns of `experiments.run`), drafters resolved against the
registry (`others` = every registered drafter no block names nor `exclude_drafters` excludes), fixed settings and
overrides; then RESULTS/leaderboard/, RESULTS/REPORT.md, the `kv:` curve and the verdict with the exit status.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from experiments.config import CONF_DIR, RunnerConfig
from experiments.store import ResultsStore, StoreError
from specdec.measure import records

GRID_DIR = Path(__file__).parent / "grids"
GRID_FILE = GRID_DIR / "main.yaml"
RECORDS = "records"
"""RESULTS/records/: the job's result record (never the checkout's docs/measurements; `python
scripts/measurements.py --publish RESULTS` copies it there)."""
OTHERS = "others"
"""The drafter entry that stands for every registered drafter no block names (and none excluded)."""


def _preset_spec(preset: str) -> str | None:
    """The quant spec that quant preset `preset` names (experiments/conf/quant/), None for no such preset
    (Hydra names a missing preset itself, with the list of presets)."""
    path = CONF_DIR / "quant" / f"{preset}.yaml"
    return str(OmegaConf.load(path).get("spec", "none")) if path.exists() else None


def _quant_note(preset: str) -> str | None:
    """Why quant preset `preset` cannot run here (its backend is not registered), or None."""
    from specdec import quant

    spec = _preset_spec(preset)
    if spec is None:
        return None
    try:
        quant.parse_spec(spec)
    except quant.QuantSpecError as err:
        return f"quant={preset} dropped: its spec {spec!r} does not parse with the backends registered here ({err})"
    return None


def grid_blocks(extra: list[str], grid_file: Path = GRID_FILE) -> tuple[list[list[str]], list[str]]:
    """The multiruns' overrides, one list per block, and notes on what was dropped. An `extra`
    `KEY=...` replaces the grid's entry for KEY in every block."""
    from specdec import drafters

    grid = OmegaConf.to_container(OmegaConf.load(grid_file))
    excluded = set(grid.get("exclude_drafters", []))
    registered = drafters.names()
    named = {d for block in grid["blocks"] for d in block.get("drafter", []) if d != OTHERS}
    fixed: dict[str, str] = {}
    for item in [*grid.get("fixed", []), *extra]:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not KEY=VALUE")
        fixed[key] = value
    notes: list[str] = []
    blocks = []
    for block in grid["blocks"]:
        entries = {key: [str(v) for v in values] for key, values in block.items()}
        if "drafter" in entries:
            wanted = []
            for name in entries["drafter"]:
                if name == OTHERS:
                    wanted += [n for n in registered if n not in named and n not in excluded]
                elif name in registered:
                    wanted.append(name)
                else:
                    notes.append(f"drafter={name} dropped: not registered (registered: {', '.join(registered)})")
            entries["drafter"] = list(dict.fromkeys(wanted))
        if "quant" in entries and "quant" not in fixed:
            kept = []
            for preset in entries["quant"]:
                note = _quant_note(preset)
                notes.append(note) if note else kept.append(preset)
            entries["quant"] = kept
        overrides = {key: ",".join(values) for key, values in entries.items() if key not in fixed}
        if any(not values for key, values in entries.items() if key not in fixed):
            continue  # a block left with nothing to sweep
        blocks.append([*(f"{k}={v}" for k, v in overrides.items()), *(f"{k}={v}" for k, v in fixed.items())])
    return blocks, list(dict.fromkeys(notes))


def pick_grid(overrides: list[str]) -> tuple[Path, list[str]]:
    """The grid file a `size=NAME` override names (default grids/main.yaml) and the other overrides."""
    sizes = [o.split("=", 1)[1] for o in overrides if o.startswith("size=")]
    rest = [o for o in overrides if not o.startswith("size=")]
    if not sizes:
        return GRID_FILE, rest
    path = GRID_DIR / f"{sizes[-1]}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in GRID_DIR.glob("*.yaml")))
        raise ValueError(f"size={sizes[-1]}: no grid {path.name} (sizes: {known})")
    return path, rest


def commands(blocks: list[list[str]]) -> list[list[str]]:
    """One `python -m experiments.run -m ...` command per block."""
    return [[sys.executable, "-m", "experiments.run", "-m", *block] for block in blocks]


def tune_command(blocks: list[list[str]]) -> list[str]:
    """`python -m specdec.tune MODEL --reuse --threads N --quant SPECS`: this machine's kernel, head dtype and
    curve for the grid's target and each real-kernel quantized target of the grid (numerics-only backends
    run the reference's cost and are not tuned), measured first or reused, and said so."""
    from specdec import quant as quantization  # torch: only when the grid is run

    settings = dict(o.split("=", 1) for o in blocks[0])
    model = OmegaConf.load(CONF_DIR / "model" / f"{settings.get('model', 'smollm2')}.yaml").name
    threads = settings.get("runner.threads", str(RunnerConfig.threads))
    names = [name for block in blocks for o in block if o.startswith("quant=") for name in o.split("=", 1)[1].split(",")]
    specs = [spec for spec in dict.fromkeys(map(_preset_spec, names))
             if spec not in (None, "none") and quantization.get(quantization.parse_spec(spec).backend).packed]
    return ([sys.executable, "-m", "specdec.tune", model, "--reuse"] + (["--threads", threads] if int(threads) else [])
            + (["--quant", ",".join(specs)] if specs else []))


def kv_command(grid_file: Path, results: str, extra: list[str]) -> list[str] | None:
    """`python -m experiments.kv RESULTS --OPTION VALUE ...` from the grid's `kv:` entry (None without
    one, or with the override `kv=off`)."""
    bad = [o for o in extra if o != "kv=off"]
    if bad:
        raise ValueError(f"{bad[0]}: the KV curve takes only kv=off (its settings are the grid file's `kv:` entry)")
    settings = OmegaConf.to_container(OmegaConf.load(grid_file)).get("kv")
    if not settings or extra:
        return None
    options = [a for key, value in settings.items() for a in (f"--{key.replace('_', '-')}", str(value))]
    return [sys.executable, "-m", "experiments.kv", results, *options]


def quick_check(overrides: list[str]) -> None:
    """Compose the command line's overrides alone against the schema before the drafters are imported
    (seconds), so a misspelled preset or key fails at once with Hydra's message; a drafter preset only
    the registry provides is looked up then."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import MissingConfigException

    from experiments.config import register_configs

    register_configs(drafter_presets=False)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            compose("config", overrides=overrides)
        except MissingConfigException as err:
            if "'drafter/" not in str(err):
                raise
            register_configs()
            compose("config", overrides=overrides)


def check_cells(blocks: list[list[str]]) -> list:
    """Compose every cell of every block as `experiments.run` will (Hydra, strict: a misspelled preset
    or key raises Hydra's own error), and check its drafter is registered and its prompts load, before
    anything runs. Returns the cells' `ExperimentConfig`s."""
    import itertools

    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from experiments.config import ExperimentConfig, check_keys, register_configs
    from experiments.questions import load_questions
    from specdec import drafters

    register_configs()
    parser, loaded, cells = OverridesParser.create(), set(), []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for block in blocks:
            choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
                       else [o.input_line] for o in parser.parse_overrides(block)]
            for overrides in itertools.product(*choices):
                cfg = compose("config", overrides=list(overrides))
                check_keys(cfg)
                exp: ExperimentConfig = OmegaConf.to_object(cfg)
                if exp.drafter.name not in drafters.names():
                    raise KeyError(f"drafter {exp.drafter.name!r} is not registered; registered drafters: "
                                   f"{', '.join(drafters.names())}")
                if repr(exp.dataset) not in loaded:
                    load_questions(exp.dataset)
                    loaded.add(repr(exp.dataset))
                cells.append(exp)
    return cells


def profile_command(blocks: list[list[str]], grid_file: Path, results: str) -> list[str] | None:
    """`experiments.run -m` of each drafter x shape of the grid's kernel blocks with the overrides of its
    `prediction:` entry (fp32, held-out prompts) into RESULTS/profile: what `predict_block` reads."""
    extra = OmegaConf.to_container(OmegaConf.load(grid_file)).get("prediction")
    kernel = [dict(o.split("=", 1) for o in b) for b in blocks if set(dict(o.split("=", 1) for o in b).get(
        "quant", "none").split(",")) - {"none"}]
    if not extra or not kernel:
        return None
    union = lambda key: ",".join(dict.fromkeys(v for b in kernel for v in b[key].split(",")))  # noqa: E731
    kept = [f"{k}={v}" for k, v in kernel[0].items() if k.split(".")[0] not in (
        "drafter", "shape", "quant", "dataset", "results") and not k.startswith(("runner.teacher", "runner.latency"))]
    return commands([[f"drafter={union('drafter')}", f"shape={union('shape')}", *kept, *extra,
                      f"results.dir={Path(results) / 'profile'}"]])[0]


def predict_block(cells: list, results: str, tune: list[str], control: dict | None, profiled: bool) -> None:
    """Before a block runs, print the mechanism control's prediction (in the grid's `mechanism_control` drafter's
    block) and, with RESULTS/profile, each drafted kernel cell's of `cells` (the block's configs, `check_cells`) from
    the tune records' curves (`experiments.predict`); a note on stderr where one cannot be made."""
    from experiments import predict
    from experiments.run import drafter_label, is_reference, kernel_label
    from specdec.core.shapes import parse_shape
    from specdec.tune import stored_record

    threads = int(tune[tune.index("--threads") + 1]) if "--threads" in tune else None
    if control and {c.drafter.name for c in cells} == {control["drafter"]}:
        try:
            print("mechanism control, predicted before it runs: " + str(predict.predict_control(
                results, control["drafter"], control["source"], kernel_label(cells[0]))), flush=True)
        except (LookupError, ValueError, StoreError) as err:
            print(f"mechanism control: no prediction ({err})", file=sys.stderr)
    for cfg in cells if profiled else []:
        if is_reference(cfg.quant.spec) and not cfg.quant.label:
            continue  # the fp32 cell: its own reference, no interaction
        drafter, shape = cfg.drafter.name, str(parse_shape(cfg.shape.spec))
        name = f"{drafter_label(drafter, cfg.drafter.options)} {shape} on {kernel_label(cfg)}"
        try:
            found = {role: stored_record(tune[3], threads, "cpu", s) for role, s in (("kernel", cfg.quant.spec),
                                                                                     ("fp32", None))}
            if None in found.values():
                raise LookupError(f"no tune record of {tune[3]} ({', '.join(r for r, f in found.items() if not f)})")
            p = predict.predict_cell(results, name, drafter, shape, {r: f[0] for r, f in found.items()},
                                     {r: Path(f[1]).name for r, f in found.items()})
            print(f"predicted before it runs: {p['cell']}: interaction {p['predicted']:.2f} (from {p['from']}; "
                  f"the tune record's fp32 forward is {p['fp32_curve_over_runs']:.2f}x the profile's)", flush=True)
        except (LookupError, ValueError, StoreError, OSError) as err:
            print(f"{name}: no prediction before it runs ({err})", file=sys.stderr)


def record_counts(kind: str, paths: list[Path], this_run: dict) -> dict[str, int]:
    """Over `this_run` and every stored record of `kind` in `paths` (the results store's and the published
    ones of this machine, a published copy counted once): runs, runs with a fight verdict, with the A/A
    control compound, with the cost model's target met; of the runs that carried them, those whose every speed cell's
    prediction (`predicted` of `predicting`; at the cell's own acceptance factor taken out, `equal` of `equalled`)
    and whose mechanism control (`mechanism` of `controlled`) fell within."""
    runs = [*{(r["date"], r["command"]): r["result"] for p in paths if p.exists() for r in records.read(p)
              if r["kind"] == kind}.values(), this_run]
    cells = [[p for p in r.get("prediction") or [] if p["cell"] in r.get("verdict", {})] for r in runs]
    scored = [[p["within"] for p in c] for c in cells]
    equal = [[p["within_at_equal_acceptance"] for p in c] for c in cells if all("at_equal_acceptance" in p for p in c)]
    controls = [r["mechanism_control"]["within"] for r in runs if r.get("mechanism_control")]
    return {"runs": len(runs), "fight": sum("fight" in r.get("verdict", {}).values() for r in runs),
            "control": sum(r.get("control") == "compound" for r in runs),
            "cost": sum(bool(r.get("cost_model", {}).get("beats_nulls")) for r in runs),
            "predicting": sum(map(bool, scored)), "predicted": sum(bool(w) and all(w) for w in scored),
            "equalled": sum(map(bool, equal)), "equal": sum(bool(w) and all(w) for w in equal),
            "controlled": len(controls), "mechanism": sum(controls)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the main grid, then print the findings report's verdict.")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every block, e.g. max_new_tokens=32")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the board and report")
    args = parser.parse_args(argv)
    try:
        grid_file, overrides = pick_grid(args.overrides)
        predict = "prediction=off" not in overrides
        overrides = [o for o in overrides if o != "prediction=off"]
        kv_off = [o for o in overrides if o.startswith("kv=")]
        if not args.dry_run:
            quick_check([o for o in overrides if o not in kv_off])
        blocks, notes = grid_blocks([o for o in overrides if o not in kv_off], grid_file)
        results = next(o.split("=", 1)[1] for o in reversed(blocks[0]) if o.startswith("results.dir="))
        kv = kv_command(grid_file, results, kv_off)
        cells = [] if args.dry_run else [check_cells([b]) for b in blocks]  # each composes; drafter, prompts load
        if not args.dry_run:
            ResultsStore(results)  # an incompatible results directory fails here too, before any work
    except Exception as err:  # noqa: BLE001 -- Hydra, OmegaConf, prompt and store errors: one line, nothing run
        print(f"experiments.main: error: {err}\nnothing was run or written", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    profile = profile_command(blocks, grid_file, results) if predict else None  # what the predictions read
    runs = [tune_command(blocks), *([profile] if profile else []), *commands(blocks), *([kv] if kv else [])]
    for command in runs:
        print(shlex.join(command), flush=True)
    if args.dry_run:
        return 0
    control = OmegaConf.to_container(OmegaConf.load(grid_file)).get("mechanism_control")
    block_commands = commands(blocks)
    for command in runs:
        block = command in block_commands
        if block:
            predict_block(cells[block_commands.index(command)], results, runs[0], control, profile is not None)
        status = subprocess.run(command).returncode
        if status != 0 and command is profile:
            print(f"the held-out profile failed (exit {status}): no prediction before the cells", file=sys.stderr)
            profile = None
        elif status != 0:  # no report: a report now would print an earlier run's cells as this run's verdict
            print(f"\nthe grid failed (exit {status}) at: {shlex.join(command)}\nno report and no record were "
                  f"written; the cells stored so far are in {results} (python -m experiments.report {results})",
                  file=sys.stderr)
            return status
        if block and profile:
            from experiments.predict import print_measured

            print_measured(results)
    from experiments.leaderboard import LeaderboardError, write_leaderboard
    from experiments.report import ReportError, write_report

    try:
        write_leaderboard(results, n_boot=args.bootstrap)
        report = write_report(results, n_boot=args.bootstrap)
    except (StoreError, LeaderboardError, ReportError) as err:
        print(f"no report: {err}", file=sys.stderr)
        return 1
    print(f"\ntables: {Path(results) / 'leaderboard' / 'leaderboard.md'}; report: {report.path}\n")
    print("\n".join(report.verdict))
    threads = int(runs[0][runs[0].index("--threads") + 1]) if "--threads" in runs[0] else "auto"  # the cells'
    kind = "main" if grid_file == GRID_FILE else f"main-{grid_file.stem}"  # one record kind per grid
    summary = {**report.summary, "results": str(results), "grid_exit": 0}
    name = f"{records.describe_machine()['key']}.jsonl"
    try:
        published = [records.default_root() / name]
    except records.RecordError:  # no checkout to read published records from
        published = []
    summary["record"] = record_counts(kind, [Path(results) / RECORDS / name, *published], summary)
    path = records.append(kind, summary, root=Path(results) / RECORDS, threads=threads)
    print(f"record: {path} (publish it: python scripts/measurements.py --publish {results})", file=sys.stderr)
    print("record of this grid on this machine, this run included: fight in {fight} of {runs}; A/A compound in "
          "{control} of {runs}; cost target met in {cost} of {runs}; every prediction within in {predicted} of "
          "{predicting} ({equal} of {equalled} at equal acceptance); mechanism control within in {mechanism} of "
          "{controlled}".format(**summary["record"]))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
