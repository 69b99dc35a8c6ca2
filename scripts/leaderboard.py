"""Leaderboard of a results store: `python scripts/leaderboard.py RESULTS [--out DIR]`.

A thin command-line wrapper; the aggregation and plots live in `experiments.leaderboard`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout, not an installed copy

from experiments.leaderboard import main

if __name__ == "__main__":
    sys.exit(main())
