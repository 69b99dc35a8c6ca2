"""Findings report of a results store: `python scripts/report.py RESULTS [--project-device H200=CURVE.json]`.

Writes RESULTS/REPORT.md and its PNGs, prints the verdict (<= 15 lines) and one JSON line last.
A thin command-line wrapper; the report lives in `experiments.report`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout, not an installed copy

from experiments.report import main

if __name__ == "__main__":
    sys.exit(main())
