"""Experiments built on the stemlm library (never imported by it): `knowledge` (dense vs STEM fact recall and
knowledge editing), `compare` (every FFN kind at a matched budget) and `bio` (memorisation vs extraction).
Each module exposes `EXPERIMENT` (stemlm.experiments.contract) and runs as `stemlm experiment <name>`."""
