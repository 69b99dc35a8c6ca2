"""Write an EAGLE-3 head as a speculators checkpoint directory (what vLLM serves).

    python scripts/export_speculators.py HEAD --target smollm2-135m --out OUT [--verifier HF_ID] [--dtype bfloat16]
    python scripts/export_speculators.py HEAD --target smollm2-135m --out OUT --check   # parse OUT with speculators

HEAD is a speculators EAGLE-3 directory (`python -m specdec.training eagle3` writes one); a specdec head is
refused, saying why. The work is `specdec.drafters.speculators_format.export_speculators`; --check needs
the speculators package (`bash scripts/install_speculators.sh`). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("head", help="a speculators EAGLE-3 directory (a specdec head is refused, with why)")
    parser.add_argument("--target", required=True, help="the target it drafts for (specdec.load_target name or path)")
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--verifier", default=None, help="verifier name_or_path to record (default: the file's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--check", action="store_true", help="parse the result with the speculators package")
    args = parser.parse_args(argv)

    import specdec
    from specdec.drafters.speculators_format import export_speculators

    try:
        report = export_speculators(args.head, specdec.load_target(args.target), args.out, getattr(torch, args.dtype),
                                    verifier=args.verifier, check=args.check)
    except ValueError as err:
        print(f"export_speculators: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
