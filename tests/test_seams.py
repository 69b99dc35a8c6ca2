"""The core contracts other work builds on: no import cycles, node ids that survive pruning, the
`commit(Step)` hook, and a cache protocol with absolute positions."""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specdec
from specdec.core import tree as tree_ops
from specdec.runtime.cache import Cache, KVCache
from specdec.core.draft import Draft, Step
from specdec.runtime.model import tree_attention


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(specdec.__path__, "specdec."))


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """Each module of specdec, imported first in its own interpreter: an import cycle fails here
    whatever order `specdec/__init__.py` happens to use."""
    script = ("import importlib, sys\nfailed = []\nfor name in sys.argv[1:]:\n"
              "    for key in [k for k in sys.modules if k == 'specdec' or k.startswith('specdec.')]:\n"
              "        del sys.modules[key]\n"
              "    try:\n        importlib.import_module(name)\n"
              "    except ImportError as err:\n        failed.append(f'{name}: {err}')\n"
              "print('\\n'.join(failed))\nsys.exit(1 if failed else 0)\n")
    names = [m for m in _modules() if not m.endswith("_backend")]  # optional libraries, tested in test_quant
    proc = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


CORE_PACKAGES = ("core", "target", "measure")
"""The layers below the drafters: the loop and its records, target models and caches, measurement."""


def _imports(path: Path) -> list[str]:
    """Names of the `specdec` modules a file imports when it runs (in functions too; not under
    `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    nodes = list(ast.walk(tree))
    names = [n.module or "" for n in nodes if isinstance(n, ast.ImportFrom) and n.level == 0]
    names += [a.name for n in nodes if isinstance(n, ast.Import) for a in n.names]
    for n in nodes:  # `from specdec.core import tree` names a module too
        if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            names += [f"{n.module}.{a.name}" for a in n.names]
    return [n for n in names if n == "specdec" or n.startswith("specdec.")]


@pytest.mark.parametrize("package", CORE_PACKAGES)
def test_core_modules_import_no_drafter_code(package):
    """The core names no drafter: drafters depend on it, never the other way round."""
    root = Path(specdec.__file__).parent / package
    for path in sorted(root.glob("*.py")):
        assert not [n for n in _imports(path) if n.startswith("specdec.drafters")], path


def test_importing_the_loop_loads_no_drafter():
    code = ("import specdec.loop.decode, sys; "
            "print(sorted(m for m in sys.modules if m.startswith('specdec.drafters')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_import_cycle():
    """The imports between specdec's modules form no cycle; a function-level import that only
    defers one counts (`drafters.model` <-> `drafters.self_draft` was one), type-checking ones do not."""
    root = Path(specdec.__file__).parent
    modules = {m: root.joinpath(*m.split(".")[1:]) for m in _modules()}
    files = {m: (p / "__init__.py" if p.is_dir() else p.with_suffix(".py")) for m, p in modules.items()}
    graph = {m: {n for n in _imports(f) if n in files and n != m and not m.startswith(n + ".")}
             for m, f in files.items()}
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, " -> ".join([*trail[trail.index(n):], n]) if n in trail else n
            if n not in state:
                visit(n, [*trail, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_node_ids_survive_pruning():
    draft = Draft(torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([-1, -1, 0, 1, 2]), node_ids=torch.tensor([10, 11, 12, 13, 14]))
    sub = draft.subtree(tree_ops.prune_to_depth(draft.parents, 2))
    assert sub.node_ids.tolist() == [10, 11, 12, 13] and sub.tokens.tolist() == [[5, 6, 7, 8]]
    assert sub.subtree(torch.tensor([1, 3])).node_ids.tolist() == [11, 13]
    assert Draft(torch.tensor([[1, 2]]), torch.tensor([-1, 0])).node_ids.tolist() == [0, 1]
    with pytest.raises(ValueError, match="node_ids"):
        Draft(torch.tensor([[1, 2]]), torch.tensor([-1, 0]), node_ids=torch.tensor([0]))


def test_positions_come_from_the_cache_not_its_length(tiny_llama64):
    """A cache that evicted entries places new tokens at their absolute positions: its logits for
    the last token equal a full cache's when the evicted entries' attention is masked out."""
    assert isinstance(KVCache(), Cache)
    ids = list(range(3, 23))
    full, thin = KVCache(), KVCache()
    tiny_llama64.prefill(ids[:-1], full)
    tiny_llama64.prefill(ids[:-1], thin)
    keep = torch.tensor([0, 1] + list(range(10, 19)))  # sink of 2 + the last 9 of 19 positions
    thin.retain(keep)
    assert thin.length == 11 and thin.next_position == 19 and thin.evicted == 8
    last = torch.tensor([[ids[-1]]])
    out_thin = tiny_llama64.forward(last, thin)
    positions, mask = tree_attention(None, 1, 19)
    mask[:, [i for i in range(19) if i not in keep.tolist()]] = torch.finfo(mask.dtype).min
    out_full = tiny_llama64.base(input_ids=last, attention_mask=mask[None, None].to(torch.float64),
                                 position_ids=positions[None], cache=full.hf, use_cache=True)
    torch.testing.assert_close(out_thin.hidden, out_full.last_hidden_state)
    # Rollback in absolute positions: truncate back to 19, keep a tree block's path.
    thin.truncate(19)
    assert thin.next_position == 19 and thin.length == 11
    tiny_llama64.forward(torch.tensor([[1, 2, 3]]), thin, torch.tensor([-1, -1, 0]))
    thin.keep(19, [1])
    assert thin.next_position == 20 and thin.length == 12
    with pytest.raises(ValueError, match="outside"):
        thin.truncate(5)


def test_tree_attention_places_the_block_at_absolute_positions():
    positions, mask = tree_attention(torch.tensor([-1, 0, 1, 0]), 2, 10, next_position=110)
    assert positions.tolist() == [110, 109]
    assert mask.shape == (2, 12)


class _Spy:
    """A drafter that records every Step it is told, and checks the KV view against the cache."""

    name = "spy"

    def __init__(self, inner):
        self.inner, self.steps = inner, []

    def reset(self):
        self.inner.reset()
        self.steps = []

    def propose(self, request):
        return self.inner.propose(request)

    def commit(self, step: Step):
        self.steps.append((step, [(k.clone(), v.clone()) for k, v in step.target_kv()]))
        self.inner.commit(step)


def test_commit_tells_the_drafter_positions_tokens_features_and_kv(tiny_llama64):
    spy = _Spy(specdec.drafters.build("ngram", target=tiny_llama64))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    out = specdec.generate(tiny_llama64, spy, prompt, shape="tree(2,2)", max_new_tokens=16, stop_on_eos=False)
    first, _ = spy.steps[0]
    assert first.is_prefill and first.num_new == [len(prompt)] and first.positions.tolist() == [list(range(7))]
    committed = prompt + out.token_ids
    position = len(prompt) - 1
    for step, kv in spy.steps[1:]:
        length = step.token_ids.shape[1]
        kept = step.positions.shape[1]
        assert kept == step.acceptance.num_accepted + 1 == step.num_new[0]
        assert step.positions.tolist() == [list(range(position, position + kept))]
        assert step.token_ids[0].tolist() == committed[:length]
        assert step.accepted_node_ids().tolist() == step.draft.node_ids[step.acceptance.path].tolist()
        # The kept rows' features and KV are the target's own for those tokens.
        fresh = KVCache()
        ref = tiny_llama64.prefill(committed[: length - 1], fresh)
        torch.testing.assert_close(step.target_hidden, ref.hidden[:, position:position + kept])
        for (k, v), (k0, v0) in zip(kv, fresh.tensors()):
            torch.testing.assert_close(k, k0[..., position:position + kept, :], rtol=0, atol=1e-10)
            torch.testing.assert_close(v, v0[..., position:position + kept, :], rtol=0, atol=1e-10)
        position += kept
    assert position == len(committed) - 1  # every committed token but the last (the next root) was kept once


@pytest.mark.parametrize("name", ["eagle", "small", "lowbit"])
def test_feature_and_model_drafters_work_from_a_one_token_prompt(tiny_llama64, name):
    drafter = specdec.drafters.build_for_tests(name, target=tiny_llama64)
    ref = specdec.generate(tiny_llama64, None, [7], max_new_tokens=10, stop_on_eos=False)
    out = specdec.generate(tiny_llama64, drafter, [7], shape="chain(3)", max_new_tokens=10, stop_on_eos=False)
    assert out.token_ids == ref.token_ids
