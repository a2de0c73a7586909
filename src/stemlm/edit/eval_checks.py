"""What `stemlm eval edits` checks before it loads a weight: every argument, and the ones that must agree.

`check_edit_eval(...)` reads each checkpoint's config.json and builds its model on the meta device (no weights), so a
refused evaluation is one line that cost nothing: a relation or count out of range, countries that make no edit
record (a name twice, one country, or countries that share the relation's object), a checkpoint given twice (also
as a run folder and its own newest checkpoint), a `--dense` control that is not a dense model or is one of the
checkpoints, row variants the model cannot edit or named twice, `--layers` that are no table layers of every
checkpoint or select nothing (only embedding rows evaluated), `--pad` with a strategy that pads nothing, `--force`
without `--out`, and an `--out` that could not be written (under a file, inside a checkpoint read), exists without
`--force`, or exists and is not an earlier `eval edits` result (what `--force` may replace).
`evaluate_checkpoint_edits` then does the work.
"""

from __future__ import annotations

from pathlib import Path

from stemlm.errors import StemlmError


def meta_model(ckpt: str):
    """(checkpoint folder, the model of CKPT on the meta device): its config and tokenizer read (the tokenizer must
    fit the rows, as loading checks), no weight loaded."""
    import torch
    from tokenizers import Tokenizer

    from stemlm.checkpoint.folder import TOKENIZER_NAME, load_config
    from stemlm.checkpoint.runs import check_tokenizer_fits, resolve_checkpoint
    from stemlm.model.decoder import StemLM

    folder = resolve_checkpoint(ckpt)
    if not (folder / TOKENIZER_NAME).is_file():
        raise StemlmError(f"{ckpt} has no {TOKENIZER_NAME}; editing needs the tokenizer the model was trained with")
    config = load_config(folder)
    try:
        tokens = Tokenizer.from_file(str(folder / TOKENIZER_NAME)).get_vocab_size()
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise StemlmError(f"cannot read {folder / TOKENIZER_NAME}: {str(exc).splitlines()[0]}") from None
    check_tokenizer_fits(tokens, config.vocab_size, folder)
    with torch.device("meta"):
        return folder, StemLM(config)


def check_records(relation: str, countries: str, ckpt: str, seed: int) -> None:
    """The countries of CKPT's records make at least one edit record of `relation`."""
    from stemlm.data.worlds.facts import edit_records
    from stemlm.edit.evaluate import record_countries

    region = record_countries(countries, ckpt)
    try:
        edit_records(relation, 1, seed=seed, region=region)
    except ValueError as exc:
        where = f" (auto: the countries {ckpt}'s run trained on)" if countries == "auto" and region else ""
        raise StemlmError(f"--countries {countries!r}{where}: {exc}") from None


def check_variants(spec: str, model, layers: str | None, ckpt: str) -> list[str]:
    """The row variants of `spec` for this model, each once, every one it can edit; `layers` must pick table layers."""
    from stemlm.edit.evaluate import edit_variants
    from stemlm.edit.positional import table_layers
    from stemlm.edit.session import parse_layers

    variants = edit_variants(spec, model)
    if not variants:
        raise StemlmError(f"--variants {spec!r} names no row kind; give auto or a comma list of tables, embed, both")
    twice = sorted({v for v in variants if variants.count(v) > 1})
    if twice:
        raise StemlmError(f"--variants {spec!r} names {', '.join(twice)} twice")
    chosen = parse_layers(layers, model)
    if any(v != "embed" for v in variants):
        try:
            table_layers(model, chosen)
        except StemlmError as exc:
            raise StemlmError(f"{ckpt}: {exc}") from None
    elif layers is not None:
        raise StemlmError(
            f"--layers {layers} selects table layers, but {ckpt} is evaluated on embedding rows only "
            f"(--variants {spec}), which have no layer"
        )
    return variants


def check_edit_eval(
    ckpts: list[str],
    *,
    relation: str,
    records: int,
    countries: str,
    seed: int,
    variants: str,
    layers: str | None,
    dense: str | None,
    strategy: str,
    pad: str | None,
    fluency_tokens: int,
    fluency_records: int,
    out: str | None,
    force: bool,
) -> None:
    """Raise a one-line StemlmError for anything `stemlm eval edits` would refuse or get wrong (module docstring)."""
    from stemlm.checkpoint.safe_write import check_file_target
    from stemlm.data.worlds.facts import RELATIONS
    from stemlm.edit.spans import check_pad

    if relation not in RELATIONS:
        raise StemlmError(f"unknown relation {relation!r}; choose one of {', '.join(RELATIONS)}")
    for flag, value in (("--records", records), ("--fluency-tokens", fluency_tokens)):
        if value < 0:
            raise StemlmError(f"{flag} must be >= 0, got {value}")
    if fluency_records < 0:
        raise StemlmError(f"--fluency-records must be >= 0, got {fluency_records}")
    check_pad(strategy, pad)
    if force and out is None:
        raise StemlmError("--force applies to --out FILE (replacing it); there is no --out")
    seen: dict[Path, str] = {}
    for ckpt in ckpts:
        folder, model = meta_model(ckpt)
        key = folder.resolve()
        if key in seen:
            same = (
                f"{ckpt} is given twice"
                if ckpt == seen[key]
                else f"{ckpt} and {seen[key]} are one checkpoint ({folder})"
            )
            raise StemlmError(f"{same}; give each checkpoint (seed) once")
        seen[key] = ckpt
        check_records(relation, countries, ckpt, seed)
        check_variants(variants, model, layers, ckpt)
    if dense is not None:
        folder, model = meta_model(dense)
        if folder.resolve() in seen:
            raise StemlmError(
                f"--dense {dense} is also given as CKPT ({seen[folder.resolve()]}); the control is another model"
            )
        seen[folder.resolve()] = dense
        if model.token_tables() or model.config.ffn != "dense":
            raise StemlmError(
                f"--dense {dense} is not a dense model (ffn={model.config.ffn}); the control is a dense checkpoint, "
                "evaluated on its embedding rows"
            )
    if out is not None:
        check_file_target(out, force=force, sources=tuple(seen))  # the checkpoint folders read (a run's own: fine)
        if Path(out).exists() and not is_edit_results(Path(out)):
            raise StemlmError(f"--out {out} is not an earlier `eval edits` result; --force replaces only such a file")


def is_edit_results(path: Path) -> bool:
    """Whether `path` holds what `eval edits --out` writes: one checkpoint's results or several checkpoints'."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and ({"checkpoint", "relation", "variants"} <= set(data) or "checkpoints" in data)
