"""`python -m specdec.training COMMAND ...`: the EAGLE training pipeline, one command per stage.

Commands: rollout, run (cli.py), eagle3, gpu, page; `COMMAND --help` lists a command's options.
"""

from __future__ import annotations

import sys

from specdec.training import cli, eagle3, gpu, page

COMMANDS = {"rollout": cli.rollout, "run": cli.run, "eagle3": eagle3.main, "gpu": gpu.main, "page": page.main}


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        raise SystemExit(f"usage: python -m specdec.training {{{','.join(COMMANDS)}}} [options]\n\n{__doc__}")
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    result = main()
    sys.exit(result if isinstance(result, int) else 0)
