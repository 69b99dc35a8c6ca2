"""`python -m specdec.training COMMAND ...`: the EAGLE training pipeline, one command per stage.

    rollout   roll out training prompts into a token-shard rollout set (specdec/training/cli.py)
    run       advance the one EAGLE run on rollout sets, resumable (specdec/training/cli.py, run.py)
    eagle3    train an EAGLE-3 head, saved in the speculators format (specdec/training/eagle3.py)
    gpu       on a lent CUDA machine: rollouts, then the run, inside a budget (specdec/training/gpu.py)
    page      docs/measurements/eagle-run.md from the runs' curves and the sets' manifests (page.py)

`python -m specdec.training COMMAND --help` lists a command's options.
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
