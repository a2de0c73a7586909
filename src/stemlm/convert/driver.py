"""`stemlm convert --stem-layers`: a dense checkpoint retrofitted into a STEM one and written with its tokenizer.

`stemlm.convert.retrofit.retrofit_from_dense(dense, spec)` builds a STEM model whose table at layer l is
`U_l = E · W_up_lᵀ` (the token embedding matrix [V, d] times that layer's up-projection transposed,
[V, d_ff]), as later official STEM commits do, drops those up-projections and copies every other weight.
Row t of U_l is exactly `up_proj_l(embed(t))`: the up-projection of the RAW embedding of t, not of the
normalised hidden state the dense layer saw, so the retrofit is a starting point for training
(`stemlm train --init-from`), not a model
with the dense logits. `convert_checkpoint` does this for a stemlm dense checkpoint (or run folder) or a local
Hugging Face Llama folder and writes a checkpoint with the tokenizer copied; the CLI is `stemlm convert`.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.safe_write import check_target
from stemlm.convert.retrofit import adapter_from, calibration_ids, retrofit, retrofit_from_dense
from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM

PRODUCER = "stemlm convert"  # names convert's outputs in their manifest (what --force may replace)


def load_dense(path: str | Path) -> tuple[StemLM, Tokenizer | None]:
    """A dense model and its tokenizer from a stemlm checkpoint or run folder, or a local HF Llama folder."""
    from stemlm.checkpoint.runs import load_checkpoint

    return load_checkpoint(path)


def convert_checkpoint(
    source: str | Path,
    stem_layers_spec: str,
    out: str | Path,
    *,
    force: bool = False,
    init: str = "embed",
    calibration: list[str] | None = None,
    calibration_tokens: int = 32768,
    adapter: bool = False,
    progress: bool = False,
) -> Path:
    """Retrofit the dense model at `source` and save it, tokenizer included, as a stemlm checkpoint at `out`.

    `init` picks the tables' start (see `stemlm.convert.retrofit`): "embed" (E · W_upᵀ), "normed", or "calib" (the FFN
    inputs seen on the first `calibration_tokens` tokens of the `calibration` files; default: the embedded
    corpus' train split). `adapter` keeps W_up and blends it with the table by a learned gate (`stem_adapter`).

    An existing non-empty `out` is refused unless `force` and it is an earlier output of `stemlm convert`;
    `out` is never the source nor a folder holding it (`stemlm.checkpoint.safe_write.check_target`). `progress`:
    a bar on stderr, one step per stage (load, tables, adapter, save; `stemlm.progress`).
    """
    from stemlm.progress import bar as progress_bar

    guard = {"producer": PRODUCER, "force": force, "sources": _sources(source)}
    check_target(out, **guard)  # before the (possibly long) load
    with progress_bar(3 + adapter, progress=progress, desc="convert", unit="stage") as bar:
        bar.set_postfix_str("load")
        dense, tokenizer = load_dense(source)
        bar.update()
        bar.set_postfix_str(f"tables ({init})")
        if init == "embed":
            stem = retrofit_from_dense(dense, stem_layers_spec)
        else:
            ids = calibration_ids(tokenizer, calibration, calibration_tokens) if init == "calib" else None
            stem = retrofit(dense, stem_layers_spec, init, ids)
        bar.update()
        if adapter:
            bar.set_postfix_str("adapter")
            stem = adapter_from(dense, stem)
            bar.update()
        bar.set_postfix_str("save")
        saved = save_pretrained(stem, out, tokenizer=tokenizer, **guard)
        bar.update()
    return saved


def _sources(source: str | Path) -> list[Path]:
    """The source argument and, for a run folder, the checkpoint it resolves to."""
    from stemlm.checkpoint.runs import resolve_checkpoint

    paths = [Path(source)]
    try:
        paths.append(resolve_checkpoint(source))
    except StemlmError:
        pass  # an HF Llama folder, or a missing path (load_dense names that problem)
    return paths
