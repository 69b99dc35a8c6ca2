"""The core: the one loop (`loop`), the drafter contract and its records (`draft`), exact acceptance
(`acceptance`), draft-tree geometry (`tree`), shapes and per-step shape policies (`shapes`,
`policy`), sampling settings (`sampling`), per-step records (`metrics`) and the slow reference
decoder every exactness test compares against (`reference`). Imports no drafter.
"""
