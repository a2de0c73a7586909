"""The shape of the hashed n-gram tables of a config (orders, heads, prime table sizes), without torch.

Shared by the model (`stemlm.model.ngram`, which hashes ids into these tables) and the kinds' accounting (which
counts them from the config alone). A kind with n-gram keys says which of its fields hold the orders, heads and
rows (`Kind.ngram`) and whether its layers share one hashing (`Kind.ngram_per_layer`).

Shared hashing (stemlm's): every n-gram layer has the same tables, one prime per head reused for every order.
Per-layer hashing (DeepSeek's Engram demo): every (layer, order, head) gets its own prime, the primes drawn in
that order as the next prime above the rows that no earlier table took, so no two tables of a model share one.
"""

from __future__ import annotations

from dataclasses import dataclass

from stemlm.errors import StemlmError
from stemlm.model.kinds.registry import Config, beside_kinds, get_kind


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def head_primes(rows: int, count: int) -> list[int]:
    """`count` distinct primes, the first >= `rows`, each the next prime after the previous one."""
    primes, candidate = [], max(2, rows)
    while len(primes) < count:
        if is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    return primes


def parse_orders(text: str | list[int] | tuple[int, ...]) -> tuple[int, ...]:
    if isinstance(text, (list, tuple)):
        orders = tuple(int(n) for n in text)
    else:
        try:
            orders = tuple(int(part) for part in str(text).replace(" ", "").split(",") if part)
        except ValueError:
            raise StemlmError(f"bad n-gram orders {text!r}: use a comma list such as 2 or 2,3") from None
    if not orders or any(n < 2 for n in orders) or len(set(orders)) != len(orders):
        raise StemlmError(f"n-gram orders must be distinct integers >= 2, got {list(orders)}")
    return tuple(sorted(orders))


@dataclass(frozen=True)
class NgramLayout:
    orders: tuple[int, ...]
    heads: int  # hash heads per order
    sizes: tuple[int, ...]  # one prime table size per (order, head), orders outer
    # Per-layer hashing: layer -> its own sizes (as `sizes`); empty when every layer has `sizes`.
    layer_sizes: tuple[tuple[int, tuple[int, ...]], ...] = ()
    pad_id: int | None = None  # per-layer hashing: the id hashed for a position before the start or padding

    def sizes_of(self, layer_idx: int) -> tuple[int, ...]:
        return dict(self.layer_sizes).get(layer_idx, self.sizes)

    def rows_of(self, layer_idx: int) -> int:
        return sum(self.sizes_of(layer_idx))

    @property
    def num_keys(self) -> int:
        return len(self.sizes)

    @property
    def num_rows(self) -> int:
        return sum(self.sizes)


def check_orders(name: str, value, need) -> None:
    """A config check: `value` is a comma list of distinct n-gram orders >= 2."""
    orders = str(value).replace(" ", "").split(",")
    ok = all(o.isdigit() and int(o) >= 2 for o in orders) and len(set(orders)) == len(orders)
    need(ok, f"{name} must be a comma list of distinct n-gram orders >= 2 such as '2' or '2,3', got {value!r}")


def ngram_kind(config: Config):
    """The kind whose layers look n-gram rows up (the FFN kind, or one beside it; at most one per model), or None."""
    ffn = get_kind(config.ffn)
    if ffn.ngram is not None and config.special_layers:
        return ffn
    return next((k for k in beside_kinds() if k.ngram is not None and config.beside_layers(k.name)), None)


def ngram_layout(config: Config) -> NgramLayout | None:
    """The n-gram tables of a config whose kind has n-gram keys (every such layer has the same), else None."""
    kind = ngram_kind(config)
    if kind is None:
        return None
    orders, heads, rows = kind.ngram(config)
    orders = parse_orders(orders)
    primes = head_primes(rows or config.vocab_size, heads)
    sizes = tuple(p for _ in orders for p in primes)
    pad_id = None if kind.ngram_per_layer is None else kind.ngram_per_layer(config)
    if pad_id is None:
        return NgramLayout(orders, heads, sizes)
    layers = [i for i in range(config.num_hidden_layers) if kind.name in config.layer_kinds(i)]
    per_layer = per_layer_primes(rows or config.vocab_size, len(orders), heads, layers)
    return NgramLayout(orders, heads, per_layer[0][1], per_layer, pad_id)


def per_layer_primes(rows: int, orders: int, heads: int, layers: list[int]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The demo's table sizes: for each layer in order and each of its orders, the heads take the next primes
    >= `rows`, one after the other, skipping every prime an earlier table of the model took."""
    taken: set[int] = set()
    out = []
    for layer in layers:
        sizes = []
        for _ in range(orders):
            candidate = rows
            for _ in range(heads):
                while not is_prime(candidate) or candidate in taken:
                    candidate += 1
                taken.add(candidate)
                sizes.append(candidate)
        out.append((layer, tuple(sizes)))
    return tuple(out)
