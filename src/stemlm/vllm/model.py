"""`StemlmForCausalLM` for vLLM: a stemlm decoder (dense, STEM, n-gram STEM, Engram) built from vLLM's own layers.

Written against vLLM's model interface (`__init__(*, vllm_config, prefix)`, `forward(input_ids, positions,
intermediate_tensors, inputs_embeds)`, `embed_input_ids`, `compute_logits`, `load_weights`) with its parallel
layers, so tensor and pipeline parallelism, the paged KV cache, CUDA graphs and weight offload apply as they do to
vLLM's Llama:

    attention   QKVParallelLinear (heads split over TP ranks), vLLM's Attention, neox-style RoPE (`get_rope`,
                stemlm's `rotate_half`), RowParallelLinear o_proj
    FFN         per layer, by kind (stemlm.vllm.ffn): dense SwiGLU, STEM's table lookup, n-gram STEM, Engram
    norms       vLLM's RMSNorm (fp32 inside, the residual add fused as in its Llama)
    head        VocabParallelEmbedding, ParallelLMHead (tied when the config says so), LogitsProcessor

The STEM table is split along d_ff, as the official STEM code splits it: rank r holds columns
[r·d_ff/tp, (r+1)·d_ff/tp) of every row, the same slice of d_ff its gate_proj shard produces, so the elementwise
product needs nothing from other ranks and down_proj's one all-reduce (the dense FFN's) is all the layer
communicates. Replicating the table instead would cost tp× its memory and save nothing.

The n-gram kinds read earlier positions of each request (their hashed ids, Engram's conv inputs), which vLLM's step
does not carry: the model keeps them per KV slot (stemlm.vllm.history) and hashes the ids once per step for every
layer (stemlm's `ngram_hasher`). That bookkeeping is host-side indexing, so such a model runs eagerly (torch.compile
is off for it, and on a GPU it needs `--enforce-eager`).

Tables in host memory are vLLM's UVA weight offload selected by name (`cpu_offload_gb` with
`cpu_offload_params={"stem_embedding"}`, or `ngram_embedding` / `engram_embedding`): each selected table moves to
pinned host memory and the device keeps a UVA view of it, so a lookup reads only the rows of the step's tokens over
PCIe (docs/vllm.md).

The kinds vLLM does not serve are refused at load with the reason they declare (`stemlm.vllm.kinds`), and so is
`--quantization`.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from stemlm.model.config import ModelConfig
from stemlm.model.kinds.engram import is_reference
from stemlm.model.kinds.registry import get_kind
from stemlm.model.ngram import ngram_hasher
from stemlm.model.ngram_layout import ngram_kind
from stemlm.vllm.ffn import DenseMLP, EngramBranchStep, EngramMLP, StemMLP, StemNgramMLP, Tokens
from stemlm.vllm.history import SlotStore, lookback
from stemlm.vllm.kinds import check_servable, dtype_note, rope_parameters

logger = init_logger(__name__)

# checkpoint name -> (the merged vLLM parameter, its shard): q/k/v and a dense layer's gate/up are one matrix here
STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"))
STACKED += ((".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))


class StemlmAttention(nn.Module):
    def __init__(self, config: ModelConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        heads, kv_heads, self.head_dim = config.num_attention_heads, config.kv_heads, config.head_size
        if heads % tp or (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
            raise ValueError(f"tensor_parallel_size={tp} does not split {heads} query / {kv_heads} key-value heads")
        self.q_size = heads // tp * self.head_dim
        self.kv_size = max(1, kv_heads // tp) * self.head_dim
        d = config.hidden_size
        self.qkv_proj = QKVParallelLinear(d, self.head_dim, heads, kv_heads, bias=False, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(heads * self.head_dim, d, bias=False, prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            is_neox_style=True,  # stemlm rotates halves (HF Llama's rotate_half), not interleaved pairs
            rope_parameters=rope_parameters(config),
        )
        self.attn = Attention(
            heads // tp,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=max(1, kv_heads // tp),
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class StemlmDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        layer_idx = extract_layer_index(prefix)
        self.self_attn = StemlmAttention(config, vllm_config, f"{prefix}.self_attn")
        d, f, kind = config.hidden_size, config.intermediate_size, config.layer_ffn(layer_idx)
        if kind == "stem":
            self.mlp = StemMLP(config.vocab_size, d, f, f"{prefix}.mlp")
        elif kind == "stem_ngram":
            self.mlp = StemNgramMLP(config, f"{prefix}.mlp")
        elif kind == "engram":
            self.mlp = EngramMLP(config, layer_idx, f"{prefix}.mlp")
        else:
            self.mlp = DenseMLP(d, f, f"{prefix}.mlp")
        # the layer's Engram branch, of its FFN kind or beside another kind (`engram_layers`; one per layer), added
        # to the FFN output (stemlm's variant) or to the residual stream before attention (the reference variant)
        self.engram: list[EngramBranchStep] = [self.mlp.step] if kind == "engram" else []
        if "engram" in config.layer_sides(layer_idx):
            self.beside = nn.ModuleDict({"engram": EngramBranchStep(config, layer_idx)})
            self.engram = [self.beside["engram"]]
        self.engram_on_residual = bool(self.engram) and is_reference(config)
        self.input_layernorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, eps=config.rms_norm_eps)

    def forward(self, positions, hidden, residual, tokens: Tokens):
        if self.engram_on_residual:  # the stream whole (x), plus the branch of x, then the unfused norm
            x = hidden if residual is None else hidden + residual
            residual = x + self.engram[0].branch(x, tokens)
            hidden = self.input_layernorm(residual)
        elif residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        out = self.mlp(hidden, tokens)
        if self.engram and not self.engram_on_residual:
            out = self.engram[0].branch(hidden, tokens, out)
        return out, residual


def reads_history(vllm_config: VllmConfig) -> bool:
    """Whether the model has n-gram layers, which read earlier positions (see the module doc)."""
    return ngram_hasher(vllm_config.model_config.hf_config.to_model_config()) is not None


@support_torch_compile(
    dynamic_arg_dims={
        name: {0: "tokens"} for name in ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")
    },
    enable_if=lambda vllm_config: not reads_history(vllm_config),
)
class StemlmModel(nn.Module):
    """vLLM's `model.` prefix: embeddings, the layers of this pipeline stage, the final norm."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = vllm_config.model_config.hf_config
        config = check_servable(hf_config)
        # a folder written before torch_dtype was recorded holds fp32 weights: stemlm saved nothing else
        note = dtype_note(getattr(hf_config, "dtype", None) or torch.float32, vllm_config.model_config.dtype)
        if note:
            logger.warning(note)
        if vllm_config.quant_config is not None:  # the layers take none, so it would be silently ignored
            raise ValueError(
                "stemlm's vLLM plugin serves unquantised weights only (fp32, bf16, fp16): drop --quantization"
            )
        kinds = {get_kind(name) for i in range(config.num_hidden_layers) for name in config.layer_kinds(i)}
        self.reads_ids = any(kind.reads_input_ids() for kind in kinds)
        self.hasher = ngram_hasher(config)
        if self.hasher is not None and current_platform.is_cuda_alike() and not vllm_config.model_config.enforce_eager:
            raise ValueError(
                f"a model with {ngram_kind(config).name} layers reads earlier positions through host-side indexing "
                "each step, which CUDA graphs would freeze: pass --enforce-eager"
            )
        self.block_size = vllm_config.cache_config.block_size
        pp = get_pp_group()
        if pp.is_first_rank or (config.tie_word_embeddings and pp.is_last_rank):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: StemlmDecoderLayer(config, vllm_config, prefix),
            prefix=f"{prefix}.layers",
        )
        if self.hasher is not None:
            # positions back a step reads: the n-grams' ids, and the Engram convs' (kernel - 1) · dilation inputs
            layers = islice(self.layers, self.start_layer, self.end_layer)
            convs = [branch.context for layer in layers for branch in layer.engram]
            self.depth = max([self.hasher.context, *convs])
            self.seen_ids = SlotStore((), torch.long, -1)  # the input id of every kept position, by KV slot
        if pp.is_last_rank:
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def step_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Tokens:
        """The step's `Tokens`: the ids, and for an n-gram model their hashed ids over each request's earlier ids."""
        if self.hasher is None:
            return Tokens(input_ids)
        metadata = get_forward_context().attn_metadata if is_forward_context_available() else None
        if isinstance(metadata, dict):
            metadata = metadata.get(self.layers[self.start_layer].self_attn.attn.layer_name)
        look = lookback(metadata, positions, self.depth, self.block_size)
        earlier = look.gather(input_ids, self.seen_ids)[:, : self.hasher.context]  # ids at p-1, p-2, ...
        self.seen_ids.write(look.write, input_ids)
        ngram_ids = self.hasher.ids(input_ids[:, None], earlier.flip(1))  # each token a row: [N, 1, K]
        ngram_ids = {k: v[:, 0] for k, v in ngram_ids.items()} if isinstance(ngram_ids, dict) else ngram_ids[:, 0]
        return Tokens(input_ids, ngram_ids, look)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if input_ids is None and self.reads_ids:
            raise ValueError(
                "this model reads tables by input token id (STEM, n-gram keys): it cannot run from prompt "
                "embeddings alone (inputs_embeds without input_ids)"
            )
        tokens = self.step_tokens(input_ids, positions)
        if get_pp_group().is_first_rank:
            hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            hidden, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden, residual = layer(positions, hidden, residual, tokens)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors (stemlm's names, HF Llama's) into the merged and sharded parameters; returns the names
        loaded. A STEM layer's gate_proj is its own parameter, so it is merged only where gate_up_proj exists."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            for merged, part, shard in STACKED:
                target = name.replace(part, merged)
                if part in name and target in params:
                    param = params[target]
                    param.weight_loader(param, tensor, shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:  # a layer of another pipeline stage
                    continue
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        return loaded


class StemlmForCausalLM(nn.Module, SupportsPP):
    """The architecture stemlm's config.json names (`architectures: ["StemlmForCausalLM"]`)."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    # vLLM's loader reads every *.safetensors of the folder unless the model names its files: a checkpoint that
    # `stemlm train` writes keeps optimizer.safetensors (the training state) beside the weights, which are
    # model.safetensors or its shards model-0000k-of-0000n.safetensors (stemlm.checkpoint.folder)
    allow_patterns_overrides = ["model.safetensors", "model-*-of-*.safetensors"]

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = StemlmModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # a tied head is the embedding's parameter, so its one tensor (model.embed_tokens.weight) loads both
        return AutoWeightsLoader(self).load_weights(weights)
