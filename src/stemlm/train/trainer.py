"""The training loop: one `Trainer`, for one process or many, that trains a stemlm model on windows of a token
dataset, evaluates, saves.

    from stemlm.train import Trainer, TrainConfig
    result = Trainer(model_config, TrainConfig(steps=400, out="runs/x")).fit()
    result = Trainer.resume("runs/x", overrides={"steps": 800}).fit()     # continue, bitwise on CPU
    stemlm train --nproc 2 --parallel fsdp ...       # N ranks: the CLI relaunches itself under torchrun

One step: `grad_accum` micro-batches, each the deterministic window batch `sample_batch(seed, step * grad_accum +
k)` (read ahead on a worker thread: `stemlm.train.batches`), forward under autocast (fp32 master weights), loss =
cross-entropy + aux_loss_coef x MoE aux loss, backward of loss / grad_accum; then one gradient-norm clip and a step
of every optimizer; `cfg.recipe` picks those rules and the init (`stemlm.train.recipes`). A non-finite loss or
gradient norm skips the update (`skipped_steps`; `max_skipped` in a row stop the run with an error); a non-finite
loss, or one above `spike_factor` x the rolling median of the last `spike_window` losses, is a spike. SIGINT /
SIGTERM end the run after the current step with a checkpoint of it (`stemlm.train.guard`); checkpoints are also
written every `save_every` steps and `save_minutes` of wall time. The data position is the step number and every
RNG state is checkpointed, so a resumed run reproduces the uninterrupted one. `fault_injection(step, loss) ->
loss` (Python API only) lets tests poison a step's loss (NaN) or raise to simulate a crash.

What differs between one process and N enters from outside, never by subclassing:
- the world (`stemlm.train.world`): rank, size, device and collectives (`agree` on a stop or save, the sums of the
  losses); rank 0 alone writes the run folder, metrics and progress;
- the table placement (`stemlm.placement.base`: resident, host, row-sharded, host-sharded): each
  micro-batch's rows through `StemLM.forward(rows=...)`, their gradients, the table optimizer, its report;
- `parallelize` (`stemlm.train.parallel.parallelize`): activation checkpointing, compile, then DDP / FSDP2, in
  torchtitan's order, as each rank materialises its part of a meta-built model (`stemlm.train.model_source`);
- checkpoints: one process writes `stemlm.train.state`'s folder, N ranks their pieces, asynchronously
  (`stemlm.train.parallel.checkpoint`); either resumes on any number of processes.
The global batch is the 1-process batch at any N, DDP / FSDP2 average the backbone gradients and the row shards
divide theirs by N, so N processes train the same model as one up to float rounding (the MoE balancing loss is
per rank). A failing rank ends the job: torchrun stops the others; a rank blocked in a collective gives up after
`cfg.dist_timeout` seconds. Tests: tests/train/test_trainer.py, tests/train/parallel/test_train_dist.py.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from stemlm.checkpoint.folder import load_config, write_json
from stemlm.checkpoint.runs import from_pretrained
from stemlm.data.tokenizer import tokenizer_digest
from stemlm.errors import StemlmError
from stemlm.model.config import ModelConfig
from stemlm.model.decoder import ForwardOptions
from stemlm.model.presets import get_preset
from stemlm.paths import refuse_symlink
from stemlm.placement.registry import make_placement
from stemlm.placement.resident import ResidentTables
from stemlm.runtime import resolve_dtype
from stemlm.train.allocator import keep_freed_blocks
from stemlm.train.batches import MicroBatches
from stemlm.train.checkpointing import make_saver
from stemlm.train.config import TrainConfig
from stemlm.train.data import load_datasets, load_datasets_distributed, resolve_sampling, resolve_tokenizer
from stemlm.train.guard import DivergenceGuard, StopSignals, check_no_checkpoints, check_run_dir, maybe_inject_exit
from stemlm.train.logging import METRICS_NAME, PLOT_NAME, QuietLogger, RunLogger, plot_losses
from stemlm.train.memory import resolve_loss
from stemlm.train.model_source import ModelSource
from stemlm.train.optim import freeze_backbone
from stemlm.train.parallel.launch import local_batch_size
from stemlm.train.parallel.parallelize import gradient_sync, parallelize
from stemlm.train.profiling import StepProfiler, check_profiling
from stemlm.train.recipes import get_recipe
from stemlm.train.resume import RUN_CONFIG_NAME, check_finite_weights, check_resume_state, resume_setup
from stemlm.train.state import check_same_data, data_digest, read_state_json, restore_rng
from stemlm.train.world import LocalWorld, detect_world

FaultInjection = Callable[[int, torch.Tensor], torch.Tensor]


def default_run_dir(cfg: TrainConfig, config: ModelConfig) -> Path:
    return Path("runs") / f"{cfg.preset}-{config.ffn}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def check_fits(config: ModelConfig, tokenizer: Tokenizer, cfg: TrainConfig) -> None:
    """The model must embed every token id and hold a whole window (also checked before a `--nproc` launch)."""
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise StemlmError(
            f"the tokenizer has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is "
            f"{config.vocab_size}; raise vocab_size or use another tokenizer"
        )
    if cfg.seq_len > config.max_position_embeddings:
        raise StemlmError(
            f"seq_len {cfg.seq_len} exceeds the model's max_position_embeddings {config.max_position_embeddings}"
        )


class Trainer:
    """One training run on any number of ranks: model, optimizers, data and run folder; `fit()` trains to
    `cfg.steps`. `world` (default: `detect_world(cfg)`) says which rank of how many this process is."""

    def __init__(
        self,
        model_config: ModelConfig | None,
        cfg: TrainConfig,
        *,
        world: LocalWorld | None = None,
        tokenizer: Tokenizer | None = None,
        fault_injection: FaultInjection | None = None,
        progress: bool = True,
        _resume_from: Path | None = None,
        _allow_nonfinite: bool = False,
    ) -> None:
        self.world = world = world or detect_world(cfg)
        self.local_batch = local_batch_size(cfg.batch_size, world.size)  # this rank's rows of the global batch
        if world.distributed and _resume_from is None and cfg.out is None:
            cfg = cfg.replace(out=self._shared_run_dir(model_config, cfg))
        self.cfg, self.fault_injection, self.progress = cfg, fault_injection, progress and world.is_main
        self.resumed = _resume_from is not None
        if _resume_from is None and cfg.out:
            check_run_dir(cfg.out)  # before anything is built: a refused --out costs nothing
        self.device = world.device
        check_profiling(cfg.memory_snapshot, self.device)
        self.amp_dtype = resolve_dtype(cfg.dtype, self.device)
        self.tokenizer = tokenizer or resolve_tokenizer(cfg)
        self.recipe = get_recipe(cfg.recipe)  # init, optimizer groups, schedule and clipping (stemlm.train.recipes)
        self.model, self.tables, self.net = self._build_model(model_config, _resume_from)
        self.config = self.model.config
        self.cfg = cfg = resolve_loss(cfg, self.config)  # fused_loss=None: by the vocabulary (stemlm.train.memory)
        if _resume_from is not None and not _allow_nonfinite:
            check_finite_weights(self.model, _resume_from)
        check_fits(self.config, self.tokenizer, cfg)
        self.train_data, self.heldout_data = self._load_data()
        self.batches = MicroBatches(
            self.train_data, cfg, world, self.local_batch, every_rank=self.tables.every_rank_ids
        )
        self.train_data.sample_batch(cfg.batch_size, cfg.seq_len, seed=cfg.seed, step=0)  # fails early if too small
        self.saver = make_saver(world, cfg)  # one process: written at once; several ranks: their pieces, async
        self.tables.bind(self.batches, cfg, self.autocast)
        self.optimizers = self._build_optimizers()
        self.step, self.skipped_steps, self.loss_spikes = 0, 0, 0
        self.window: deque[float] = deque(maxlen=cfg.spike_window)
        self.train_time = 0.0
        # This process's CPU seconds in train_step and the steps they cover (not checkpointed: the CPU-time
        # throughput of the summary is this session's, stemlm.train.throughput)
        self.cpu_time, self.cpu_steps = 0.0, 0
        if _resume_from is not None:
            self.run_dir = _resume_from.parent.parent
            self._restore(_resume_from)
        else:
            self.run_dir = Path(cfg.out) if cfg.out else default_run_dir(cfg, self.config)
            self._start_run_dir()

    # ----- construction -----
    def _shared_run_dir(self, model_config: ModelConfig | None, cfg: TrainConfig) -> str:
        # The default folder name carries a timestamp: rank 0 picks it, the others take its choice.
        name = None
        if self.world.is_main:
            config = model_config or (load_config(cfg.init_from) if cfg.init_from else get_preset(cfg.preset))
            name = str(default_run_dir(cfg, config))
        return self.world.broadcast(name)

    def _build_model(self, model_config: ModelConfig | None, resume_from: Path | None):
        """(model, table placement, the module whose forward trains), in this order: the model (on the meta device
        on several ranks), the backbone frozen (`--train tables`: DDP / FSDP2 must see it frozen), the tables
        placed (row shards leave the model before any wrapping), then checkpointing, compile and data
        parallelism applied from outside (stemlm.train.parallel.parallelize) as this rank's part is materialised."""
        self.model_source = source = ModelSource(self.cfg, model_config, resume_from, self.world, self.recipe)
        model = source.build()
        if self.cfg.trainable == "tables":
            freeze_backbone(model)
        tables = make_placement(self.cfg, model, self.world)
        net = parallelize(
            model, self.cfg, self.world, self.amp_dtype, lambda: source.materialise(model, tables.row_shards)
        )
        return model, tables, net

    def _build_optimizers(self) -> list[torch.optim.Optimizer]:
        """The recipe's optimizers over the model's parameters, with the table placement's in them."""
        return self.tables.wrap_optimizers(self.recipe.build_optimizers(self.model, self.cfg), self.cfg)

    def inference_rows(self) -> dict[str, Any]:
        """Keyword arguments for a no-grad forward of `self.model` in this process (sampling)."""
        rows = self.tables.lookup_rows()
        return {} if rows is None else {"rows": rows}

    @functools.cached_property
    def flops_per_token(self) -> float:
        from stemlm.model.accounting import training_flops_per_token

        return training_flops_per_token(self.config, self.cfg.seq_len)

    def _load_data(self) -> tuple[Any, Any]:
        if self.world.distributed:  # rank 0 builds the shards, the others open its files
            return load_datasets_distributed(self.cfg, self.tokenizer, self.world.is_main)
        return load_datasets(self.cfg, self.tokenizer)

    def _start_run_dir(self) -> None:
        if self.world.is_main:
            check_no_checkpoints(self.run_dir)
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                for stale in (METRICS_NAME, PLOT_NAME):
                    (self.run_dir / stale).unlink(missing_ok=True)
            except OSError as exc:
                raise StemlmError(f"cannot write the run folder {self.run_dir}: {exc.strerror or exc}") from None
            self._write_run_config()
        # The loop draws from no global RNG today (windows and init use their own generators); seeding them, and
        # checkpointing their states, keeps anything added later (dropout, sampling) reproducible across resumes.
        random.seed(self.cfg.seed)
        np.random.seed(self.cfg.seed)
        torch.manual_seed(self.cfg.seed)
        self.world.barrier()

    def run_config(self) -> dict[str, Any]:
        """The resolved configuration written to RUN/run_config.json (model + train + tokenizer + derived)."""
        config = {
            "model": self.config.to_dict(),
            "train": self.cfg.to_dict(),
            "tokenizer": {
                "name": self.cfg.tokenizer or ("init_from" if self.cfg.init_from else "default"),
                "vocab_size": self.tokenizer.get_vocab_size(),
                "sha256_16": tokenizer_digest(self.tokenizer),
            },
            "resolved": {
                "device": self.device.type,
                "autocast_dtype": str(self.amp_dtype).removeprefix("torch."),
                "warmup_steps": self.cfg.warmup_steps,
                "table_peak_lr": self.cfg.table_peak_lr,
                "tokens_per_step": self.cfg.tokens_per_step,
                "sampling": resolve_sampling(self.cfg),
                "train_tokens": self.train_data.num_tokens,
                "heldout_tokens": self.heldout_data.num_tokens if self.heldout_data else 0,
            },
        }
        if self.world.distributed:
            config["distributed"] = {
                "world_size": self.world.size,
                "backend": self.world.backend,
                "parallel": self.cfg.parallel,
                "local_batch_size": self.local_batch,
            }
        return config

    # ----- resume -----
    @classmethod
    def resume(
        cls,
        path: str | Path,
        *,
        model_config: ModelConfig | None = None,
        tokenizer: Tokenizer | None = None,
        overrides: dict[str, Any] | None = None,
        fault_injection: FaultInjection | None = None,
        progress: bool = True,
        allow_nonfinite: bool = False,
        world: LocalWorld | None = None,
    ) -> Trainer:
        """Continue a run from its newest checkpoint (or the given checkpoint folder of a run).

        `model_config` / `tokenizer`, when given, must match the run's (else a StemlmError names the
        difference); `overrides` change training fields, e.g. {"steps": 800}. Weights holding NaN or Inf are
        refused unless `allow_nonfinite`. Nothing in the run folder is written before `fit()`.
        """
        setup = resume_setup(path, tokenizer=tokenizer, overrides=overrides)
        return cls(
            model_config,
            setup.cfg,
            world=world,
            tokenizer=setup.tokenizer,
            fault_injection=fault_injection,
            progress=progress,
            _resume_from=setup.ckpt,
            _allow_nonfinite=allow_nonfinite,
        )

    def _restore(self, ckpt: Path) -> None:
        state = read_state_json(ckpt)
        data = state.get("data")
        check_same_data(data.get("digest") if isinstance(data, dict) else None, data_digest(self.train_data), ckpt)
        check_resume_state(ckpt, state, self.cfg)
        self.saver.load_optimizers(self, ckpt, state)
        self.step = state["step"]
        self.skipped_steps, self.loss_spikes = state["skipped_steps"], state["loss_spikes"]
        self.window.extend(state["spike_window"][-self.cfg.spike_window :])
        self.train_time = state.get("train_time_s", 0.0)
        restore_rng(state["rng"])

    def _write_run_config(self) -> None:
        """RUN/run_config.json, written when training starts (a resume's with its overrides): a refused run or
        resume has written nothing."""
        if not self.world.is_main:
            return
        path = refuse_symlink(self.run_dir / RUN_CONFIG_NAME, "run folder entry")
        try:
            write_json(path, self.run_config())
        except OSError as exc:
            raise StemlmError(f"cannot write the run folder {self.run_dir}: {exc.strerror or exc}") from None

    def state(self) -> dict[str, Any]:
        """Counters and data position saved with each checkpoint (RNG and optimizer state are added by save)."""
        return {
            "skipped_steps": self.skipped_steps,
            "loss_spikes": self.loss_spikes,
            "spike_window": list(self.window),
            "train_time_s": self.train_time,
            "data": {
                "seed": self.cfg.seed,
                "next_window_step": self.step * self.cfg.grad_accum,
                "digest": data_digest(self.train_data),
            },
            "config": {"model": self.config.to_dict(), "train": self.cfg.to_dict()},
        }

    def save(self) -> Path:
        """Checkpoint this step: RUN/checkpoints/step-<step>/ (several ranks: in place once `saver.wait()` returns,
        which the next save and the end of `fit` do)."""
        self.tables.before_save()
        return self.saver.save(self)

    # ----- training -----
    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp_dtype == torch.bfloat16)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step at `self.step`; returns its metrics record and advances the step."""
        maybe_inject_exit(self.world.rank, self.step + 1, before=self.saver.wait)
        cfg, step = self.cfg, self.step
        mult = self.recipe.set_learning_rates(self.optimizers, step, cfg)
        start, cpu_start = time.perf_counter(), time.process_time()
        losses, auxes, finite = self._accumulate_gradients(step)
        norm = self._clip_gradients() if finite else math.nan
        applied = finite and math.isfinite(norm)
        if applied:
            for opt in reversed(self.optimizers):  # tables first: a host-table update then overlaps the backbone's
                opt.step()
        else:
            self.skipped_steps += 1
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        self.train_time += elapsed
        self.cpu_time += time.process_time() - cpu_start
        self.cpu_steps += 1
        self.step += 1
        loss = sum(losses) / len(losses)
        # A jump to a non-finite loss is a spike too, though the step is skipped; only applied losses enter the window.
        spike = not math.isfinite(loss) or (
            len(self.window) == cfg.spike_window and loss > cfg.spike_factor * statistics.median(self.window)
        )
        self.loss_spikes += spike
        if applied:
            self.window.append(loss)
        record = {
            "kind": "train",
            "step": self.step,
            "loss": loss,
            "lr": cfg.lr * mult,
            "grad_norm": norm,
            "tokens_per_s": cfg.tokens_per_step / elapsed,
            # Model FLOP/s (stemlm.model.accounting's training FLOPs per token x tokens/s); the summary adds the MFU.
            "model_gflops_per_s": self.flops_per_token * cfg.tokens_per_step / elapsed / 1e9,
            "skipped": not applied,
            "spike": spike,
        }
        if auxes:
            record["aux_loss"] = sum(auxes) / len(auxes)
        if self.model.lookup_tables():
            record["table_lr"] = cfg.table_peak_lr * mult
        return record | self.tables.step_record(self.step, self.step == cfg.steps)

    def _accumulate_gradients(self, step: int) -> tuple[list[float], list[float], bool]:
        """Forward and backward of the step's `grad_accum` micro-batches: (losses, aux losses, all finite), the
        means over the ranks."""
        cfg, tables = self.cfg, self.tables
        first = step * cfg.grad_accum
        tables.begin_step(first, final=step + 1 >= cfg.steps)
        options = ForwardOptions(loss_chunk=cfg.loss_chunk, fused_loss=cfg.fused_loss)
        stats, has_aux = [], False
        for k in range(cfg.grad_accum):
            window = first + k
            x, y = self.batches.get(window)
            with gradient_sync(self.net, last=k == cfg.grad_accum - 1):
                with self.autocast():
                    out = self.net(x, labels=y, options=options, rows=tables.rows(window, x))
                loss = out.loss if self.fault_injection is None else self.fault_injection(step + 1, out.loss)
                aux = out.aux_loss.float() if out.aux_loss is not None else None
                has_aux = aux is not None
                total = loss if aux is None else loss + cfg.aux_loss_coef * aux
                no_aux = torch.zeros((), device=loss.device)
                finite = (~torch.isfinite(total.detach())).float()
                stats.append(torch.stack([loss.detach().float(), no_aux if aux is None else aux.detach(), finite]))
                # No host sync per micro-batch, and every rank runs every micro-batch (collectives stay matched):
                # NaN gradients of a bad micro-batch are never applied, the step is skipped on all ranks below.
                (total / cfg.grad_accum).backward()
        tables.finish_grads()
        # One all_reduce (several ranks) and one device->host read per step: the mean losses and aux losses over
        # the ranks, and whether any rank went non-finite in any micro-batch, so that every rank skips together.
        values = (self.world.all_reduce_(torch.stack(stats)) / self.world.size).tolist()
        losses = [v[0] for v in values]
        auxes = [v[1] for v in values] if has_aux else []
        return losses, auxes, all(v[2] == 0 for v in values)

    def _clip_gradients(self) -> float:
        if not self.world.distributed:
            return self.recipe.clip_gradients(self.optimizers, self.cfg.grad_clip).item()
        # One clip over every optimized tensor: the backbone (replicated or FSDP2-sharded; `--train tables` may
        # leave none), replicated n-gram / memory tables, and the row shards, whose norm needs a cross-rank sum.
        shards = list(self.tables.row_shards.parameters()) if self.tables.row_shards is not None else []
        sharded = {id(p) for p in shards}
        backbone = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"] if id(p) not in sharded]
        return self.recipe.clip_distributed(backbone, shards, self.cfg.grad_clip).item()

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean held-out cross-entropy over `eval_batches` fixed batches spread over the held-out split (on several
        ranks: the same windows, each batch split over the ranks)."""
        if self.heldout_data is None:
            return None
        cfg, n, rank = self.cfg, self.world.size, self.world.rank
        totals = torch.zeros(2, dtype=torch.float64)
        self.model.eval()
        windows = self.heldout_data.iter_eval_windows(cfg.seq_len, cfg.eval_batches * cfg.batch_size, cfg.batch_size)
        for x, y in windows:
            # A short last batch: a rank without rows still takes part in the collectives, on x[:1] at weight 0.
            parts = [
                (p, q, 1.0) if p.shape[0] else (x[:1], y[:1], 0.0)
                for p, q in zip(x.tensor_split(n), y.tensor_split(n), strict=True)
            ]
            part_x, part_y, weight = parts[rank]
            part_x, part_y = part_x.to(self.device), part_y.to(self.device)
            with self.autocast():
                rows = self.tables.eval_rows(part_x, [p[0] for p in parts])
                out = self.model(part_x, labels=part_y, rows=rows, **self.eval_loss())
            totals += torch.tensor([out.loss.item() * part_y.numel(), part_y.numel()], dtype=torch.float64) * weight
        self.model.train()
        totals = self.world.all_reduce_(totals.to(self.device))
        return (totals[0] / totals[1]).item()

    def eval_loss(self) -> dict[str, Any]:
        """The fused loss evaluates without [tokens, V] logits too (no gradient work under no_grad); the other
        paths keep evaluating on the full logits."""
        if not self.cfg.fused_loss:
            return {}
        return {"options": ForwardOptions(loss_chunk=self.cfg.loss_chunk, fused_loss=True)}

    def fit(self) -> dict[str, Any]:
        """Train from `self.step` to `cfg.steps`, evaluating and saving on schedule; returns the final metrics."""
        keep_freed_blocks()  # the step's large temporaries reused, not mapped anew each step (stemlm.train.allocator)
        cfg, wall = self.cfg, time.perf_counter()
        try:
            heldout, checkpoint, last, stopped = self._train()
        except BaseException:
            self.tables.end_training(failed=True)
            with contextlib.suppress(Exception):
                self.saver.wait()  # a save in flight still completes (or leaves only its temporary folder)
            raise
        self.tables.end_training(failed=False)
        self.saver.wait()  # the last checkpoint is in place before fit returns
        if self.world.is_main:
            plot_losses(self.run_dir / METRICS_NAME, self.run_dir / PLOT_NAME, title=self.run_dir.name)
        tokens = cfg.tokens_per_step * self.step
        result = {
            "run_dir": str(self.run_dir),
            "checkpoint": str(checkpoint),
            "steps": self.step,
            "train_loss": last["loss"] if last else None,
            "heldout_loss": heldout,
            "skipped_steps": self.skipped_steps,
            "loss_spikes": self.loss_spikes,
            "tokens_seen": tokens,
            "tokens_per_s": tokens / self.train_time if self.train_time else None,
            "train_time_s": self.train_time,
            "cpu_tokens_per_s": cfg.tokens_per_step * self.cpu_steps / self.cpu_time if self.cpu_time else None,
            "wall_s": time.perf_counter() - wall,
            "device": self.device.type,
            "autocast_dtype": str(self.amp_dtype).removeprefix("torch."),
            "placement": self.tables.name,  # the table placement (stemlm.placement); its report lines key on it
            **self.tables.summary(self.optimizers),
            "stopped_by": stopped,
        }
        if self.world.distributed:
            result.update(world_size=self.world.size, parallel=cfg.parallel)
        return result

    def _train(self) -> tuple[float | None, Path | None, dict[str, Any] | None, str | None]:
        """The loop of `fit`: (last held-out loss, last checkpoint, last step's record, the signal that stopped it)."""
        cfg = self.cfg
        if self.resumed:  # accepted once every rank has built its part (`agree` waits for them all)
            self.world.agree(False)
            self._write_run_config()  # now with this resume's overrides
        logger = RunLogger(self.run_dir, self.step, cfg.steps, self.progress) if self.world.is_main else QuietLogger()
        if self.heldout_data is None:
            logger.message(f"note: no held-out split with a window of {cfg.seq_len} tokens; no held-out evaluation")
        heldout, checkpoint, last, stopped = None, None, None, None
        guard, saved_at = DivergenceGuard(cfg.max_skipped), time.monotonic()
        try:
            profiler = StepProfiler(
                self.run_dir,
                self.world.rank,
                self.device,
                cfg.steps - self.step,
                trace=cfg.profile,
                memory=cfg.memory_snapshot,
            )
            with StopSignals(abort_on_second=not self.world.distributed) as signals, profiler:
                while self.step < cfg.steps:
                    last = self.train_step()
                    profiler.step()
                    logger.log(last)
                    logger.advance(last["loss"], last["tokens_per_s"])
                    if last["skipped"]:
                        logger.message(f"step {self.step}: non-finite loss or gradient norm, update skipped")
                    elif last["spike"]:
                        logger.message(
                            f"step {self.step}: loss spike {last['loss']:.4f} (> {cfg.spike_factor} x median)"
                        )
                    guard.update(last)
                    # Every rank must take the same decision (a save is collective): `agree` reduces them.
                    due = cfg.save_minutes and time.monotonic() - saved_at >= 60 * cfg.save_minutes
                    stop, due = self.world.agree(signals.requested is not None, bool(due))
                    # A stop on an evaluation step evaluates it first: the resumed run starts after it.
                    if self.step == cfg.steps or (cfg.eval_every and self.step % cfg.eval_every == 0):
                        heldout = self._evaluate_and_log(logger, last)
                    if stop and self.step < cfg.steps:
                        stopped = signals.requested or "SIGTERM"
                        break
                    if due or self.step == cfg.steps or (cfg.save_every and self.step % cfg.save_every == 0):
                        checkpoint, saved_at = self.save(), time.monotonic()
            if stopped is not None and last is not None:
                checkpoint = self.save()  # the last completed step
                logger.message(
                    f"stopped by {stopped} after step {self.step}/{cfg.steps}; checkpoint {checkpoint}; "
                    f"continue with: stemlm train --resume {self.run_dir}"
                )
        finally:
            logger.close()
            self.batches.close()
        return heldout, checkpoint, last, stopped

    def _evaluate_and_log(self, logger: RunLogger, last: dict[str, Any]) -> float | None:
        heldout = self.evaluate()
        record = {"kind": "eval", "step": self.step, "heldout_loss": heldout, "train_loss": last["loss"]}
        logger.log(record)
        shown = (
            "n/a"
            if heldout is None
            else f"{heldout:.4f} (ppl {math.exp(min(heldout, 50)):.1f}, window {self.cfg.seq_len})"
        )
        logger.message(
            f"step {self.step}/{self.cfg.steps} | train {last['loss']:.4f} | held-out {shown} | lr {last['lr']:.2e} | "
            f"{last['tokens_per_s']:,.0f} tok/s, {last['model_gflops_per_s']:,.1f} GFLOP/s | "
            f"skipped {self.skipped_steps} | spikes {self.loss_spikes}"
        )
        return heldout

    def finish(self, checkpoint: str | Path | None = None) -> None:
        """Leave the world (a multi-process run's process group); on rank 0, replace `model` by the unsharded one
        from `checkpoint` (e.g. the final one) so the caller can generate or evaluate with it."""
        self.tables.close()
        self.world.close()
        if checkpoint is not None and self.world.is_main:
            self.model = from_pretrained(checkpoint, device=self.device).eval()
            self.tables = ResidentTables()  # the reloaded model holds its own tables
