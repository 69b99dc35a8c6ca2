"""specdec experiments: the Hydra-composed matched grid, its prompt suites, results store and leaderboard.

Owns: the structured configs and their presets (`config`, `conf/`), the prompt-suite loader
(`questions`, data in `prompts/`), one matched cell (`cell`), the crash-safe results store (`store`),
the Hydra entry point (`run`), the default grid (`main`) and the leaderboard (`leaderboard`).
Knows nothing about how a drafter drafts or how a quantization backend quantizes: drafters and
quantization specs are names handed to `specdec.drafters.build` and `specdec.load_target`.
"""
