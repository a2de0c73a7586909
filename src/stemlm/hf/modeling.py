"""`StemlmForCausalLM`: a Hugging Face `PreTrainedModel` + `GenerationMixin` around our `StemLM`, by composition.

The wrapper owns a `StemLM` and registers that model's own `model` and `lm_head` modules as its children, so
its parameter names are exactly the checkpoint names (`model.layers.0.mlp.stem_embedding.weight`, ...) and
`from_pretrained` / `save_pretrained` / `generate` work on a stemlm folder as on any HF model. `forward` runs
`StemLM.forward`; nothing of the decoder is re-implemented here.

transformers 5 points handled here:
- the KV cache: `generate` hands `forward` an HF `Cache` (a `DynamicCache` by default) as `cache` (the old
  name `past_key_values` is still accepted, with transformers' deprecation warning). `_HFCacheView` presents it
  through the two members our attention uses, so HF keeps owning the cache (beam reordering, cropping) and our
  attention code stays unchanged.
  Static (pre-allocated) caches are refused: our attention has no mask over unused cache slots. Beam search
  reorders the cache through `_reorder_cache`, which reorders the kinds' decoding state (n-gram ids, Engram
  conv inputs) with the keys and values.
- weights: `_init_weights` runs only on modules whose tensors were not loaded (HF's `_is_hf_initialized` flag,
  honoured by `transformers.initialization`), gives each parameter the std of `StemLM.init_specs` (tables by
  `table_init`, norms ones, everything else normal(initializer_range), a kind's own `init_stds`), and always
  recomputes the unsaved buffers (RoPE frequencies, hash-MoE assignment), which HF's loader leaves as
  uninitialised memory.
- `_tied_weights_keys` is a dict {target: source}; HF ties only when `config.tie_word_embeddings` is set.
- outputs as HF Llama gives them: `output_hidden_states` (keyword or config) returns the embeddings and every
  layer's output, the last after the final norm; `output_attentions` (keyword or config) returns each layer's
  weights from a math attention (`stemlm.model.attention.math_attention`) run for that call, as
  `attn_implementation="eager"` does for every call; otherwise attention is SDPA and the forward is stemlm's
  default one. Unset flags (`use_cache`, `return_dict`, ...) are read from the config; `return_dict=False` gives
  the tuple.
- activation checkpointing: the decoder layers are transformers' `GradientCheckpointingLayer`s (`StemlmDecoderLayer`,
  stemlm's `DecoderLayer` with that base: the model package does not import transformers), so
  `activation_checkpointing_enable()` (or its deprecated name `gradient_checkpointing_enable()`) flags each layer,
  the layer checkpoints its own forward, and `is_activation_checkpointing` reads the flags, as for Llama.
- `resize_token_embeddings`: transformers resizes `embed_tokens` / `lm_head`, `stemlm.model.resize` the kinds'
  tables, maps and hashes; tied embeddings stay tied.
- EOS: a folder whose config.json names no `eos_token_id` takes its tokenizer.json's `<|endoftext|>` id
  (`from_pretrained`), the id `stemlm generate` stops on; `save_pretrained` writes it to generation_config.json.
- `inputs_embeds` replaces `embed_tokens`; without `input_ids` only when no layer's kind reads the ids
  (`Kind.reads_input_ids` is false for all of them), since the others index tables or route by them.
  `generate(input_ids, inputs_embeds=...)` keeps the prompt's ids beside its embeddings for that reason.
- labels follow HF: `labels` are the input ids (-100 = ignore), shifted by one here; `loss` is that mean
  cross-entropy plus `config.router_aux_loss_coef` · `aux_loss`, the summed MoE balancing (and z) losses,
  which is also returned on its own as `aux_loss` (None for kinds without a router).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.utils.deprecation import deprecate_kwarg

from stemlm.errors import StemlmError
from stemlm.hf.configuration import StemlmConfig
from stemlm.model.attention import KVCache
from stemlm.model.decoder import DecoderLayer, ForwardOptions, StemLM
from stemlm.model.decoding_state import reorder_decoding_state
from stemlm.model.ffn import EMBED
from stemlm.model.kinds.registry import Fill, Uniform, get_kind
from stemlm.model.resize import resize_vocabulary


@dataclass
class StemlmCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus the MoE auxiliary loss (already included in `loss` with its coefficient)."""

    aux_loss: torch.Tensor | None = None


class _HFCacheView:
    """An HF `Cache` seen through our `KVCache` interface (`length`, `update(layer_idx, k, v)`)."""

    def __init__(self, cache) -> None:
        if getattr(cache, "is_compileable", False):
            raise StemlmError(
                f"{type(cache).__name__} is a static (pre-allocated) cache, which stemlm models do not support; "
                "use the default dynamic cache (do not set cache_implementation)"
            )
        self.cache = cache

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(k, v, layer_idx)


class StemlmDecoderLayer(DecoderLayer, GradientCheckpointingLayer):
    """stemlm's decoder layer as a transformers `GradientCheckpointingLayer`: the same module, parameters and forward,
    which recomputes itself in the backward pass once `activation_checkpointing_enable()` has set its flag. The
    wrapper gives each layer of the `StemLM` it wraps this class (`_build_lm`), so the names stay the checkpoint's.
    `StemLM.forward` passes the cache positionally, where transformers does not clear it: `_run` turns caching off
    while the layers are checkpointed instead."""


class StemlmPreTrainedModel(PreTrainedModel):
    """What the base model and the causal LM share: the config class, the weight init and the forward's inputs."""

    config_class = StemlmConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["StemlmDecoderLayer"]
    _supports_sdpa = True  # our attention always runs scaled_dot_product_attention
    supports_gradient_checkpointing = True  # each StemlmDecoderLayer checkpoints itself

    def _build_lm(self, config: StemlmConfig, lm: StemLM | None) -> StemLM:
        if getattr(config, "stemlm_table_storage", None):  # transformers would load int8 codes as float weights
            raise StemlmError(
                "this checkpoint stores its tables compactly (stemlm convert --table-dtype); transformers cannot "
                "read that layout: load it with stemlm, or write a plain copy with stemlm export CKPT --out DIR"
            )
        lm = lm if lm is not None else StemLM(config.to_model_config())
        for layer in lm.model.layers:
            if type(layer) is DecoderLayer:
                layer.__class__ = StemlmDecoderLayer  # a subclass adding only transformers' checkpointing
        # Kept outside the module tree (plain attribute) so its parameters are registered once, under the
        # wrapper's `model.` / `lm_head.` names, which are the checkpoint names.
        object.__setattr__(self, "_lm", lm)
        return lm

    @property
    def stem(self) -> StemLM:
        """The wrapped stemlm model (shares every parameter with this wrapper)."""
        return self._lm

    # ----- initialisation -----
    def _init_weights(self, module: nn.Module) -> None:
        # Mirrors StemLM.init_weights; HF calls this only for modules with tensors that were not loaded, and
        # `transformers.initialization` skips the loaded tensors of a partly loaded module.
        if hasattr(module, "reset_buffers"):
            # Derived, unsaved buffers (RoPE, hash assignment): always recomputed, whatever the loader left there.
            buffer = next(module.buffers(recurse=False), None)
            if buffer is not None and buffer.device.type != "meta":
                module.reset_buffers(buffer.device)
        # The std StemLM.init_weights gives each parameter (tables by table_init, norms and std None: ones, a
        # module's own init_stds, else initializer_range): read from the model, so no kind is named here.
        stds = {id(param): std for _, param, std in self._lm.init_specs()}
        for param in module.parameters(recurse=False):
            std = stds.get(id(param))
            if std is None and id(param) in stds:
                init.ones_(param)
            elif isinstance(std, Fill):
                init.constant_(param, std.value)
            elif isinstance(std, Uniform):
                init.uniform_(param, -std.bound, std.bound)
            elif std is not None:
                init.normal_(param, std=std)

    def _resize_token_embeddings(self, new_num_tokens, pad_to_multiple_of=None, mean_resizing=True):
        # transformers resizes embed_tokens and lm_head (its mean-resizing); every other table, map and hash that
        # vocab_size shapes follows through stemlm.model.resize, which reads them from the kinds.
        embeddings = super()._resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        resize_vocabulary(self._lm, embeddings.num_embeddings)
        return embeddings

    def _run(self, input_ids, inputs_embeds, attention_mask, position_ids, cache, flags, labels=None, head=True):
        """`StemLM.forward` on HF's arguments; `flags` are the (use_cache, output_attentions, output_hidden_states)
        already resolved against the config. Returns stemlm's output and the HF cache to hand back."""
        use_cache, output_attentions, output_hidden_states = flags
        layers = self._lm.model.layers
        if self.training and torch.is_grad_enabled() and any(getattr(m, "gradient_checkpointing", 0) for m in layers):
            # Recomputing a layer would append its keys and values to the cache again (transformers' layers drop
            # a cache passed by keyword the same way).
            use_cache, cache = False, None
        input_ids, embed_rows = self._inputs(input_ids, inputs_embeds)
        if cache is not None and not isinstance(cache, KVCache):
            cache = _HFCacheView(cache)
        if cache is None and use_cache:
            cache = _HFCacheView(DynamicCache())
        out = self._lm(
            input_ids,
            labels=labels,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            rows=None if embed_rows is None else {EMBED: embed_rows},
            options=ForwardOptions(
                hidden_states=bool(output_hidden_states),
                # "eager" (attn_implementation="eager") runs the math attention even when the weights are not asked
                # for.
                attentions=bool(output_attentions) or self.config._attn_implementation == "eager",
                head=head,
            ),
        )
        return out, (cache.cache if isinstance(cache, _HFCacheView) else cache)

    def _flags(self, use_cache, output_attentions, output_hidden_states, return_dict):
        """The flags a caller left None, read from the config as transformers does."""
        config = self.config
        return (
            (config.use_cache if use_cache is None else use_cache),
            (config.output_attentions if output_attentions is None else output_attentions),
            (config.output_hidden_states if output_hidden_states is None else output_hidden_states),
        ), (config.return_dict if return_dict is None else return_dict)

    def _inputs(self, input_ids, inputs_embeds):
        """(input_ids, embed_rows) for `StemLM.forward` from HF's pair of alternatives."""
        if inputs_embeds is None:
            if input_ids is None:
                raise StemlmError("pass input_ids (or inputs_embeds, for kinds that do not read token ids)")
            return input_ids, None
        if input_ids is None:
            config = self._lm.config
            readers = sorted(
                {
                    f
                    for i in range(config.num_hidden_layers)
                    for f in config.layer_kinds(i)
                    if get_kind(f).reads_input_ids()
                }
            )
            if readers:
                raise StemlmError(
                    f"inputs_embeds without input_ids: ffn={','.join(readers)} reads the token ids (its tables or "
                    "routing are indexed by them); pass input_ids too"
                )
            # No layer reads the ids, so zeros stand in for them: they only give the forward its shape.
            input_ids = torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
        return input_ids, lambda ids: inputs_embeds


class StemlmModel(StemlmPreTrainedModel):
    """The decoder without its head (HF's base model, `StemlmForCausalLM.model`): embeddings, layers, final norm.

    Its children are the `StemLM`'s own `model.` modules (the same objects), so the causal LM's `model.` parameter
    names are this model's names with the prefix, and a base-model folder loads into the causal LM."""

    def __init__(self, config: StemlmConfig, lm: StemLM | None = None) -> None:
        super().__init__(config)
        lm = self._build_lm(config, lm)
        self.embed_tokens = lm.model.embed_tokens
        self.layers = lm.model.layers
        self.norm = lm.model.norm
        self.rotary_emb = lm.model.rotary_emb
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = self._lm.model.embed_tokens = value

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")  # transformers' own schedule for the rename
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        """The final-normed hidden states [B, T, hidden] (`last_hidden_state`), as HF's base models return."""
        flags, return_dict = self._flags(use_cache, output_attentions, output_hidden_states, return_dict)
        # The hidden states are always collected: the last one is the output (they are views kept alive anyway
        # while training; a probe asks for them).
        out, cache = self._run(
            input_ids, inputs_embeds, attention_mask, position_ids, cache, (flags[0], flags[1], True),
            head=False,
        )  # fmt: skip
        result = BaseModelOutputWithPast(
            last_hidden_state=out.hidden_states[-1],
            cache=cache,
            hidden_states=out.hidden_states if flags[2] else None,
            attentions=out.attentions if flags[1] else None,
        )
        return result if return_dict else result.to_tuple()


class StemlmForCausalLM(StemlmPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: StemlmConfig) -> None:
        super().__init__(config)
        lm = self._build_lm(config, None)
        self.model = StemlmModel(config, lm)
        self.lm_head = lm.lm_head
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' `from_pretrained`; a folder whose config names no `eos_token_id` (a stemlm checkpoint's
        does not) takes its tokenizer's end-of-text id, so `generate()` stops where `stemlm generate` stops."""
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, info) with output_loading_info=True
        tokenizer = Path(str(pretrained_model_name_or_path), "tokenizer.json")
        if model.config.eos_token_id is None and tokenizer.is_file():
            from tokenizers import Tokenizer

            from stemlm.data.tokenizer import EOT_TOKEN

            eos = Tokenizer.from_file(str(tokenizer)).token_to_id(EOT_TOKEN)
            if eos is not None:
                model.config.eos_token_id = model.generation_config.eos_token_id = eos
        return loaded

    def prepare_inputs_for_generation(self, input_ids, *args, inputs_embeds=None, **kwargs):
        """transformers' step inputs; on the step that feeds `inputs_embeds` it drops the ids, which the kinds that
        index tables or route by token id need: the ids of those positions are kept when generate() was given them.
        (`inputs_embeds` is named in the signature: generate() reads it there to accept embeddings.)"""
        inputs = super().prepare_inputs_for_generation(input_ids, *args, inputs_embeds=inputs_embeds, **kwargs)
        embeds = inputs.get("inputs_embeds")
        if inputs.get("input_ids") is None and embeds is not None and input_ids.shape[1] >= embeds.shape[1]:
            inputs["input_ids"] = input_ids[:, input_ids.shape[1] - embeds.shape[1] :]
        return inputs

    def _reorder_cache(self, cache, beam_idx: torch.LongTensor):
        """Beam search's reordering between steps: the cache's keys and values, and with them the decoding state
        the n-gram and Engram kinds keep on the cache (earlier ids, conv inputs), which transformers does not see."""
        cache.reorder_cache(beam_idx)
        reorder_decoding_state(cache, beam_idx)
        return cache

    # ----- embeddings (used by HF's resize/tie helpers) -----
    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = self._lm.lm_head = value

    # ----- forward -----
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")  # transformers' own schedule for the rename
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        shift_labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> StemlmCausalLMOutput | tuple:
        """HF-style causal LM forward. `labels` are the input ids (shifted here); -100 marks ignored positions.
        `shift_labels`, when given, are the targets already aligned with the positions (sequence-parallel
        trainers shift before sharding) and replace `labels`. Flags left None are read from the config."""
        flags, return_dict = self._flags(use_cache, output_attentions, output_hidden_states, return_dict)
        targets = shift_labels
        if labels is not None and shift_labels is None:
            # HF convention: position t predicts labels[t + 1]; the last position has no target.
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        out, cache = self._run(input_ids, inputs_embeds, attention_mask, position_ids, cache, flags, targets)
        loss = out.loss
        if loss is not None and out.aux_loss is not None:
            loss = loss + self.config.router_aux_loss_coef * out.aux_loss
        result = StemlmCausalLMOutput(
            loss=loss,
            logits=out.logits,
            cache=cache,
            hidden_states=out.hidden_states,
            attentions=out.attentions if flags[1] else None,
            aux_loss=out.aux_loss,
        )
        return result if return_dict else result.to_tuple()
