"""Training drafters: the EAGLE head's self-distillation data, shards and prompt sources.

Owns everything that exists to *make* a drafter rather than run one: `prompts` (the training prompt
sources and the train/validation split), `shards` (rollouts on disk with a manifest), `eagle` (the
batched target rollouts, the multi-depth loss, validation) and `LOG.md` (what each training run did
and measured). `scripts/train_eagle.py` drives it. The runtime never imports this package: a drafter
loads a trained head from a file (`specdec.drafters.eagle_head`).
"""
