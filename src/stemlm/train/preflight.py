"""The checks of a `--nproc N` run made once in the launcher, before any rank starts: `preflight(request, ...)`.

A refusal inside N ranks would come out as N copies of the line inside torchrun's failure report; here it is one
line and exit 2 before a process is started. `preflight` runs the checks the single-process path runs, with its
messages, short of building the model: the request itself (`setup.plan_run`: tokenizer, model config,
`--init-from`), a resume's run, config, seed, tokenizer and trainer state (`stemlm.train.resume`), the run folder
(`guard.check_run_dir`, symlinks included), the device and profiling options (and one GPU per local rank), that
the model fits the tokenizer and the window, that the global batch splits over the ranks, and the data: it is
read (tokenized into the shared cache, which the ranks then reuse) and a first batch is drawn, so unreadable,
binary or out-of-vocabulary data is refused here. What only a rank can see (its shard of the checkpoint's
weights, a peer that stops answering, divergence) is still reported from the ranks (`stemlm.cli.train_launch`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from stemlm.checkpoint.folder import load_config
from stemlm.errors import StemlmError
from stemlm.model.presets import get_preset
from stemlm.runtime import resolve_device
from stemlm.train.config import model_config_diff
from stemlm.train.data import load_datasets, resolve_tokenizer
from stemlm.train.guard import check_run_dir
from stemlm.train.parallel.launch import local_batch_size
from stemlm.train.profiling import check_profiling
from stemlm.train.recipes import get_recipe
from stemlm.train.resume import check_resume_state, resume_setup
from stemlm.train.setup import RunRequest, plan_run
from stemlm.train.state import check_same_data, data_digest
from stemlm.train.trainer import check_fits, default_run_dir


def preflight(r: RunRequest, world_size: int, local_ranks: int) -> Path:
    """Raise the StemlmError the ranks would raise while setting up `r` on `world_size` ranks, `local_ranks` of
    them on this node; else the run folder they will write. Nothing is written and no CUDA context is made."""
    plan = plan_run(r)
    setup = None
    if r.resume:
        setup = resume_setup(r.resume, tokenizer=plan.tokenizer, overrides=plan.changes)
        cfg, tokenizer = setup.cfg, setup.tokenizer
        config = load_config(setup.ckpt)
        diff = model_config_diff(config, plan.model) if plan.model is not None else []
        if diff:
            raise StemlmError(f"model config differs from the checkpoint {setup.ckpt}: {'; '.join(diff)}")
        check_resume_state(setup.ckpt, setup.state, cfg)
        run_dir = setup.run_dir
    else:
        cfg = plan.cfg
        if cfg.out:
            check_run_dir(cfg.out)
        config = plan.model or (load_config(cfg.init_from) if cfg.init_from else get_preset(cfg.preset))
        tokenizer = plan.tokenizer or resolve_tokenizer(cfg)
        run_dir = Path(cfg.out) if cfg.out else default_run_dir(cfg, config)
    device = resolve_device(cfg.device)
    check_profiling(cfg.memory_snapshot, device)
    if device.type == "cuda" and local_ranks > torch.cuda.device_count():
        raise StemlmError(
            f"--nproc {local_ranks} starts {local_ranks} processes on this node but it has "
            f"{torch.cuda.device_count()} GPUs (one process per GPU); lower --nproc or pass --device cpu"
        )
    get_recipe(cfg.recipe)
    check_fits(config, tokenizer, cfg)
    local_batch_size(cfg.batch_size, world_size)
    train, _ = load_datasets(cfg, tokenizer)
    train.sample_batch(cfg.batch_size, cfg.seq_len, seed=cfg.seed, step=0)  # as the trainer does: fails if too small
    if setup is not None:
        data = setup.state.get("data")
        check_same_data(data.get("digest") if isinstance(data, dict) else None, data_digest(train), setup.ckpt)
    return run_dir
