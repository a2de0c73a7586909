"""The per-rank memory plan against independent counts: activations saved by real forwards (every tensor
autograd keeps, deduplicated by storage), FSDP2's dim-0 chunks, the strided table shard, and the optimizer
state that real optimizers allocate; plus `stemlm info --memory`.

Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_memory_plan.py -q`.
"""

from __future__ import annotations

import json

import pytest
import torch

from stemlm.cli.main import main
from stemlm.model import build_model
from stemlm.model.accounting import total_parameters
from stemlm.model.config import ModelConfig
from stemlm.model.decoder import ForwardOptions
from stemlm.model.presets import get_preset
from stemlm.placement.table_optim import make_table_optimizer
from stemlm.train.memory import checkpoint_blocks
from stemlm.train.memory_plan import activation_elements_per_token, memory_plan, recompute_elements_per_token

SHAPES = [
    dict(hidden_size=96, head_dim=16, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2),
    dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
]


def config(ffn: str, layers: int, shape: dict) -> ModelConfig:
    return ModelConfig(vocab_size=300, num_hidden_layers=layers, max_position_embeddings=64, ffn=ffn,
                       ffn_layers="odd", **shape)  # fmt: skip


def saved_elements_per_token(cfg: ModelConfig, chunk: int, ac: bool, B: int = 2, T: int = 8) -> float:
    model = build_model(cfg, seed=0).train()
    if ac:
        checkpoint_blocks(model)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (B, T), generator=gen) for _ in range(2))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, labels=y, options=ForwardOptions(loss_chunk=chunk))
    scalars = 4 * (-(-B * T // chunk) if chunk else 1)  # the loss (per chunk) scalars: not per token
    return (sum(seen.values()) - scalars) / 4 / (B * T)


@pytest.mark.parametrize("ffn", ["dense", "stem"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk, ac", [(0, False), (8, False), (0, True)])
def test_activation_counts_match_real_forwards(ffn, shape, chunk, ac):
    for layers in (1, 3):
        cfg = config(ffn, layers, shape)
        assert saved_elements_per_token(cfg, chunk, ac) == activation_elements_per_token(
            cfg, loss_chunk=chunk, checkpointing=ac
        )


def test_recompute_peak_is_one_unwrapped_block():
    cfg = config("stem", 1, SHAPES[0])
    full = activation_elements_per_token(cfg)
    kept = activation_elements_per_token(cfg, checkpointing=True)
    # One block recomputed (with RoPE) = what a plain 1-layer forward keeps minus the block input kept anyway.
    assert recompute_elements_per_token(cfg) == full - kept + cfg.hidden_size


@pytest.mark.parametrize("nproc", [1, 3, 8])
def test_parameter_shards_match_meta_counts(nproc):
    cfg = get_preset("paper-350m")
    meta = build_model(cfg, device="meta")
    tables = {id(t.weight) for t in meta.token_tables().values()}
    backbone = [p for p in meta.parameters() if id(p) not in tables]
    fsdp = memory_plan(cfg, nproc=nproc, parallel="fsdp")
    ddp = memory_plan(cfg, nproc=nproc, parallel="ddp")
    chunks = sum(torch.chunk(p, nproc, dim=0)[0].numel() for p in backbone)  # FSDP2 shards dim 0 with torch.chunk
    assert fsdp["bytes_per_rank"]["backbone_weights"] == 4 * chunks
    assert ddp["bytes_per_rank"]["backbone_weights"] == 4 * sum(p.numel() for p in backbone)
    assert fsdp["parameters"]["total"] == total_parameters(cfg)
    rows = len(range(0, cfg.vocab_size, nproc))  # rank 0 owns rows 0, N, 2N, ...
    widths = sum(t.weight.shape[1] for t in meta.token_tables().values())
    assert fsdp["bytes_per_rank"]["table_shard"] == 4 * rows * widths


@pytest.mark.parametrize("name", ["adamw", "lazy_adamw", "rowwise_adagrad"])
def test_table_optimizer_state_matches_a_real_optimizer(name):
    cfg = ModelConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, max_position_embeddings=16, ffn="stem", ffn_layers="all")  # fmt: skip
    tables = [t.weight for t in build_model(cfg, seed=0).token_tables().values()]
    opt = make_table_optimizer(name, tables, lr=1e-3)
    for t in tables:
        ids, rows = torch.arange(cfg.vocab_size)[None], torch.ones(cfg.vocab_size, 48)
        t.grad = torch.sparse_coo_tensor(ids, rows, check_invariants=True)
    opt.step()
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    assert memory_plan(cfg, table_optim=name)["bytes_per_rank"]["table_optimizer"] == state


def test_backbone_optimizer_matches_adamw():
    cfg = config("stem", 2, SHAPES[0])
    model = build_model(cfg, seed=0)
    tables = {id(t.weight) for t in model.token_tables().values()}
    backbone = [p for p in model.parameters() if id(p) not in tables]
    opt = torch.optim.AdamW(backbone)
    for p in backbone:
        p.grad = torch.ones_like(p)
    opt.step()
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    assert memory_plan(cfg)["bytes_per_rank"]["backbone_optimizer"] == state


def test_info_memory_cli(capsys):
    args = ["info", "--preset", "paper-1b", "--nproc", "8", "--table-optim", "rowwise_adagrad", "--memory"]
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["memory"]
    assert plan["nproc"] == 8 and plan["parameters"]["total"] == total_parameters(get_preset("paper-1b"))
    assert plan["bytes_per_rank"]["total"] == sum(v for k, v in plan["bytes_per_rank"].items() if k != "total")
    assert main(args) == 0
    assert "training memory per rank: 8 ranks" in capsys.readouterr().out


def test_info_memory_plans_the_default_runs_loss_path(capsys):
    """Without --loss-chunk the plan takes what a default `stemlm train` takes: full logits below V = 65536, the
    fused loss's chunks of 512 from there up (stemlm.train.memory.resolve_loss); --loss-chunk 0 plans full logits."""

    def logits(*flags):
        assert main(["info", *flags, "--memory", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["memory"]["bytes_per_rank"]["loss_chunk_logits"]

    vocab = get_preset("paper-1b").vocab_size
    assert vocab >= 65536
    assert logits("--preset", "paper-1b") == 512 * vocab * 6  # a chunk as memory_plan counts it: 4 + 2 bytes each
    assert logits("--preset", "paper-1b", "--loss-chunk", "0") == 0
    assert logits("--preset", "tiny") == 0  # V = 8192: the plain path
