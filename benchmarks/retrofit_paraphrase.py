"""Table-row edits of a retrofitted real model on a held-out phrasing, among countries it answers there: for each
retrofit init, which of the countries the retrofit answers on the phrasing (teacher-forced greedy, whole capital),
and for each such source given the next such country's table rows (positional edit, `--rows tables`), the top
three next tokens and whether the first is the first token of the target's capital.

`stemlm eval edits` draws each record's target at random from its country list; a target whose capital the model
does not produce on the phrasing cannot be moved to, which is what this measures apart. The retrofits are built
in memory from the dense checkpoint (`stemlm.convert.retrofit.retrofit`; calib reads 32,768 train-split tokens).

    python benchmarks/retrofit_paraphrase.py "0:embed;0:normed;0:calib"
    python benchmarks/retrofit_paraphrase.py scan        # how COUNTRIES was found (`convert --stem-layers 0`)

Each config prints `RESULT config=<layers>:<init> known=K pairs=P moved=M` (`--all-countries` pairs all 12,
known or not: a model that knows none still makes every edit); `scan` prints, for every capital
template of the fact world, how many of its 248 countries the layer-0 retrofit answers, and which.
"""

from __future__ import annotations

import argparse

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
def measure(ckpt: str, configs: str, all_countries: bool) -> None:
    dense, tok = load_checkpoint(ckpt)
    dense.eval()
    for cfg in configs.split(";"):
        layers, init = cfg.split(":")
        ids = calibration_ids(tok, None, 32768) if init == "calib" else None
        model = retrofit(dense, layers, init, ids).eval()
        items = [(encode(tok, PHRASING.format(s=c)), encode(tok, " " + country(c).capital)) for c in COUNTRIES]
        known = [c for c, s in zip(COUNTRIES, score_items(model, items), strict=True) if s[1]]
        pairs = COUNTRIES if all_countries else known
        moved = 0
        for k, src in enumerate(pairs):
            tgt = pairs[(k + 1) % len(pairs)]
            prompt = encode(tok, PHRASING.format(s=src))
            edit = make_edit(model, tok, prompt, src, tgt, rows="tables")
            probs = edited_forward(model, torch.tensor([prompt]), edit).logits[0, -1].float().softmax(-1)
            top = probs.topk(3)
            moved += int(top.indices[0]) == encode(tok, " " + country(tgt).capital)[0]
            shown = " ".join(f"{tok.decode([int(i)])!r}:{float(v):.2f}" for v, i in zip(*top, strict=True))
            print(f"  {cfg} {src}->{tgt}: {shown}", flush=True)
        print(f"RESULT config={cfg} known={len(known)} pairs={len(pairs)} moved={moved}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", help='retrofits to measure, "layers:init;..." (e.g. "0:embed;0:calib"), or scan')
    parser.add_argument("--ckpt", default="ckpt/smollm2", help="the dense checkpoint (default ckpt/smollm2)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--all-countries", action="store_true", help="pair all 12 countries, known or not")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.configs == "scan":
        scan(args.ckpt)
    else:
        measure(args.ckpt, args.configs, args.all_countries)


if __name__ == "__main__":
    main()
