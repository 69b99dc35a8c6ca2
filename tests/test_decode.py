"""`specdec.decode`, the one loop's door: `generate` and `generate_batch` are folds of its events for
every registered drafter; an event holds what its docstring says (committed = the path's tokens then
the next token, logits rows, kept nodes, phase times); `force=` commits the forced tokens with any
drafter; no tool gets into a step any other way (static guards over the product code); bad prompts
name their row."""

import ast
import dataclasses
from pathlib import Path

import pytest

import specdec
from specdec.drafters import names
from specdec.drafters.registry import build_for_tests
from specdec.loop.decode import DecodeConfig, cut_at_eos, decode

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]


def fold(target, drafter, prompts, config):
    """The outputs by hand: each row's committed tokens, cut at its stop set and limit."""
    out = [[] for _ in prompts]
    for event in decode(target, drafter, prompts, config):
        for b, i in enumerate(event.rows):
            out[i] += event.committed[b]
    stop = set(target.eos_token_ids if config.eos is None else config.eos) if config.stop_on_eos else set()
    return [cut_at_eos(o, stop)[: config.max_new_tokens] for o in out]


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_generate_is_the_fold_of_decode_for_every_drafter(tiny_llama64, name, temperature):
    drafter = None if name == "none" else build_for_tests(name, target=tiny_llama64)
    prompts = PROMPTS if drafter is None or getattr(drafter, "batchable", False) else PROMPTS[:1]
    config = DecodeConfig(shape="chain(3)", max_new_tokens=9, temperature=temperature, seed=4, chat=False,
                          eos={17})
    folded = fold(tiny_llama64, drafter, prompts, config)
    assert [o.token_ids for o in specdec.generate_batch(tiny_llama64, drafter, prompts, config)] == folded
    assert specdec.generate(tiny_llama64, drafter, prompts[0], config).token_ids == folded[0]


def test_an_event_holds_what_it_says(tiny_llama64):
    drafter = build_for_tests("ngram", target=tiny_llama64)
    events = list(decode(tiny_llama64, drafter, [[5, 6, 7, 5, 6, 7, 5, 6]], DecodeConfig(shape="tree(2,2)",
                                                                                  max_new_tokens=12, chat=False)))
    assert [e.index for e in events] == list(range(len(events))) and events[-1].done == [True]
    for e in events:
        with pytest.raises(dataclasses.FrozenInstanceError):
            e.index = 99
        draft, path = e.drafts[0], e.paths[0]
        assert e.logits.shape[:2] == (1, e.width) and e.width == 1 + draft.num_nodes
        assert e.committed[0][:-1] == [draft.tokens[0, j].item() for j in path] == \
            [draft.tokens[0, j].item() for j in e.acceptances[0].path]
        assert e.committed[0][-1] == int(e.logits[0, ([0] + [j + 1 for j in path])[-1]].argmax())  # T = 0
        assert e.kept[0] is None and draft.num_nodes == e.proposals[0].num_nodes
        assert min(dataclasses.astuple(e.times)) >= 0 and e.times.total > 0


def test_force_commits_the_forced_tokens_with_any_drafter(tiny_llama64):
    forced = [9, 3, 3, 41, 7, 2, 11, 5]
    for name in ("ngram", "eagle", "self_draft"):
        drafter = build_for_tests(name, target=tiny_llama64)
        config = DecodeConfig(shape="chain(3)", max_new_tokens=len(forced), force=[forced], stop_on_eos=False,
                              chat=False)
        assert specdec.generate(tiny_llama64, drafter, PROMPTS[0], config).token_ids == forced
        plain = specdec.generate(tiny_llama64, None, PROMPTS[0], max_new_tokens=6, chat=False, stop_on_eos=False)
        teacher = DecodeConfig(shape="chain(3)", max_new_tokens=6, force=[plain.token_ids], stop_on_eos=False,
                               chat=False)
        events = list(decode(tiny_llama64, drafter, [PROMPTS[0]], teacher))
        assert [t for e in events for t in e.committed[0]] == plain.token_ids
    full = specdec.drafters.build("self_draft", target=tiny_llama64, kv="full")  # drafts the target's own text
    events = list(decode(tiny_llama64, full, [PROMPTS[0]], teacher))
    assert [t for e in events for t in e.committed[0]] == plain.token_ids  # and its paths are kept whole
    assert [len(e.paths[0]) for e in events] == [e.drafts[0].num_nodes for e in events] != [0] * len(events)
    with pytest.raises(ValueError, match="force ran out"):
        specdec.generate(tiny_llama64, None, PROMPTS[0], max_new_tokens=4, force=[[1, 2]], chat=False)


def product_trees():
    for folder in ("specdec", "experiments", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def test_no_tool_rebinds_the_loop_or_a_generation_config():
    loop_names = {"decode", "loop", "rows", "policy", "auto_policy"}
    found = []
    for rel, tree in product_trees():
        if rel.startswith("specdec/loop/"):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                text = ast.unparse(t)
                if isinstance(t, ast.Attribute) and (text.split(".")[0] in loop_names or "generation_config" in text
                                                     or text.endswith("config.eos_token_id")):
                    found.append(f"{rel}:{node.lineno} {text}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args and \
                    ast.unparse(node.args[0]).split(".")[0] in loop_names:
                found.append(f"{rel}:{node.lineno} setattr")
    assert found == []


def test_only_records_drafters_and_the_loop_build_a_step():
    allowed = ("specdec/core/", "specdec/drafters/", "specdec/loop/")
    found = [f"{rel}:{node.lineno}" for rel, tree in product_trees() if not rel.startswith(allowed)
             for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Step")
             and ast.unparse(node.func).split(".")[-1] == "Step"]
    assert found == []


def test_bad_prompts_name_their_row(tiny_llama64):
    with pytest.raises(TypeError, match=r"^prompt 1: prompt must be a string, chat messages .* got int"):
        specdec.generate_batch(tiny_llama64, None, [[1, 2], 42])
    with pytest.raises(TypeError, match="prompts must be a list of prompts, got str: wrap one prompt"):
        specdec.generate_batch(tiny_llama64, None, "Hi.")
    with pytest.raises(ValueError, match=r"^prompt 2: the prompt is empty"):
        specdec.generate_batch(tiny_llama64, None, [[1], [2], []])
    with pytest.raises(TypeError, match=r"^prompt 0: .*a list mixes"):
        specdec.generate(tiny_llama64, None, ["Hi.", 42])
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'"):
        specdec.generate(tiny_llama64, None, [1, 2], max_tokens=3)
