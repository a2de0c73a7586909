"""`dense`: the SwiGLU FFN, `y = down_proj(silu(gate_proj(x)) * up_proj(x))`.

Every layer outside `ffn_layers` is dense, whatever `ffn` is; `ffn="dense"` makes all of them so.
"""

from __future__ import annotations

from stemlm.model.ffn import DenseFFN
from stemlm.model.kinds.registry import Config, Kind, LayerCount


def count(config: Config, layer_idx: int) -> LayerCount:
    weights = 3 * config.hidden_size * config.intermediate_size  # gate, up, down
    return LayerCount({"ffn_dense": weights}, {"ffn_dense": weights})


def swiglu_activations(config: Config) -> int:
    # gate, its SiLU, up (or the STEM rows) and their product, d_ff each (stemlm.train.memory_plan)
    return 4 * config.intermediate_size


KIND = Kind(
    name="dense",
    order=0,
    summary="SwiGLU FFN: down_proj(silu(gate_proj x) * up_proj x)",
    build=lambda config, layer_idx: DenseFFN(config.hidden_size, config.intermediate_size),
    count=count,
    components=("ffn_dense",),
    activation_elements=swiglu_activations,
    vllm_unserved=None,
)
