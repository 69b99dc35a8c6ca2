"""Training drafters: the EAGLE head's self-distillation data, the run, and prompt sources.

Owns everything that exists to *make* a drafter rather than run one: `prompts`, `tokens` (rollout sets), `features`,
`eagle` (rollouts, loss, validation), `run`, `eagle3` and `LOG.md`; `python -m specdec.training` drives it. The runtime
never imports this package: a drafter loads a trained head from a file (`specdec.drafters.eagle_head`).
"""
