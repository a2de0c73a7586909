"""Llama-3-style RoPE frequency scaling ("rope_type": "llama3"), so Llama 3.x checkpoints load with their logits.

Each rotary frequency is judged by its wavelength against the original training context L0:
wavelengths shorter than L0 / high_freq_factor keep their frequency, longer than L0 / low_freq_factor are
divided by `factor`, and those in between are interpolated smoothly between the two
(smooth = (L0 / wavelength - low) / (high - low)). Attention itself is unchanged (no extra scaling for llama3).
"""

from __future__ import annotations

import math

import torch

from stemlm.errors import StemlmError

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_llama3(params: dict) -> None:
    """Raise a StemlmError naming the problem unless `params` is a complete, valid llama3 scaling dict."""
    if not isinstance(params, dict):
        raise StemlmError(f"invalid config: rope_llama3 must be a dict of {', '.join(LLAMA3_KEYS)}, got {params!r}")
    missing = [k for k in LLAMA3_KEYS if k not in params]
    if missing:
        raise StemlmError(f"invalid config: rope_llama3 lacks {', '.join(missing)}")
    for key in LLAMA3_KEYS:
        value = params[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise StemlmError(f"invalid config: rope_llama3 {key} must be a positive number, got {value!r}")
    if params["high_freq_factor"] <= params["low_freq_factor"]:
        raise StemlmError("invalid config: rope_llama3 high_freq_factor must exceed low_freq_factor")


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """The llama3-scaled version of the plain RoPE inverse frequencies `inv_freq` (fp32)."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)
