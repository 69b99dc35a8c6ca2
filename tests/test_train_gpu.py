"""`python -m specdec.training gpu` (specdec/training/gpu.py) on the CPU (--smoke, tiny-llama): one call grows the token set and trains the run,
a second call grows the set again and continues the same run on the grown set (never a new one), the
compact state and the curve carrying it across; a run that has ended is followed by a new run from its head,
never restarted in place; the CUDA default without CUDA, and a call with no run to continue, are clear errors."""

import json

import pytest
import torch

from specdec.training.run import Run
from specdec.training.tokens import TokenSet



@pytest.fixture(scope="module")
def train_gpu():
    from specdec.training import gpu

    return gpu


@pytest.fixture
def single_turn(monkeypatch):
    """A prompt source the tiny tokenizer can take (no chat template: single turns)."""
    from specdec.training.prompts import SOURCES, user

    texts = [f"zq{i} xv{i * 7} kw{i % 5} about item {i}" for i in range(80)]
    monkeypatch.setitem(SOURCES, "test-single", lambda n, seed: [user(t) for t in texts][:n])
    return "test-single"


def test_two_calls_grow_the_set_and_continue_one_run(train_gpu, single_turn, tmp_path):
    work = tmp_path / "w"
    common = ["--smoke", "--work", str(work), "--sources", single_turn, "--minutes", "2", "--rollout-share", "0.5",
              "--anneal-start", "6", "--max-steps", "10", "--val-every", "2"]
    first = train_gpu.main(common + ["--steps", "3"])
    assert first["device"] == "cpu" and first["rollouts"]["prompts_done"] == 32
    assert first["train"]["step"] == 3
    assert Run.saved_step(work / "run-state.pt") == 3
    shards = [s.sha256 for s in TokenSet.open(work / "set").shards]

    (work / "run" / "run.pt").unlink()  # another machine: only the kept compact state travels
    second = train_gpu.main(common + ["--steps", "3"])
    assert second["rollouts"]["prompts_done"] == 64  # 32 more prompts, none repeated
    grown = TokenSet.open(work / "set").shards
    assert [s.sha256 for s in grown[:len(shards)]] == shards and len(grown) == len(shards) + 2
    assert second["train"]["step"] == 6  # continued from step 3, not restarted
    assert second["train"]["data_checksum"] != first["train"]["data_checksum"]
    state = torch.load(work / "run-state.pt", weights_only=False, map_location="cpu")
    assert [h["step"] for h in state["data_history"]] == [3]  # the growth is recorded where it happened
    curve = [json.loads(ln)["step"] for ln in (work / "curve.jsonl").read_text().splitlines()]
    assert curve == [0, 2, 4, 6]


def test_a_probe_fits_the_schedule_so_the_run_ends_inside_the_budget(train_gpu, single_turn, tmp_path):
    work = tmp_path / "w"
    out = train_gpu.main(["--smoke", "--work", str(work), "--sources", single_turn, "--minutes", "3",
                          "--rollout-share", "0.3", "--probe-steps", "2", "--steps", "3", "--val-every", "2"])
    assert out["probe"]["step"] == out["probe"]["steps_done"] == 2
    schedule = out["schedule"]
    assert 2 < schedule["anneal_start"] < schedule["max_steps"]  # the rest of 3 minutes at the probe's rate
    assert out["train"]["step"] == 5  # --steps bounds the call; the run continued from the probe's step
    state = torch.load(work / "run-state.pt", weights_only=False, map_location="cpu")
    assert (state["config"]["anneal_start"], state["config"]["max_steps"]) == (schedule["anneal_start"],
                                                                                 schedule["max_steps"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
def test_the_cuda_default_without_cuda_is_refused(train_gpu, tmp_path):
    with pytest.raises(SystemExit, match="no CUDA device here"):
        train_gpu.main(["--keep", str(tmp_path / "state.pt")])
    assert not (tmp_path / "state.pt").exists()


def test_a_new_run_starts_from_a_head_and_never_over_a_kept_run(train_gpu, single_turn, tmp_path):
    first = ["--smoke", "--sources", single_turn, "--minutes", "2", "--rollout-share", "0.5", "--anneal-start", "2",
             "--max-steps", "3", "--val-every", "1", "--steps", "3"]
    assert train_gpu.main(first + ["--work", str(tmp_path / "one")])["train"]["step"] == 3  # the first run ends
    head = tmp_path / "one" / "run" / "head-best.safetensors"
    assert head.exists()
    work = tmp_path / "two"
    second = train_gpu.main(first + ["--work", str(work), "--init-head", str(head), "--steps", "2"])
    assert second["train"]["step"] == 2  # a new run: from step 0, on the given head
    assert Run.saved_step(work / "run-state.pt") == 2
    assert [json.loads(ln)["step"] for ln in (work / "curve.jsonl").read_text().splitlines()] == [0, 2]
    with pytest.raises(SystemExit, match="starts a new run"):  # over the kept run: refused before any rollout
        train_gpu.main(first + ["--work", str(work), "--init-head", str(head)])
    assert len(TokenSet.open(work / "set").done()) == second["rollouts"]["prompts_done"]
    with pytest.raises(Exception, match="missing"):  # the head reaches the trainer: a missing one is its error
        train_gpu.main(first + ["--work", str(tmp_path / "three"), "--init-head", str(tmp_path / "missing.safetensors")])


def test_a_call_with_no_run_to_continue_is_refused_before_it_rolls_out(train_gpu, tmp_path):
    with pytest.raises(SystemExit, match="no run state at"):
        train_gpu.main(["--device", "cpu", "--keep", str(tmp_path / "none.pt"), "--out", str(tmp_path / "out"),
                        "--sets", str(tmp_path / "set")])
    assert not (tmp_path / "set").exists()
