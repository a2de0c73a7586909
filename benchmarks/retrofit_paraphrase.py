"""Table-row edits of a retrofitted real model on a held-out phrasing, among countries it answers there: for each
retrofit init, which of the countries the retrofit answers on the phrasing (teacher-forced greedy, whole capital),
and for each such source given the next such country's table rows (positional edit, `--rows tables`), the top
three next tokens and whether the first is the first token of the target's capital.

`stemlm eval edits` draws each record's target at random from its country list; a target whose capital the model
does not produce on the phrasing cannot be moved to, which is what this measures apart. The retrofits are built
in memory from the dense checkpoint (`stemlm.convert.retrofit.retrofit`; calib reads 32,768 train-split tokens).

    python benchmarks/retrofit_paraphrase.py "0:embed;0:normed;0:calib"
    python benchmarks/retrofit_paraphrase.py scan        # how COUNTRIES was found (`convert --stem-layers 0`)

Each config prints `RESULT <layers>:<init> known K first-token moved M`; `scan` prints, for every capital
template of the fact world, how many of its 248 countries the layer-0 retrofit answers, and which.
"""

from __future__ import annotations

import sys

import torch

from stemlm.checkpoint.runs import load_checkpoint
from stemlm.convert.retrofit import calibration_ids, retrofit
from stemlm.data.worlds.facts import TEMPLATES, country, load_countries
from stemlm.edit.evaluate import encode, score_items
from stemlm.edit.positional import edited_forward, make_edit

# The countries SmolLM2-135M's layer-0 retrofit (`convert --stem-layers 0`) answers on the phrasing below,
# found among all 248 of the fact world (greedy, whole capital).
COUNTRIES = "Australia,China,France,Germany,Greece,Hungary,Italy,Japan,Mexico,South Korea,Sweden,Syria".split(",")
PHRASING = "Which city is the capital of {s}? It is"  # a held-out template of the fact world (TEMPLATES)


@torch.no_grad()
def scan(ckpt: str) -> None:
    model, tok = load_checkpoint(ckpt)
    model = retrofit(model.eval(), "0").eval()
    countries = [c for c in load_countries() if c.capital]
    for template in (t for split in TEMPLATES["capital"] for t in split):
        items = [(encode(tok, template.format(s=c.name)), encode(tok, " " + c.capital)) for c in countries]
        known = [c.name for c, s in zip(countries, score_items(model, items, batch_rows=128), strict=True) if s[1]]
        print(f"{template!r}: {len(known)}: {','.join(known)}", flush=True)


@torch.no_grad()
def main(configs: str, ckpt: str = "ckpt/smollm2") -> None:
    torch.set_num_threads(2)
    if configs == "scan":
        return scan(ckpt)
    dense, tok = load_checkpoint(ckpt)
    dense.eval()
    for cfg in configs.split(";"):
        layers, init = cfg.split(":")
        ids = calibration_ids(tok, None, 32768) if init == "calib" else None
        model = retrofit(dense, layers, init, ids).eval()
        items = [(encode(tok, PHRASING.format(s=c)), encode(tok, " " + country(c).capital)) for c in COUNTRIES]
        known = [c for c, s in zip(COUNTRIES, score_items(model, items), strict=True) if s[1]]
        moved = 0
        for k, src in enumerate(known):
            tgt = known[(k + 1) % len(known)]
            prompt = encode(tok, PHRASING.format(s=src))
            edit = make_edit(model, tok, prompt, src, tgt, rows="tables")
            probs = edited_forward(model, torch.tensor([prompt]), edit).logits[0, -1].float().softmax(-1)
            top = probs.topk(3)
            moved += int(top.indices[0]) == encode(tok, " " + country(tgt).capital)[0]
            pairs = zip(top.values, top.indices, strict=True)
            shown = " ".join(f"{tok.decode([int(i)])!r}:{float(v):.2f}" for v, i in pairs)
            print(f"  {cfg} {src}->{tgt}: {shown}", flush=True)
        print(f"RESULT {cfg} known {len(known)} first-token moved {moved}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
