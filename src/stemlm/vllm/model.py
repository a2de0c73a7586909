"""`StemlmForCausalLM` for vLLM: a stemlm decoder (dense and STEM layers) built from vLLM's own layers.

Written against vLLM's model interface (`__init__(*, vllm_config, prefix)`, `forward(input_ids, positions,
intermediate_tensors, inputs_embeds)`, `embed_input_ids`, `compute_logits`, `load_weights`) with its parallel
layers, so tensor and pipeline parallelism, the paged KV cache, CUDA graphs and weight offload apply as they do to
vLLM's Llama:

    attention   QKVParallelLinear (heads split over TP ranks), vLLM's Attention, neox-style RoPE (`get_rope`,
                stemlm's `rotate_half`), RowParallelLinear o_proj
    dense FFN   MergedColumnParallelLinear gate|up, SiluAndMul, RowParallelLinear down_proj
    STEM FFN    ColumnParallelLinear gate_proj, the table U_l [vocab, d_ff / tp] (a vocabulary-indexed lookup,
                `F.embedding` of the input ids, no kernel of its own), RowParallelLinear down_proj
    norms       vLLM's RMSNorm (fp32 inside, the residual add fused as in its Llama)
    head        VocabParallelEmbedding, ParallelLMHead (tied when the config says so), LogitsProcessor

The STEM table is split along d_ff, as the official STEM code splits it: rank r holds columns
[r·d_ff/tp, (r+1)·d_ff/tp) of every row, the same slice of d_ff its gate_proj shard produces, so the elementwise
product needs nothing from other ranks and down_proj's one all-reduce (the dense FFN's) is all the layer
communicates. Replicating the table instead would cost tp× its memory and save nothing.

Tables in host memory are vLLM's UVA weight offload selected by name (`cpu_offload_gb` with
`cpu_offload_params={"stem_embedding"}`): each layer's table moves to pinned host memory and the device keeps a UVA
view of it, so the lookup reads only the rows of the step's tokens over PCIe (docs/vllm.md).

Kinds other than dense and STEM are refused at load with the reason (`stemlm.vllm.kinds`), and so is `--quantization`.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader, sharded_weight_loader
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.model_executor.utils import set_weight_attrs
from vllm.sequence import IntermediateTensors

from stemlm.model.config import ModelConfig
from stemlm.vllm.kinds import check_servable, rope_parameters

# checkpoint name -> (the merged vLLM parameter, its shard): q/k/v and a dense layer's gate/up are one matrix here
STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"))
STACKED += ((".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))


class DenseMLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj x) * up_proj x), gate and up one column-parallel product."""

    def __init__(self, hidden: int, ffn: int, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [ffn] * 2, bias=False, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(ffn, hidden, bias=False, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        y, _ = self.gate_up_proj(x)
        y, _ = self.down_proj(self.act_fn(y))
        return y


class TokenTable(nn.Module):
    """A [vocab, width / tp] table read by token id: this rank's column slice of the checkpoint's table (loaded by
    narrowing dim 1), so the vocabulary stays whole on every rank and no rank asks another for a row."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, width // get_tensor_model_parallel_world_size()), False)
        set_weight_attrs(self.weight, {"weight_loader": sharded_weight_loader(1)})

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # a gather of the rows; through UVA when offloaded to the host


class StemMLP(nn.Module):
    """STEM: down_proj(silu(gate_proj x) * U[t]), U split along d_ff like gate_proj's output (see the module doc)."""

    def __init__(self, vocab: int, hidden: int, ffn: int, prefix: str) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, ffn, bias=False, prefix=f"{prefix}.gate_proj")
        self.down_proj = RowParallelLinear(ffn, hidden, bias=False, prefix=f"{prefix}.down_proj")
        self.stem_embedding = TokenTable(vocab, ffn)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        gate, _ = self.gate_proj(x)
        up = self.stem_embedding(input_ids)  # this rank's d_ff slice of U[t]
        y, _ = self.down_proj(F.silu(gate) * up.to(gate.dtype))
        return y


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
        d, f = config.hidden_size, config.intermediate_size
        if config.layer_ffn(layer_idx) == "stem":
            self.mlp = StemMLP(config.vocab_size, d, f, f"{prefix}.mlp")
        else:
            self.mlp = DenseMLP(d, f, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, eps=config.rms_norm_eps)

    def forward(self, positions, hidden, residual, input_ids):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, input_ids), residual


@support_torch_compile(
    dynamic_arg_dims={
        name: {0: "tokens"} for name in ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")
    }
)
class StemlmModel(nn.Module):
    """vLLM's `model.` prefix: embeddings, the layers of this pipeline stage, the final norm."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = check_servable(vllm_config.model_config.hf_config)
        if vllm_config.quant_config is not None:  # the layers take none, so it would be silently ignored
            raise ValueError(
                "stemlm's vLLM plugin serves unquantised weights only (fp32, bf16, fp16): drop --quantization"
            )
        self.has_tables = bool(config.special_layers) and config.ffn == "stem"
        pp = get_pp_group()
        if pp.is_first_rank or (config.tie_word_embeddings and pp.is_last_rank):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: StemlmDecoderLayer(config, vllm_config, prefix),
            prefix=f"{prefix}.layers",
        )
        if pp.is_last_rank:
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if input_ids is None and self.has_tables:
            raise ValueError(
                "a STEM model reads its tables by input token id at every layer: it cannot run from prompt "
                "embeddings alone (inputs_embeds without input_ids)"
            )
        if get_pp_group().is_first_rank:
            hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            hidden, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden, residual = layer(positions, hidden, residual, input_ids)
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
