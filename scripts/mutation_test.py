"""Mutation testing of the exactness code against the fast exactness tests, in memory.

    pip install mutmut==2.5.1        # the mutant generator (a venv with --system-site-packages will do)
    python scripts/mutation_test.py specdec/core/sampling.py specdec/core/tree.py
    python scripts/mutation_test.py specdec/core/tree.py --only 12,40   # rerun some mutants
    python scripts/mutation_test.py MODULES --tests tests/test_sampling.py,... --out /tmp/first.md
    python scripts/mutation_test.py MODULES --resume /tmp/first.jsonl

Owns the run: mutmut 2.5.1 lists every mutant of each module; each runs in a forked child of one warm
process with the changed functions' `__code__` / `__defaults__` swapped (`specdec.measure.mutation`),
no file written. A mutant is *killed* when the tests (`-x`) fail, *timeout* past `--timeout-factor` x
the unmutated run, *survived* when they pass, *not applied* when it changes nothing a running function
reads. Survivors are explained in `EQUIVALENT` or killed by a new test. Writes
`docs/measurements/mutation-testing.md` and the raw per-mutant results beside it.
Knows nothing about what the modules compute: the tests decide.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from specdec.machine import machine_facts
from specdec.measure.mutation import list_mutants, rebind, swaps

ROOT = Path(__file__).resolve().parents[1]
TESTS = ("tests/test_sampling_contract.py", "tests/test_tree_contract.py", "tests/test_sampling.py", "tests/test_tree.py", "tests/test_exact_law.py", "tests/test_exactness.py",
         "tests/test_chain_mask.py")
"""The fast exactness tests (the chi-square grid of test_exactness.py is deselected by `DESELECT`); the
two contract files were added to kill the survivors of a first run without them."""
DESELECT = "not sampling_matches and not reference_cases and not sibling_draft and not greedy_output and not same_seed"
OUT = ROOT / "docs" / "measurements" / "mutation-testing.md"

_S, _T, _A = "specdec/core/sampling.py", "specdec/core/tree.py", "specdec/core/acceptance.py"
EQUIVALENT: dict[tuple[str, str, str], str] = {
    (_S, "if sampling.top_k and sampling.top_k < scaled.shape[-1]:",
     "if sampling.top_k and sampling.top_k <= scaled.shape[-1]:"):
        "at top_k = V the k-th largest is the minimum, and masking the values below the minimum masks nothing",
    (_T, 'if parents.device.type != "cpu":', 'if parents.device.type != "XXcpuXX":'):
        "every tensor then takes the ancestor-mask path, which gives the same depths (the host walk is a "
        "speed choice)",
    (_T, "rows = torch.arange(n, device=parents.device)", "rows = None"):
        "`rows` is never read (dead code in `ancestor_mask`)",
    (_T, "for _ in range(max(1, n).bit_length()):  # 2^rounds >= n >= depth: no host sync needed",
     "for _ in range(max(2, n).bit_length()):  # 2^rounds >= n >= depth: no host sync needed"):
        "one more pointer-jumping round for n <= 1; a round after every ancestor is marked changes nothing",
    (_T, "up = torch.where(has, up, torch.full_like(up, -1))", "up = torch.where(has, up, torch.full_like(up, -2))"):
        "a negative `up` is only compared with 0 and clamped before indexing: -2 acts as -1",
    (_T, "new_index = torch.full((parents.numel(),), -1, dtype=torch.long)",
     "new_index = torch.full((parents.numel(),), +1, dtype=torch.long)"):
        "the fill is never read: new_index is read at the parents of kept nodes, which are kept (keep is "
        "ancestor-closed)",
    (_T, "new_index = torch.full((parents.numel(),), -1, dtype=torch.long)",
     "new_index = torch.full((parents.numel(),), -2, dtype=torch.long)"):
        "the fill is never read: new_index is read at the parents of kept nodes, which are kept (keep is "
        "ancestor-closed)",
    (_T, "return torch.where(old >= 0, new_index[old.clamp(min=0)], old)",
     "return torch.where(old > 0, new_index[old.clamp(min=0)], old)"):
        "differs only where the old parent is node 0; node 0 is then kept and first in `keep`, so its new "
        "index is 0 too",
    (_T, "return torch.where(old >= 0, new_index[old.clamp(min=0)], old)",
     "return torch.where(old >= 1, new_index[old.clamp(min=0)], old)"):
        "differs only where the old parent is node 0; node 0 is then kept and first in `keep`, so its new "
        "index is 0 too",
    (_A, "return accept_greedy(draft, target_logits[0].argmax(-1))",
     "return accept_greedy(draft, target_logits[0].argmax(+1))"):
        "target_logits[0] is 2-D ([N + 1, V]), so dim +1 is dim -1",
    (_A, "device = target_probs.device", "device = None"):
        "not on a CPU: torch.rand(device=None) draws on the CPU, where every test's generator and tensors "
        "live; on a GPU the mutant would raise (a CUDA generator asked for a CPU tensor), and the suite "
        "has no GPU to show it",
}
"""(module path, original line, mutated line), both stripped -> why the mutant cannot be told apart
from the real code by any test of the module's contract."""


# ---- running ------------------------------------------------------------------------------------

class _FirstFailure:
    """pytest plugin: remembers the first failing test's node id."""

    def __init__(self) -> None:
        self.nodeid = None

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed and self.nodeid is None:
            self.nodeid = report.nodeid


def pytest_args(tests: list[str]) -> list[str]:
    if not tests:
        raise ValueError("no test files: pytest would collect the whole suite")
    return [*tests, "-x", "-q", "-p", "no:cacheprovider", "-k", DESELECT, "-W", "ignore"]


def run_mutant(module: types.ModuleType, mutant: dict, stages: list[list[str]], timeout: float) -> dict:
    """Fork, patch the mutant in, run the tests stage by stage (the module's own tests first, so a
    kill there skips collecting the rest); the verdict with the first failing test."""
    import pytest

    report = tempfile.NamedTemporaryFile("r", suffix=".txt", delete=False)
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # child: patch, test, exit with pytest's code
        code = 98
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            try:
                pairs, namespace = swaps(module, mutant["source"])
            except Exception as err:  # the mutant does not even import: any test fails
                Path(report.name).write_text(f"import: {type(err).__name__}: {err}")
                os._exit(1)
            if mutant["in_function"]:
                if not pairs:
                    os._exit(97)
                for fn, new in pairs:
                    fn.__code__, fn.__defaults__, fn.__kwdefaults__ = new.__code__, new.__defaults__, new.__kwdefaults__
            elif not rebind(module, namespace, mutant["names"]):
                os._exit(97)
            plugin = _FirstFailure()
            for tests in stages:
                code = int(pytest.main(pytest_args(tests), plugins=[plugin]))
                if code != 0:
                    break
            Path(report.name).write_text(plugin.nodeid or "")
        finally:
            os._exit(code)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.perf_counter() - start > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = None
            break
        time.sleep(0.05)
    seconds = round(time.perf_counter() - start, 1)
    first = Path(report.name).read_text().strip()
    os.unlink(report.name)
    if status is None:
        verdict = "timeout"
    else:
        code = os.waitstatus_to_exitcode(status)
        verdict = {0: "survived", 1: "killed", 97: "not applied"}.get(code, f"error (exit {code})")
    return {k: mutant[k] for k in ("module", "id", "line", "old", "new")} | {
        "verdict": verdict, "killed_by": first if verdict == "killed" else None, "seconds": seconds}


def run_module(path: str, only: set[int] | None, timeout_factor: float, log, earlier: dict) -> list[dict]:
    """Run every mutant of `path` (or those in `only`); a mutant `earlier` (a previous run's results
    by (module, id, old, new)) found killed keeps that verdict, the others run again."""
    import importlib

    import pytest

    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    own = [t for t in TESTS if Path(t).stem.startswith(f"test_{Path(path).stem}")]
    # the module's own tests first (most kills are there); a module without its own test file
    # (acceptance.py) has one stage: an empty stage would hand pytest no path, and it would collect
    # the whole suite (its acceptance mutants all timed out so)
    stages = [stage for stage in (own, [t for t in TESTS if t not in own]) if stage]
    start = time.perf_counter()
    if pytest.main(pytest_args(list(TESTS))) != 0:
        raise SystemExit(f"the tests fail on the unmutated {path}: fix them first")
    baseline = time.perf_counter() - start
    results = []
    for mutant in list_mutants(path, (ROOT / path).read_text()):
        if only is not None and mutant["id"] not in only:
            continue
        before = earlier.get((path, mutant["id"], mutant["old"], mutant["new"]))
        if before is not None and before["verdict"] in ("killed", "timeout"):
            results.append(before)
            continue
        result = run_mutant(module, mutant, stages, timeout_factor * baseline + 20)
        if earlier:  # the verdict of the earlier run, where it reached this mutant
            result["first"] = before.get("first", before["verdict"]) if before else None
        else:
            result["first"] = result["verdict"]
        result["equivalent"] = EQUIVALENT.get((path, result["old"], result["new"]))
        results.append(result)
        log.write(json.dumps(result) + "\n")
        log.flush()
        print(f"{path}:{result['line']} #{result['id']} {result['verdict']} {result['seconds']}s  "
              f"{result['old']!r} -> {result['new']!r}", file=sys.stderr)
    return results


# ---- the generated page -------------------------------------------------------------------------

def score(results: list[dict]) -> dict:
    applied = [r for r in results if r["verdict"] != "not applied"]
    killed = [r for r in applied if r["verdict"] in ("killed", "timeout")]
    equivalent = [r for r in applied if r["verdict"] == "survived" and r["equivalent"]]
    return {"mutants": len(results), "applied": len(applied), "killed": len(killed),
            "equivalent": len(equivalent), "unexplained": len(applied) - len(killed) - len(equivalent)}


def render(results: list[dict], meta: dict) -> str:
    lines = ["# Mutation testing of the exactness code", "",
             f"Generated by `{meta['command']}` on {meta['date']} at commit {meta['commit']}"
             + (" (the first run: the same with `--tests` the files before the two contract files)."
                if "--resume" in meta["command"] else "."),
             f"Machine: `lscpu` \"{meta['cpu']}\", {os.cpu_count()} cores shared; mutmut {meta['mutmut']} lists the "
             "mutants, each is patched in memory into a forked child (`scripts/mutation_test.py`).",
             f"Tests: `{' '.join(TESTS)}` with `-k \"{DESELECT}\"` (the chi-square grid deselected), `-x`.", "",
             "Score = killed / (applied - equivalent); a timeout counts as killed; *not applied* = the edit "
             "changes no code a function runs (docstrings, annotations).", ""]
    for path in dict.fromkeys(r["module"] for r in results):
        mine = [r for r in results if r["module"] == path]
        s = score(mine)
        denominator = s["applied"] - s["equivalent"]
        lines += [f"## `{path}`", "",
                  f"{s['mutants']} mutants, {s['applied']} applied: {s['killed']} killed, {s['equivalent']} "
                  f"equivalent, {s['unexplained']} survived unexplained. Score {s['killed']}/{denominator}"
                  f" = {s['killed'] / denominator:.3f}." if denominator else "no mutant applied.", "",
                  "Every mutant that survived the first run or survives now, with its verdict now:", "",
                  "| # | line | original | mutant | first run | now |", "| --- | --- | --- | --- | --- | --- |"]
        first = [r for r in mine if r.get("first", r["verdict"]) is not None]
        lines[-4:-4] = [f"First run (the tests before the contract files): {len(first)} mutants reached, "
                        f"{sum(r.get('first', r['verdict']) == 'survived' for r in first)} survived.", ""]
        for r in mine:
            if r.get("first", r["verdict"]) in ("killed", "timeout") or (
                    r.get("first", r["verdict"]) is None and r["verdict"] in ("killed", "timeout")):
                continue
            now = {"killed": f"killed by `{r['killed_by']}`"}.get(r["verdict"], r["verdict"])
            if r["verdict"] == "survived" and r["equivalent"]:
                now = f"equivalent: {r['equivalent']}"
            lines.append(f"| {r['id']} | {r['line']} | `{_cell(r['old'])}` | `{_cell(r['new'])}` | "
                         f"{r.get('first', r['verdict']) or 'not reached'} | {now} |")
        killers = {}
        for r in mine:
            if r["killed_by"]:
                test = r["killed_by"].split("[")[0]
                killers[test] = killers.get(test, 0) + 1
        lines += ["", "Kills per test (first failing test, `-x`): " +
                  "; ".join(f"`{t}` {n}" for t, n in sorted(killers.items(), key=lambda kv: -kv[1])), ""]
    return "\n".join(lines) + f"\n<!-- meta {json.dumps(meta)} -->\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _cpu_name() -> str:
    facts = machine_facts()
    return f"{facts['name']}, family {facts['family']} model {facts['model']}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="+", help="module paths, e.g. specdec/core/tree.py")
    parser.add_argument("--only", default=None, help="comma-separated mutant numbers (one module)")
    parser.add_argument("--timeout-factor", type=float, default=3.0)
    parser.add_argument("--out", default=str(OUT), help="the generated page; its raw results go beside it (.jsonl)")
    parser.add_argument("--tests", default=None, help="comma-separated test files instead of TESTS (e.g. a "
                        "first run without the contract files, then --resume from its results)")
    parser.add_argument("--render", action="store_true", help="only write the page again from the raw results "
                        "beside --out (after EQUIVALENT or the page's wording changed)")
    parser.add_argument("--resume", default=None, help="raw results (.jsonl) of an earlier run: its killed "
                        "mutants keep their verdict, the others run again (after tests were added)")
    return parser.parse_args(argv)


def rerender(out: Path) -> None:
    """The page written again from the raw results beside it and the meta it records."""
    results = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    meta = json.loads(out.read_text().split("<!-- meta ")[1].split(" -->")[0])
    out.write_text(render(results, meta))


def write_page(out: Path, results: list[dict], argv: list[str]) -> None:
    """The raw results (.jsonl beside `out`) and the page, with the run's command, date, commit and machine."""
    import mutmut

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"command": "python scripts/mutation_test.py " + " ".join(argv), "date": datetime.date.today().isoformat(),
            "commit": commit, "cpu": _cpu_name(), "mutmut": mutmut.__version__}
    out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    out.write_text(render(results, meta))


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.tests:
        global TESTS
        TESTS = tuple(args.tests.split(","))
    os.environ.setdefault("SPECDEC_CACHE", tempfile.mkdtemp())
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", tempfile.mkdtemp())
    os.chdir(ROOT)
    import torch

    torch.set_num_threads(1)  # and no thread pool to inherit across fork
    only = None if args.only is None else {int(x) for x in args.only.split(",")}
    if args.render:
        return rerender(Path(args.out))
    earlier = {}
    for line in Path(args.resume).read_text().splitlines() if args.resume else []:
        r = json.loads(line)
        earlier[(r["module"], r["id"], r["old"], r["new"])] = r
    results = []
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as log:
        for path in args.modules:
            results += run_module(path, only, args.timeout_factor, log, earlier)
    if only is not None:  # a partial rerun: print, do not overwrite the page
        return print(json.dumps(results))
    write_page(Path(args.out), results, sys.argv[1:] if argv is None else argv)
    print(json.dumps({path: score([r for r in results if r["module"] == path]) for path in args.modules}))

if __name__ == "__main__":
    main()
