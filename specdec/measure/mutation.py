"""Mutants of a module patched in memory: what scripts/mutation_test.py runs the tests against.

Owns `list_mutants` (every mutmut 2.5.1 mutant of a module's source), `swaps` (the real functions
whose `__code__` / `__defaults__` a mutant changes, paired with the mutant's) and `rebind` (an edited
class or constant replaced wherever a loaded module holds it). No file is written. Knows nothing
about tests or verdicts: the script forks, patches, runs pytest and renders the page;
`specdec.certify.mutants` holds hand-written mutants of the acceptance rules for the certificate.
"""

from __future__ import annotations

import ast
import difflib
import sys
import types


def list_mutants(path: str, source: str) -> list[dict]:
    """Every mutmut mutant of the module `source` (read from `path`): its id, line and mutated source."""
    try:
        import mutmut
    except ImportError as err:
        raise SystemExit(f"mutation testing needs mutmut 2.5.1 ({err}): pip install mutmut==2.5.1") from err
    ids = mutmut.list_mutations(mutmut.Context(source=source, filename=path))
    old_lines = source.split("\n")
    bodies = function_bodies(source)
    mutants = []
    for number, mid in enumerate(ids):
        mutated, count = mutmut.mutate(mutmut.Context(source=source, mutation_id=mid, filename=path))
        if count != 1:
            raise RuntimeError(f"{path}: mutmut applied {count} mutations for id {mid}, expected 1")
        new_lines = mutated.split("\n")
        tag, i1, i2, j1, j2 = next(op for op in difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
                                   .get_opcodes() if op[0] != "equal")
        while i1 + 1 < i2 and not old_lines[i1].strip():  # a removed line aligned after a blank one
            i1 += 1
        mutants.append({"module": path, "id": number, "line": i1 + 1,
                        "old": " / ".join(x.strip() for x in old_lines[i1:max(i2, i1 + 1)]),
                        "new": " / ".join(x.strip() for x in new_lines[j1:j2]) or "(line removed)",
                        "in_function": any(a <= i1 + 1 <= b for a, b in bodies),
                        "names": top_level_names(source, i1 + 1), "source": mutated})
    return mutants


def function_bodies(source: str) -> list[tuple[int, int]]:
    """(first, last) line of every function body: an edit there changes only that function's code."""
    return [(node.body[0].lineno, node.end_lineno) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def top_level_names(source: str, line: int) -> list[str]:
    """Names bound by the top-level statement(s) of `source` that span `line` (decorators included)."""
    names = []
    for node in ast.parse(source).body:
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        if first <= line <= node.end_lineno:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.append(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names += [t.id for t in targets if isinstance(t, ast.Name)]
    return names


def rebind(module: types.ModuleType, namespace: dict, names: list[str]) -> int:
    """Replace the real objects called `names` by the mutant's wherever a loaded module holds them
    (a class or constant whose definition the mutant edits outside any function body)."""
    count = 0
    for name in names:
        old, new = getattr(module, name), namespace[name]
        for mod in list(sys.modules.values()):
            holder = getattr(mod, "__dict__", None)
            if not isinstance(holder, dict):
                continue
            for key, value in list(holder.items()):
                if value is old:
                    holder[key] = new
                    count += 1
    return count


def _functions(namespace: dict, module_name: str):
    """(owner, attribute, function) for every function and method defined in a module's namespace."""
    for name, value in namespace.items():
        if isinstance(value, types.FunctionType) and value.__module__ == module_name:
            yield namespace, name, value
        elif isinstance(value, type) and value.__module__ == module_name:
            for attr, member in vars(value).items():
                if isinstance(member, property):
                    member, attr = member.fget, f"{attr}.fget"
                elif isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if isinstance(member, types.FunctionType):
                    yield value, attr, member


def swaps(module: types.ModuleType, mutated_source: str) -> tuple[list[tuple[types.FunctionType, types.FunctionType]], dict]:
    """(real function, mutant function) pairs whose code or defaults differ, and the namespace of the
    mutated module (`exec` into a fresh one; SyntaxError and the like propagate: it cannot import)."""
    namespace = {"__name__": module.__name__, "__file__": module.__file__, "__builtins__": __builtins__}
    exec(compile(mutated_source, module.__file__, "exec", dont_inherit=True), namespace)
    new = {(id(owner) if owner is not namespace else 0, attr): fn
           for owner, attr, fn in _functions(namespace, module.__name__)}
    old_classes = {name: v for name, v in vars(module).items() if isinstance(v, type)}
    new_classes = {name: v for name, v in namespace.items() if isinstance(v, type)}
    out = []
    for owner, attr, fn in _functions(vars(module), module.__name__):
        key = (0, attr)
        if owner is not vars(module):
            name = next(n for n, c in old_classes.items() if c is owner)
            key = (id(new_classes[name]), attr)
        mutant = new.get(key)
        if mutant is None:
            continue
        if (fn.__code__ != mutant.__code__ or fn.__defaults__ != mutant.__defaults__
                or fn.__kwdefaults__ != mutant.__kwdefaults__):
            out.append((fn, mutant))
    return out, namespace


# ---- running ------------------------------------------------------------------------------------
