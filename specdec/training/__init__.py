"""Training drafters: everything that exists to *make* a drafter (prompts, rollout sets, features, the EAGLE run,
EAGLE-3, LOG.md), driven by `python -m specdec.training`. The runtime never imports it: drafters load heads from files.
"""
