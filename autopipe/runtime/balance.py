"""A balance: layers per stage, in chain order; checked once for both engines."""
from __future__ import annotations

from typing import Sequence

__all__ = ["check_balance", "stage_of_layer"]


def check_balance(balance: Sequence[int], layers: int, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` unless ``balance`` gives every stage at least one layer and covers the
    ``layers`` of the chain exactly."""
    if not balance or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in balance) \
            or sum(balance) != layers:
        raise error(f"balance {list(balance)} must give every stage at least one layer and cover the "
                    f"model's {layers} layers (it covers {sum(n for n in balance if isinstance(n, int))})")


def stage_of_layer(balance: Sequence[int]) -> list[int]:
    """The stage index of each layer."""
    return [stage for stage, count in enumerate(balance) for _ in range(count)]
