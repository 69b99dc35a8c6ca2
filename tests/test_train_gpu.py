"""scripts/train_gpu.py on the CPU: the smoke recipe (tiny target) runs both of train_eagle.py's stages,
returns only the head and its validation curve, and a second call resumes (no new rollouts, training
continues from the checkpoint); the CUDA recipe without CUDA is a clear error."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from specdec.drafters.eagle_head import EagleHead

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_gpu.py"


@pytest.fixture(scope="module")
def train_gpu():
    spec = importlib.util.spec_from_file_location("train_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpu"] = module
    spec.loader.exec_module(module)
    return module


def test_smoke_returns_the_head_and_its_curve_then_resumes(train_gpu, tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "out"
    assert train_gpu.main(["--smoke", "--work", str(work), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["head.json", "head.safetensors", "summary.json", "val_curve.json"]
    head = EagleHead.load(out / "head.safetensors")
    assert head.config.target_name == "tiny-llama" and head.config.aux_layers == (1,)
    curve = json.loads((out / "val_curve.json").read_text())
    assert [c["step"] for c in curve] == [0, 2, 4] and all("chain_mal" in c and "acc@3" in c for c in curve)
    shards = sorted(p.name for p in (work / "data" / "train").glob("*"))

    assert train_gpu.main(["--smoke", "--steps", "6", "--work", str(work), "--out", str(out)]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert sorted(p.name for p in (work / "data" / "train").glob("*")) == shards  # no new rollouts
    curve = json.loads((out / "val_curve.json").read_text())
    assert [c["step"] for c in curve] == [0, 2, 4, 6]
    steps = [json.loads(line)["step"] for line in (work / "train_log.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5, 6]  # the second call trained steps 5 and 6 only


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
def test_the_cuda_recipe_without_cuda_is_refused(train_gpu, tmp_path, capsys):
    assert train_gpu.main(["--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
