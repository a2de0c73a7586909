"""The model: shared decoder parts (`attention`), token-aware FFNs (`ffn`, `moe`) and the decoder (`decoder`)."""

from stemlm.model.decoder import ModelOutput, StemLM, build_model, check_token_ids
from stemlm.model.ffn import TokenContext

__all__ = ["ModelOutput", "StemLM", "TokenContext", "build_model", "check_token_ids"]
