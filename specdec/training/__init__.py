"""Training drafters: the EAGLE head's self-distillation data, the run, and prompt sources.

Owns everything that exists to *make* a drafter rather than run one: `prompts` (the training prompt
sources, read from the repository's data/prompts/), `tokens` (rollout sets: token shards on disk with a
manifest), `features` (the target's features recomputed from them), `eagle` (batched target rollouts,
the multi-depth loss, validation), `run` (the one resumable training run), `eagle3` (an EAGLE-3 head in
the speculators format) and `LOG.md` (what each training run did and measured). `python -m
specdec.training {rollout,run,eagle3,gpu}` drives it (`__main__.py`). The runtime never imports this
package: a drafter loads a trained head from a file (`specdec.drafters.eagle_head`).
"""
