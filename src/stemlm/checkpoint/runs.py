"""Resolving a CKPT argument to a checkpoint folder, and loading it with its tokenizer.

Every command that reads a model takes either a checkpoint folder (it holds `config.json`) or a training
run folder, meaning that run's newest checkpoint under `RUN/checkpoints/step-N/` (the trainer writes these,
see `stemlm.train.state`). The trainer's pointer `RUN/checkpoints/latest.json` is followed when it names a
complete checkpoint; when it is missing or names nothing usable, the highest-numbered complete `step-*`
folder is taken, so an interrupted save never breaks resolution.

    from stemlm.checkpoint.runs import load_checkpoint
    model, tokenizer = load_checkpoint("runs/tiny")      # tokenizer is None when the folder has none
    model, tokenizer = load_checkpoint("runs/tiny", need_tokenizer="editing")  # a one-line error if it is missing
    model = from_pretrained("runs/tiny")                 # the model only: a checkpoint, run or Llama folder

Every command line tool loads models through these functions, so no CLI module needs another's loader. The
commands that read a folder without running it live here too: `load_model_config` / `named_model_config`
(`stemlm info --config`), `verify_checkpoint` (`stemlm verify`) and `export_model` (`stemlm export`).

A Hugging Face Llama folder (config.json with model_type "llama") loads as a dense model through the same
`from_pretrained`, so every command and the Python API take an imported model alike.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from tokenizers import Tokenizer

from stemlm.checkpoint.folder import CONFIG_NAME, TOKENIZER_NAME, WEIGHTS_NAME, load_config, read_state, weight_files
from stemlm.checkpoint.sharded import is_sharded
from stemlm.errors import StemlmError
from stemlm.model.config import ModelConfig
from stemlm.model.decoder import StemLM
from stemlm.runtime import check_device

CHECKPOINTS_DIR = "checkpoints"
LATEST_NAME = "latest.json"
STEP_DIR = re.compile(r"^step-(\d+)$")


def is_checkpoint(path: Path) -> bool:
    """A complete checkpoint: config.json plus every weights file it needs."""
    if not (path / CONFIG_NAME).is_file():
        return False
    if is_sharded(path):  # written by `stemlm train --nproc N` (stemlm.checkpoint.sharded)
        return True
    try:
        weight_files(path)
    except StemlmError:
        return False
    return True


def _from_pointer(run: Path) -> Path | None:
    """The checkpoint named by RUN/checkpoints/latest.json ({"step": N, "path": "step-…"}), if it is complete; a
    pointer leading out of checkpoints/ is refused, never followed."""
    pointer = run / CHECKPOINTS_DIR / LATEST_NAME
    try:
        data = json.loads(pointer.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    name = data.get("path") if isinstance(data, dict) else None
    if not isinstance(name, str) or not name:
        return None
    if not STEP_DIR.match(name):  # the trainer writes "step-N": anything else would lead out of the run
        raise StemlmError(
            f"{pointer} points at {name!r}, not at a step folder of {pointer.parent}; the file was edited or damaged "
            "(delete it to resume from the newest step folder)"
        )
    target = pointer.parent / name
    return target if is_checkpoint(target) else None


def step_checkpoints(run: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint of a run, oldest first."""
    folder = Path(run) / CHECKPOINTS_DIR
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and is_checkpoint(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder meant by `path`: itself if it is one, else the newest checkpoint of a run folder."""
    path = Path(path)
    if not path.exists():
        raise StemlmError(f"checkpoint or run folder {path} does not exist")
    if not path.is_dir():
        raise StemlmError(f"{path} is a file; pass a checkpoint folder or a training run folder")
    if (path / CONFIG_NAME).is_file():
        return path
    if (path / CHECKPOINTS_DIR).is_dir():
        # The pointer wins when valid: after a resume from an older step it names the live branch, while a
        # higher-numbered folder may be left over from the abandoned one.
        latest = _from_pointer(path)
        if latest is not None:
            return latest
        steps = step_checkpoints(path)
        if steps:
            return steps[-1][1]
        raise StemlmError(f"run folder {path} has no complete checkpoint yet under {path / CHECKPOINTS_DIR}")
    raise StemlmError(
        f"{path} is neither a checkpoint folder (no {CONFIG_NAME}) nor a run folder (no {CHECKPOINTS_DIR}/)"
    )


def _model_type(folder: Path) -> str | None:
    try:
        data = json.loads((folder / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data.get("model_type") if isinstance(data, dict) else None


def check_tokenizer_fits(tokens: int, rows: int, where: str | Path) -> None:
    """A checkpoint's tokenizer must cover its embedding rows: no id past the rows, and not far fewer tokens.

    Models pad the vocabulary (to a multiple of 64 or 128, or some reserved ids), so a few unused rows are
    normal; a tokenizer with over a quarter (and 1024) fewer tokens than the rows is another model's (a
    300-token tokenizer on 8192 rows generates garbage) and is refused.
    """
    if tokens > rows:
        raise StemlmError(
            f"checkpoint {where}: its tokenizer has {tokens} tokens but the model's vocab_size is {rows}; "
            "ids past the model vocabulary could not be embedded"
        )
    if rows - tokens > max(1024, rows // 4):
        raise StemlmError(
            f"checkpoint {where}: its tokenizer has {tokens} tokens but the model has {rows} embedding rows; "
            "the tokenizer belongs to another model (put the one it was trained with next to it)"
        )


def load_checkpoint(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    need_tokenizer: str | None = None,
) -> tuple[StemLM, Tokenizer | None]:
    """The model (in eval mode) and tokenizer (None if the folder has no tokenizer.json) of a CKPT argument.

    `need_tokenizer` names what the tokenizer is needed for; then a folder without one is a one-line error.
    """
    check_device(device)
    folder = resolve_checkpoint(path)
    if need_tokenizer and not (folder / TOKENIZER_NAME).is_file():
        raise StemlmError(
            f"{path} has no {TOKENIZER_NAME}; {need_tokenizer} needs the tokenizer the model was trained with"
        )
    model = from_pretrained(folder, device=device, dtype=dtype).eval()
    tokenizer = None
    if (folder / TOKENIZER_NAME).is_file():
        try:
            tokenizer = Tokenizer.from_file(str(folder / TOKENIZER_NAME))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise StemlmError(f"cannot read {folder / TOKENIZER_NAME}: {str(exc).splitlines()[0]}") from None
        check_tokenizer_fits(tokenizer.get_vocab_size(), model.config.vocab_size, folder)
    return model, tokenizer


def output_dir(path: str | Path, name: str) -> Path:
    """Where a command writes its files for a CKPT argument by default: RUN/<name> for a checkpoint of a
    training run, else <checkpoint folder>/<name> (never the working directory)."""
    folder = resolve_checkpoint(path)
    owner = folder.parent.parent if folder.parent.name == CHECKPOINTS_DIR else folder
    return owner / name


def checked_output(out: str | None, ckpt: str | None, name: str, producer: str, force: bool):
    """(folder, guard) of a command that writes a results folder: `out`, else `name` beside CKPT (`output_dir`;
    None without either), checked now, before any work, that `producer` may write it (`guard`: the
    `safe_write.AtomicFolder` arguments of the later write)."""
    from stemlm.checkpoint.safe_write import check_target

    folder = Path(out) if out else output_dir(ckpt, name) if ckpt is not None else None
    guard = {"producer": producer, "force": force, "sources": [ckpt] if ckpt else []}
    if folder is not None:
        check_target(folder, **guard)
    return folder, guard


def training_window(path: str | Path) -> int | None:
    """The sequence length the run of a CKPT argument trained (and evaluated) at, or None for a model folder
    without trainer state (a saved, converted or edited model)."""
    folder = resolve_checkpoint(path)
    try:
        state = json.loads((folder / "trainer_state.json").read_text())  # stemlm.train.state.STATE_NAME
        window = state["config"]["train"]["seq_len"]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        return None
    return window if isinstance(window, int) and window > 0 else None


def trained_fact_countries(path: str | Path) -> list[str] | str | None:
    """The fact-world countries the run of a CKPT argument mixed into its training text (a list of names, or a
    region name: `TrainConfig.fact_selection`), or None when it mixed none or has no trainer state."""
    folder = resolve_checkpoint(path)
    try:
        train = json.loads((folder / "trainer_state.json").read_text())["config"]["train"]
        mixed = train.get("data") is None and train.get("fact_fraction", 0) > 0
        return (list(train.get("fact_countries") or []) or train["fact_region"]) if mixed else None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        return None


def folder_bytes(path: str | Path) -> int:
    """Bytes of every file under `path` (a run folder's size on disk, as `du --apparent-size` counts it)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def from_pretrained(
    directory: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> StemLM:
    """The model of a checkpoint folder, a run folder (its newest checkpoint) or a Hugging Face Llama folder
    (as a dense model), checking every tensor against config.json. Weights are read from safetensors only."""
    directory = Path(directory)
    if (directory / CHECKPOINTS_DIR).is_dir() and not (directory / CONFIG_NAME).is_file():
        directory = resolve_checkpoint(directory)  # a run folder; anything else keeps load_config's messages
    config = load_config(directory)
    if _model_type(directory) == "llama":
        if not any(directory.glob("*.safetensors")) and any(directory.glob("pytorch_model*.bin")):
            raise StemlmError(
                f"{directory} holds only pickle weights (pytorch_model*.bin), which stemlm never loads; "
                f"re-save the model with safetensors ({WEIGHTS_NAME})"
            )
    state = read_state(directory, device)
    # Old Llama checkpoints stored each layer's RoPE frequencies; ours are recomputed from rope_theta.
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    with torch.device("meta"):
        model = StemLM(config)
    return fill_model(model, state, directory, device=device, dtype=dtype)


def fill_model(
    model: StemLM,
    state: dict[str, torch.Tensor],
    directory: str | Path,
    *,
    skip: set[str] = frozenset(),
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> StemLM:
    """Load `state` (read from `directory`) into a meta-device `model`, checking every tensor's name and shape
    against the model config.json implies. Names in `skip` (tables an offloaded loader keeps elsewhere) stay
    meta placeholders. Every loader of a model folder ends here, so they all refuse a mismatch alike."""
    tied = model.config.tie_word_embeddings
    state = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    expected = {k: v for k, v in model.state_dict().items() if k not in skip and not (tied and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensors (e.g. {unexpected[0]})")
        raise StemlmError(f"checkpoint {directory} does not match its config.json: {'; '.join(parts)}")
    for name, ref in expected.items():
        if tuple(state[name].shape) != tuple(ref.shape):
            raise StemlmError(
                f"checkpoint {directory}: tensor {name} has shape {list(state[name].shape)}, "
                f"config.json implies {list(ref.shape)}"
            )
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.reset_buffers(device)
    return model


def load_model_config(path: str | Path) -> ModelConfig:
    """A config from a checkpoint or run folder, or a JSON file (a model config, or {"model": {...}})."""
    p = Path(path)
    if p.is_dir() and (p / "run_config.json").is_file() and not (p / "config.json").is_file():
        p = p / "run_config.json"  # a training run folder: its resolved config (model section nested)
    elif p.is_dir():
        p = resolve_checkpoint(p) / "config.json"
    if not p.is_file():
        raise StemlmError(f"{path} is neither a config.json file nor a folder holding one")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StemlmError(f"{p} is not valid JSON ({exc})") from None
    if isinstance(data, dict) and isinstance(data.get("model"), dict) and "hidden_size" not in data:
        data = data["model"]  # a run config with the model section nested
    if not isinstance(data, dict):
        raise StemlmError(f"{p} does not hold a JSON object")
    try:
        return ModelConfig.from_dict(data)
    except TypeError as exc:
        raise StemlmError(f"{p} is not a stemlm model config ({exc})") from None


def named_model_config(
    preset: str | None = None, path: str | None = None, ffn: str | None = None, overrides=()
) -> tuple[str, ModelConfig]:
    """(name, config) of a named preset or of a config file / checkpoint folder (`load_model_config`), with the
    FFN kind `ffn` and `key=value` `overrides` applied (what `stemlm info` accounts for)."""
    from stemlm.model.presets import get_preset

    name, config = (preset, get_preset(preset)) if preset else (str(path), load_model_config(path))
    if ffn:
        config = config.replace(ffn=ffn)
    return name, config.with_overrides(list(overrides)) if overrides else config


def verify_checkpoint(path: str | Path) -> dict:
    """Re-hash every file a checkpoint folder's manifest records (a run folder: its newest checkpoint); the
    result of `safe_write.verify_folder` with the folder, or a one-line error naming the damaged files."""
    from stemlm.checkpoint.safe_write import verify_folder

    path = Path(path)
    folder = path if path.is_dir() and not (path / "checkpoints").is_dir() else resolve_checkpoint(path)
    result = {"folder": str(folder), **verify_folder(folder)}
    if not result["ok"]:
        bad = [f"{n} (changed)" for n in result["changed"]] + [f"{n} (missing)" for n in result["missing"]]
        raise StemlmError(f"{folder}: {len(bad)} of {result['files']} files fail verification: {', '.join(bad)}")
    return result


def export_model(ckpt: str | Path, out: str | Path, *, force: bool, producer: str, extra=None) -> dict:
    """Write a (sharded or plain) training checkpoint as a plain model folder at `out`, every file first
    re-hashed against the checkpoint's manifest; the summary `stemlm export --json` prints. `extra` adds
    files to the folder as `stemlm.checkpoint.folder.save_pretrained`'s does."""
    from stemlm.checkpoint.folder import save_pretrained
    from stemlm.checkpoint.safe_write import check_target, verify_folder
    from stemlm.checkpoint.sharded import sharded_metadata

    folder = resolve_checkpoint(ckpt)
    sources = (ckpt, folder)
    check_target(out, producer=producer, force=force, sources=sources)  # before any reading
    sharded = is_sharded(folder)
    if sharded:
        sharded_metadata(folder, verify=True)  # every file re-hashed against the manifest before anything is read
    elif Path(folder, "stemlm-manifest.json").is_file():
        result = verify_folder(folder)
        if not result["ok"]:
            bad = result["changed"] + result["missing"]
            raise StemlmError(f"{folder}: {len(bad)} files fail verification against its manifest: {', '.join(bad)}")
    model, tokenizer = load_checkpoint(folder)
    written = save_pretrained(model, out, tokenizer, force=force, sources=sources, producer=producer, extra=extra)
    return {
        "out": str(written),
        "source": str(folder),
        "sharded": sharded,
        "parameters": model.num_parameters(),
        "tokenizer": tokenizer is not None,
    }
