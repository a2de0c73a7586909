"""The tokenizer folder lm-evaluation-harness's API models need to score a served model as `stemlm eval lm` does.

lm-eval's `local-completions` model tokenizes on the client (a Hugging Face tokenizer folder) to find where each
context ends in the echoed prompt's log-probabilities, and sends the ids. `stemlm eval lm` conditions every
context on `<|endoftext|>` first, the separator the trainer puts before each document; lm-eval adds a prefix only
as the tokenizer's special tokens with `add_bos_token=True`. `write_lm_eval_tokenizer` writes the checkpoint's
tokenizer with `<|endoftext|>` as that prefix, so both send the model the same ids:

    folder = write_lm_eval_tokenizer("runs/tiny", "runs/tiny-lm-eval-tokenizer")
    # lm_eval --model local-completions --model_args base_url=...,tokenizer_backend=huggingface,
    #     tokenizer=<folder>,add_bos_token=True,...
"""

from __future__ import annotations

import json
from pathlib import Path

from stemlm.errors import StemlmError

EOT_TOKEN = "<|endoftext|>"


def write_lm_eval_tokenizer(checkpoint: str | Path, folder: str | Path, *, force: bool = False) -> Path:
    """Write `folder`/tokenizer.json and tokenizer_config.json: CKPT's tokenizer (a checkpoint or run folder) whose
    special tokens put `<|endoftext|>` before every text; returns `folder`. An existing non-empty `folder` is
    refused with a one-line error; `force` replaces it only if this function wrote it."""
    from tokenizers import Tokenizer, processors

    from stemlm.checkpoint.runs import resolve_checkpoint
    from stemlm.checkpoint.safe_write import AtomicFolder

    source = resolve_checkpoint(checkpoint) / "tokenizer.json"
    if not source.is_file():
        raise StemlmError(f"checkpoint {source.parent} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(source))
    eot = tokenizer.token_to_id(EOT_TOKEN)
    if eot is None:
        raise StemlmError(f"the tokenizer of {source.parent} has no {EOT_TOKEN} token to condition contexts on")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOT_TOKEN} $A", pair=f"{EOT_TOKEN} $A $B", special_tokens=[(EOT_TOKEN, eot)]
    )
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT_TOKEN, "eos_token": EOT_TOKEN}
    # Atomic and guarded like every stemlm output: never into an existing folder it did not write (the
    # checkpoint's own folder included), never through a symlink.
    with AtomicFolder(folder, producer="lm-eval-tokenizer", sources=[source.parent], force=force, flag="folder") as tmp:
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(folder)
