"""Write an EAGLE-3 head as a speculators checkpoint directory (the format vLLM serves), checked on the way.

    python scripts/export_speculators.py HEAD --target smollm2-135m --out OUT [--verifier HF_ID] [--dtype bfloat16]
    python scripts/export_speculators.py HEAD --target smollm2-135m --out OUT --check   # parse OUT with speculators

HEAD is a speculators EAGLE-3 directory (re-written: another dtype, the verifier named, the target's
embedding filled in when the file lacks it, every field checked against --target). A specdec head
(`.safetensors` + `.json`, e.g. the shipped specdec/drafters/heads/smollm2-135m) is refused with the
reason: its architecture (specdec/drafters/eagle_head.py) is not EAGLE-3's, and the speculators format
cannot express it (specdec/drafters/speculators_format.py). --check (needs `pip install
'specdec[speculators]'`) parses OUT's config with the package and builds its model from it, whose
tensor names and shapes must be the file's. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch


def package_check(directory: Path) -> dict:
    """Parse `directory` with the speculators package and compare its model's tensors with the file's."""
    from safetensors import safe_open
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(str(directory))
    model_class = SpeculatorModel.registered_model_class_from_config(config)
    expected = {k: tuple(v.shape) for k, v in model_class(config).state_dict().items()
                if not k.startswith(("verifier_", "input_norm"))}
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    if stored != {k: v for k, v in expected.items() if k in stored} or set(expected) - set(stored):
        raise ValueError(f"speculators builds tensors {sorted(set(expected) ^ set(stored))} or other shapes than "
                         f"{directory / 'model.safetensors'} holds")
    return {"package_class": model_class.__name__, "tensors": len(stored)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write an EAGLE-3 head as a speculators checkpoint directory.")
    parser.add_argument("head", help="a speculators EAGLE-3 directory (a specdec head is refused, with why)")
    parser.add_argument("--target", required=True, help="the target it drafts for (specdec.load_target name or path)")
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--verifier", default=None, help="verifier name_or_path to record (default: the file's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--check", action="store_true", help="parse the result with the speculators package")
    args = parser.parse_args(argv)

    import specdec
    from specdec.drafters.speculators_format import is_speculators_dir, load_speculators, save_speculators

    if not is_speculators_dir(args.head):
        print(f"export_speculators: error: {args.head} is not a speculators EAGLE-3 directory. A specdec head (fc over "
              "[embedding, final feature] + a plain decoder layer, scored by the target's lm_head) is another "
              "architecture than EAGLE-3 (the embedding never enters the residual stream, the head owns its lm_head): "
              "the format cannot hold it, and converting means training an EAGLE-3 head", file=sys.stderr)
        return 2
    target = specdec.load_target(args.target)
    try:
        head = load_speculators(args.head)
        head.config.check_target(target)
    except ValueError as err:
        print(f"export_speculators: error: {err}", file=sys.stderr)
        return 2
    if args.verifier:
        head.config = dataclasses.replace(head.config, target_name=args.verifier)
    out = save_speculators(head, args.out, dtype=getattr(torch, args.dtype),
                           embedding=target.base.get_input_embeddings().weight)
    again = load_speculators(out)  # the written directory reads back as the same head (up to the dtype)
    report = {"out": str(out), "dtype": args.dtype, "draft_vocab": int(again.draft_vocab.numel()),
              "aux_layers": list(again.config.aux_layers), "verifier": again.config.target_name}
    if args.check:
        report.update(package_check(Path(out)))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
