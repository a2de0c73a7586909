"""Experiments built on the stemlm library (never imported by it): `knowledge` (dense vs STEM fact recall
and knowledge editing). Each runs from `stemlm experiment <name>` or `python -m stemlm.experiments.<name>`."""
