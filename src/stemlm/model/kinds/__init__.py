"""The per-layer kinds: one module each (`dense`, `stem`, `moe`, ...), plus `registry`, which finds them.

A module here defines `KIND = stemlm.model.kinds.registry.Kind(...)`; `registry.all_kinds()` imports every module
of this package, so adding a file adds a kind (docs/kinds.md).
"""
