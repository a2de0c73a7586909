"""Micro-expert attribution: how much each position's STEM rows contribute to one predicted token, per layer.

For a prompt and a token predicted after it (default: the model's top next token), per STEM layer and
prompt position:

- `ffn_norm`: the L2 norm of that STEM layer's FFN output at the position (what its micro-experts add to
  the residual stream there, whatever the prediction);
- `grad_x_input`: gradient x input on the looked-up row, sum_k U_l[t]_k * d log p(token) / d U_l[t]_k, the
  first-order effect on the token's log-probability of switching that position's row off (positive: the row
  supports the prediction).

Rows enter through the `token` row provider (`rows={"token": ...}`) as leaf tensors that require grad, so gradients
reach the exact rows each position used; FFN outputs are read by temporary forward hooks, removed before returning,
that record only the calling thread's forward (a served model may be decoding for another request meanwhile).
`plot_attribution` draws both as token x layer heat maps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM
from stemlm.model.kinds.registry import key_label, key_layer


def attribute(
    model: StemLM, prompt_ids: Sequence[int], token_id: int | None = None, *, forward: Callable | None = None
) -> dict:
    """Per STEM layer and position: FFN output norm and gradient x input for log p(token | prompt). `forward` runs
    the model's forward (default: the model itself; a served model's `InferenceModel`, for its autocast)."""
    tables = model.token_tables()
    if not tables:
        raise StemlmError("attribution needs a STEM model (this checkpoint has no STEM tables)")
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], device=device)
    leaves: dict[int, torch.Tensor] = {}

    def rows(layer_idx: int, input_ids: torch.Tensor) -> torch.Tensor:
        leaf = tables[layer_idx](input_ids).detach().requires_grad_(True)
        leaves[layer_idx] = leaf
        return leaf

    outputs: dict[int, torch.Tensor] = {}
    me = threading.get_ident()

    def capture(i: int, out) -> None:
        # Hooks live on the shared module: a server thread decoding at the same time fires them too. Only this
        # call's own forward (same thread) is recorded, so concurrent requests never see each other's outputs.
        if threading.get_ident() == me:
            outputs[i] = out[0].detach()

    handles = [
        model.model.layers[key_layer(model.config, i)].mlp.register_forward_hook(
            lambda _m, _inp, out, i=i: capture(i, out)
        )
        for i in tables  # a side table's key (past the layers) hooks its layer's FFN
    ]
    try:
        with torch.enable_grad():
            logp = (forward or model)(ids, rows={"token": rows}).logits[0, -1].float().log_softmax(-1)
            token = int(logp.argmax()) if token_id is None else int(token_id)
            if not 0 <= token < logp.numel():
                raise StemlmError(f"token id {token} is outside the vocabulary of {logp.numel()}")
            order = sorted(leaves)
            # autograd.grad, not backward(): parameter .grad fields of a shared model stay untouched.
            grads = dict(zip(order, torch.autograd.grad(logp[token], [leaves[i] for i in order]), strict=True))
    finally:
        for h in handles:
            h.remove()
    layers = {}
    for i in sorted(tables):
        layers[str(i)] = {
            "label": key_label(model.config, i),
            "ffn_norm": outputs[i].norm(dim=-1).tolist(),
            "grad_x_input": (grads[i][0] * leaves[i].detach()[0]).sum(-1).tolist(),
        }
    return {"token_id": token, "logprob": float(logp[token].detach()), "prompt_ids": list(prompt_ids), "layers": layers}


def plot_attribution(result: dict, labels: list[str], target: str, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layer_names = list(result["layers"])
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 0.55 * len(labels) + 2), 1.1 * len(layer_names) * 2 + 2.2))
    for ax, key, cmap, title in (
        (axes[0], "ffn_norm", "viridis", "STEM FFN output norm"),
        (axes[1], "grad_x_input", "RdBu_r", f"gradient x input on the rows, for log p({target!r})"),
    ):
        grid = torch.tensor([result["layers"][name][key] for name in layer_names])
        if key == "grad_x_input":
            bound = float(grid.abs().max()) or 1.0
            image = ax.imshow(grid.numpy(), aspect="auto", cmap=cmap, vmin=-bound, vmax=bound)
        else:
            image = ax.imshow(grid.numpy(), aspect="auto", cmap=cmap)
        ax.set_yticks(range(len(layer_names)), [result["layers"][n]["label"] for n in layer_names])
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.025)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
