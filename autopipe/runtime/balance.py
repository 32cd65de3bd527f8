"""A balance: layers per stage, in chain order; checked once for both engines."""
from __future__ import annotations

from typing import Sequence

from .._checks import is_positive_int
from ..errors import OptionError

__all__ = ["check_balance", "stage_of_layer"]


def check_balance(balance: Sequence[int], layers: int, error: type[Exception] = OptionError) -> None:
    """Raise ``error`` unless ``balance`` gives every stage at least one layer and covers the
    ``layers`` of the chain exactly; the message names the first stage without a layer, or the
    count covered."""
    empty = next((s for s, n in enumerate(balance) if not is_positive_int(n)), None)
    if empty is not None:
        raise error(f"balance {list(balance)}: stage {empty} has {balance[empty]!r} layers; every stage needs "
                    "a whole number of layers, at least one")
    if not balance or sum(balance) != layers:
        raise error(f"balance {list(balance)} covers {sum(balance)} layers but the model has {layers}; give layer "
                    f"counts per stage that add up to {layers}")


def stage_of_layer(balance: Sequence[int]) -> list[int]:
    """The stage index of each layer."""
    return [stage for stage, count in enumerate(balance) for _ in range(count)]
