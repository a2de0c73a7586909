"""Import a Llama-architecture GGUF file (llama.cpp's format) as a Hugging Face Llama folder.

    stemlm convert --from-gguf SmolLM2-135M-Instruct.Q4_1.gguf --out ckpt/smollm2
    from stemlm.convert.gguf import convert_gguf; convert_gguf("model.gguf", "ckpt/smollm2")

The folder holds `config.json` (model_type "llama"), `model.safetensors` (fp32), `tokenizer.json`,
`tokenizer_config.json` (special tokens and the GGUF's chat template) and `generation_config.json`, so it loads
in `transformers.AutoModelForCausalLM` / `AutoTokenizer` as it is and in stemlm through the Llama loader
(`stemlm.checkpoint.from_pretrained` reads it; every stemlm command taking a CKPT accepts it).

Reading: the `gguf` package parses the file and dequantises each tensor with its own `gguf.quants.dequantize`
(F32, F16, BF16, Q8_0, Q4_0, Q4_1 and every other type that function knows; anything else is refused naming
the tensor and its type). GGUF stores shapes fastest-dimension first, so a dequantised [ne1, ne0] array is
already the PyTorch [out, in] weight. llama.cpp's converter permutes the rows of Q and K from HF's
"rotate-half" layout to interleaved pairs (per head: rows 0,d/2,1,d/2+1,...); `unpermute_qk` inverts that.
The tokenizer is rebuilt from the GGUF's BPE vocabulary and merges with HF `tokenizers` (byte-level, with the
pre-tokenizer llama.cpp names in `tokenizer.ggml.pre`); CONTROL and USER_DEFINED tokens become special tokens.

The file is untrusted: every metadata value, the tokenizer and every tensor's shape are checked against each other
(`stemlm.convert.gguf_checks`) and every weight for NaN / Inf before anything is written; the chat template is
copied as text and only ever rendered in `stemlm.inference.template_sandbox`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stemlm.checkpoint.folder import CONFIG_NAME, WEIGHTS_NAME, AtomicFolder, write_json
from stemlm.checkpoint.safe_write import check_target
from stemlm.convert.gguf_checks import check_tensors, check_tokenizer, integer, number, read_metadata, string, token_id
from stemlm.errors import StemlmError
from stemlm.paths import input_file

# GGUF tensor names (after "blk.N.") -> HF Llama names (after "model.layers.N.").
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp's pre-tokenizer names -> (split digits one by one first, GPT-2 regex) as in llama-vocab.cpp.
PRE_TOKENIZERS = {"default": False, "gpt2": False, "smollm": True, "starcoder": True, "refact": True}
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType values


def _gguf():
    try:
        import gguf
    except ImportError:
        raise StemlmError("reading GGUF files needs the `gguf` package: pip install 'stemlm[gguf]'") from None
    return gguf


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` for `path`, with a one-line error for a missing or malformed file."""
    path = input_file(path, "GGUF file")
    gguf = _gguf()
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError / struct errors / KeyError on garbage
        detail = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise StemlmError(f"{path} is not a readable GGUF file: {detail}") from None


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a Q or K weight [n_heads * head_dim, d] (interleaved -> rotate-half)."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def dequantize(tensor) -> torch.Tensor:
    """One GGUF tensor as an fp32 torch tensor in PyTorch layout, or a StemlmError naming an unsupported type."""
    gguf = _gguf()
    qtype = tensor.tensor_type
    try:
        array = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise StemlmError(
            f"tensor {tensor.name} uses GGUF type {qtype.name}, which the gguf package cannot dequantise"
        ) from None
    shape = tuple(int(n) for n in reversed(tensor.shape))
    try:
        return torch.from_numpy(np.array(array, dtype=np.float32, copy=True).reshape(shape))
    except ValueError:  # the data the header points at does not hold shape's values
        raise StemlmError(f"GGUF tensor {tensor.name}: its data does not hold its shape {list(shape)}") from None


def check_type(tensor) -> None:
    """Refuse, before any tensor is read, one whose GGUF type the `gguf` package cannot dequantise."""
    gguf = _gguf()
    qtype = tensor.tensor_type
    empty = np.zeros((0, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    try:
        gguf.quants.dequantize(empty, qtype)
    except NotImplementedError:
        raise StemlmError(
            f"tensor {tensor.name} uses GGUF type {qtype.name}, which the gguf package cannot dequantise"
        ) from None
    except ValueError:
        pass  # a block type, which a zero-row array cannot reshape: it is implemented


def llama_config(meta: dict[str, Any], vocab_size: int, tied: bool) -> dict[str, Any]:
    """The HF Llama config.json dict described by the GGUF metadata, every value checked (`gguf_checks`)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise StemlmError(f"GGUF architecture is {arch!r}; only 'llama' files can be imported")
    hidden, heads = integer(meta, "llama.embedding_length"), integer(meta, "llama.attention.head_count")
    kv_heads = integer(meta, "llama.attention.head_count_kv", heads)
    if "llama.attention.key_length" in meta:
        head_dim = integer(meta, "llama.attention.key_length")
    elif hidden % heads:
        raise StemlmError(
            f"GGUF metadata llama.attention.head_count {heads} does not divide llama.embedding_length {hidden}"
        )
    else:
        head_dim = hidden // heads
    if head_dim % 2:
        raise StemlmError(f"GGUF head dimension {head_dim} (llama.attention.key_length) must be even for RoPE")
    if heads % kv_heads:
        raise StemlmError(
            f"GGUF metadata llama.attention.head_count_kv {kv_heads} does not divide attention.head_count {heads}"
        )
    if integer(meta, "llama.attention.value_length", head_dim) != head_dim:
        raise StemlmError("GGUF metadata llama.attention.value_length differs from key_length; not a Llama")
    eps = number(meta, "llama.attention.layer_norm_rms_epsilon")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": integer(meta, "llama.feed_forward_length"),
        "num_hidden_layers": integer(meta, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": integer(meta, "llama.context_length"),
        # GGUF stores eps as float32 (1e-5 reads 9.9999997e-06); 7 significant digits recover the written value.
        "rms_norm_eps": float(f"{eps:.7g}"),
        "rope_theta": number(meta, "llama.rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
    }
    scaling = string(meta, "llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise StemlmError(f"GGUF RoPE scaling type {scaling!r} is not supported by the importer")
    for name in ("bos", "eos", "padding"):
        index = token_id(meta, f"tokenizer.ggml.{name}_token_id", vocab_size)
        if index is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = index
    return config


def _layer_name(name: str) -> str:
    if name == "rope_freqs.weight":
        raise StemlmError("GGUF holds rope_freqs (Llama-3 RoPE scaling factors), which the importer refuses")
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    raise StemlmError(f"GGUF tensor {name!r} has no Llama counterpart; the file is not a plain Llama model")


def llama_state(
    reader, config: dict[str, Any], allow_nonfinite: bool = False, progress: bool = False
) -> dict[str, torch.Tensor]:
    """HF Llama state dict (fp32) from the GGUF tensors, Q/K rows restored to HF order; a tensor holding NaN or
    Inf is refused unless `allow_nonfinite`. `progress`: a bar on stderr, one step per tensor (`stemlm.progress`)."""
    from stemlm.progress import bar

    state = {}
    for tensor in bar(reader.tensors, progress=progress, desc="dequantise", unit="tensor"):
        name = _layer_name(tensor.name)
        weight = dequantize(tensor)
        if not allow_nonfinite and not bool(torch.isfinite(weight).all()):
            raise StemlmError(f"GGUF tensor {tensor.name} holds NaN or Inf values; --allow-nonfinite imports it anyway")
        if name.endswith("q_proj.weight"):
            weight = unpermute_qk(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = unpermute_qk(weight, config["num_key_value_heads"])
        state[name] = weight
    return state


def build_tokenizer(meta: dict[str, Any]):
    """A HF `tokenizers.Tokenizer` equal to the GGUF's byte-level BPE (vocabulary, merges, special tokens)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise StemlmError(f"GGUF tokenizer model is {kind!r}; only byte-level BPE ('gpt2') can be rebuilt")
    pre = string(meta, "tokenizer.ggml.pre", "default")
    tokens, types, merges = check_tokenizer(meta)
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=merges,
        fuse_unk=False,
        ignore_merges=pre == "llama-bpe",  # Llama 3's tokenizer.json sets it; GPT-2-style files do not
    )
    tok = Tokenizer(bpe)
    if pre == "llama-bpe":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in PRE_TOKENIZERS:
        steps = [pre_tokenizers.Digits(individual_digits=True)] if PRE_TOKENIZERS[pre] else []
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    else:
        known = ", ".join(sorted([*PRE_TOKENIZERS, "llama-bpe"]))
        raise StemlmError(f"GGUF pre-tokenizer {pre!r} is not supported (known: {known})")
    tok.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, types, strict=True))
    special = [AddedToken(t, special=True, normalized=False) for t, k in typed if k == CONTROL]
    user = [AddedToken(t, normalized=False) for t, k in typed if k == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    bos_id = token_id(meta, "tokenizer.ggml.bos_token_id", len(tokens))
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(meta: dict[str, Any], context_length: int) -> dict[str, Any]:
    """tokenizer_config.json for `transformers.AutoTokenizer`: special tokens and the chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context_length,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    for name, field in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        index = token_id(meta, f"tokenizer.ggml.{field}_token_id", len(tokens))
        if index is not None:
            config[f"{name}_token"] = tokens[index]
    template = string(meta, "tokenizer.chat_template")
    if template:  # stored as given: it is untrusted text, rendered only in stemlm.inference.template_sandbox
        config["chat_template"] = template
    return config


def convert_gguf(
    path: str | Path, out: str | Path, *, force: bool = False, allow_nonfinite: bool = False, progress: bool = False
) -> Path:
    """Write the Llama GGUF at `path` as a Hugging Face Llama folder at `out` (refused if `out` holds files).

    Everything is read and checked (metadata, tokenizer, every tensor's shape and values) before `out` is
    touched; weights holding NaN or Inf are refused unless `allow_nonfinite`. `progress`: a bar per tensor."""
    from safetensors.torch import save_file

    out = Path(out)
    guard = {"producer": "stemlm convert --from-gguf", "force": force, "sources": [path]}
    check_target(out, **guard)  # refused if `out` holds files, unless an earlier import and --force
    reader = open_gguf(path)
    meta = read_metadata(reader)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    if len(shapes) != len(reader.tensors):
        raise StemlmError(f"{path} lists a tensor name twice")
    for tensor in reader.tensors:
        check_type(tensor)
        _layer_name(tensor.name)  # every tensor must have a Llama counterpart
    if "token_embd.weight" not in shapes:
        raise StemlmError(f"{path} has no token_embd.weight tensor; not a Llama model file")
    tokenizer = build_tokenizer(meta)
    tokens = meta["tokenizer.ggml.tokens"]  # checked by build_tokenizer
    tied = "output.weight" not in shapes
    config = llama_config(meta, vocab_size=len(tokens), tied=tied)
    check_tensors(shapes, config, tied)
    state = llama_state(reader, config, allow_nonfinite, progress)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    with AtomicFolder(out, **guard) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        write_json(tmp / CONFIG_NAME, config)
        write_json(tmp / "generation_config.json", generation)
        write_json(tmp / "tokenizer_config.json", tokenizer_config(meta, config["max_position_embeddings"]))
        tokenizer.save(str(tmp / "tokenizer.json"))
    return out


def summary(out: str | Path) -> dict[str, Any]:
    """The written config as a dict (for the CLI's --json)."""
    return json.loads((Path(out) / CONFIG_NAME).read_text())
