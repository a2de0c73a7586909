"""Why a token table can replace W_up at layer 0 of a pretrained model and not deeper: per layer, how close the
FFN input h_l is to "the token" RMSNorm_l(E[t]) (cosine), before and after the up-projection.

The dense checkpoint reads `--tokens` tokens of the embedded corpus' held-out split (one window); for each
layer it reports the mean over positions of cos(h_l, RMSNorm_l(E[t])) and cos(W_up h_l, W_up RMSNorm_l(E[t]))
(`stemlm.convert.retrofit.ffn_input_alignment`). A retrofitted table row is a function of t alone, so it can only
stand in for W_up h_l where h_l is mostly determined by t.

    python benchmarks/retrofit_alignment.py ckpt/smollm2 --tokens 2048

The last line is `RESULT cos_input_layer0=… cos_input_layer1=… max_cos_input_deeper=…`.
"""

from __future__ import annotations

import argparse
import json

import torch

from stemlm.checkpoint.runs import load_checkpoint
from stemlm.convert.retrofit import ffn_input_alignment
from stemlm.data.corpus import embedded_texts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="a dense checkpoint or HF Llama folder with its tokenizer")
    parser.add_argument("--tokens", type=int, default=2048, help="held-out tokens to read (default 2048)")
    parser.add_argument("--json", action="store_true", help="print the per-layer rows as one JSON object")
    args = parser.parse_args(argv)
    model, tok = load_checkpoint(args.ckpt)
    text = embedded_texts("heldout")[0]
    ids = torch.tensor(tok.encode(text[: args.tokens * 16], add_special_tokens=False).ids[: args.tokens])
    rows = ffn_input_alignment(model, ids)
    if args.json:
        print(json.dumps({"tokens": int(ids.numel()), "layers": rows}))
    else:
        print("layer  cos(h, norm E[t])  cos(W_up h, W_up norm E[t])")
        for r in rows:
            print(f"{r['layer']:5d}  {r['cos_input']:17.3f}  {r['cos_up']:27.3f}")
    deeper = max(r["cos_input"] for r in rows[1:])
    print(
        f"RESULT cos_input_layer0={rows[0]['cos_input']:.3f} cos_input_layer1={rows[1]['cos_input']:.3f} "
        f"max_cos_input_deeper={deeper:.3f}"
    )


if __name__ == "__main__":
    main()
