"""The floors hold (docs/architecture.md): imports point down only (the layers contract in
pyproject.toml, checked with import-linter), no module imports itself back through any chain,
type-only imports included (strongly connected components of grimp's module graph), and
`import specdec` is lazy: it loads no submodule above the log filter, and costs little beside
`import torch, transformers` in a fresh interpreter."""

import subprocess
import sys
from pathlib import Path

import grimp
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_the_layers_contract_is_kept(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0


def cycles(graph) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan, iterative)."""
    index, low, on, stack, found = {}, {}, set(), [], []
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start), on.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while component[-1:] != [node]:
                        component.append(stack.pop()), on.discard(component[-1])
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child), on.add(child)
                work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
            elif child in on:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_cycles_type_only_included():
    assert cycles(grimp.build_graph("specdec", "experiments", cache_dir=None)) == []


def test_the_cycle_finder_finds_a_cycle():
    class Graph:  # a -> b -> c -> a, d alone
        modules = {"a", "b", "c", "d"}
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

        def find_modules_directly_imported_by(self, m):
            return self.edges[m]

    assert cycles(Graph()) == [["a", "b", "c"]]


def fresh_seconds(code: str) -> float:
    """The best of three fresh interpreters' time for `code`."""
    probe = f"import time; t = time.perf_counter(); {code}; print(time.perf_counter() - t)"
    return min(float(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                     cwd=ROOT).stdout.split()[-1]) for _ in range(3))


def test_import_specdec_is_lazy_and_cheap():
    loaded = subprocess.run([sys.executable, "-c", "import sys, specdec; print(sorted(m for m in sys.modules "
                             "if m.startswith('specdec.')))"], capture_output=True, text=True, check=True, cwd=ROOT)
    assert loaded.stdout.split() == ["['specdec.quiet']"]
    assert fresh_seconds("import specdec") <= 1.25 * fresh_seconds("import torch, transformers")
