"""Multi-process training with torch.distributed: `DistributedTrainer`, the `Trainer` of one rank.

    stemlm train --nproc 2 --parallel fsdp ...          # the CLI relaunches itself under torchrun
    torchrun --nproc-per-node 2 -m stemlm.cli.main train ...   # the same, by hand

Every rank builds the same model from the same seed (or reads the same checkpoint), then
- the STEM/PLE tables are row-sharded over the ranks (`stemlm.train.parallel.ShardedTables`, built before any
  optimizer so the backbone optimizer never sees them) and stepped by the table optimizer on the shards;
- the backbone is replicated with DDP (`parallel="ddp"`) or sharded with FSDP2 (`"fsdp"`: `fully_shard` per
  decoder layer, then the root).
The global batch is the 1-process batch: each micro-batch is the same `sample_batch(seed, step)` draw and rank r
takes rows [r * b, (r + 1) * b), b = batch_size / N. With sharded tables every rank reads the whole micro-batch's
windows (B x (T+1) tokens; it computes on its rows only): every rank's ids plan the table exchange on the host, so
a micro-batch costs two collectives (rows forward, gradients backward) and no device read, and micro-batch k+1's
rows are exchanged (async) while k computes (the first micro-batch's while the backbone optimizer steps). DDP /
FSDP2 average the backbone gradients and the tables divide theirs by N, so N processes train the same model as one
(up to float rounding); the MoE balancing loss is the exception (its batch statistics are per rank). Gradients are
synchronised on the last micro-batch only (DDP `no_sync`, FSDP2 `set_requires_gradient_sync(False)` before it); one
clip covers the backbone (replicated or sharded) and the table shards (`--recipe official`: one clip each, and its
init drawn over this rank's part; `stemlm.train.recipes`). With `--train tables` the backbone is frozen
before any wrapping: only adapter gates (if any) go through DDP / FSDP2, and a backbone with nothing to learn is
not wrapped at all (tests/train/parallel/test_train_tables_dist.py). Rank 0 alone writes the run folder, metrics and
progress; the table traffic, summed over ranks and over the `traffic_every` steps up to the record's (one
all_reduce per `traffic_every` steps, and at the last step), is logged as `table_bytes_sent` (and `/rows`,
`/grads`), with `table_traffic_steps` the steps it covers. Checkpoints: `stemlm.train.parallel.checkpoint` (they resume
on any number of processes).

A failing rank ends the job: torchrun then stops the others, and a rank blocked in a collective gives up
after `cfg.dist_timeout` seconds. Fault injection for tests: `STEMLM_FAULT_EXIT=RANK:STEP` makes that rank
exit with status 1 just before it computes that (1-based) step, once its part of any checkpoint being written
in the background is on disk (so the test knows which checkpoint survives; a real crash can lose the one in
flight, never an earlier one).
Tests: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_train_dist.py -q`.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from stemlm.checkpoint.folder import load_config
from stemlm.checkpoint.runs import _model_type, from_pretrained
from stemlm.checkpoint.sharded import is_sharded
from stemlm.checkpoint.table_storage import read_storage
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.config import MODEL_TYPE, ModelConfig
from stemlm.model.decoder import ForwardOptions
from stemlm.model.kinds.registry import FAMILIES
from stemlm.model.presets import get_preset
from stemlm.train.config import TrainConfig, model_config_diff
from stemlm.train.data import load_datasets_distributed
from stemlm.train.logging import RunLogger
from stemlm.train.parallel.checkpoint import ShardedSaver, load_model_pieces, load_optimizers
from stemlm.train.parallel.host_shards import HostShardedTables
from stemlm.train.parallel.launch import destroy_distributed, init_distributed, local_batch_size
from stemlm.train.parallel.meta_init import init_plan, init_rank_part, load_rank_part, materialise
from stemlm.train.parallel.sharded_tables import ShardedTables
from stemlm.train.tables.optim import make_table_optimizer, use_sparse_table_grads
from stemlm.train.trainer import FaultInjection, Trainer, default_run_dir

FAULT_ENV = "STEMLM_FAULT_EXIT"
TRAFFIC_KINDS = ("rows", "grads")  # the routing is planned on the host: no count or id messages


class DistributedTrainer(Trainer):
    """A `Trainer` for one rank of a torchrun job (the process group is joined on construction)."""

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
        device = None if cfg.device == "auto" else cfg.device
        self.dist = init_distributed(device=device, timeout_s=cfg.dist_timeout)
        self.local_batch = local_batch_size(cfg.batch_size, self.dist.world_size)
        self.traffic, self.traffic_steps = dict.fromkeys(TRAFFIC_KINDS, 0), 0  # this rank's, since the last record
        if _resume_from is None and cfg.out is None:
            cfg = cfg.replace(out=self._shared_run_dir(model_config, cfg))
        super().__init__(
            model_config,
            cfg,
            tokenizer=tokenizer,
            fault_injection=fault_injection,
            progress=progress and self.dist.is_main,
            _resume_from=_resume_from,
            _allow_nonfinite=_allow_nonfinite,
        )

    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    @property
    def rank(self) -> int:
        return self.dist.rank

    distributed = True

    def _agree(self, *flags: bool) -> tuple[bool, ...]:
        # One tiny all-reduce per step: a signal seen by any rank (or its save clock) stops / saves them all.
        votes = torch.tensor([float(f) for f in flags], device=self.device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in votes.tolist())

    def _shared_run_dir(self, model_config: ModelConfig | None, cfg: TrainConfig) -> str:
        # The default folder name carries a timestamp: rank 0 picks it, the others take its choice.
        name = [None]
        if self.dist.is_main:
            config = model_config or (load_config(cfg.init_from) if cfg.init_from else get_preset(cfg.preset))
            name = [str(default_run_dir(cfg, config))]
        dist.broadcast_object_list(name, src=0)
        return name[0]

    # ----- construction: shard the tables, wrap the backbone, then build the optimizers -----
    def _construct_model(self, model_config, resume_from):
        # The model is built on the meta device and each rank materialises only its part once sharded
        # (stemlm.train.parallel.meta_init): initialised here for a fresh run, read from the checkpoint's pieces
        # (a sharded one) or from the rows of a model folder it keeps (--init-from, a 1-process checkpoint).
        source = resume_from or (Path(self.cfg.init_from) if self.cfg.init_from else None)
        if source is None:
            config = model_config or get_preset(self.cfg.preset)
            self._meta_source = "init"
        elif _model_type(source) != MODEL_TYPE or (not is_sharded(source) and read_storage(source) is not None):
            # A Hugging Face Llama folder, or compact (bf16 / int8) tables to dequantise: read whole, as on one process.
            self._meta_source = None
            return super()._construct_model(model_config, resume_from)
        else:
            config = load_config(source)
            diff = model_config_diff(config, model_config) if model_config is not None else []
            if diff:
                raise StemlmError(f"model config differs from the checkpoint {source}: {'; '.join(diff)}")
            self._meta_source = ("sharded" if is_sharded(source) else "folder", Path(source))
        model = build_model(config, device="meta").train()
        self._init_plan = init_plan(model)
        return model

    def _materialise(self, model) -> None:
        """Allocate this rank's part of the meta-built model, then initialise it or read it from the checkpoint."""
        if self._meta_source is None or getattr(self, "_materialised", False):
            return
        self._materialised = True
        materialise(model, self.tables, self.device)
        if self._meta_source == "init":
            init_rank_part(model, self.tables, self._init_plan, self.cfg.seed)
            self.recipe.init_weights(model, self.cfg.seed)  # the official recipe's own init (stemlm.train.recipes)
        elif self._meta_source[0] == "sharded":
            load_model_pieces(model, self.tables, self.mesh, self._meta_source[1])
        else:
            load_rank_part(model, self.tables, self._init_plan, self._meta_source[1])

    def _build_model(self, model_config, resume_from):
        model = super()._build_model(model_config, resume_from)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (self.dist.world_size,))
        self.saver = ShardedSaver(self.cfg.dist_timeout)
        self.tables, self._batches, self._ahead = None, {}, None
        if model.stem_tables():
            self.tables = HostShardedTables(model, self.device) if self.cfg.tables == "host" else ShardedTables(model)
        if self.cfg.parallel != "fsdp":
            self._materialise(model)  # DDP copies rank 0's weights at construction: they must exist before it
        if self.tables is not None:  # host shards too: the hook is device-agnostic
            for shard in self.tables.parameters():
                shard.register_post_accumulate_grad_hook(_coalesce_grad)
        replicated = [f for f in model.lookup_tables() if FAMILIES[f].nproc == "replicated"]
        if self.cfg.table_optim != "adamw" and replicated:
            # n-gram / memory tables stay replicated; their row-sparse gradients must be declared before DDP
            # wraps the model (gloo all-reduces sparse gradients; FSDP2 shards dense tensors only).
            if self.cfg.parallel == "fsdp":
                raise StemlmError(
                    f"--table-optim {self.cfg.table_optim} with n-gram / memory tables needs --parallel ddp "
                    "(FSDP2 cannot shard row-sparse gradients); or use --table-optim adamw"
                )
            use_sparse_table_grads(model)
        if not any(p.requires_grad for p in model.parameters()):
            # `--train tables` with no adapter gates: nothing in the backbone learns, so there are no gradients to
            # average (DDP refuses such a module) and each rank keeps the whole frozen backbone.
            self._materialise(model)
            self.net = model
        elif self.cfg.parallel == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            # Under bf16 the layers' weights are all-gathered and used in bf16 (half the gather traffic and
            # memory); gradients are reduced in fp32 into the fp32 master shards the optimizer steps.
            bf16 = self.amp_dtype == torch.bfloat16
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
            kwargs = {"mp_policy": policy} if policy is not None else {}
            for layer in model.model.layers:
                fully_shard(layer, mesh=self.mesh, **kwargs)
            fully_shard(model, mesh=self.mesh, **kwargs)
            self._materialise(model)  # after sharding: only this rank's shards are allocated
            self.net = model
        else:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            # Gradients live in DDP's buckets (no second copy); the only buffers (RoPE frequencies) are computed
            # identically on every rank, so nothing is broadcast before each forward.
            self.net = DistributedDataParallel(
                model, device_ids=ids, gradient_as_bucket_view=True, broadcast_buffers=False
            )
        return model

    def _load_data(self) -> tuple[Any, Any]:
        return load_datasets_distributed(self.cfg, self.tokenizer, self.is_main)

    def _build_optimizers(self) -> list[torch.optim.Optimizer]:
        optimizers = super()._build_optimizers()  # the backbone only: the tables left the model's parameters
        if self.tables is not None:
            cfg = self.cfg
            table_opt = make_table_optimizer(
                cfg.table_optim,
                self.tables.parameters(),
                lr=cfg.table_peak_lr,
                betas=(cfg.beta1, cfg.beta2),
                eps=cfg.eps,
                weight_decay=cfg.table_wd,
            )
            for group in table_opt.param_groups:
                group.update(name="tables", peak_lr=cfg.table_peak_lr)
            self.tables.bind_windows(self._rank_ids, cfg.grad_accum, self.device)
            if not self._host_shards:  # (host shards gather the next step's rows behind their update instead)
                self._ahead_hook = table_opt.register_step_post_hook(self._exchange_next_step)
            optimizers.append(self.tables.wrap(table_opt) if self._host_shards else table_opt)
        return optimizers

    @property
    def _host_shards(self) -> bool:
        return isinstance(self.tables, HostShardedTables)

    def _make_host_tables(self):
        return None  # --tables host: the row shards themselves live on the host (HostShardedTables)

    def _start_run_dir(self) -> None:
        if self.is_main:
            super()._start_run_dir()
        else:
            random.seed(self.cfg.seed)
            np.random.seed(self.cfg.seed)
            torch.manual_seed(self.cfg.seed)
        dist.barrier()

    def run_config(self) -> dict[str, Any]:
        config = super().run_config()
        config["distributed"] = {
            "world_size": self.dist.world_size,
            "backend": self.dist.backend,
            "parallel": self.cfg.parallel,
            "local_batch_size": self.local_batch,
        }
        return config

    def _make_logger(self) -> RunLogger | _QuietLogger:
        return super()._make_logger() if self.is_main else _QuietLogger()

    # ----- one step -----
    def _global_batch(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `window` of the global batch (CPU), read once: every rank's input ids plan the table
        exchange on the host (stemlm.train.parallel.row_plan), this rank's rows are its inputs and targets."""
        if window not in self._batches:
            for old in [w for w in self._batches if w < window - self.cfg.grad_accum]:
                del self._batches[old]  # windows of a step cut short, or long gone
            self._batches[window] = self._prefetched(window, torch.device("cpu"))  # read ahead, pinned on CUDA
        return self._batches[window]

    def _rank_ids(self, window: int) -> list[torch.Tensor]:
        return list(self._global_batch(window)[0].split(self.local_batch))

    def _sync(self, last: bool):
        """Synchronise gradients on the last micro-batch only."""
        if self.net is self.model:  # a frozen, unwrapped backbone: no backbone gradients to synchronise
            return contextlib.nullcontext()
        if self.cfg.parallel == "fsdp":
            self.net.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.net.no_sync()

    def _sample(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Without sharded tables this rank's rows only: no rank reads the others' windows. With them every rank
        # reads the whole micro-batch: all ranks' ids plan the exchange (`_global_batch`).
        cfg, rank = self.cfg, self.dist.rank
        rows = None if self.tables is not None else slice(rank * self.local_batch, (rank + 1) * self.local_batch)
        return self.train_data.sample_batch(cfg.batch_size, cfg.seq_len, seed=cfg.seed, step=window, rows=rows)

    def _exchange_next_step(self, *_) -> None:
        """Issue the next step's first exchange as soon as the table update has run (the tables step before the
        backbone): its rows travel while the backbone steps. Not after the last step, nor after a skipped one."""
        if self.step + 1 < self.cfg.steps:
            first = (self.step + 1) * self.cfg.grad_accum
            with self.autocast():
                self._ahead = (first, self.tables.start_window(first))

    def _drop_ahead(self) -> None:
        """Wait out an exchange issued for a step that will not run here (the run stopped or ended)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].wait()

    def _accumulate_gradients(self, step: int) -> tuple[list[float], list[float], bool]:
        cfg, n, tables = self.cfg, self.dist.world_size, self.tables
        rows = slice(self.dist.rank * self.local_batch, (self.dist.rank + 1) * self.local_batch)
        first = step * cfg.grad_accum
        stats, has_aux, pending = [], False, None
        if tables is not None:
            # The table exchange is planned on the host (no collective, no device read) and issued one micro-batch
            # ahead: window k+1's rows travel while k computes (the shards do not change within a step), and the
            # first window's since the previous step's table update. Host shards also gather two windows ahead.
            for window in range(first, first + min(2, cfg.grad_accum)):
                tables.prefetch(window)
            if self._ahead is not None and self._ahead[0] == first:
                pending, self._ahead = self._ahead[1], None
            else:
                self._drop_ahead()
                with self.autocast():
                    pending = tables.start_window(first)
        for k in range(cfg.grad_accum):
            window = first + k
            if tables is None:  # this rank's rows only (`_sample`), read ahead by the prefetcher
                x, y = self._batch(window)
            else:
                x, y = (t[rows] for t in self._batches.pop(window, None) or self._global_batch(window))
                pinned = self.device.type == "cuda"  # row views of the prefetcher's pinned global batch
                x, y = x.to(self.device, non_blocking=pinned), y.to(self.device, non_blocking=pinned)
            with self._sync(k == cfg.grad_accum - 1):
                with self.autocast():
                    kwargs = {}
                    if tables is not None:
                        kwargs["rows"] = {"token": pending.rows()}
                        if k + 2 < cfg.grad_accum:
                            tables.prefetch(window + 2)
                        if k + 1 < cfg.grad_accum:
                            pending = tables.start_window(window + 1)
                    options = ForwardOptions(loss_chunk=cfg.loss_chunk, fused_loss=cfg.fused_loss)
                    out = self.net(x, labels=y, options=options, **kwargs)
                loss = out.loss if self.fault_injection is None else self.fault_injection(step + 1, out.loss)
                aux = out.aux_loss.float() if out.aux_loss is not None else None
                has_aux = aux is not None
                total = loss if aux is None else loss + cfg.aux_loss_coef * aux
                stats.append(
                    torch.stack(
                        [
                            loss.detach().float(),
                            aux.detach() if aux is not None else torch.zeros((), device=loss.device),
                            (~torch.isfinite(total.detach())).float(),
                        ]
                    )
                )
                # Every rank runs every micro-batch (no early exit, so collectives stay matched); NaN gradients
                # of a bad micro-batch are never applied: the step is skipped on all ranks below.
                (total / cfg.grad_accum).backward()
        # One all_reduce and one device->host read per step: the global mean losses and aux losses, and whether
        # any rank went non-finite in any micro-batch, so that every rank skips together.
        summed = torch.stack(stats)
        dist.all_reduce(summed)
        values = (summed / n).tolist()
        losses = [v[0] for v in values]
        auxes = [v[1] for v in values] if has_aux else []
        return losses, auxes, all(v[2] == 0 for v in values)

    def _clip_gradients(self) -> float:
        # Every optimized tensor but the row shards (whose norm needs a cross-rank sum): the backbone, if any learns
        # (`--train tables` may leave no backbone optimizer), and replicated n-gram / memory tables.
        shards = list(self.tables.parameters()) if self.tables is not None else []
        sharded = {id(p) for p in shards}
        backbone = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"] if id(p) not in sharded]
        return self.recipe.clip_distributed(backbone, shards, self.cfg.grad_clip).item()

    def train_step(self) -> dict[str, Any]:
        _maybe_inject_exit(self.dist.rank, self.step + 1, before=self.saver.wait)
        if self.tables is not None:
            self.tables.comm.pop_step()  # drop the held-out evaluation's lookups: count this step's traffic only
        record = super().train_step()
        if self.tables is not None:
            sent = self.tables.comm.pop_step()  # host-side byte counts: no device read, no collective
            for kind in TRAFFIC_KINDS:
                self.traffic[kind] += sent.get(f"table_bytes_sent/{kind}", 0)
            self.traffic_steps += 1
            if self.step % self.cfg.traffic_every == 0 or self.step == self.cfg.steps:  # the same on every rank
                record.update(self._table_traffic())
        return record

    def _table_traffic(self) -> dict[str, int]:
        """Bytes sent between ranks for the table exchange since the last record, summed over the ranks (collective)."""
        counts = torch.tensor([self.traffic[kind] for kind in TRAFFIC_KINDS], dtype=torch.int64).to(self.device)
        dist.all_reduce(counts)
        values = counts.tolist()
        record = {"table_bytes_sent": sum(values), "table_traffic_steps": self.traffic_steps}
        self.traffic, self.traffic_steps = dict.fromkeys(TRAFFIC_KINDS, 0), 0
        return record | {f"table_bytes_sent/{kind}": v for kind, v in zip(TRAFFIC_KINDS, values, strict=True)}

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Held-out loss over the same windows as one process, each batch split over the ranks."""
        if self.heldout_data is None:
            return None
        cfg, n, rank = self.cfg, self.dist.world_size, self.dist.rank
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
                kwargs = {}
                if self.tables is not None:  # every rank's ids are here: the exchange is planned on the host
                    kwargs["rows"] = {"token": self.tables.lookup(part_x, all_ids=[p[0] for p in parts])}
                out = self.model(part_x, labels=part_y, **kwargs, **self.eval_loss())
            totals += torch.tensor([out.loss.item() * part_y.numel(), part_y.numel()], dtype=torch.float64) * weight
        self.model.train()
        totals = totals.to(self.device)
        dist.all_reduce(totals)
        return (totals[0] / totals[1]).item()

    # ----- checkpoints -----
    def save(self) -> Path:
        """Start an asynchronous sharded checkpoint of this step (`stemlm.train.parallel.checkpoint`); fit waits."""
        if self._host_shards:
            self.tables.sync()  # the queued table update lands before the shards are read
        return self.saver.save(self)

    def _load_optimizer_state(self, ckpt: Path, state: dict[str, Any]) -> None:
        load_optimizers(self.optimizers, ckpt, state, tables=self.tables, mesh=self.mesh)

    def fit(self) -> dict[str, Any]:
        try:
            result = super().fit()
        except BaseException:
            self._ahead = None  # not waited: a failed peer would never complete it
            with contextlib.suppress(Exception):
                self.saver.wait()  # a save in flight still completes (or leaves only its temporary folder)
            raise
        self._drop_ahead()  # a stop signal ends the run after a step that already issued the next one's exchange
        self.saver.wait()  # the last checkpoint is in place before fit returns
        result.update(world_size=self.dist.world_size, parallel=self.cfg.parallel)
        if self._host_shards:
            tables, state = self.tables.host_bytes(self.optimizers[-1])
            result.update(tables="host", device_bytes_saved=tables + state, host_table_bytes=tables)
            result.update(host_optimizer_bytes=state, host_overlap=self.tables.overlap())  # this rank's
        return result

    def finish(self, checkpoint: str | Path | None = None) -> None:
        """Leave the process group; on rank 0, replace `model` by the unsharded one from `checkpoint`
        (e.g. the final one) so the caller can generate or evaluate with it."""
        if self._host_shards:
            self.tables.close()
        destroy_distributed()
        if checkpoint is not None and self.is_main:
            self.model = from_pretrained(checkpoint, device=self.device).eval()


def _coalesce_grad(param: torch.Tensor) -> None:
    # Autograd adds sparse gradients by concatenation: over grad_accum micro-batches a shard's gradient would
    # hold every micro-batch's rows (duplicates included) until the optimizer coalesces. Coalescing after each
    # accumulation keeps it at most one entry per shard row.
    if param.grad is not None and param.grad.is_sparse:
        param.grad = param.grad.coalesce()


class _QuietLogger:
    """The logger of ranks other than 0: they train silently."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def advance(self, loss: float, tokens_per_s: float) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def _maybe_inject_exit(rank: int, step: int, before=None) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    target_rank, _, target_step = spec.partition(":")
    if int(target_rank) == rank and int(target_step) == step:
        if before is not None:
            before()  # this rank's part of a checkpoint in flight is written first: tests know which one survives
        print(f"{FAULT_ENV}: rank {rank} exits before step {step}", file=sys.stderr, flush=True)
        os._exit(1)
