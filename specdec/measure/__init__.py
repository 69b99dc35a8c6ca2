"""Measurement and analysis: latency curves (`latency`), acceptance profiles and their replays
(`profiles`) and the cost model (`costmodel`). The exactness certificate is the command
`python -m specdec.certify`; the machine's tuned choices come from `python -m specdec.tune`.
"""
