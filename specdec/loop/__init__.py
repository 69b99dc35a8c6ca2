"""The loop: `decode` and its folds `generate` / `generate_batch` (`decode`), the batch's rows
(`rows`), per-step shape policies (`policy`, `auto_policy`) and the slow reference decoder every
exactness test compares against (`reference`). Stands on the target runtime; imports no drafter.
"""
