"""The task heads a causal LM in transformers ships, on `StemlmModel`: sequence and token classification, extractive
question answering (`AutoModelForSequenceClassification` / `...TokenClassification` / `...QuestionAnswering`).

    AutoModelForSequenceClassification.from_pretrained(stemlm_folder, num_labels=3, pad_token_id=0)

Each is transformers' generic head (`transformers.modeling_layers.GenericFor...`, the code behind
`LlamaForSequenceClassification` and its siblings): its forward, pooling and losses are transformers' own. What
differs is the constructor: the generic one builds the base model with `AutoModel.from_config`, which in a
remote-code folder (`stemlm.hf.remote_code`) needs `trust_remote_code` passed again; here it is `StemlmModel`
itself, under the same `model.` prefix, so a causal-LM folder's decoder weights load into a head unchanged (its
`lm_head` is left out, the head's new layer initialised).
- sequence classification scores the hidden state of each row's last token that is not `config.pad_token_id`
  (right or left padding); with no pad id only a batch of one is accepted, as transformers does. The loss follows
  `config.problem_type` (regression: MSE, single label: cross-entropy, multi-label: BCE with logits), inferred from
  `num_labels` and the labels' dtype when unset.
- token classification applies dropout (`config.classifier_dropout`, transformers' default 0.1 when unset) and a
  linear layer to every position; question answering a linear layer giving start and end logits.
"""

from __future__ import annotations

from torch import nn
from transformers import initialization as init
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
)

from stemlm.hf.configuration import StemlmConfig
from stemlm.hf.modeling import StemlmModel, StemlmPreTrainedModel


class _StemlmHeadModel(StemlmPreTrainedModel):
    """A `StemlmModel` under `model.` and one new linear layer (`_head`, named by the subclass) on its output."""

    _head = ""

    @property
    def _lm(self):  # the decoder's StemLM, which the shared init and resize code read
        return self.model.stem

    def _init_weights(self, module: nn.Module) -> None:
        # The new layer as transformers initialises a linear layer: normal(initializer_range), zero bias; the
        # decoder's modules as StemlmForCausalLM initialises them.
        if module is getattr(self, self._head, None):
            init.normal_(module.weight, std=self.config.initializer_range)
            if module.bias is not None:
                init.zeros_(module.bias)
        else:
            super()._init_weights(module)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.set_input_embeddings(value)


class StemlmForSequenceClassification(GenericForSequenceClassification, _StemlmHeadModel):
    _head = "score"

    def __init__(self, config: StemlmConfig) -> None:
        _StemlmHeadModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = StemlmModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()


class StemlmForTokenClassification(GenericForTokenClassification, _StemlmHeadModel):
    _head = "score"

    def __init__(self, config: StemlmConfig) -> None:
        _StemlmHeadModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = StemlmModel(config)
        dropout = getattr(config, "classifier_dropout", None)
        self.dropout = nn.Dropout(0.1 if dropout is None else dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class StemlmForQuestionAnswering(GenericForQuestionAnswering, _StemlmHeadModel):
    _head = "qa_outputs"

    def __init__(self, config: StemlmConfig) -> None:
        _StemlmHeadModel.__init__(self, config)
        self.model = StemlmModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()
