"""The bad-input suite: every subcommand given bad input exits 2 with exactly one stderr line naming the problem, and
changes nothing on disk (the whole workspace, folders included, is hashed before and after each case).

Cases run in-process through `stemlm.cli.main.main(argv)` on a tiny workspace built once: a STEM and a dense
checkpoint with the default tokenizer, a run folder, a checkpoint whose tokenizer does not fit its rows, a damaged
one, files and folders to be refused as outputs. Placeholders in an argv: {ck} {dense} {run} {ws} {nope} {file}
{full} {bin} {text} {tokdir} {smalltok} {corrupt} {legacy} {outdir} {factrun} (a run that mixed in one country's
facts). API cases at the end assert StemlmError. The newest surfaces (`eval edits`, the fact-world settings,
`experiment compare --variants`) are tried argument by argument and in the combinations that must agree.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer, save_tokenizer, train_bpe
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from tests.bad_input import refuse, tree
from tests.sharded import write_sharded

P = "Country: Spain. Capital:"


def tiny(ffn: str = "stem", vocab: int = 8192) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        ffn=ffn,
        ffn_layers="1",
    )


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad_inputs")
    tok = default_tokenizer()
    save_pretrained(build_model(tiny()), root / "ck", tokenizer=tok)
    save_pretrained(build_model(tiny("dense")), root / "dense" / "model", tokenizer=tok)
    save_pretrained(build_model(tiny()), root / "run" / "checkpoints" / "step-000001", tokenizer=tok)
    (root / "run" / "run_config.json").write_text("{}")
    small = train_bpe([(root / "ck" / "config.json").read_text() * 20], vocab_size=300)
    save_pretrained(build_model(tiny()), root / "smalltok", tokenizer=small)
    save_pretrained(build_model(tiny()), root / "corrupt", tokenizer=tok)
    weights = root / "corrupt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096] + b"\xff" * 4096)
    shutil.copytree(root / "ck", root / "legacy")
    (root / "legacy" / "stemlm-manifest.json").unlink()
    (root / "file.txt").write_text("a file\n")
    (root / "full").mkdir()
    (root / "full" / "notes.txt").write_text("the user's notes\n")
    (root / "binary.bin").write_bytes(bytes(range(256)) * 64)
    (root / "text.txt").write_text("The king of Spain spoke to the queen of France. " * 40)
    save_tokenizer(tok, root / "tokdir")
    (root / "outdir").mkdir()  # an empty folder: a fine output, so failures must leave it empty
    # Sharded checkpoints (as `stemlm train --nproc N` writes them), intact and damaged four ways.
    for name in ("sharded", "shardmiss", "shardflip", "shardextra", "shardtrunc"):
        write_sharded(build_model(tiny()), root / name, tok)
    (root / "shardmiss" / "dcp" / "shard-00001-model-00001-of-00002.safetensors").unlink()
    flip = root / "shardflip" / "dcp" / "shard-00001-model-00002-of-00002.safetensors"
    data = bytearray(flip.read_bytes())
    data[-100:] = bytes(255 - b for b in data[-100:])  # tensor bytes: the header still parses
    flip.write_bytes(bytes(data))
    shutil.copy(flip, root / "shardextra" / "dcp" / "shard-00003-model-00001-of-00001.safetensors")
    trunc = root / "shardtrunc" / "dcp" / "shard-00001-model-00002-of-00002.safetensors"
    trunc.write_bytes(trunc.read_bytes()[:-64])
    # A run whose trainer state says it mixed in the facts of one country (what `eval edits --countries auto` reads).
    save_pretrained(build_model(tiny()), root / "factrun" / "checkpoints" / "step-000001", tokenizer=tok)
    (root / "factrun" / "run_config.json").write_text("{}")
    train = {"data": None, "fact_fraction": 0.8, "fact_region": "Europe", "fact_countries": ["Spain"]}
    state = {"step": 1, "config": {"train": train}}
    (root / "factrun" / "checkpoints" / "step-000001" / "trainer_state.json").write_text(json.dumps(state))
    (root / "cwd").mkdir()
    return root


def fill(argv: list[str], ws: Path) -> list[str]:
    names = dict(
        ck=ws / "ck",
        dense=ws / "dense" / "model",
        run=ws / "run",
        ws=ws,
        nope=ws / "does-not-exist",
        file=ws / "file.txt",
        full=ws / "full",
        bin=ws / "binary.bin",
        text=ws / "text.txt",
        tokdir=ws / "tokdir",
        smalltok=ws / "smalltok",
        corrupt=ws / "corrupt",
        legacy=ws / "legacy",
        outdir=ws / "outdir",
        sharded=ws / "sharded",
        shardmiss=ws / "shardmiss",
        shardflip=ws / "shardflip",
        shardextra=ws / "shardextra",
        shardtrunc=ws / "shardtrunc",
        factrun=ws / "factrun",
    )
    return [a.format(**{k: str(v) for k, v in names.items()}) for a in argv]


# (argv, a piece of the one error line). Grouped by subcommand.
CASES = [
    # --- top level and info ---
    (["bogus-command"], "invalid choice"),
    (["info", "--preset", "nope"], "nope"),
    (["info", "--config", "{nope}"], "does-not-exist"),
    (["info", "--config", "{file}"], "JSON"),
    (["info", "--preset", "tiny", "--set", "hidden_size=abc"], "hidden_size"),
    (["info", "--preset", "tiny", "--set", "nokey=1"], "unknown config key 'nokey'"),
    (["info", "--preset", "tiny", "--set", "rope_theta=inf"], "rope_theta must be a positive number (finite)"),
    (["info", "--preset", "tiny", "--set", "rms_norm_eps=nan"], "rms_norm_eps"),
    (["info", "--preset", "tiny", "--set", "num_attention_heads=3"], "does not divide"),
    (["info", "--preset", "tiny", "--set", "ffn_layers=9"], "out of range"),
    (["info", "--preset", "tiny", "--seq-len", "0"], "seq"),
    (["info", "--preset", "tiny", "--seq-len", "-5"], "seq"),
    (["info", "--preset", "tiny", "--dtype", "fp64"], "invalid choice"),
    (["info", "--bogus-flag"], "unrecognized argument --bogus-flag (see stemlm info --help)"),
    # --- train (all refused before any data is read or anything written) ---
    (["train", "--steps", "0"], "steps must be a positive integer"),
    (["train", "--steps", "-3"], "steps must be a positive integer"),
    (["train", "--steps", "x"], "option 'steps' expects an integer, got 'x'"),
    (["train", "--batch-size", "0"], "batch_size"),
    (["train", "--seq-len", "0"], "seq_len must be a positive integer"),
    (["train", "--grad-accum", "0"], "grad_accum"),
    (["train", "--lr", "nan"], "lr must be a positive number"),
    (["train", "--lr", "inf"], "lr must be a positive number"),
    (["train", "--lr", "-1"], "lr must be a positive number"),
    (["train", "--warmup", "500", "--steps", "10"], "warmup"),
    (["train", "--set", "foo=1"], "prefix the key"),
    (["train", "--set", "train.nokey=1"], "unknown training config key"),
    (["train", "--set", "model.hidden_size=abc"], "hidden_size"),
    (["train", "--set", "model.rope_theta=inf"], "rope_theta"),
    (["train", "--set", "noequals"], "not of the form"),
    (["train", "--preset", "nope"], "nope"),
    (["train", "--ffn", "bogus"], "invalid choice"),
    (["train", "--ffn-layers", "99"], "out of range"),
    (["train", "--resume", "{nope}"], "does not exist"),
    (["train", "--resume", "{ck}"], "not a training run folder"),
    (["train", "--resume", "{run}", "--init-from", "{ck}"], "cannot be combined"),
    (["train", "--out", "{ck}"], "model checkpoint folder"),
    (["train", "--out", "{full}"], "not a stemlm run"),
    (["train", "--out", "{file}"], "is a file"),
    (["train", "--nproc", "0"], "--nproc"),
    (["train", "--sample-tokens", "-1"], "--sample-tokens"),
    (["train", "--device", "bogus"], "invalid choice"),
    (["train", "--dtype", "fp16"], "invalid choice"),
    (["train", "--table-lr", "abc"], "--table-lr"),
    (["train", "--keep-last", "0"], "keep_last"),
    (["train", "--max-skipped", "-1"], "max_skipped"),
    (["train", "--save-minutes", "nan"], "save_minutes"),
    (["train", "--eval-every", "-1"], "eval_every"),
    (["train", "--spike-factor", "0"], "spike_factor"),
    (["train", "--grad-clip", "-1"], "grad_clip"),
    (["train", "--threads", "0"], "threads"),
    (["train", "--data", "{nope}"], "does-not-exist"),
    (["train", "--data", "/dev/zero"], "not a regular file"),
    (["train", "--tokenizer", "{nope}"], "does-not-exist"),
    (["train", "--recipe", "lingua"], "argument --recipe: invalid choice: 'lingua'"),
    (["train", "--sampling", "shuffled"], "argument --sampling: invalid choice: 'shuffled'"),
    (["train", "--recipe", "official", "--table-optim", "rowwise_adagrad"], "dense AdamW"),
    (["train", "--recipe", "official", "--ffn", "moe"], "no init or optimizer rule for moe's"),
    # the fact world mixed into the embedded corpus: every setting, and with --data (where it would do nothing)
    (["train", "--set", "train.fact_relations="], "fact_relations is empty"),
    (["train", "--set", "train.fact_relations=bogus"], "fact_relations: unknown relation 'bogus'"),
    (["train", "--set", "train.fact_relations=capital,capital"], "fact_relations names capital twice"),
    (["train", "--set", "train.fact_region=Mars"], "fact_region: no country in region 'Mars'"),
    (["train", "--set", "train.fact_region="], "fact_region: no country in region ''"),
    (["train", "--set", "train.fact_region=Asia"], "not in fact_region 'Asia'"),
    (["train", "--set", "train.fact_countries=Atlantis"], "fact_countries: unknown country 'Atlantis'"),
    (["train", "--set", "train.fact_countries=Spain,Spain"], "Spain named twice"),
    (["train", "--set", "train.fact_countries=Japan"], "fact_countries Japan not in fact_region 'Europe'"),
    (["train", "--set", "train.fact_fraction=1"], "fact_fraction must lie in [0, 1)"),
    (["train", "--set", "train.fact_fraction=-0.5"], "fact_fraction must lie in [0, 1)"),
    (["train", "--set", "train.fact_fraction=nan"], "fact_fraction must lie in [0, 1)"),
    (["train", "--set", "train.fact_fraction=abc"], "'fact_fraction' expects a number"),
    (
        ["train", "--data", "{text}", "--set", "train.fact_fraction=0.5"],
        "train.fact_fraction has no effect with --data",
    ),
    (["train", "--data", "{text}", "--set", "train.fact_countries=Spain"], "has no effect with --data"),
    (["train", "--init-from", "{ck}", "--data", "{text}", "--set", "train.fact_region=all"], "no effect with --data"),
    # --- tokenizer ---
    (["tokenizer"], "required"),
    (["tokenizer", "train", "--out", "{ck}"], "model checkpoint folder"),
    (["tokenizer", "train", "--out", "{ck}", "--force"], "model checkpoint folder"),
    (["tokenizer", "train", "--out", "{file}"], "is a file"),
    (["tokenizer", "train", "--out", "{tokdir}"], "already exists"),
    (["tokenizer", "train", "--vocab-size", "10", "--out", "{outdir}"], "too small"),
    (["tokenizer", "train", "--data", "{nope}", "--out", "{outdir}"], "does-not-exist"),
    (["tokenizer", "train", "--heldout-fraction", "2", "--out", "{outdir}"], "fraction"),
    (["tokenizer", "encode", "--tokenizer", "{nope}", "x"], "does-not-exist"),
    # --- generate ---
    (["generate", "{nope}", "x"], "does not exist"),
    (["generate", "{file}", "x"], "is a file"),
    (["generate", "{ck}", "x", "--max-new-tokens", "-1"], "max_new_tokens"),
    (["generate", "{ck}", "x", "--temperature", "nan"], "temperature"),
    (["generate", "{ck}", "x", "--temperature", "inf"], "temperature"),
    (["generate", "{ck}", "x", "--temperature", "-1"], "temperature"),
    (["generate", "{ck}", "x", "--top-k", "-1"], "top"),
    (["generate", "{ck}", "x", "--top-p", "1.5"], "top"),
    (["generate", "{ck}", "x", "--top-p", "0"], "top"),
    (["generate", "{ck}", "x", "--device", "bogus"], "unknown device 'bogus'"),
    (["generate", "{ck}", "x", "--device", "cuda"], "no CUDA device"),
    (["generate", "{ck}", "x", "--tables", "host", "--device", "cuda"], "no CUDA device"),
    (["generate", "{ck}", "--ids", "abc"], "ids"),
    (["generate", "{ck}", "--ids", "99999"], "99999"),
    (["generate", "{ck}", "x", "--cache-rows", "5"], "host"),
    (["generate", "{smalltok}", "x"], "tokenizer"),
    # --- convert ---
    (["convert", "--from-dense", "{nope}", "--stem-layers", "odd", "--out", "{outdir}"], "does-not-exist"),
    (["convert", "--from-official", "{ck}", "--out", "{outdir}"], "has no params.json"),
    (["convert", "--from-official", "{ck}", "--stem-layers", "1", "--out", "{outdir}"], "keeps the run's STEM layers"),
    (["convert", "--from-dense", "{ck}", "--stem-layers", "odd", "--out", "{outdir}"], "dense"),
    (["convert", "--from-dense", "{dense}", "--stem-layers", "9", "--out", "{outdir}"], "out of range"),
    (["convert", "--from-dense", "{dense}", "--stem-layers", "odd", "--out", "{full}"], "not empty"),
    (["convert", "--from-dense", "{dense}", "--stem-layers", "odd", "--out", "{full}", "--force"], "not written by"),
    (["convert", "--from-dense", "{dense}", "--stem-layers", "odd", "--out", "{ws}/dense", "--force"], "the source"),
    (["convert", "--from-dense", "{dense}", "--stem-layers", "odd", "--out", "{dense}", "--force"], "the source"),
    (["convert", "--from-dense", "{dense}", "--stem-layers", "odd", "--out", "{file}"], "is a file"),
    (["convert", "--from-dense", "{dense}", "--out", "{outdir}"], "--stem-layers"),
    (["convert", "--from-gguf", "{nope}", "--out", "{outdir}"], "does-not-exist"),
    (["convert", "--to-llama", "{dense}", "--out", "{ws}/dense", "--force"], "contains the source"),
    (["convert", "--to-llama", "{dense}", "--out", "{full}", "--force"], "not written by"),
    (["convert", "--to-llama", "{nope}", "--out", "{outdir}"], "does not exist"),
    (["convert", "--from-dense", "{dense}", "--stem-layers", "odd"], "required: --out"),
    # --- cache-sim ---
    (["cache-sim", "{ck}", "--fractions", "2"], "fraction"),
    (["cache-sim", "{ck}", "--fractions", "abc"], "fraction"),
    (["cache-sim", "{ck}", "--policy", "bogus"], "bogus"),
    (["cache-sim", "{nope}"], "does not exist"),
    (["cache-sim", "{ck}", "--max-tokens", "0"], "max-tokens"),
    (["cache-sim", "--tokenizer", "{nope}"], "does-not-exist"),
    (["cache-sim", "{ck}", "--data", "{bin}"], "binary"),
    (["cache-sim", "{ck}", "--out", "{file}"], "is a file"),
    (["cache-sim", "{ck}", "--out", "{full}"], "not empty"),
    # --- edit ---
    (["edit", "{ck}", "--prompt", P, "--source", "Spain", "--target", "Spain"], "same entity"),
    (["edit", "{ck}", "--prompt", P, "--target", "Spain"], "--source"),
    (["edit", "{ck}", "--source", "Spain", "--inject", "Zorbia", "--target", "France"], "exclusive"),
    (["edit", "{ck}", "--source", "Spain", "--target", "Germany"], "--prompt"),
    (["edit", "{ck}", "--prompt", P, "--source", "Spain", "--target", "Germany", "--top-k", "0"], "--top-k"),
    (["edit", "{ck}", "--source", "Spain", "--target", "Germany", "--save", "{full}"], "not empty"),
    (["edit", "{ck}", "--source", "Spain", "--target", "Germany", "--save", "{ck}", "--force"], "the source"),
    (["edit", "{run}", "--source", "Spain", "--target", "Germany", "--save", "{ws}", "--force"], "the source"),
    (["edit", "{ck}", "--source", "Spain", "--target", "Germany", "--save", "{file}"], "is a file"),
    (["edit", "{nope}", "--prompt", P, "--source", "Spain", "--target", "Germany"], "does not exist"),
    (["edit", "{ck}", "--prompt", P, "--source", "Spain", "--target", "Germany", "--layers", "9"], "out of range"),
    (["edit", "{ck}", "--prompt", P, "--source", "Spain", "--target", "Germany", "--strategy", "x"], "invalid choice"),
    (["edit", "{ck}", "--prompt", P, "--source", "Atlantis", "--target", "Germany"], "Atlantis"),
    (["edit", "{ck}", "--prompt", P, "--source", "Spain", "--target", "Germany", "--layers", "-9"], "index -9 is out"),
    (
        ["edit", "{ck}", "--prompt", P, "--source", "Spain", "--target", "Germany", "--pad", "zero"],
        "--pad zero applies",
    ),
    # --- eval ---
    (["eval", "ppl", "{nope}"], "does not exist"),
    (["eval", "ppl", "{ck}", "--batch-size", "0"], "batch_size"),
    (["eval", "ppl", "{ck}", "--seq-len", "0"], "seq-len"),
    (["eval", "ppl", "{ck}", "--stride", "0"], "stride"),
    (["eval", "ppl", "{ck}", "--max-tokens", "0"], "max_tokens"),
    (["eval", "ppl", "{ck}", "--data", "{nope}"], "does-not-exist"),
    (["eval", "ppl", "{ck}", "--data", "{bin}"], "binary"),
    (["eval", "ppl", "{ck}", "--device", "bogus"], "unknown device 'bogus'"),
    (["eval", "ppl", "{ck}", "--device", "cuda"], "no CUDA device"),
    (["eval", "niah", "{ck}", "--lengths", "abc"], "lengths"),
    (["eval", "niah", "{ck}", "--samples", "0"], "samples"),
    (["eval", "niah", "{ck}", "--lengths", "32", "--out", "{file}"], "is a file"),
    (["eval", "niah", "{ck}", "--lengths", "32", "--out", "{full}"], "not empty"),
    (["eval", "niah", "{ck}", "--lengths", "32", "--out", "{ws}", "--force"], "the source"),
    (["eval", "niah-data", "--out", "{file}", "--num", "3"], "exists"),
    (["eval", "niah-data", "--out", "{ws}/n.jsonl", "--num", "0"], "num"),
    (["eval", "edits", "{ck}", "--records", "-1"], "records"),
    (["eval", "edits", "{ck}", "--out", "{file}"], "exists"),
    # eval edits: every argument, and the combinations that must agree (all refused before a weight is read)
    (["eval", "edits", "{ck}", "--countries", "Spain,Spain"], "Spain named twice"),
    (["eval", "edits", "{ck}", "--countries", "Spain"], "edit records need two countries whose capital differs"),
    (["eval", "edits", "{ck}", "--countries", ""], "--countries '' names no country"),
    (["eval", "edits", "{ck}", "--countries", ","], "names no country"),
    (["eval", "edits", "{ck}", "--countries", "Atlantis"], "unknown country 'Atlantis'"),
    (
        ["eval", "edits", "{ck}", "--countries", "spain,France"],
        "unknown country 'spain' in the fact world (names are exact: Spain)",
    ),
    (["eval", "edits", "{ck}", "--countries", "France,Germany", "--relation", "currency"], "whose currency differs"),
    (["eval", "edits", "{ck}", "--countries", "France,Germany", "--relation", "region"], "whose region differs"),
    (["eval", "edits", "{factrun}"], "(auto: the countries"),
    (["eval", "edits", "{ck}", "--relation", "bogus"], "unknown relation 'bogus'"),
    (["eval", "edits", "{ck}", "--relation", "Capital"], "unknown relation 'Capital'"),
    (["eval", "edits", "{ck}", "--records", "x"], "argument --records: invalid int value: 'x'"),
    (["eval", "edits", "{ck}", "--fluency-tokens", "-1"], "--fluency-tokens must be >= 0"),
    (["eval", "edits", "{ck}", "--fluency-records", "-1"], "--fluency-records must be >= 0"),
    (["eval", "edits", "{ck}", "--variants", "bogus"], "unknown variant 'bogus'"),
    (["eval", "edits", "{ck}", "--variants", ""], "names no row kind"),
    (["eval", "edits", "{ck}", "--variants", "stem,tables"], "names tables twice"),
    (["eval", "edits", "{dense}", "--variants", "tables"], "has no STEM tables"),
    (["eval", "edits", "{dense}", "--variants", "both"], "has no STEM tables"),
    (["eval", "edits", "{dense}", "--layers", "1"], "embedding rows only"),
    (["eval", "edits", "{ck}", "--variants", "embed", "--layers", "1"], "embedding rows only"),
    (["eval", "edits", "{ck}", "--layers", "-9"], "layer index -9 is out of range"),
    (["eval", "edits", "{ck}", "--layers", "0"], "layer 0 is not a STEM layer"),
    (["eval", "edits", "{ck}", "--layers", "abc"], "bad layer spec 'abc'"),
    (["eval", "edits", "{ck}", "--layers", "1,1"], "lists a layer twice"),
    (["eval", "edits", "{ck}", "--mode", "bogus"], "invalid choice"),
    (["eval", "edits", "{ck}", "--strategy", "bogus"], "invalid choice"),
    (["eval", "edits", "{ck}", "--pad", "zero"], "--pad zero applies to --strategy left_pad or right_pad, not auto"),
    (["eval", "edits", "{ck}", "--pad", "eot", "--strategy", "copy"], "not copy"),
    (["eval", "edits", "{ck}", "{ck}"], "is given twice"),
    (["eval", "edits", "{run}", "{run}/checkpoints/step-000001"], "are one checkpoint"),
    (["eval", "edits", "{ck}", "{nope}"], "does not exist"),
    (["eval", "edits", "{ck}", "{smalltok}"], "tokenizer"),
    (["eval", "edits", "{ck}", "{tokdir}"], "neither a checkpoint folder"),
    (["eval", "edits", "{ck}", "--dense", "{nope}"], "does not exist"),
    (["eval", "edits", "{ck}", "--dense", "{file}"], "is a file"),
    (["eval", "edits", "{ck}", "--dense", "{ck}"], "is also given as CKPT"),
    (["eval", "edits", "{dense}", "--dense", "{dense}"], "is also given as CKPT"),
    (["eval", "edits", "{dense}", "--dense", "{ck}"], "is not a dense model (ffn=stem)"),
    (["eval", "edits", "{ck}", "--dense", "{run}"], "is not a dense model"),
    (["eval", "edits", "{ck}", "--out", "{outdir}"], "is a folder"),
    (["eval", "edits", "{ck}", "--out", "{file}/r.json"], "is a file, so nothing can be written under it"),
    (["eval", "edits", "{ck}", "--out", "{ck}/config.json", "--force"], "which this command reads"),
    (["eval", "edits", "{run}", "--out", "{run}/checkpoints/step-000001/r.json"], "which this command reads"),
    (["eval", "edits", "{ck}", "--dense", "{dense}", "--out", "{dense}/r.json"], "which this command reads"),
    (["eval", "edits", "{ck}", "--force"], "--force applies to --out"),
    (["eval", "edits", "{run}", "--out", "{run}/run_config.json", "--force"], "not an earlier `eval edits` result"),
    (["eval", "edits", "{ck}", "--out", "{text}", "--force"], "--force replaces only such a file"),
    (["eval", "lm", "{ck}", "--tasks", "no_such_task"], "no_such_task"),
    (["eval", "lm", "{ck}", "--out", "{file}"], "exists"),
    # --- analyze ---
    (["analyze", "{ck}", "--max-tokens", "0"], "max-tokens"),
    (["analyze", "{ck}", "--top-k", "0"], "top-k"),
    (["analyze", "{ck}", "--text", "{bin}"], "binary"),
    (["analyze", "{ck}", "--text", "{nope}"], "does-not-exist"),
    (["analyze", "{ck}", "--only", "bogus"], "bogus"),
    (["analyze", "{dense}", "--only", "spread"], "need a STEM checkpoint"),
    (["analyze", "{ck}", "--prompt", ""], "--prompt encodes to no tokens"),
    (["analyze", "{ck}", "--out", "{file}"], "is a file"),
    (["analyze", "{ck}", "--out", "{full}"], "not empty"),
    (["analyze", "{ck}", "--out", "{ck}", "--force"], "the source"),
    # --- serve ---
    (["serve", "{nope}"], "does not exist"),
    (["serve", "{ck}", "--port", "-1"], "--port"),
    (["serve", "{ck}", "--port", "70000"], "--port"),
    (["serve", "{ck}", "--cache-rows", "5"], "host"),
    (["serve", "{ck}", "--save-dir", "{ck}"], "served checkpoint"),
    (["serve", "{ck}", "--device", "bogus"], "unknown device 'bogus'"),
    (["serve", "{ck}", "--tables", "host", "--device", "cuda"], "no CUDA device"),
    (["server", "{nope}"], "does not exist"),
    (["server", "{ck}", "--port", "70000"], "--port 70000"),  # the alias of serve
    (["server", "{ck}", "--slots", "0"], "--slots must be >= 1"),
    (["server", "{ck}", "--request-timeout", "0"], "--request-timeout"),
    (["server", "{ck}", "--cache-rows", "5"], "host"),
    (["server", "{ck}", "--device", "bogus"], "unknown device 'bogus'"),
    # --- experiment and data ---
    (["experiment", "knowledge", "--set", "bogus=1"], "bogus"),
    (["experiment", "knowledge", "--steps", "0", "--out", "{outdir}"], "steps"),
    (["experiment", "knowledge", "--quick", "--set", "relations=", "--out", "{outdir}"], "relations is empty"),
    (
        ["experiment", "knowledge", "--quick", "--set", "relations=bogus", "--out", "{outdir}"],
        "relations: unknown relation 'bogus'",
    ),
    (
        ["experiment", "knowledge", "--quick", "--set", "relations=capital,capital", "--out", "{outdir}"],
        "relations names capital twice",
    ),
    (
        ["experiment", "knowledge", "--quick", "--set", "edit_relation=bogus", "--out", "{outdir}"],
        "edit_relation: unknown relation 'bogus'",
    ),
    (
        ["experiment", "knowledge", "--quick", "--set", "edit_relation=language", "--out", "{outdir}"],
        "not among the trained relations (capital)",
    ),
    (
        ["experiment", "knowledge", "--quick", "--set", "fact_repeats=0", "--out", "{outdir}"],
        "fact_repeats must be a positive integer",
    ),
    (
        ["experiment", "knowledge", "--quick", "--set", "arms=dense", "--out", "{outdir}"],
        "arms must include dense and stem",
    ),
    (["experiment", "knowledge", "--quick", "--records", "-1", "--out", "{outdir}"], "--records must be >= 0"),
    (
        ["experiment", "knowledge", "--quick", "--set", "vocab_size=10", "--out", "{outdir}"],
        "vocab_size 10 is too small",
    ),
    (
        ["experiment", "knowledge", "--quick", "--set", "stem_layers=9", "--out", "{outdir}"],
        "layer index 9 is out of range",
    ),
    (
        ["experiment", "knowledge", "--quick", "--set", "seq_len=0", "--out", "{outdir}"],
        "seq_len must be a positive integer",
    ),
    (["experiment", "compare", "--kinds", "dense,bogus", "--out", "{outdir}"], "bogus"),
    (["experiment", "compare", "--budget", "abc", "--out", "{outdir}"], "budget"),
    (["experiment", "knowledge", "--quick", "--out", "{full}"], "not an experiment folder"),
    (["experiment", "compare", "--quick", "--out", "{file}"], "not a folder"),
    (["experiment", "bio", "--quick", "--out", "{full}"], "not an experiment folder"),
    # experiment compare: variants against --kinds, what each arm decides, every option (refused before writing)
    (
        ["experiment", "compare", "--kinds", "engram", "--set", "engram_variant=reference", "--out", "{outdir}"],
        "each arm sets engram_variant itself",
    ),
    (
        ["experiment", "compare", "--kinds", "engram-reference", "--set", "engram_variant=stemlm", "--out", "{outdir}"],
        "sets engram_variant itself",
    ),
    (
        ["experiment", "compare", "--kinds", "ple", "--set", "model.ple_variant=reference", "--out", "{outdir}"],
        "each arm sets ple_variant itself",
    ),
    (["experiment", "compare", "--set", "ffn=moe", "--out", "{outdir}"], "each arm sets ffn itself"),
    (["experiment", "compare", "--set", "vocab_size=100", "--out", "{outdir}"], "each arm sets vocab_size itself"),
    (
        ["experiment", "compare", "--kinds", "dense,stem", "--variants", "reference", "--out", "{outdir}"],
        "no kind in --kinds dense,stem has variants",
    ),
    (
        ["experiment", "compare", "--kinds", "dense_embed,moe", "--variants", "reference", "--out", "{outdir}"],
        "so it would add no arm",
    ),
    (
        ["experiment", "compare", "--kinds", "engram", "--variants", "reference,reference", "--out", "{outdir}"],
        "--variants names reference twice",
    ),
    (
        ["experiment", "compare", "--kinds", "engram", "--variants", "bogus", "--out", "{outdir}"],
        "engram_variant must be one of stemlm, reference",
    ),
    (["experiment", "compare", "--kinds", "dense-reference", "--out", "{outdir}"], "unknown kind 'dense-reference'"),
    (
        ["experiment", "compare", "--kinds", "engram-bogus", "--out", "{outdir}"],
        "arm engram-bogus (engram_variant=bogus",
    ),
    (["experiment", "compare", "--kinds", "engram,engram", "--out", "{outdir}"], "lists a kind twice"),
    (
        ["experiment", "compare", "--kinds", "value_embed", "--variants", "reference", "--out", "{outdir}"],
        "ffn_layers=1,2,-3,-2,-1, on 4 layers",
    ),
    (["experiment", "compare", "--seeds", "0", "--out", "{outdir}"], "seeds must be a positive integer"),
    (["experiment", "compare", "--workers", "0", "--out", "{outdir}"], "workers must be a positive integer"),
    (["experiment", "compare", "--lr", "0", "--out", "{outdir}"], "lr must be a positive number"),
    (["experiment", "compare", "--lr", "nan", "--out", "{outdir}"], "lr must be a positive number"),
    (["experiment", "compare", "--lr-sweep", "0,1", "--out", "{outdir}"], "learning rates must be positive"),
    (["experiment", "compare", "--budget", "0", "--out", "{outdir}"], "--budget must be positive"),
    (["experiment", "compare", "--budget", "nan", "--out", "{outdir}"], "--budget must be positive"),
    (["experiment", "compare", "--corpus-chars", "0", "--out", "{outdir}"], "corpus_chars must be a positive integer"),
    (["experiment", "compare", "--fact-repeats", "-1", "--out", "{outdir}"], "fact_repeats must be >= 0"),
    (["experiment", "compare", "--passkey-docs", "-1", "--out", "{outdir}"], "passkey_docs must be >= 0"),
    (
        ["experiment", "compare", "--eval-limit", "0", "--out", "{outdir}"],
        "eval_limit must be a positive integer or none",
    ),
    (["experiment", "compare", "--ppl-tokens", "0", "--out", "{outdir}"], "ppl_tokens must be a positive integer"),
    (["experiment", "compare", "--niah-lengths", "0", "--out", "{outdir}"], "niah_lengths must be positive"),
    (
        ["experiment", "compare", "--niah-lengths", "1024", "--out", "{outdir}"],
        "NIAH length 1024 exceeds max_position_embeddings=512",
    ),
    (["experiment", "compare", "--niah-samples", "0", "--out", "{outdir}"], "niah_samples must be a positive integer"),
    (["experiment", "compare", "--seq-len", "0", "--out", "{outdir}"], "seq_len must be a positive integer"),
    (
        ["experiment", "compare", "--seq-len", "1024", "--out", "{outdir}"],
        "seq_len 1024 exceeds max_position_embeddings=512",
    ),
    (["experiment", "compare", "--batch-size", "0", "--out", "{outdir}"], "batch_size must be a positive integer"),
    (["experiment", "compare", "--layers", "0", "--out", "{outdir}"], "num_hidden_layers must be a positive integer"),
    (["experiment", "compare", "--hidden-size", "7", "--out", "{outdir}"], "does not divide hidden_size=7"),
    (["experiment", "compare", "--ffn-layers", "9", "--out", "{outdir}"], "layer index 9 is out of range"),
    (["experiment", "compare", "--device", "cuda", "--out", "{outdir}"], "no CUDA device"),
    (["experiment", "compare", "--match", "bogus", "--out", "{outdir}"], "invalid choice"),
    (
        ["experiment", "compare", "--seed", "999", "--seeds", "3", "--out", "{outdir}"],
        "sweep_seed 1000 is one of the final seeds",
    ),
    (["experiment", "compare", "--preset", "nope", "--out", "{outdir}"], "unknown preset 'nope'"),
    (["experiment", "compare", "--set", "bogus=1", "--out", "{outdir}"], "unknown config key 'bogus'"),
    (["experiment", "compare", "--out", "{full}"], "not an experiment folder"),
    (["data", "prepare", "{nope}", "--out", "{ws}/shards"], "does-not-exist"),
    (["data", "prepare", "{text}", "--out", "{full}"], "already exists"),
    (["data", "prepare", "{text}", "--out", "{file}"], "already exists"),
    (["data", "verify", "{nope}"], "does-not-exist"),
    (["data", "verify", "{ck}"], "manifest"),
    # --- verify ---
    (["verify", "{nope}"], "does not exist"),
    (["verify", "{corrupt}"], "model.safetensors (changed)"),
    (["verify", "{legacy}"], "no stemlm-manifest.json"),
    (["verify", "{file}"], "is a file"),
    # --- export ---
    (["export", "{nope}", "--out", "{ws}/exported"], "does not exist"),
    (["export", "{sharded}", "--out", "{full}"], "already exists"),
    (["export", "{sharded}", "--out", "{full}", "--force"], "was not written by stemlm export"),
    (["export", "{sharded}", "--out", "{ws}", "--force"], "contains the source"),
    (["export", "{shardmiss}", "--out", "{ws}/exported"], "is missing dcp/shard-00001-model-00001-of-00002"),
    (["export", "{shardflip}", "--out", "{ws}/exported"], "does not match its SHA-256"),
    (["export", "{shardextra}", "--out", "{ws}/exported"], "which its manifest does not record"),
    (["export", "{shardtrunc}", "--out", "{ws}/exported"], "does not have the size its manifest records"),
    (["export", "{corrupt}", "--out", "{ws}/exported"], "fail verification"),
    (["export", "{sharded}"], "--out"),
    (["generate", "{shardtrunc}", "x"], "does not have the size"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_changes(ws, capsys, monkeypatch, argv, message):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a machine with CUDA")
    monkeypatch.chdir(ws / "cwd")  # commands with a default output folder would write here
    monkeypatch.setenv("STEMLM_CACHE", str(ws / "cwd" / ".cache"))
    refuse(fill(argv, ws), message, capsys, ws)


def test_the_suite_covers_every_subcommand():
    from stemlm.cli.main import SUBCOMMANDS

    assert len(CASES) >= 100
    assert set(SUBCOMMANDS) <= {argv[0] for argv, _ in CASES}


def test_a_missing_extra_is_one_line_naming_it(ws, capsys, monkeypatch):
    for module in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError, as when not installed
    assert main(["eval", "lm", str(ws / "ck")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["stemlm eval: error: this needs lm-eval: pip install 'stemlm[eval]'"]


# ----- the same problems through the Python API: StemlmError, never a bare exception -----
def _api_cases(ws: Path):
    from stemlm.checkpoint.runs import load_checkpoint
    from stemlm.convert.driver import convert_checkpoint
    from stemlm.edit.evaluate import evaluate_checkpoint_edits
    from stemlm.experiments.compare import CompareConfig, run_command
    from stemlm.experiments.contract import ExperimentLog
    from stemlm.inference.generate import generate
    from stemlm.train.config import TrainConfig

    model, log = build_model(tiny()), ExperimentLog()
    return [
        lambda: ModelConfig(rope_theta=float("inf")),
        lambda: ModelConfig(hidden_size=0),
        lambda: TrainConfig(seq_len=0),
        lambda: TrainConfig(lr=float("nan")),
        lambda: TrainConfig(max_skipped=-1),
        lambda: save_pretrained(model, ws / "full"),
        lambda: save_pretrained(model, ws / "file.txt", force=True),
        lambda: convert_checkpoint(ws / "dense" / "model", "odd", ws / "dense", force=True),
        lambda: load_checkpoint(ws / "smalltok"),
        lambda: load_checkpoint(ws / "nope"),
        lambda: generate(model, [1, 2], 3, temperature=float("nan")),
        lambda: generate(model, [1, 2], 3, temperature=float("inf")),
        lambda: TrainConfig(fact_relations=[]),
        lambda: TrainConfig(fact_region="Mars"),
        lambda: TrainConfig(fact_countries=["Spain", "Spain"]),
        lambda: evaluate_checkpoint_edits(str(ws / "ck"), "capital", 2, seed=0, countries="Spain,Spain"),
        lambda: evaluate_checkpoint_edits(str(ws / "ck"), "capital", 2, seed=0, countries="Spain"),
        lambda: run_command(CompareConfig(kinds=("dense",), variants=("reference",), out=str(ws / "x")), log),
        lambda: run_command(CompareConfig(kinds=("engram",), model_overrides=["engram_variant=reference"]), log),
    ]


API_CASES = 19


def test_the_api_case_count():
    assert len(_api_cases(Path("."))) == API_CASES


@pytest.mark.parametrize("index", range(API_CASES))
def test_api_bad_input_raises_stemlm_error(ws, index):
    before = tree(ws)
    with pytest.raises(StemlmError):
        _api_cases(ws)[index]()
    assert tree(ws) == before


def test_corrupt_json_state_in_a_run_is_one_line(ws, capsys, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ws / "run", run)
    ckpt = run / "checkpoints" / "step-000001"
    state = {"format": "stemlm-trainer-state-v1", "step": "seven", "config": {}}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    before = tree(tmp_path)
    assert main(["train", "--resume", str(run)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "'step' must be a non-negative integer" in lines[0], lines
    assert tree(tmp_path) == before
    assert os.path.isdir(ckpt)
