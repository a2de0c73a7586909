"""Which layers of a pretrained dense model can be retrofitted without training: fact recall and held-out
perplexity of the dense model and of `E·W_upᵀ` retrofits at several layer sets, side by side.

For each layer set the retrofit is built in memory (`stemlm.convert.retrofit.retrofit_from_dense`); every model answers
"The capital of {country} is" greedily for the first `--countries` countries of the fact world (correct when
the greedy continuation starts with the capital), and scores `--tokens` tokens of the embedded corpus' held-out
split (`stemlm.evaluation.perplexity`, windows of 512). The dense row is the reference the retrofits lose from.

    python benchmarks/retrofit_layers.py ckpt/smollm2 --sets 0 1 0,1 0,1,2,3 --countries 40 --tokens 2048

The last line is `RESULT recall_dense=… recall_<set>=… ppl_dense=… ppl_<set>=…` (sets with '-' for ',').
"""

from __future__ import annotations

import argparse

import torch

from stemlm.checkpoint.runs import load_checkpoint
from stemlm.convert.retrofit import retrofit_from_dense
from stemlm.data.corpus import embedded_texts
from stemlm.data.worlds.facts import load_countries
from stemlm.evaluation.perplexity import evaluate_perplexity


@torch.no_grad()
def recall(model, tok, countries) -> float:
    hits = 0
    for country in countries:
        ids = tok.encode(f"The capital of {country.name} is").ids
        answer = tok.encode(f" {country.capital}").ids
        x = torch.tensor([ids])
        out = []
        for _ in range(len(answer)):
            nxt = int(model(x).logits[0, -1].argmax())
            out.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]])], 1)
        hits += out == answer
    return hits / len(countries)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="a dense checkpoint or HF Llama folder with its tokenizer")
    parser.add_argument("--sets", nargs="+", default=["0", "1", "0,1", "0,1,2,3"], help="layer sets to retrofit")
    parser.add_argument("--countries", type=int, default=40, help="countries asked (default 40)")
    parser.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored (default 2048)")
    args = parser.parse_args(argv)
    dense, tok = load_checkpoint(args.ckpt)
    countries = load_countries()[: args.countries]
    held = embedded_texts("heldout")
    result = {}
    for name in ["dense", *args.sets]:
        model = dense if name == "dense" else retrofit_from_dense(dense, name).eval()
        r = recall(model, tok, countries)
        ppl = evaluate_perplexity(model, tok, held, window=512, max_tokens=args.tokens).perplexity
        key = name.replace(",", "-")
        result[f"recall_{key}"], result[f"ppl_{key}"] = r, ppl
        print(f"{name:>10}  capital recall {r:.3f}  held-out ppl {ppl:.2f}", flush=True)
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
