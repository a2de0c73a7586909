"""The training loop: a `Trainer` that trains a stemlm model on windows of a token dataset, evaluates, saves.

    from stemlm.train import Trainer, TrainConfig
    result = Trainer(model_config, TrainConfig(steps=400, out="runs/x")).fit()
    result = Trainer.resume("runs/x", overrides={"steps": 800}).fit()     # continue, bitwise on CPU

One step: `grad_accum` micro-batches, each the deterministic window batch `sample_batch(seed, step * grad_accum +
k)` (read `cfg.prefetch` micro-batches ahead on a worker thread: `stemlm.train.prefetch`), forward under autocast
(fp32 master weights), loss = cross-entropy + aux_loss_coef x MoE aux loss, backward of loss / grad_accum; then
one global gradient-norm clip over all parameters and a step of every optimizer (`stemlm.train.optim`); `cfg.recipe`
picks those rules and the init (`stemlm.train.recipes`: `official` clips per optimizer). A
non-finite loss or gradient norm skips the update (counted as `skipped_steps`; `max_skipped` in a row stop the run
with an error); a non-finite loss, or one above `spike_factor` x the rolling median of the last `spike_window`
losses, is counted as a spike. SIGINT / SIGTERM end the run after the current step with a checkpoint of it
(`stemlm.train.guard`); checkpoints are also written every `save_every` steps and every `save_minutes` of wall
time. The data position is the step number and every RNG state is checkpointed, so a resumed run reproduces the
uninterrupted one. `fault_injection(step, loss) -> loss` (Python API only) lets tests poison a step's loss (NaN)
or raise to simulate a crash. `stemlm.train.distributed.DistributedTrainer` runs this loop on N ranks by
overriding the underscored hooks (`_build_optimizers`, `_sample`, `_accumulate_gradients`, `_clip_gradients`,
`_agree`, `_load_optimizer_state`, `_make_logger`) and `is_main`. `fit()` first tells glibc to keep large freed blocks
for reuse (`stemlm.train.allocator`: no fresh mapping of the loss's [tokens, V] tensors each step).
"""

from __future__ import annotations

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
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.model.decoder import ForwardOptions
from stemlm.model.presets import get_preset
from stemlm.paths import refuse_symlink
from stemlm.runtime import resolve_device, resolve_dtype
from stemlm.train.allocator import keep_freed_blocks
from stemlm.train.config import TrainConfig, model_config_diff
from stemlm.train.data import load_datasets, resolve_sampling, resolve_tokenizer
from stemlm.train.guard import DivergenceGuard, StopSignals, check_no_checkpoints, check_run_dir
from stemlm.train.logging import METRICS_NAME, PLOT_NAME, RunLogger, plot_losses
from stemlm.train.memory import resolve_loss
from stemlm.train.optim import freeze_backbone
from stemlm.train.profiling import StepProfiler, check_profiling
from stemlm.train.recipes import get_recipe
from stemlm.train.resume import RUN_CONFIG_NAME, check_finite_weights, check_resume_state, resume_setup
from stemlm.train.state import (
    check_same_data,
    data_digest,
    load_optimizer_state,
    read_state_json,
    read_trainer_state,
    restore_rng,
    save_checkpoint,
)

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
    """One training run: model, optimizers, data and run folder; `fit()` trains to `cfg.steps`."""

    is_main = True  # this process writes the run folder (rank 0 of a multi-process run: stemlm.train.distributed)
    rank = 0  # this process's rank (stemlm.train.distributed overrides it)

    def __init__(
        self,
        model_config: ModelConfig | None,
        cfg: TrainConfig,
        *,
        tokenizer: Tokenizer | None = None,
        fault_injection: FaultInjection | None = None,
        progress: bool = True,
        _resume_from: Path | None = None,
        _allow_nonfinite: bool = False,
    ) -> None:
        self.cfg, self.fault_injection, self.progress = cfg, fault_injection, progress
        self.resumed = _resume_from is not None
        if _resume_from is None and cfg.out:
            check_run_dir(cfg.out)  # before anything is built: a refused --out costs nothing
        self.device = resolve_device(cfg.device)
        check_profiling(cfg.memory_snapshot, self.device)
        self.amp_dtype = resolve_dtype(cfg.dtype, self.device)
        self.tokenizer = tokenizer or resolve_tokenizer(cfg)
        self.recipe = get_recipe(cfg.recipe)  # init, optimizer groups, schedule and clipping (stemlm.train.recipes)
        self.model = self._build_model(model_config, _resume_from)
        self.config = self.model.config
        self.cfg = cfg = resolve_loss(cfg, self.config)  # fused_loss=None: by the vocabulary (stemlm.train.memory)
        if _resume_from is not None and not _allow_nonfinite:
            check_finite_weights(self.model, _resume_from)
        check_fits(self.config, self.tokenizer, cfg)
        self.train_data, self.heldout_data = self._load_data()
        self.prefetcher = None  # built at the first micro-batch (stemlm.train.prefetch)
        self.train_data.sample_batch(cfg.batch_size, cfg.seq_len, seed=cfg.seed, step=0)  # fails early if too small
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
    def _build_model(self, model_config: ModelConfig | None, resume_from: Path | None):
        model = self._construct_model(model_config, resume_from)
        if self.cfg.trainable == "tables":  # before any wrapping: DDP / FSDP2 must see the frozen backbone as frozen
            freeze_backbone(model)
        if self.cfg.activation_checkpointing:  # before any FSDP wrapping (DistributedTrainer), as torchtitan orders
            from stemlm.train.memory import checkpoint_blocks

            checkpoint_blocks(model)
        if self.cfg.compile:
            from stemlm.train.compile import compile_blocks

            compile_blocks(model)
        return model

    def _construct_model(self, model_config: ModelConfig | None, resume_from: Path | None):
        source = resume_from or (Path(self.cfg.init_from) if self.cfg.init_from else None)
        if source is None:
            config = model_config or get_preset(self.cfg.preset)
            model = build_model(config, device=self.device, seed=self.cfg.seed).train()
            self.recipe.init_weights(model, self.cfg.seed)  # a fresh run only: a checkpoint keeps its weights
            return model
        if model_config is not None:
            diff = model_config_diff(load_config(source), model_config)
            if diff:
                raise StemlmError(f"model config differs from the checkpoint {source}: {'; '.join(diff)}")
        model = from_pretrained(source, device=self.device).train()
        # Tensors read from safetensors are views at unaligned offsets of a file buffer, and some CPU kernels round
        # differently with differently aligned operands (measured: a resumed MoE run lost bitwise equality with
        # the uninterrupted one after 4 steps). Fresh allocations, like an uninterrupted run's, keep it exact.
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.clone()
        return model

    def _build_optimizers(self) -> list[torch.optim.Optimizer]:
        self.host_tables = self._make_host_tables()
        optimizers = self.recipe.build_optimizers(self.model, self.cfg)
        if self.host_tables is not None:
            optimizers[-1] = self.host_tables.wrap(optimizers[-1], self.cfg.table_optim)
        return optimizers

    def _make_host_tables(self):
        """`--tables host`: the tables and their optimizer leave the device (stemlm.train.tables.host)."""
        if self.cfg.tables != "host":
            return None
        from stemlm.train.tables.host import HostTables

        cfg = self.cfg

        def ids_for(window: int) -> torch.Tensor:
            return self.train_data.sample_batch(cfg.batch_size, cfg.seq_len, seed=cfg.seed, step=window)[0]

        return HostTables(self.model, self.device, ids_for, cfg.grad_accum)

    def inference_rows(self) -> dict[str, Any]:
        """Keyword arguments for a no-grad forward of `self.model` (evaluation, sampling)."""
        return {} if self.host_tables is None else {"rows": {"token": self.host_tables.lookup}}

    @functools.cached_property
    def flops_per_token(self) -> float:
        from stemlm.model.accounting import training_flops_per_token

        return training_flops_per_token(self.config, self.cfg.seq_len)

    def _load_data(self) -> tuple[Any, Any]:
        return load_datasets(self.cfg, self.tokenizer)

    def _start_run_dir(self) -> None:
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

    def run_config(self) -> dict[str, Any]:
        """The resolved configuration written to RUN/run_config.json (model + train + tokenizer + derived)."""
        return {
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
        self._load_optimizer_state(ckpt, state)
        self.step = state["step"]
        self.skipped_steps, self.loss_spikes = state["skipped_steps"], state["loss_spikes"]
        self.window.extend(state["spike_window"][-self.cfg.spike_window :])
        self.train_time = state.get("train_time_s", 0.0)
        restore_rng(state["rng"])

    def _write_run_config(self) -> None:
        """RUN/run_config.json, written when training starts (a resume's with its overrides): a refused run or
        resume has written nothing."""
        if not self.is_main:
            return
        path = refuse_symlink(self.run_dir / RUN_CONFIG_NAME, "run folder entry")
        try:
            write_json(path, self.run_config())
        except OSError as exc:
            raise StemlmError(f"cannot write the run folder {self.run_dir}: {exc.strerror or exc}") from None

    def _load_optimizer_state(self, ckpt: Path, state: dict[str, Any]) -> None:
        if "distributed" in state:  # written by several processes: sharded, in torch.distributed.checkpoint form
            from stemlm.train.parallel.checkpoint import load_optimizers

            load_optimizers(self.optimizers, ckpt, state)
        else:
            _, tensors = read_trainer_state(ckpt)
            load_optimizer_state(self.optimizers, tensors, state["optimizers"], ckpt)

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
        cfg = self.cfg
        return save_checkpoint(
            self.run_dir,
            self.step,
            self.model,
            self.tokenizer,
            self.optimizers,
            self.state(),
            cfg.keep_last,
            cfg.keep_optimizer_state,
        )

    # ----- training -----
    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp_dtype == torch.bfloat16)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step at `self.step`; returns its metrics record and advances the step."""
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
        return record

    def _sample(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `window` of the run on the host (this process's rows of it)."""
        cfg = self.cfg
        return self.train_data.sample_batch(cfg.batch_size, cfg.seq_len, seed=cfg.seed, step=window)

    def _batch(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `window` on the device, the next ones being read meanwhile."""
        return self._prefetched(window, self.device)

    def _prefetched(self, window: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`_sample(window)` moved to `device`, from the run's prefetcher (pinned on the host when training on CUDA)."""
        if self.prefetcher is None:
            from stemlm.train.prefetch import BatchPrefetcher

            cfg, pin = self.cfg, self.device.type == "cuda"
            end = cfg.steps * cfg.grad_accum
            self.prefetcher = BatchPrefetcher(self._sample, device, ahead=cfg.prefetch, end=end, pin=pin)
        return self.prefetcher.get(window)

    def _accumulate_gradients(self, step: int) -> tuple[list[float], list[float], bool]:
        """Forward and backward of the step's `grad_accum` micro-batches: (losses, aux losses, all finite)."""
        cfg = self.cfg
        losses, auxes = [], []
        for k in range(cfg.grad_accum):
            window = step * cfg.grad_accum + k
            x, y = self._batch(window)
            rows = {} if self.host_tables is None else {"rows": {"token": self.host_tables.train_rows(window, x)}}
            with self.autocast():
                options = ForwardOptions(loss_chunk=cfg.loss_chunk, fused_loss=cfg.fused_loss)
                out = self.model(x, labels=y, options=options, **rows)
            loss = out.loss if self.fault_injection is None else self.fault_injection(step + 1, out.loss)
            total = loss if out.aux_loss is None else loss + cfg.aux_loss_coef * out.aux_loss.float()
            losses.append(loss.detach().float())
            auxes += [] if out.aux_loss is None else [out.aux_loss.detach().float()]
            # No host sync per micro-batch: a non-finite loss is found once per step below; its NaN gradients are
            # never applied (the step is skipped and zero_grad drops them).
            (total / cfg.grad_accum).backward()
        if self.host_tables is not None:
            self.host_tables.finish_grads()
        values = torch.stack(losses + auxes).tolist()  # the step's one device->host read of the losses
        losses_f, auxes_f = values[: len(losses)], values[len(losses) :]
        return losses_f, auxes_f, all(math.isfinite(v) for v in values)

    def _clip_gradients(self) -> float:
        return self.recipe.clip_gradients(self.optimizers, self.cfg.grad_clip).item()

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean held-out cross-entropy over `eval_batches` fixed batches spread over the held-out split."""
        if self.heldout_data is None:
            return None
        cfg, total, count = self.cfg, 0.0, 0
        self.model.eval()
        windows = self.heldout_data.iter_eval_windows(cfg.seq_len, cfg.eval_batches * cfg.batch_size, cfg.batch_size)
        for x, y in windows:
            with self.autocast():
                out = self.model(
                    x.to(self.device), labels=y.to(self.device), **self.inference_rows(), **self.eval_loss()
                )
            total += out.loss.item() * y.numel()
            count += y.numel()
        self.model.train()
        return total / count

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
        if self.resumed:  # accepted once every rank has built its part (`_agree` waits for them all)
            self._agree(False)
            self._write_run_config()  # now with this resume's overrides
        logger = self._make_logger()
        if self.heldout_data is None:
            logger.message(f"note: no held-out split with a window of {cfg.seq_len} tokens; no held-out evaluation")
        heldout, checkpoint, last, stopped = None, None, None, None
        guard, saved_at = DivergenceGuard(cfg.max_skipped), time.monotonic()
        try:
            profiler = StepProfiler(
                self.run_dir,
                self.rank,
                self.device,
                cfg.steps - self.step,
                trace=cfg.profile,
                memory=cfg.memory_snapshot,
            )
            with StopSignals(abort_on_second=not self.distributed) as signals, profiler:
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
                    # Every rank must take the same decision (a save is collective): `_agree` reduces them.
                    due = cfg.save_minutes and time.monotonic() - saved_at >= 60 * cfg.save_minutes
                    stop, due = self._agree(signals.requested is not None, bool(due))
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
            if self.prefetcher is not None:
                self.prefetcher.close()
                self.prefetcher = None
        if self.is_main:
            plot_losses(self.run_dir / METRICS_NAME, self.run_dir / PLOT_NAME, title=self.run_dir.name)
        tokens = cfg.tokens_per_step * self.step
        return {
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
            **(self.host_tables.summary(self.optimizers[-1]) if self.host_tables is not None else {}),
            "stopped_by": stopped,
        }

    distributed = False  # a torchrun worker (stemlm.train.distributed): signals are torchrun's to escalate

    def _agree(self, *flags: bool) -> tuple[bool, ...]:
        """The decisions every process takes (one process: its own; DistributedTrainer: any rank's)."""
        return flags

    def _make_logger(self) -> RunLogger:
        return RunLogger(self.run_dir, self.step, self.cfg.steps, self.progress)

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
