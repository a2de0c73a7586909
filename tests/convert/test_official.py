"""`stemlm convert --from-official`: checkpoints in the official STEM trainer's layouts become stemlm folders whose
logits equal the official forward, re-implemented here from `lingua/transformer.py`, `lingua/stem.py` and
`apps/main/stem.py` (Infini-AI-Lab/STEM main@dcc9b73).

The fixture writes one model's weights (random, official names) as the official code saves them:
- a step folder as `StemCheckpointManager.save` writes it (`lingua/stem_checkpoint.py`): `dcp.save` of
  {"model": backbone state with the `lm_transformer.` prefix, "optim": ...} (`split_backbone_and_stem_state_dict`
  removes the tables), `params.json`, and `save_stem_shards`' `stem_shards/stem_model_mp{r}.pt`, each STEM
  model-parallel rank's columns of every table (2 ranks here);
- its consolidated folder as `consolidate_checkpoints` + `consolidate_stem_shards` write it: `consolidated.pth`
  (the nested dict `dcp_to_torch_save` produces), `params.json`, `consolidated_stem.pth` (tables joined on dim 1).
Run: `OMP_NUM_THREADS=1 python -m pytest tests/convert/test_official.py -q`.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from stemlm.checkpoint.runs import from_pretrained
from stemlm.cli.main import main
from stemlm.convert.official import official_ffn_dim, read_official
from stemlm.errors import StemlmError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process

# the official args (LMTransformerArgs + StemTransformerArgs) of a small tied run: d_ff = 256 ⌈int(2/3 · 4 · 48)/256⌉
MODEL = dict(dim=48, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=97, weight_tying=True, rope_theta=10000.0)
MODEL.update(norm_eps=1e-5, multiple_of=32, max_seqlen=64, stem_layers=[1, 2], init_base_std=0.02)


def official_weights(m: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the official names (backbone as in `LMTransformer`, tables as `stem_embeddings.j`)."""
    gen = torch.Generator().manual_seed(seed)
    d, hd = m["dim"], m["dim"] // m["n_heads"]
    f = official_ffn_dim(d, m["multiple_of"], m.get("ffn_dim_multiplier"))

    def rand(*shape):
        return torch.randn(shape, generator=gen) * 0.2

    sd = {"tok_embeddings.weight": rand(m["vocab_size"], d), "norm.weight": 1 + rand(d)}
    if not m["weight_tying"]:
        sd["output.weight"] = rand(m["vocab_size"], d)
    for i in range(m["n_layers"]):
        p = f"layers.{i}."
        sd[p + "attention.wq.weight"] = rand(m["n_heads"] * hd, d)
        sd[p + "attention.wk.weight"] = rand(m["n_kv_heads"] * hd, d)
        sd[p + "attention.wv.weight"] = rand(m["n_kv_heads"] * hd, d)
        sd[p + "attention.wo.weight"] = rand(d, m["n_heads"] * hd)
        sd[p + "feed_forward.w1.weight"] = rand(f, d)
        sd[p + "feed_forward.w2.weight"] = rand(d, f)
        if i not in m["stem_layers"]:
            sd[p + "feed_forward.w3.weight"] = rand(f, d)
        sd[p + "attention_norm.weight"] = 1 + rand(d)
        sd[p + "ffn_norm.weight"] = 1 + rand(d)
    for j in range(len(m["stem_layers"])):
        sd[f"stem_embeddings.{j}.weight"] = rand(m["vocab_size"], f)
    return sd


def official_forward(sd: dict[str, torch.Tensor], m: dict, ids: torch.Tensor) -> torch.Tensor:
    """The official forward: fp32 RMSNorm, RoPE on interleaved pairs (2i, 2i+1), repeated KV heads, SwiGLU or STEM."""
    B, T = ids.shape
    d, H, KV = m["dim"], m["n_heads"], m["n_kv_heads"]
    hd = d // H

    def norm(x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + m["norm_eps"]) * w.float()).type_as(x)

    freqs = 1.0 / m["rope_theta"] ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd)
    angles = torch.outer(torch.arange(T).float(), freqs)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]

    def rope(x):  # x [B, T, heads, hd]: element 2i pairs with 2i + 1
        pairs = x.float().reshape(*x.shape[:-1], hd // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(3).type_as(x)

    h = sd["tok_embeddings.weight"][ids]
    for i in range(m["n_layers"]):
        p = f"layers.{i}."
        x = norm(h, sd[p + "attention_norm.weight"])
        q = rope((x @ sd[p + "attention.wq.weight"].T).view(B, T, H, hd))
        k = rope((x @ sd[p + "attention.wk.weight"].T).view(B, T, KV, hd)).repeat_interleave(H // KV, dim=2)
        v = (x @ sd[p + "attention.wv.weight"].T).view(B, T, KV, hd).repeat_interleave(H // KV, dim=2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + att.transpose(1, 2).reshape(B, T, H * hd) @ sd[p + "attention.wo.weight"].T
        x = norm(h, sd[p + "ffn_norm.weight"])
        if i in m["stem_layers"]:
            up = sd[f"stem_embeddings.{m['stem_layers'].index(i)}.weight"][ids]
        else:
            up = x @ sd[p + "feed_forward.w3.weight"].T
        h = h + (F.silu(x @ sd[p + "feed_forward.w1.weight"].T) * up) @ sd[p + "feed_forward.w2.weight"].T
    head = sd["tok_embeddings.weight"] if m["weight_tying"] else sd["output.weight"]
    return norm(h, sd["norm.weight"]) @ head.T


def write_step_folder(folder, sd: dict[str, torch.Tensor], m: dict, ranks: int = 2) -> None:
    """A step folder as `StemCheckpointManager.save` writes it (no process group: one DCP writer)."""
    import torch.distributed.checkpoint as dcp

    backbone = {f"lm_transformer.{k}": v for k, v in sd.items() if not k.startswith("stem_embeddings.")}
    optim = {"state": {"lm_transformer.norm.weight": {"exp_avg": torch.zeros(m["dim"])}}}
    dcp.save({"model": backbone, "optim": optim}, checkpoint_id=str(folder), no_dist=True)
    (folder / "params.json").write_text(json.dumps({"name": "fixture", "model": m, "optim": {"lr": 3e-4}}))
    (folder / "stem_shards").mkdir()
    tables = {k: v for k, v in sd.items() if k.startswith("stem_embeddings.")}
    for r in range(ranks):  # ParallelEmbedding: rank r holds columns [r * f / P, (r + 1) * f / P)
        shard = {k: v.chunk(ranks, dim=1)[r].clone() for k, v in tables.items()}
        torch.save(shard, folder / "stem_shards" / f"stem_model_mp{r}.pt")


def write_consolidated(folder, sd: dict[str, torch.Tensor], m: dict) -> None:
    folder.mkdir()
    backbone = {f"lm_transformer.{k}": v for k, v in sd.items() if not k.startswith("stem_embeddings.")}
    torch.save({"model": backbone, "optim": {}}, folder / "consolidated.pth")
    (folder / "params.json").write_text(json.dumps({"model": m}))
    torch.save({k: v for k, v in sd.items() if k.startswith("stem_embeddings.")}, folder / "consolidated_stem.pth")


@pytest.mark.parametrize("layout", ["step", "consolidated"])
@pytest.mark.parametrize("tied", [True, False])
def test_converted_logits_equal_the_official_forward(tmp_path, capsys, layout, tied):
    m = {**MODEL, "weight_tying": tied}
    sd = official_weights(m)
    source = tmp_path / "0000000100"
    if layout == "step":
        write_step_folder(source, sd, m)
    else:
        write_consolidated(source, sd, m)
    assert main(["convert", "--from-official", str(source), "--out", str(tmp_path / "out"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stem_layers"] == [1, 2] and report["config"]["tie_word_embeddings"] is tied
    model = from_pretrained(tmp_path / "out").eval()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    ids = torch.randint(0, m["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids).logits
    reference = official_forward(sd, m, ids)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=0)
    # the q/k row permutation is what makes them agree: the rows as saved give another function
    config, state = read_official(source)
    unpermuted = {**state, "model.layers.0.self_attn.q_proj.weight": sd["layers.0.attention.wq.weight"]}
    model.load_state_dict({k: v for k, v in unpermuted.items() if k in model.state_dict()}, strict=False)
    with torch.no_grad():
        assert float((model(ids).logits - reference).abs().max()) > 1e-2


def test_d_ff_is_the_official_rounding():
    assert official_ffn_dim(960, 256, None) == 2560
    assert official_ffn_dim(2048, 256, 1.5) == 8192
    assert official_ffn_dim(48, 32, None) == 128


def test_bad_official_folders(tmp_path):
    with pytest.raises(StemlmError, match="has no params.json"):
        read_official(tmp_path)
    (tmp_path / "params.json").write_text(json.dumps({"model": MODEL}))
    with pytest.raises(StemlmError, match="neither consolidated.pth nor a DCP checkpoint"):
        read_official(tmp_path)
    write_consolidated(tmp_path / "c", official_weights(MODEL), MODEL)
    (tmp_path / "c" / "params.json").write_text(json.dumps({"model": {**MODEL, "sliding_window": 16}}))
    with pytest.raises(StemlmError, match="sliding_window 16"):
        read_official(tmp_path / "c")
