"""`TrainConfig`: every knob of a training run (data, schedule, optimizer groups, logging, checkpoints).

One flat dataclass with grouped, commented fields and defaults that train the `tiny` preset on two CPU cores
in a few minutes. A field declared `setting(default, help, section=...)` carries its `stemlm train` flag (help,
choices, metavar; stemlm.flags), shown in the help group `SECTIONS[section]`; `--set train.<field>=<value>`
reaches every field (`with_overrides`, parsed by `stemlm.model.overrides`; `table_lr_fields` reads `--table-lr`).
The resolved config is written into each run folder.

Choices documented here rather than in code comments elsewhere:
- weight decay applies to every matrix (projections, token embedding, LM head, router, experts), as in
  the official STEM/Lingua code; one-dimensional parameters (RMSNorm gains, any bias) get none, which the
  official code does not exempt (`recipe="official"` decays them: stemlm.train.recipes, docs/recipe.md).
- the lookup tables (every table of `model.lookup_tables()`) form their own optimizer with their own peak lr
  (`table_lr`, or `lr * table_lr_scale`) and weight decay `table_wd`, following the same warm-up + cosine
  shape. Defaults lr x10, wd 0, by measurement: `tiny-odd` (STEM in layers 1, 3), 150 steps of 8 x 256 tokens,
  backbone lr 2e-3 / wd 0.1, held-out loss over 32k tokens: table lr x1 5.626 (wd 0.1) / 5.627 (wd 0);
  x10 5.431 (wd 0) / 5.430 (wd 0.1): the lr matters (-0.20 nats), the table weight decay does not at this
  length (one run each; PAPER.md's prototype also found x10 with wd 0 slightly better).
- the table optimizer defaults to the row-sparse `rowwise_adagrad` (FBGEMM-style, touched rows only; `adamw`
  is the official code's dense AdamW over whole tables). Held-out loss against `lazy_adamw`, paired by seed at
  this default run's budget and at the knowledge experiment's: `benchmarks/table_optim_seeds.py --budget
  main|knowledge` (README "Row-sparse tables"; lower on every seed measured); its state is one float per row
  instead of 2 x d_ff, and its step is the cheaper one.
- defaults size `stemlm train` to 5.96 TFLOP of training (stemlm's accounting: 29.1 MFLOPs/token x 204,800
  tokens): the `tiny` preset (STEM in every layer) for 200 steps x 8 x 128 tokens at lr 1.2e-3, half of them
  the fact world's capital statements for 12 well-known European countries (`fact_fraction`, `fact_countries`)
  in ten phrasings (`stemlm.data.worlds.facts.MIX_TEMPLATES`), in fact documents from which every batch draws
  half of its windows (`fact_layout`), so that a swap of table rows alone moves what the default model recalls
  (the README's edit). Chosen by measurement (docs/results.md "The default run" logs every configuration tried
  and the curve of fact share against edit, recall and corpus loss): 30% facts left the model unsure of the
  capitals (P(Madrid) about 0.5) and the edit short of 10x its runner-up; windows drawn from anywhere (the
  earlier layout) made the batch loss swing between fact batches and corpus batches, and the spike check fired
  on healthy runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stemlm.choices import (
    COMPUTE_DTYPES,
    DEVICES,
    FACT_LAYOUTS,
    KEEP_OPTIMIZER_STATE,
    PARALLEL_MODES,
    RECIPES,
    ROW_SPARSE_OPTIMIZERS,
    SAMPLING,
    TABLE_OPTIMIZERS,
    TRAINABLE,
)
from stemlm.errors import StemlmError
from stemlm.flags import setting
from stemlm.model.config import ModelConfig
from stemlm.model.kinds.registry import all_kinds
from stemlm.model.overrides import apply_overrides
from stemlm.placement.registry import TRAIN, needs_row_sparse_optimizer, resolve, tables_values

if TYPE_CHECKING:  # torch and tokenizers load only when a run is resolved, so the CLI parser stays light
    from tokenizers import Tokenizer

# the default run's fact-world countries: well-known ones whose capitals the README's edit example moves
FACT_COUNTRIES = (
    "Spain",
    "Germany",
    "France",
    "Italy",
    "Portugal",
    "Greece",
    "Norway",
    "Sweden",
    "Poland",
    "Austria",
    "Ireland",
    "Netherlands",
)

# The sections of a run's settings, in the order `stemlm train --help` shows their flags (the common ones first);
# each field's `setting(section=...)` names one.
SECTIONS = {
    "model": "model",
    "data": "data",
    "optimizer": "optimisation",
    "checkpointing": "evaluation, checkpoints and output",
    "tables": "lookup tables",
    "parallelism": "several processes (torch.distributed)",
    "advanced": "profiling and advanced",
}

# Upper bounds of the sizes a run is built from, far above any real run's, so a hostile or mistyped config is
# one line instead of an allocation that never ends (a model's own sizes: stemlm.model.config.SIZE_LIMITS).
SIZE_LIMITS = {"steps": 10**9, "seq_len": 2**24, "batch_size": 2**20, "grad_accum": 2**20, "eval_batches": 2**20}
MAX_BATCH_TOKENS = 2**27


@dataclass
class TrainConfig:
    # --- run ---
    preset: str = setting(
        "tiny", "model preset (default {default}); see `stemlm info --list-presets`", section="model", metavar="NAME"
    )
    out: str | None = setting(
        None, "run folder (default runs/<preset>-<ffn>-<timestamp>)", section="checkpointing", metavar="DIR"
    )
    seed: int = setting(0, "seed of the model init and the data windows (default {default})", section="optimizer")
    device: str = setting("auto", "device (default {default})", section="advanced", one_of=DEVICES)
    dtype: str = setting(
        "auto",
        "autocast dtype; weights stay fp32 (default auto: bf16 on CUDA, fp32 on CPU where bf16 measured slower)",
        section="advanced",
        one_of=COMPUTE_DTYPES,
    )
    threads: int | None = setting(  # CPU threads for the CLI; None: os.cpu_count()
        None, "CPU threads (default: all cores)", section="advanced"
    )
    # --- data ---
    data: list[str] | None = setting(
        None,
        "text/markdown/jsonl files or folders (default: the embedded Shakespeare + Austen corpus)",
        section="data",
        metavar="PATH",
        many=True,
    )
    tokenizer: str | None = setting(  # None: the --init-from checkpoint's, else default
        None, "default | gpt2 | path to a tokenizer.json (default: the default one)", section="data", metavar="NAME"
    )
    separator: str = setting(
        "<|endoftext|>",
        "special token placed after every document (default {default})",
        section="data",
        metavar="TOKEN",
    )
    init_from: str | None = setting(
        None, "start from the weights (and tokenizer) of this model checkpoint folder", section="model", metavar="CKPT"
    )
    # the fact world mixed into the embedded corpus (not into --data): statements of fact_relations about the
    # countries of fact_region make up fact_fraction of the training tokens (stemlm.data.fact_mix); 0: none
    fact_fraction: float = 0.5
    fact_region: str = "Europe"
    # a few countries instead of the whole region, so each statement is seen often enough at the default budget
    # to be learnt (53 European countries got ~23 exposures each in 200 steps and were not); []: all of fact_region
    fact_countries: list[str] = field(default_factory=lambda: list(FACT_COUNTRIES))
    fact_relations: list[str] = field(default_factory=lambda: ["capital"])
    # batches: fact documents after the corpus, every batch holding fact_fraction of its windows from them, so
    # each batch mixes facts and text alike (windows drawn from anywhere made the batch loss swing and the spike
    # check fire on a healthy run); lines: a statement a line spread through the corpus; documents: windows from
    # anywhere, what runs before this field trained with (stemlm.data.fact_mix)
    fact_layout: str = "batches"
    # window sampling: epoch = every aligned window once per epoch in a seeded order (stemlm.data.stream.permute);
    # uniform = any start, with replacement; auto = epoch for prepared shards, uniform for text and the embedded
    # corpus (what every published figure of those, the default run's included, was measured with)
    sampling: str = setting(
        "auto",
        "epoch, uniform, or auto: epoch for prepared shards, else uniform (default {default})",
        section="data",
        metavar="MODE",
        one_of=SAMPLING,
    )
    prefetch: int = setting(
        2, "micro-batches read ahead on a worker thread; 0: off (default {default})", section="data"
    )
    seq_len: int = setting(128, "tokens per sequence (default {default})", section="data")
    batch_size: int = setting(8, "sequences per micro-batch (default {default})", section="data")
    grad_accum: int = setting(1, "micro-batches per optimizer step (default {default})", section="optimizer")
    # --- schedule: linear warm-up, then cosine to min_lr_ratio * peak ---
    steps: int = setting(200, "optimizer steps (default {default})", section="optimizer")
    lr: float = setting(1.2e-3, "peak learning rate of the backbone (default {default})", section="optimizer")
    warmup: int | None = setting(
        None, "linear warm-up steps before the cosine decay (default 10%% of --steps)", section="optimizer"
    )
    min_lr_ratio: float = 0.1
    # --- optimizer ---
    recipe: str = setting(
        "stemlm",
        "training rules: stemlm, or official (the official STEM code's; docs/recipe.md) (default {default})",
        section="optimizer",
        metavar="NAME",
        one_of=RECIPES,
    )
    weight_decay: float = setting(
        0.1,
        "AdamW weight decay of matrices; norms get none (--recipe official: they do) (default {default})",
        section="optimizer",
    )
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = setting(  # one global L2 norm over all parameters; 0 disables clipping
        1.0,
        "clip the global gradient norm (--recipe official: each optimizer's) to this value; 0 disables "
        "(default {default})",
        section="optimizer",
    )
    aux_loss_coef: float = setting(0.01, "weight of the MoE auxiliary loss (default {default})", section="optimizer")
    # STEM table optimizer: row-sparse by measurement (see the docstring)
    table_optim: str = setting(
        "rowwise_adagrad",
        "optimizer of the STEM tables: rowwise_adagrad (default) or lazy_adamw (row-sparse: touched rows only), "
        "or adamw (dense over whole tables, as the official code; the one --recipe official takes); see "
        "stemlm.placement.table_optim",
        section="tables",
        metavar="NAME",
    )
    # peak lr of the tables; None: lr * table_lr_scale. The flag takes either (`table_lr_fields`).
    table_lr: float | None = setting(
        None,
        "peak lr of the STEM tables: a number, or xN for N x --lr (default x{table_lr_scale:g}; --recipe official: x1)",
        section="tables",
        metavar="LR|xN",
        parse=str,
    )
    table_lr_scale: float = 10.0
    table_wd: float = setting(
        0.0, "weight decay of the STEM tables (default {default}; --recipe official: --weight-decay)", section="tables"
    )
    embed_like_tables: bool = False  # token embedding at the tables' peak lr and wd (the fair dense control)
    tables: str = setting(
        "device",
        "where the STEM tables and their optimizer state live while training: device (default) or host (rows "
        "gathered to the device ahead of each step, row-sparse update on the host; see stemlm.placement.host)",
        section="tables",
        metavar="{" + ",".join(tables_values(TRAIN, aliases=False)) + "}",
        one_of=tables_values(TRAIN),
    )
    trainable: str = setting(
        "all",
        "parameters that learn: all, or tables (the backbone frozen) (default {default})",
        section="optimizer",
        name="--train",
        metavar="WHAT",
        one_of=TRAINABLE,
    )
    # --- memory levers (stemlm.train.memory; the math is unchanged) ---
    loss_chunk: int = setting(
        0, "lm_head + loss this many tokens at a time (no full logits kept); 0: off", section="advanced"
    )
    # The fused lm_head + cross-entropy (stemlm.model.fused_loss; true needs loss_chunk), evaluation too; None: by the
    # vocabulary, fused from 65536 tokens up (stemlm.train.memory.resolve_loss).
    fused_loss: bool | None = None
    activation_checkpointing: bool = setting(
        False,
        "recompute each decoder block's activations in backward (less memory, ~1 extra forward)",
        section="advanced",
        const=True,
    )
    # stemlm.train.compile, stemlm.train.profiling
    compile: bool = setting(False, "torch.compile each decoder block (inductor)", section="advanced", const=True)
    profile: bool = setting(
        False,
        "torch.profiler over steps 3-5: traces for TensorBoard / Perfetto and an operator table in RUN/profile",
        section="advanced",
        const=True,
    )
    memory_snapshot: bool = setting(
        False,
        "record the CUDA allocator's history; RUN/profile/memory-rank<r>.pickle for pytorch.org/memory_viz",
        section="advanced",
        const=True,
    )
    # --- evaluation, logging, checkpoints ---
    eval_every: int = setting(
        50, "steps between held-out evaluations; 0: only at the end (default {default})", section="checkpointing"
    )
    eval_batches: int = setting(
        8, "held-out batches (of --batch-size windows) per evaluation (default {default})", section="checkpointing"
    )
    save_every: int = setting(
        0, "steps between checkpoints; 0: only at the end (default {default})", section="checkpointing"
    )
    save_minutes: float = setting(
        10.0, "also save every this many minutes; 0: off (default {default})", section="checkpointing"
    )
    max_skipped: int = setting(
        10, "stop after this many non-finite steps in a row; 0: never (default {default})", section="advanced"
    )
    keep_last: int = setting(2, "checkpoints to keep (default {default})", section="checkpointing")
    keep_optimizer_state: str = "newest"  # newest: only the newest checkpoint keeps optimizer state (resume); all
    spike_factor: float = setting(
        1.5, "count a loss above this x the rolling median as a spike (default {default})", section="advanced"
    )
    spike_window: int = setting(
        50, "steps in the rolling median of the spike check (default {default})", section="advanced"
    )
    traffic_every: int = 10  # --nproc: steps summed per table-traffic record (one all_reduce each; and the last)
    # --- several processes (stemlm train --nproc N; batch_size stays the global micro-batch, split over N) ---
    parallel: str = setting(
        "ddp",
        "with --nproc > 1: replicate the backbone (ddp) or shard it per layer (fsdp, FSDP2); STEM tables are "
        "always row-sharded (default {default})",
        section="parallelism",
        one_of=PARALLEL_MODES,
    )
    dist_timeout: float = setting(
        300.0, "with --nproc: seconds a rank waits for a stalled peer (default {default})", section="parallelism"
    )

    def __post_init__(self) -> None:
        if self.tables in tables_values(TRAIN):  # "resident" is "device" (stemlm.placement.registry)
            self.tables = resolve(self.tables, TRAIN)
        self.validate()

    @property
    def warmup_steps(self) -> int:
        return round(0.1 * self.steps) if self.warmup is None else self.warmup

    @property
    def table_peak_lr(self) -> float:
        return self.lr * self.table_lr_scale if self.table_lr is None else self.table_lr

    def fact_selection(self) -> list[str] | str:
        """The mixed-in fact world's countries: the named ones, or all of fact_region when none are named."""
        return list(self.fact_countries) or self.fact_region

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum

    def validate(self) -> None:
        """Raise "invalid training config: <what>" for the first field out of range: the counts first (nothing
        is sized before they pass), then the numbers, then the closed choices and the settings that must agree."""
        check_counts(self)
        check_numbers(self)
        check_choices(self)

    # ----- (de)serialisation -----
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise StemlmError(f"unknown training config keys {', '.join(unknown)}")
        return cls(**d)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def with_overrides(self, overrides: dict[str, Any] | list[str]) -> TrainConfig:
        """Apply overrides: a dict of typed values, or `key=value` strings (a `train.` prefix is allowed)."""
        return apply_overrides(self, overrides, prefix="train.", label="training config key")


def need(cond: bool, msg: str) -> None:
    """A check of `TrainConfig.validate`: raise "invalid training config: <msg>" when `cond` is false."""
    if not cond:
        raise StemlmError(f"invalid training config: {msg}")


def check_counts(cfg: TrainConfig) -> None:
    """Steps, sizes and counts: integers in range, and the micro-batch within its token limit."""
    positive = ("steps", "seq_len", "batch_size", "grad_accum", "eval_batches", "keep_last", "spike_window")
    for name in (*positive, "traffic_every"):
        value = getattr(cfg, name)
        need(_is_int(value) and value > 0, f"{name} must be a positive integer, got {value!r}")
    for name, limit in SIZE_LIMITS.items():  # before anything is sized from them
        need(getattr(cfg, name) <= limit, f"{name}={getattr(cfg, name)} exceeds the limit of {limit}")
    need(
        cfg.batch_size * cfg.seq_len <= MAX_BATCH_TOKENS,
        f"batch_size x seq_len = {cfg.batch_size * cfg.seq_len} tokens per micro-batch exceeds the limit of "
        f"{MAX_BATCH_TOKENS} (raise grad_accum instead)",
    )
    for name in ("seed", "eval_every", "save_every", "max_skipped", "loss_chunk", "prefetch"):
        value = getattr(cfg, name)
        need(_is_int(value) and value >= 0, f"{name} must be a non-negative integer, got {value!r}")
    need(
        cfg.fused_loss is not True or (_is_int(cfg.loss_chunk) and cfg.loss_chunk > 0),
        f"fused_loss needs loss_chunk > 0 (tokens per chunk), got loss_chunk={cfg.loss_chunk!r}",
    )
    need(
        cfg.warmup is None or (_is_int(cfg.warmup) and cfg.warmup >= 0),
        f"warmup must be a non-negative integer, got {cfg.warmup!r}",
    )
    need(
        cfg.warmup is None or not _is_int(cfg.steps) or cfg.warmup < cfg.steps,
        f"warmup ({cfg.warmup}) must be smaller than steps ({cfg.steps})",
    )
    need(
        cfg.threads is None or (_is_int(cfg.threads) and cfg.threads > 0),
        f"threads must be a positive integer, got {cfg.threads!r}",
    )


def check_numbers(cfg: TrainConfig) -> None:
    """Learning rates, decays, betas, fractions and timeouts: finite and in their ranges; the fact mix's settings."""
    for name in ("lr", "table_lr_scale", "eps", "spike_factor", "dist_timeout"):
        value = getattr(cfg, name)
        need(_finite(value) and value > 0, f"{name} must be a positive number, got {value!r}")
    need(  # seconds a rank waits for its peers: under 1 s a healthy collective times out, a week is plenty
        not _finite(cfg.dist_timeout) or 1 <= cfg.dist_timeout <= 7 * 86400,
        f"dist_timeout must lie in [1, 604800] seconds, got {cfg.dist_timeout!r}",
    )
    for name in ("weight_decay", "table_wd", "grad_clip", "aux_loss_coef", "save_minutes"):
        value = getattr(cfg, name)
        need(_finite(value) and value >= 0, f"{name} must be a non-negative number, got {value!r}")
    need(
        cfg.table_lr is None or (_finite(cfg.table_lr) and cfg.table_lr > 0),
        f"table_lr must be a positive number, got {cfg.table_lr!r}",
    )
    need(
        _finite(cfg.fact_fraction) and 0 <= cfg.fact_fraction < 1,
        f"fact_fraction must lie in [0, 1), got {cfg.fact_fraction!r}",
    )
    need(not (problem := fact_mix_problem(cfg)), problem)
    need(
        _finite(cfg.min_lr_ratio) and 0 <= cfg.min_lr_ratio <= 1,
        f"min_lr_ratio must lie in [0, 1], got {cfg.min_lr_ratio!r}",
    )
    for name in ("beta1", "beta2"):
        value = getattr(cfg, name)
        need(_finite(value) and 0 <= value < 1, f"{name} must lie in [0, 1), got {value!r}")


def check_choices(cfg: TrainConfig) -> None:
    """Each closed setting one of its values (stemlm.choices), the settings that must agree, and the data paths."""

    def one_of(*pairs: tuple[str, tuple[str, ...]]) -> None:
        for name, choices in pairs:
            value = getattr(cfg, name)
            need(value in choices, f"{name} must be one of {', '.join(choices)}, got {value!r}")

    one_of(
        ("dtype", COMPUTE_DTYPES),
        ("device", DEVICES),
        ("trainable", TRAINABLE),
        ("tables", tables_values(TRAIN, aliases=False)),
    )
    need(
        not needs_row_sparse_optimizer(cfg.tables) or cfg.table_optim in ROW_SPARSE_OPTIMIZERS,
        f"tables={cfg.tables} needs a row-sparse table optimizer ({' or '.join(ROW_SPARSE_OPTIMIZERS)}), "
        f"got {cfg.table_optim!r}",
    )
    pairs = (("keep_optimizer_state", KEEP_OPTIMIZER_STATE), ("fact_layout", FACT_LAYOUTS), ("sampling", SAMPLING))
    one_of(*pairs, ("recipe", RECIPES))
    need(
        cfg.recipe != "official" or cfg.table_optim == "adamw",
        f"recipe official trains the tables with dense AdamW (table_optim adamw), got {cfg.table_optim!r}",
    )
    one_of(("parallel", PARALLEL_MODES), ("table_optim", TABLE_OPTIMIZERS))
    need(
        cfg.data is None or (isinstance(cfg.data, list) and len(cfg.data) > 0),
        "data must be a non-empty list of paths (or None for the embedded corpus)",
    )


# Fields a saved run config may predate, each at the value such a run trained with (not today's default).
PREDATED_FIELDS = {"fact_fraction": 0.0, "fact_layout": "documents"}


def saved_defaults(train: dict[str, Any]) -> dict[str, Any]:
    """The fields that `train` (the "train" section of a saved run config) predates, at what its run trained with:
    a resume and the rebuild of a run's data fill them in before `TrainConfig.from_dict`."""
    return {name: value for name, value in PREDATED_FIELDS.items() if name not in train}


def table_lr_fields(text: str) -> dict[str, Any]:
    """The table lr fields a `--table-lr` value sets: a number is `table_lr`, xN is `table_lr_scale` N."""
    try:
        if text.lower().startswith("x"):
            return {"table_lr": None, "table_lr_scale": float(text[1:])}
        return {"table_lr": float(text)}
    except ValueError:
        raise StemlmError(f"--table-lr {text!r}: pass a number (e.g. 3e-3) or a multiple of --lr (e.g. x10)") from None


def fact_mix_problem(cfg: TrainConfig) -> str:
    """What is wrong with the fact mix's settings (stemlm.data.worlds.facts.check_fact_mix), or ""."""
    from stemlm.data.worlds.facts import check_fact_mix

    try:
        check_fact_mix(cfg.fact_region, cfg.fact_countries, cfg.fact_relations)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ----- resolving a run: vocabulary, comparisons on resume -----
def fitted_vocab_size(tok: Tokenizer) -> int:
    """The tokenizer's size rounded up to a multiple of 64 (tensor-core friendly table and head shapes)."""
    return -(-tok.get_vocab_size() // 64) * 64


def fit_vocab(config: ModelConfig, tok: Tokenizer) -> ModelConfig:
    """`config` with vocab_size = `fitted_vocab_size(tok)` (when it differs)."""
    size = fitted_vocab_size(tok)
    return config if config.vocab_size == size else config.replace(vocab_size=size)


def check_vocab(config: ModelConfig, tok: Tokenizer, *, requested: str, vocab_set: bool, fit: bool) -> ModelConfig:
    """The model config a run trains, never silently resized: a requested vocab_size must suit the tokenizer.

    `fit` (`--fit-vocab`) resizes to the tokenizer; an explicit `model.vocab_size` (`vocab_set`) is kept when it
    holds every token id; otherwise (a named preset) vocab_size must equal the fitted size, else a StemlmError
    names both sizes. `requested` names the source in the message (e.g. "preset paper-1b").
    """
    if fit:
        return fit_vocab(config, tok)
    size, tokens = fitted_vocab_size(tok), tok.get_vocab_size()
    if config.vocab_size == size or (vocab_set and config.vocab_size >= tokens):
        return config
    raise StemlmError(
        f"{requested} has vocab_size {config.vocab_size} but the tokenizer has {tokens} tokens (fitted vocab_size "
        f"{size}); pass --fit-vocab to train with vocab_size {size}, a tokenizer of {config.vocab_size} tokens, "
        f"or --set model.vocab_size=N (N >= {tokens})"
    )


def _resolved(config: ModelConfig) -> dict[str, Any]:
    d = config.to_dict()
    d.update(ffn_layers=config.special_layers, head_dim=config.head_size, num_key_value_heads=config.kv_heads)
    for kind in all_kinds():  # every kind's None defaults resolved (moe_intermediate_size)
        if kind.resolved is not None:
            d.update(kind.resolved(config))
    return d


def model_config_diff(run: ModelConfig, requested: ModelConfig) -> list[str]:
    """`field: run X, requested Y` for every model field that differs, compared resolved (a preset's head_dim
    None and a checkpoint's 64 are the same model when hidden_size / heads = 64)."""
    a, b = _resolved(run), _resolved(requested)
    return [f"{k}: run {a[k]!r}, requested {b[k]!r}" for k in a if a[k] != b.get(k)]
