"""specdec experiments: the Hydra-composed matched grid, its prompt suites, results store and leaderboard.

Knows nothing about how a drafter drafts or a backend quantizes: both are names handed to
`specdec.drafters.build` and `specdec.load_target`.
"""
