"""Row-swap edits on a retrofitted real model: for pairs of countries the model knows, does giving the source
country the target's table rows (a positional edit of the prompt's span) move the answer to the target's
capital, on several phrasings, and does a second country asked in the same prompt keep its answer?

The dense checkpoint is retrofitted in memory at each `--sets` layer set (`E·W_upᵀ`, no training). A country is
"known" on a phrasing when the retrofit answers its capital greedily; each known source is paired with the next
known country of the list (a phrasing with fewer than 3 known countries gets no pairs: its rates print as 0).
Per set and phrasing: exact greedy rate of the new capital and the share with
P(new capital) > P(true capital) (sequence log-probabilities), each beside its unedited value; locality: in
"The capital of S is C_S. The capital of O is", with S edited, the share where O's capital is still the greedy
answer (unedited beside it).

    python benchmarks/retrofit_edits.py ckpt/smollm2 --sets 0 0,1

`--all-countries` pairs every country, known or not (the rates are then over all of them): a model that knows
no capital, such as a random one, still makes every edit.

The last line is `RESULT <set>_greedy=… <set>_pnew=… <set>_locality=…` (means over phrasings).
"""

from __future__ import annotations

import argparse

import torch

from stemlm.checkpoint.runs import load_checkpoint
from stemlm.convert.retrofit import retrofit_from_dense
from stemlm.data.worlds.facts import country
from stemlm.edit.positional import edit_hooks, edited_forward, greedy_generate, make_edit

COUNTRIES = "France Spain Germany Italy Japan China Russia Egypt Greece Norway Canada Portugal Poland India".split()
PHRASINGS = ["The capital of {s} is", "{s}'s capital city is", "The capital city of {s} is"]


def logprob(model, prompt: list[int], answer: list[int], edit) -> float:
    ids = torch.tensor([prompt + answer])
    logp = torch.log_softmax(edited_forward(model, ids, edit).logits[0].float(), -1)
    return float(sum(logp[len(prompt) - 1 + i, t] for i, t in enumerate(answer)))


def greedy_is(model, prompt: list[int], answer: list[int], edit) -> bool:
    return greedy_generate(model, prompt, len(answer), prefill=edit_hooks(model, edit))[: len(answer)] == answer


@torch.no_grad()
def measure(model, tok, phrasing: str, all_countries: bool = False) -> dict:
    cap = {c: tok.encode(" " + country(c).capital).ids for c in COUNTRIES}
    known = [c for c in COUNTRIES if greedy_is(model, tok.encode(phrasing.format(s=c)).ids, cap[c], None)]
    rows = {"known": len(known), "greedy": [0, 0], "pnew": [0, 0], "local": [0, 0]}
    if all_countries:
        known = COUNTRIES
    if len(known) < 3:  # a pair needs a different target, and locality a third country
        known = []
    for k, src in enumerate(known):
        tgt, other = known[(k + 1) % len(known)], known[(k + 2) % len(known)]
        prompt = tok.encode(phrasing.format(s=src)).ids
        edit = make_edit(model, tok, prompt, src, tgt, layers=None)
        for j, e in enumerate((edit, None)):
            rows["greedy"][j] += greedy_is(model, prompt, cap[tgt], e)
            rows["pnew"][j] += logprob(model, prompt, cap[tgt], e) > logprob(model, prompt, cap[src], e)
        text = f"The capital of {src} is {country(src).capital}. The capital of {other} is"
        local = tok.encode(text).ids
        local_edit = make_edit(model, tok, local, src, tgt, layers=None)
        for j, e in enumerate((local_edit, None)):
            rows["local"][j] += greedy_is(model, local, cap[other], e)
    n = max(1, len(known))
    return {k: ([v[0] / n, v[1] / n] if isinstance(v, list) else v) for k, v in rows.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="a dense checkpoint or HF Llama folder with its tokenizer")
    parser.add_argument("--sets", nargs="+", default=["0", "0,1"], help="layer sets to retrofit (default 0 and 0,1)")
    parser.add_argument("--all-countries", action="store_true", help="pair every country, not only the known ones")
    args = parser.parse_args(argv)
    dense, tok = load_checkpoint(args.ckpt)
    result = {}
    for layers in args.sets:
        model = retrofit_from_dense(dense, layers).eval()
        means = {"greedy": 0.0, "pnew": 0.0, "locality": 0.0}
        for phrasing in PHRASINGS:
            r = measure(model, tok, phrasing, args.all_countries)
            print(
                f"layers {layers:8} {phrasing!r:32} known {r['known']:2d}/{len(COUNTRIES)}  new greedy "
                f"{r['greedy'][0]:.2f} ({r['greedy'][1]:.2f})  P(new)>P(true) {r['pnew'][0]:.2f} ({r['pnew'][1]:.2f})"
                f"  locality kept {r['local'][0]:.2f} ({r['local'][1]:.2f})",
                flush=True,
            )
            for key, src in (("greedy", "greedy"), ("pnew", "pnew"), ("locality", "local")):
                means[key] += r[src][0] / len(PHRASINGS)
        for key, value in means.items():
            result[f"{layers.replace(',', '-')}_{key}"] = value
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
