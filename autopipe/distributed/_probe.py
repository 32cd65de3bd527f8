"""The engine's shape probe leaves the parameters as it found them.

torch.distributed.pipelining runs each stage's forward once before the first step to learn the
shapes it sends: a forward the plain model never runs.  One that writes into a parameter in place
(a running statistic kept in a frozen ``nn.Parameter``) would apply that write once more than the
plain model does, and every later step would compute from the other value.  Buffers are kept and
put back whole (:func:`~autopipe.runtime.checkpoint.buffers_restored`); parameters can be large,
so only those the probe writes are copied, the moment before their first write: a dispatch mode
sees each operation that writes into memory a parameter holds (through a view or ``.data`` too).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["params_kept"]


@contextlib.contextmanager
def params_kept(params: Iterable[Tensor]) -> Iterator[None]:
    """Inside the block, copy each of ``params`` before an operation first writes into its
    memory; after it, write the copies back (through ``.data``: the probe's autograd graph is
    dropped, and no version counter of the step's moves)."""
    writes = _FirstWrites(params)
    try:
        with writes:
            yield
    finally:
        with torch.no_grad():
            for param, value in writes.kept.values():
                param.data.copy_(value)


class _FirstWrites(TorchDispatchMode):
    """The parameters' values before the first operation that writes into their memory."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        super().__init__()
        # by the address of their memory, which views and .data share (meta tensors hold none)
        self.params = {p.untyped_storage().data_ptr(): p for p in params if p.device.type != "meta" and p.numel()}
        self.kept: dict[int, tuple[Tensor, Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        for position, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[position] if position < len(args) else kwargs.get(argument.name)
                for tensor in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(tensor, Tensor):
                        self._keep(tensor)
        return func(*args, **kwargs)

    def _keep(self, tensor: Tensor) -> None:
        if tensor.device.type == "meta" or tensor.is_sparse:
            return
        address = tensor.untyped_storage().data_ptr()
        param = self.params.get(address)
        if param is not None and address not in self.kept:
            self.kept[address] = (param, param.detach().clone())
