"""Where a training run's model comes from: built fresh, read from a checkpoint (a resume, `--init-from`), or, on
several ranks, built on the meta device and materialised part by part once its tables and backbone are placed.

    source = ModelSource(cfg, model_config, resume_from, world, recipe)
    model = source.build()                      # real weights on the device, or (several ranks) on meta
    ...                                         # table placement, DDP / FSDP2 (stemlm.train.parallel.parallelize)
    source.materialise(model, row_shards)       # this rank's part allocated and filled (no-op once real)

One process builds the whole model on its device (`build_model(seed)` and the recipe's init, or the checkpoint's
weights). On several ranks the model is built with no storage and each rank allocates only its part once sharded
(stemlm.train.parallel.meta_init): initialised for a fresh run, read from a sharded checkpoint's pieces, or from
the rows of a model folder it keeps (`--init-from`, a 1-process checkpoint). A Hugging Face Llama folder, or one
with compact (bf16 / int8) tables to dequantise, is read whole on every rank, as on one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stemlm.checkpoint.folder import load_config
from stemlm.checkpoint.runs import _model_type, from_pretrained
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.config import MODEL_TYPE, ModelConfig
from stemlm.model.presets import get_preset
from stemlm.train.config import TrainConfig, model_config_diff


class ModelSource:
    """The model of a run, and (several ranks) how this rank's part of it is filled once placed."""

    def __init__(
        self, cfg: TrainConfig, model_config: ModelConfig | None, resume_from: Path | None, world: Any, recipe: Any
    ) -> None:
        self.cfg, self.model_config, self.world, self.recipe = cfg, model_config, world, recipe
        self.path = resume_from or (Path(cfg.init_from) if cfg.init_from else None)
        # None: built with real weights; "init", ("sharded", path) or ("folder", path): built on meta, filled so
        self.meta: Any = None
        self._plan, self._materialised = None, False

    def build(self):
        if self.world.distributed and self._meta_source() is not None:
            return self._build_on_meta()
        if self.path is None:
            config = self.model_config or get_preset(self.cfg.preset)
            model = build_model(config, device=self.world.device, seed=self.cfg.seed).train()
            self.recipe.init_weights(model, self.cfg.seed)  # a fresh run only: a checkpoint keeps its weights
            return model
        if self.model_config is not None:
            self._check_config(load_config(self.path))
        model = from_pretrained(self.path, device=self.world.device).train()
        # Tensors read from safetensors are views at unaligned offsets of a file buffer, and some CPU kernels round
        # differently with differently aligned operands (measured: a resumed MoE run lost bitwise equality with
        # the uninterrupted one after 4 steps). Fresh allocations, like an uninterrupted run's, keep it exact.
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.clone()
        return model

    def _check_config(self, config: ModelConfig) -> None:
        diff = model_config_diff(config, self.model_config) if self.model_config is not None else []
        if diff:
            raise StemlmError(f"model config differs from the checkpoint {self.path}: {'; '.join(diff)}")

    def _meta_source(self):
        from stemlm.checkpoint.sharded import is_sharded
        from stemlm.checkpoint.table_storage import read_storage

        if self.path is None:
            return "init"
        if _model_type(self.path) != MODEL_TYPE or (not is_sharded(self.path) and read_storage(self.path) is not None):
            return None  # a Hugging Face Llama folder, or compact tables to dequantise: read whole
        return ("sharded" if is_sharded(self.path) else "folder", Path(self.path))

    def _build_on_meta(self):
        from stemlm.train.parallel.meta_init import init_plan

        self.meta = self._meta_source()
        if self.meta == "init":
            config = self.model_config or get_preset(self.cfg.preset)
        else:
            config = load_config(self.path)
            self._check_config(config)
        model = build_model(config, device="meta").train()
        self._plan = init_plan(model)
        return model

    def materialise(self, model, shards) -> None:
        """Allocate this rank's part of a meta-built model (and of its row `shards`, if any), then initialise it or
        read it from the checkpoint; nothing to do for a model built with its weights, or a second time."""
        if self.meta is None or self._materialised:
            return
        from stemlm.train.parallel.meta_init import init_rank_part, load_rank_part, materialise

        self._materialised = True
        materialise(model, shards, self.world.device)
        if self.meta == "init":
            init_rank_part(model, shards, self._plan, self.cfg.seed)
            self.recipe.init_weights(model, self.cfg.seed)  # the official recipe's own init (stemlm.train.recipes)
        elif self.meta[0] == "sharded":
            from stemlm.train.parallel.checkpoint import load_model_pieces

            load_model_pieces(model, shards, self.world.mesh, self.meta[1])
        else:
            load_rank_part(model, shards, self._plan, self.meta[1])
