"""Training: `TrainConfig` (every knob), `Trainer` (the loop, checkpoints, exact resume), optimizer groups.

Modules: `config` (TrainConfig), `optim` (parameter groups, optimizers, schedule, clipping), `table_optim`
(optimizers for the STEM tables), `state` (trainer checkpoints), `logging` (metrics.jsonl, TensorBoard,
progress, loss plot), `trainer` (the loop). Names load lazily so `import stemlm.train` stays cheap:

    from stemlm.train import Trainer, TrainConfig
    Trainer(model_config, TrainConfig(steps=100, out="runs/x")).fit()

The command line is `stemlm train` (or `python -m stemlm train`), see `stemlm.cli.train`.
"""

from stemlm._lazy import lazy_exports

_EXPORTS = {
    "TrainConfig": "stemlm.train.config",
    "Trainer": "stemlm.train.trainer",
    "fit_vocab": "stemlm.train.config",
    "build_optimizers": "stemlm.train.optim",
    "lr_multiplier": "stemlm.train.optim",
    "save_checkpoint": "stemlm.train.state",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
