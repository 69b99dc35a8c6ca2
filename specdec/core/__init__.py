"""The records every floor above reads: the drafter contract and its records (`draft`), exact
acceptance (`acceptance`), draft-tree geometry (`tree`), shapes (`shapes`), sampling settings
(`sampling`), per-step records (`metrics`). Imports nothing of specdec above it.
"""
