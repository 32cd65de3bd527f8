"""The captured layer module: one slice of the traced graph, popping and stashing its skips.

A torch.export graph covers the dtypes it saw: the model's inputs' (the first layer refuses
others), and wherever the model converts a value to the dtype it already had at the capture
(``logits.float()`` on float32 logits, a mask's ``.to(torch.long)``) the graph checks that
dtype, export having traced a conversion that changed nothing.  Converting the model
(``pipe.double()``) or calling it under another autocast changes those values' dtypes;
:func:`fixed_dtype` makes such a check an error that says why.  A graph without such checks
runs on other dtypes as the model's operations do, and an fx graph calls the model's own
operations, which take any dtype.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor, fx
from torch.utils._pytree import TreeSpec, tree_leaves, tree_unflatten

from ..layers import ChainError, Hooks
from ..skip import Skippable, pop, stash
from ._state import Read, same_value

__all__ = ["CapturedLayer", "CapturedCallError", "autocast_state", "fixed_dtype"]

_MODES = {True: "train", False: "eval"}

#: The device types and dtypes autocast is on for (none: off).
Autocast = tuple[tuple[str, torch.dtype], ...]


def autocast_state() -> Autocast:
    """The device types autocast is on for in this thread, with their dtypes."""
    return tuple((kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind))


class _FixedDtype(Exception):
    """An exported graph's dtype check failed: ``given`` where the capture saw ``expected``."""

    def __init__(self, expected: torch.dtype, given: torch.dtype, where: str) -> None:
        super().__init__(expected, given, where)
        self.expected, self.given, self.where = expected, given, where


def fixed_dtype(value: Tensor, *args: Any, where: str = "", dtype: torch.dtype | None = None, **kwargs: Any) -> None:
    """torch.export's ``aten._assert_tensor_metadata`` (``value`` has ``dtype``, and the device,
    layout and sizes given), raising :class:`_FixedDtype` for another dtype, so that the layer
    running the graph can say why it differs; ``where`` is the model's line it was traced from."""
    if dtype is not None and value.dtype != dtype:
        raise _FixedDtype(dtype, value.dtype, where)
    torch.ops.aten._assert_tensor_metadata.default(value, *args, **kwargs)


class CapturedCallError(ChainError, RuntimeError):
    """A captured layer called in a way its graph does not cover (the other train/eval mode, a
    batch size export fixed, arguments it does not take): the graph would compute something else.
    A ``TypeError`` (as a :class:`ChainError`) and a ``RuntimeError`` (as the mode refusal was)."""


class CapturedLayer(Skippable):
    """One captured layer: runs its slice of the traced graph, popping and stashing its skips.

    It holds the original modules, parameters and buffers at their original dotted paths (as
    ``fx.GraphModule`` does), so its ``state_dict`` keys are the model's keys.  It is built
    while the model is captured, so the autocast state and the dtypes of its parameters and
    buffers at its construction are the capture's (which a failed dtype check compares with).
    """

    def __init__(
        self,
        code: fx.GraphModule,
        main_inputs: int,
        pops: Sequence[str],
        stashes: Sequence[str],
        main_outputs: int | None,
        exported_mode: bool | None = None,
        keywords: Sequence[str] = (),
        output_spec: TreeSpec | None = None,
        input_sizes: Sequence[tuple[int, ...] | None] | None = None,
        input_constants: Sequence[tuple[int, Any]] = (),
        traced_mode: bool | None = None,
        argument_names: Sequence[str] = (),
        batch_sizes: Sequence[int | None] | None = None,
        batch_ranges: Sequence[tuple[int, int | None] | None] | None = None,
        batch_guards: Callable[..., None] | None = None,
        positional_names: Sequence[str] = (),
        fixed: Mapping[str, tuple[Any, Any]] | None = None,
        input_dtypes: Sequence[torch.dtype | None] | None = None,
        traced_hooks: Mapping[str, Hooks] | None = None,
        traced_reads: Sequence[Read] = (),
    ) -> None:
        super().__init__()
        self.traced_hooks = dict(traced_hooks or {})  # the model's hooks the trace ran into the graph, by path
        self.traced_reads = list(traced_reads)  # the plain values the traced code may read, as the graph keeps them
        self.input_dtypes = None if input_dtypes is None else tuple(input_dtypes)
        self.captured_autocast = autocast_state()
        self.captured_dtypes = {name: t.dtype for name, t in (*code.named_parameters(), *code.named_buffers())}
        self.keywords = tuple(keywords)
        self.argument_names = tuple(argument_names)
        self.positional_names = tuple(positional_names)
        self.fixed = dict(fixed or {})  # fx: an argument the capture fixed: its value in the graph, its default
        self.batch_sizes = None if batch_sizes is None else tuple(batch_sizes)
        self.batch_ranges = None if batch_ranges is None else tuple(batch_ranges)
        self.batch_guards = batch_guards  # export's checks of a whole batch's inputs (_tracing.Traced)
        self.traced_mode = traced_mode
        self.input_sizes = None if input_sizes is None else tuple(input_sizes)
        self.input_constants = tuple(input_constants)
        self.output_spec = output_spec
        self._modules.update(code._modules)
        self._parameters.update(code._parameters)
        self._buffers.update(code._buffers)
        self._non_persistent_buffers_set.update(code._non_persistent_buffers_set)
        self.graph = code.graph
        self._code: Callable[..., Any] = type(code).forward
        self.main_inputs = main_inputs
        self.main_outputs = main_outputs
        self.pop_names = tuple(pops)
        self.stash_names = tuple(stashes)
        self.exported_mode = exported_mode
        if exported_mode is not None:
            self.train(exported_mode)
        elif traced_mode is not None:
            self.training = traced_mode  # its modules keep their own flags (a frozen part stays in eval)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The model's call arguments as this (first) layer's positional inputs: for an export,
        the keyword arguments the model was captured with, in the capture's order, after the
        positional ones; for fx, the arguments bound as the forward binds them, in the graph's order.

        Raises:
            TypeError: an argument is missing, was not part of the capture or was fixed by it.
            ValueError: an input's size other than the batch's differs from the sample's, which
                the exported graph keeps (a sequence length).
            CapturedCallError: an input's dtype differs from the sample's, which the exported
                graph keeps (a bool attention mask captured as int64), or an input that is no
                tensor (a number, a flag) differs from the sample's, which it keeps too.
        """
        bound = self._keywords(args, kwargs)
        if self.input_constants:
            self._check_constants(bound)
        if self.input_sizes is not None:
            self._check_sizes(bound)
        if self.input_dtypes is not None:
            self._check_dtypes(bound)
        return bound

    def _keywords(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        if self.argument_names and not self.keywords:
            return self._by_name(args, kwargs)
        if not kwargs and not self.keywords:
            return args
        missing = [name for name in self.keywords if name not in kwargs]
        extra = [name for name in kwargs if name not in self.keywords]
        if missing or extra:
            raise TypeError(self._keyword_mismatch(args, kwargs))
        return args + tuple(kwargs[name] for name in self.keywords)

    def _keyword_mismatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """Why a call does not fit the captured keyword arguments, and the way out: the exported
        graph takes them in the capture's order, so positional ones cannot stand for them."""
        again = "capture it again with the arguments it is called with (autopipe.chain(model, {name: tensor, ...}))"
        if not self.keywords:
            return (f"the model was captured with positional arguments only and is called with the keyword "
                    f"arguments {list(kwargs)}; pass them by position, as captured, or {again}")
        captured = f"the model was captured with keyword arguments {list(self.keywords)} and is called with"
        if not args:
            return f"{captured} the keyword arguments {list(kwargs)}; {again}"
        plural = "s" if len(args) > 1 else ""
        by_keyword = ", ".join(f"{name}=..." for name in self.keywords)
        return (f"{captured} {len(args)} positional argument{plural} and the keyword arguments {list(kwargs)}; "
                f"pass them by keyword, as captured (pipe({by_keyword}) or pipe(**batch)), or {again}")

    def _by_name(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """A traced forward's arguments bound as the forward binds them (by position in the order of
        its parameters, fixed ones too, then by name), in the graph's order.  An argument the
        capture fixed may be given with the value the graph holds, or left out where that is its
        default; another value is refused."""
        given = {**dict(zip(self.positional_names, args)), **kwargs}
        for name, (value, default) in self.fixed.items():
            passed = given.pop(name, _LEFT_OUT)
            if not same_value(default if passed is _LEFT_OUT else passed, value):
                called = f"leaves it at its default {default!r}" if passed is _LEFT_OUT else f"passes {_shown(passed)}"
                raise CapturedCallError(
                    f"the model's traced forward was captured with {name}={value!r}, which torch.fx fixed in its "
                    f"graph (an argument with a default that the sample gives as no tensor), and this call {called}; "
                    f"pass {name}={value!r}, or capture it again with the value it is called with "
                    "(autopipe.chain(model, sample) then autopipe.Pipeline), or with a sample that passes it as a "
                    "tensor")
        missing = [name for name in self.argument_names if name not in given]
        unexpected = [name for name in given if name not in self.argument_names] + [
            f"{name} (given twice)" for name in self.positional_names[:len(args)] if name in kwargs] + [
            f"positional argument {n + 1}" for n in range(len(self.positional_names), len(args))]
        if missing or unexpected:
            raise CapturedCallError(
                f"the model's traced forward takes {list(self.argument_names)} and is called with {len(args)} "
                f"positional (its parameters {list(self.positional_names)} in order) and the keyword arguments "
                f"{list(kwargs)}: missing {missing}, unexpected {unexpected}"
            )
        return tuple(given[name] for name in self.argument_names)

    def _check_constants(self, inputs: tuple[Any, ...]) -> None:
        """Refuse inputs that were no tensors in the sample (``k=2``, ``flag=True``) and now differ:
        torch.export specialises its graph to those values (its own guard refuses others too)."""
        leaves = tree_leaves(inputs)
        for position, value in self.input_constants:
            given = leaves[position] if position < len(leaves) else _LEFT_OUT
            if not same_value(given, value):
                given = "nothing" if given is _LEFT_OUT else _shown(given)
                raise CapturedCallError(
                    f"the model was captured with torch.export on a sample whose input {position + 1} (counting the "
                    f"tensors and values of its arguments in order) was {value!r}, which its graph keeps: torch.export "
                    f"fixes the numbers and flags of the sample. It is called with {given}; capture it again with "
                    "the value it is called with (autopipe.chain(model, sample) then autopipe.Pipeline), or pass the "
                    "value as a tensor")

    def _check_sizes(self, inputs: tuple[Any, ...]) -> None:
        assert self.input_sizes is not None
        given = [tuple(t.shape[1:]) if isinstance(t, Tensor) else None for t in tree_leaves(inputs)]
        if given != list(self.input_sizes):
            raise ValueError(
                f"the model was captured with torch.export on inputs of sizes {list(self.input_sizes)} "
                f"after the batch dimension, which its graph keeps, and is called with {given}; "
                "capture it again on a batch of these sizes (pad to one sequence length)"
            )

    def _check_dtypes(self, inputs: tuple[Any, ...]) -> None:
        """Refuses inputs of other dtypes than the sample's, named as the call names them (the
        keyword arguments come last, in the capture's order)."""
        assert self.input_dtypes is not None
        names = [f"positional argument {n + 1}" for n in range(len(inputs) - len(self.keywords))] + list(self.keywords)
        leaves = [(name, leaf) for name, value in zip(names, inputs) for leaf in tree_leaves(value)]
        wrong = [f"'{name}' of {leaf.dtype} (captured as {dtype})"
                 for (name, leaf), dtype in zip(leaves, self.input_dtypes)
                 if isinstance(leaf, Tensor) and leaf.dtype != dtype]
        if wrong:
            raise CapturedCallError(
                f"the model was captured with torch.export, whose graph keeps the dtypes of the sample's inputs, "
                f"and is called with {', '.join(wrong)}; pass each in its captured dtype (mask.to(torch.int64)), "
                "or capture it again on a batch of these dtypes (autopipe.chain(model, batch), after converting the "
                "model if it runs converted: model.to(dtype))"
            )

    def structure(self, flat: Any) -> Any:
        """The model's own output (a ``ModelOutput``, a dict…) from this (last) layer's flat
        outputs, joined over micro-batches; flat as it is when the capture kept no structure."""
        if self.output_spec is None:
            return flat
        return tree_unflatten(list(flat) if isinstance(flat, (tuple, list)) else [flat], self.output_spec)

    def forward(self, *main: Any) -> Any:
        """``main`` is the previous layer's value (a tensor or a tuple), or the model's inputs."""
        self._check_mode()
        if self.batch_sizes is not None:
            self._check_batch(self._inputs(main))
        if self.pop_names or self.stash_names:
            return self._drive(self._steps(main))
        return self._main(self._run(self._inputs(main)))

    def _run(self, inputs: list[Any]) -> Any:
        """The graph on ``inputs``; a failed dtype check of an exported graph (:func:`fixed_dtype`)
        becomes a :class:`CapturedCallError` naming why the dtype differs and the fix."""
        try:
            return self._code(self, *inputs)
        except _FixedDtype as fixed:
            raise CapturedCallError(self._dtype_refusal(fixed)) from None

    def _dtype_refusal(self, fixed: _FixedDtype) -> str:
        """Why a value has another dtype than at the capture, and what to do: the autocast or the
        layer's parameters and buffers differ from the capture's, or else its inputs do."""
        where = f" (traced {fixed.where})" if fixed.where else ""
        reasons = [f"this layer was captured with torch.export, whose graph covers the dtypes it saw: a value "
                   f"the model converts{where} was {fixed.expected} at the capture and is {fixed.given} now."]
        now = autocast_state()
        if now != self.captured_autocast:
            reasons.append(
                f"Autocast is {_autocast_text(now)} here and was {_autocast_text(self.captured_autocast)} at the "
                "capture: capture the model under the autocast it runs with (autopipe.chain(model, batch) inside "
                "`with torch.autocast(...):`).")
        state = [*self.named_parameters(), *self.named_buffers()]
        changed = [f"'{name}' is {t.dtype} where the capture saw {self.captured_dtypes[name]}" for name, t in state
                   if name in self.captured_dtypes and t.dtype != self.captured_dtypes[name]]
        if changed:
            reasons.append(
                f"The model was converted since ({', '.join(changed[:2])}{', ...' if len(changed) > 2 else ''}): "
                "convert it before capturing it (model.to(dtype), then autopipe.chain(model, batch)).")
        if len(reasons) == 1:
            reasons.append(
                "Its inputs come in other dtypes than at the capture (the layers before it run converted or under "
                "another autocast): capture the model again after converting it, under the autocast it runs with.")
        return " ".join(reasons)

    def _check_mode(self) -> None:
        if self.exported_mode is not None and self.training != self.exported_mode:
            raise CapturedCallError(
                f"this layer was captured with torch.export in {_MODES[self.exported_mode]} mode, which "
                f"the exported graph keeps; call autopipe.chain again with the model in "
                f"{_MODES[self.training]} mode"
            )
        if self.traced_mode is not None and self.training != self.traced_mode:
            raise CapturedCallError(
                f"this layer was captured with torch.fx in {_MODES[self.traced_mode]} mode, and the forward it "
                "traced (the model's or a submodule's) reads the train/eval flag (`if self.training:`, "
                "`F.dropout(x, training=self.training)`), "
                f"so the traced graph keeps the {_MODES[self.traced_mode]} branch; call autopipe.chain again "
                f"with the model in {_MODES[self.training]} mode, or make the mode-dependent part a submodule "
                "kept whole with leaf_modules=[...]"
            )

    def _check_batch(self, inputs: list[Any]) -> None:
        """Refuses inputs whose first size differs from one export fixed: the graph would run with
        the sample's batch size built into its reshapes and reductions."""
        assert self.batch_sizes is not None
        given = [t.shape[0] if t.dim() else None for t in tree_leaves(inputs) if isinstance(t, Tensor)]
        if any(fixed is not None and size != fixed for size, fixed in zip(given, self.batch_sizes)):
            raise CapturedCallError(
                f"the model was captured with torch.export on a sample whose first sizes {list(self.batch_sizes)} "
                f"export fixed in its graph (it specialises a batch of 1; None is dynamic), and this layer is "
                f"called with {given}; capture it again on a sample of at least 2 (autopipe.chain(model, batch)), "
                "or run micro-batches of the sample's size"
            )

    def check_whole_batch(self, main: tuple[Any, ...]) -> None:
        """Refuse a whole batch (a call of the model, before it is split into micro-batches) of a
        size the graph does not hold for: the model's forward branches on the batch size, and
        export kept the sample's branch (:attr:`batch_ranges`, and the conditions export checks,
        :attr:`batch_guards`: ``B % 2 == 0`` is no range)."""
        inputs = self._inputs(main)
        self._check_batch_ranges(inputs)
        if self.batch_guards is None or self.batch_sizes is not None:
            return  # a batch export fixed is checked per micro-batch (its guards hold the whole batch to it)
        if self.input_sizes is not None:
            self._check_sizes(tuple(inputs))  # its own message for the sizes after the batch
        try:
            self.batch_guards(*tree_leaves(inputs))
        except AssertionError as failed:
            raise CapturedCallError(
                f"the model was captured with torch.export, and its forward branches on the input sizes: export kept "
                f"the sample's branches, which hold only where {str(failed).removeprefix('Guard failed: ')}, and "
                "this call's inputs do not; capture it again on a batch of this size for these calls "
                "(autopipe.chain(model, batch)), or make the forward independent of the batch size"
            ) from None

    def _check_batch_ranges(self, inputs: list[Any]) -> None:
        """:meth:`check_whole_batch` for the ranges of batch sizes export recorded."""
        if self.batch_ranges is None:
            return
        given = [t.shape[0] if t.dim() else None for t in tree_leaves(inputs) if isinstance(t, Tensor)]
        for size, bounds in zip(given, self.batch_ranges):
            if size is not None and bounds is not None and not bounds[0] <= size <= (bounds[1] or size):
                held = f"{bounds[0]} to {bounds[1]}" if bounds[1] is not None else f"{bounds[0]} or more"
                raise CapturedCallError(
                    f"the model was captured with torch.export, and its forward branches on the batch size: export "
                    f"kept the sample's branch, which holds for batches of {held}, and this call's batch is {size}; "
                    "capture it again on a batch of this size for these calls (autopipe.chain(model, batch)), or "
                    "make the forward independent of the batch size"
                )

    def _steps(self, main: tuple[Any, ...]) -> Any:
        inputs = self._inputs(main)
        for name in self.pop_names:
            inputs.append((yield pop(name)))
        outputs = self._run(inputs)
        if self.main_outputs is not None:
            for name, value in zip(self.stash_names, outputs[self.main_outputs:]):
                yield stash(name, value)
        return self._main(outputs)

    def _inputs(self, main: tuple[Any, ...]) -> list[Any]:
        """Inputs arrive as separate arguments (the runtime's first stage) or as one tuple."""
        if len(main) == 1 and self.main_inputs > 1:
            return list(main[0])
        return list(main)

    def _main(self, outputs: Any) -> Any:
        """The value handed to the next layer: one tensor or a tuple (the model's output if last)."""
        if self.main_outputs is None:
            return outputs
        sent = outputs[: self.main_outputs]
        return sent[0] if self.main_outputs == 1 else tuple(sent)

    def updates_batch_norm_statistics(self) -> bool:
        """Whether its graph, exported in training mode, runs batch norm on running statistics:
        an ATen operation, which :class:`~autopipe.DeferredBatchNorm` (a module) cannot replace."""
        return bool(self.exported_mode) and any(
            node.op == "call_function" and "batch_norm" in str(node.target) and "no_training" not in str(node.target)
            and len(node.args) > 3 and isinstance(node.args[3], fx.Node)
            for node in self.graph.nodes)

    def extra_repr(self) -> str:
        return f"pop={list(self.pop_names)}, stash={list(self.stash_names)}"


def _autocast_text(state: Autocast) -> str:
    return ", ".join(f"on for {kind} ({str(dtype).removeprefix('torch.')})" for kind, dtype in state) or "off"


_LEFT_OUT = object()


def _shown(value: Any) -> str:
    """A value a call passes, for a message: a tensor as such, not its numbers."""
    return "a tensor" if isinstance(value, Tensor) else repr(value)
