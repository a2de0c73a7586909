"""Interpretability of STEM micro-experts: angular spread, attribution, nearest tokens, activated parameters.

Modules (each returns JSON-ready numbers and has a `plot_*` writing a PNG): `spread` (pairwise cosine of STEM
rows vs a dense model's `W_up x`), `attribution` (per position and STEM layer: FFN output norm and gradient x
input on the looked-up rows, for one predicted token), `nearest` (nearest tokens by row cosine per layer),
`activated` (activated table parameters vs context length). `stemlm analyze CKPT` runs them all.
"""
