"""Who writes a run's checkpoints: `make_saver(world, cfg)` picks, once, the saver of one process or of a rank.

    saver = make_saver(world, cfg)
    path = saver.save(trainer)          # RUN/checkpoints/step-<step>/
    saver.wait()                        # in place (a rank's save runs in the background until then)
    saver.load_optimizers(trainer, ckpt, state)

One process writes `stemlm.train.state`'s folder before `save` returns (`LocalSaver`); each rank of several hands
its pieces to torch.distributed.checkpoint, asynchronously (`stemlm.train.parallel.checkpoint.ShardedSaver`, the
same three methods). Either folder resumes on any number of processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stemlm.train.config import TrainConfig
from stemlm.train.state import load_optimizer_state, read_trainer_state, save_checkpoint


class LocalSaver:
    """The checkpoints of a one-process trainer: `save_checkpoint`, written before `save` returns."""

    def save(self, trainer) -> Path:
        cfg = trainer.cfg
        return save_checkpoint(
            trainer.run_dir,
            trainer.step,
            trainer.model,
            trainer.tokenizer,
            trainer.optimizers,
            trainer.state(),
            cfg.keep_last,
            cfg.keep_optimizer_state,
        )

    def wait(self) -> None:
        """Nothing is written in the background."""

    def load_optimizers(self, trainer, ckpt: Path, state: dict[str, Any]) -> None:
        """The checkpoint's optimizer state into `trainer.optimizers` (one written by several ranks too)."""
        if "distributed" in state:  # sharded, in torch.distributed.checkpoint form
            from stemlm.train.parallel.checkpoint import load_optimizers

            load_optimizers(trainer.optimizers, ckpt, state)
        else:
            _, tensors = read_trainer_state(ckpt)
            load_optimizer_state(trainer.optimizers, tensors, state["optimizers"], ckpt)


def make_saver(world: Any, cfg: TrainConfig):
    """`LocalSaver` in a world of one; a rank's asynchronous sharded saver (its own gloo group) otherwise."""
    if not world.distributed:
        return LocalSaver()
    from stemlm.train.parallel.checkpoint import ShardedSaver

    return ShardedSaver(cfg.dist_timeout)
