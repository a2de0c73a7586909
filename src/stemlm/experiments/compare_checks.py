"""What `stemlm experiment compare` checks before it writes or trains anything: every option, and the ones that
must agree, so a refused comparison is one line that cost nothing.

`check_compare(cfg)`: counts and sizes in range, a device that exists, the training settings every run would get
(through `TrainConfig`'s own checks), `--variants` named once each and given to a listed kind that has variants,
and no `--set` of what the arms decide themselves (`ffn`, `vocab_size`, `<kind>_variant`: an arm's variant is in
its label, `engram-reference`, so a variant set for every arm would run under the default's name). The arms'
model configs are checked by `compare.model_configs`, also before any work.
"""

from __future__ import annotations

import math

from stemlm.errors import StemlmError
from stemlm.model.config import FFN_KINDS

# Counts that must be at least 1 (`passkey_docs` and `fact_repeats` may be 0: that part of the mixture is left out).
POSITIVE = ("seeds", "workers", "corpus_chars", "ppl_tokens", "niah_samples", "niah_digits", "seq_len", "batch_size")
ARM_FIELDS = ("ffn", "vocab_size")  # decided per arm (its kind) and by the tokenizer


def variant_field(kind: str) -> str | None:
    """The config field that picks `kind`'s variant (`engram_variant`), or None for a kind without variants."""
    from stemlm.model.kinds.registry import get_kind

    name = f"{kind}_variant"
    return name if kind in FFN_KINDS and any(f.name == name for f in get_kind(kind).fields) else None


def check_compare(cfg) -> None:
    """Raise a one-line StemlmError for an option `stemlm experiment compare` would refuse later or get wrong."""
    from stemlm.runtime import check_device
    from stemlm.train.config import TrainConfig

    for name in POSITIVE:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise StemlmError(f"{name} must be a positive integer, got {value!r}")
    for name in ("passkey_docs", "fact_repeats"):
        if getattr(cfg, name) < 0:
            raise StemlmError(f"{name} must be >= 0 (0: none in the mixture), got {getattr(cfg, name)}")
    if cfg.eval_limit is not None and cfg.eval_limit < 1:
        raise StemlmError(f"eval_limit must be a positive integer or none, got {cfg.eval_limit}")
    if not cfg.niah_lengths or any(n < 1 for n in cfg.niah_lengths):
        raise StemlmError(f"niah_lengths must be positive token counts, got {','.join(map(str, cfg.niah_lengths))}")
    if not all(0 <= d <= 1 for d in cfg.niah_depths):
        raise StemlmError(f"niah_depths must lie in [0, 1], got {','.join(map(str, cfg.niah_depths))}")
    if not (isinstance(cfg.lr, (int, float)) and math.isfinite(cfg.lr) and cfg.lr > 0):
        raise StemlmError(f"lr must be a positive number, got {cfg.lr!r}")
    if cfg.seq_len > cfg.max_position_embeddings:
        raise StemlmError(f"seq_len {cfg.seq_len} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    if cfg.device != "auto":
        check_device(cfg.device)
    for item in cfg.model_overrides:
        key = item.split("=", 1)[0].strip().removeprefix("model.")
        if key in ARM_FIELDS or key.endswith("_variant"):
            raise StemlmError(
                f"--set {item}: each arm sets {key} itself (its kind, its variant, the tokenizer); name variant arms "
                "in --kinds (e.g. engram-reference) or add them with --variants reference"
            )
    twice = sorted({v for v in cfg.variants if cfg.variants.count(v) > 1})
    if twice:
        raise StemlmError(f"--variants names {', '.join(twice)} twice")
    extra = [v for v in cfg.variants if v != "default"]
    if extra and not any(variant_field(kind) for kind in cfg.kinds):
        with_variants = ", ".join(k for k in FFN_KINDS if variant_field(k))
        raise StemlmError(
            f"--variants {','.join(cfg.variants)}: no kind in --kinds {','.join(cfg.kinds)} has variants, so it would "
            f"add no arm; list a kind that has ({with_variants})"
        )
    TrainConfig(seq_len=cfg.seq_len, batch_size=cfg.batch_size, lr=cfg.lr, steps=1, data=["mixture"])  # its checks
