"""Which modules become layers, and the traced forward: torch.fx, else torch.export."""
from __future__ import annotations

import contextlib
import difflib
import inspect
import io
import logging
import operator
import os
import sys
import traceback
from dataclasses import dataclass, field, replace
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Literal

import torch
from torch import fx, nn
from torch.nn.modules.module import register_module_buffer_registration_hook
from torch.utils._pytree import TreeSpec, tree_leaves, tree_map

from ...errors import RAISED_BY, add_note
from ..layers import UNCALLED, ChainError, Hooks, call_hooks, training_flags
from ._checking import assignments_on_sample, left_as_is
from ._state import Read, Snapshot, descendants

__all__: list[str] = []

Granularity = Literal["module", "finer"]
LeafSpec = str | type[nn.Module]
_CONTAINERS = (nn.Sequential, *UNCALLED)
_FX_DIR = os.path.dirname(fx.__file__)


#: Python's augmented assignments (``h += y``) as :mod:`operator` functions: on a tensor each writes in place.
AUGMENTED = frozenset((operator.iadd, operator.iand, operator.ifloordiv, operator.ilshift, operator.imatmul,
                       operator.imod, operator.imul, operator.ior, operator.ipow, operator.irshift, operator.isub,
                       operator.itruediv, operator.ixor))


class CaptureError(ChainError):
    """The model's forward cannot be traced into a chain."""


class _AssignsBuffers(Exception):
    """The traced forward assigns buffers, which neither torch.fx nor torch.export records."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__(
            f"its forward assigns the buffers {paths} (`self.count = self.count + 1` makes a new tensor, "
            f"which neither torch.fx nor torch.export records: the chain would never update the buffer). "
            f"Way out: update them in place (`self.count += 1`, `self.mean.copy_(new)`){_kept_whole(paths)}"
        )


@dataclass
class LeafRule:
    """The dotted paths that become layers, and the user's extra leaves."""

    model: nn.Module
    granularity: Granularity
    extra: tuple[LeafSpec, ...]
    paths: set[str] = field(init=False)
    ancestors: set[str] = field(init=False)

    def __post_init__(self) -> None:
        if self.granularity not in ("module", "finer"):
            raise ValueError(f"granularity must be 'module' or 'finer', not {self.granularity!r}")
        self._check_extra()
        paths = self._module_level()
        if self.granularity == "finer":
            paths = [p for path in paths for p in self._finer(path)]
        self.paths = set(paths)
        self.ancestors = {path.rsplit(".", i)[0] for path in paths for i in range(1, path.count(".") + 1)}

    def _check_extra(self) -> None:
        """Refuse a leaf spec that names nothing: a mistyped path was ignored silently."""
        known = {path for path, _ in self.model.named_modules() if path}
        for spec in self.extra:
            if isinstance(spec, str) and spec not in known:
                close = difflib.get_close_matches(spec, sorted(known), n=3)
                raise CaptureError(f"leaf_modules: the model has no submodule '{spec}' (give dotted paths as "
                                   f"model.named_modules() names them{', e.g. ' + ', '.join(close) if close else ''}"
                                   ", or module classes)")
            if not isinstance(spec, str) and not (isinstance(spec, type) and issubclass(spec, nn.Module)):
                raise CaptureError(f"leaf_modules: {spec!r} is neither a dotted path nor a module class; give "
                                   "['encoder.block'] or [MyBlock], not a module instance")

    def is_extra(self, module: nn.Module, path: str) -> bool:
        return any(spec == path if isinstance(spec, str) else isinstance(module, spec) for spec in self.extra)

    def _whole(self, module: nn.Module, path: str) -> bool:
        """A user's extra leaf, or a module with hooks: a layer whose call runs them (traced
        through, fx would keep a forward hook's effect on the tensors but neither a backward hook
        nor what a hook does besides)."""
        return self.is_extra(module, path) or (any(call_hooks(module)) and not isinstance(module, UNCALLED))

    def is_leaf(self, module: nn.Module, path: str) -> bool:
        """Layers and extra leaves are leaves; their ancestors are traced through; else fx's rule."""
        if path in self.paths or self._whole(module, path):
            return True
        if path in self.ancestors:
            return False
        builtin = module.__module__.startswith("torch.nn") and not isinstance(module, _CONTAINERS)
        return builtin or not any(module.children())

    def _module_level(self) -> list[str]:
        """Top-level children, those leading to a container opened down to its blocks."""
        paths: list[str] = []
        for name, child in self.model.named_children():
            opened = self._leads_to_container(child) and not self._whole(child, name)
            paths.extend(self._open(child, name, deep=not isinstance(child, _CONTAINERS)) if opened else [name])
        return paths

    def _leads_to_container(self, module: nn.Module) -> bool:
        """A container, or a module holding one, directly or through modules that hold one
        (``bert`` → ``encoder`` → ``layer``)."""
        return isinstance(module, _CONTAINERS) or any(self._leads_to_container(c) for c in module.children())

    def _open(self, module: nn.Module, prefix: str, deep: bool = False) -> list[str]:
        """Children of ``module`` as paths, containers opened recursively; ``deep`` also opens
        the children leading to a container, but never a container's blocks."""
        paths: list[str] = []
        for name, child in module.named_children():
            path = f"{prefix}.{name}"
            if self._whole(child, path):
                paths.append(path)
            elif isinstance(child, _CONTAINERS):
                paths.extend(self._open(child, path))
            elif deep and self._leads_to_container(child):
                paths.extend(self._open(child, path, deep=True))
            else:
                paths.append(path)
        return paths

    def _finer(self, path: str) -> list[str]:
        module = self.model.get_submodule(path)
        whole = module.__module__.startswith("torch.nn") or self._whole(module, path)
        return [path] if whole or not any(module.children()) else self._open(module, path)


class _Proxy(fx.Proxy):
    """An fx proxy whose augmented assignments (``h += y``) are recorded as the in-place operators
    they are on tensors (``operator.iadd``): fx's own falls back to ``h = h + y``, and then a
    view or another name of ``h`` would miss the write."""


def _in_place(target: Callable[[Any, Any], Any]) -> Callable[[fx.Proxy, Any], fx.Proxy]:
    def record(self: fx.Proxy, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", target, (self, other), {})

    return record


for _target in AUGMENTED:
    setattr(_Proxy, f"__{_target.__name__}__", _in_place(_target))


def _kept_whole(paths: list[str]) -> str:
    """The other way out for assignments at ``paths``: keeping the modules that make them whole
    (one layer: their code then runs at every call)."""
    owners = sorted({path.rpartition(".")[0] for path in paths} - {""})
    return f", or keep {' and '.join(map(repr, owners))} whole with leaf_modules={owners}" if owners else ""


class _AssignsAttributes(Exception):
    """The traced code assigns attributes of the model's modules, or writes into their tensors that
    are no buffers."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__(
            f"its forward assigns the attributes {paths} (a counter, a stored value) or changes them in place (a "
            f"tensor that is no buffer, a list it appends to): torch.fx and torch.export run the Python of the code "
            f"they trace once, at the capture, so the chain would never change them. Way out: keep such state in a "
            f"buffer updated in place (`self.register_buffer('count', torch.zeros(()))`, then `self.count += 1`)"
            f"{_kept_whole(paths)}"
        )


class _ChangesGradMode(Exception):
    """The traced forward switches grad mode or autocast (``with torch.no_grad():``), which fx does not record."""

    def __str__(self) -> str:
        return (
            "its forward changes grad mode or autocast (`with torch.no_grad():`, `with torch.autocast(...):`), "
            "which torch.fx does not record: the chain would differentiate and cast as if the block were not there"
        )


def _grad_state() -> tuple[Any, ...]:
    """Grad mode and each device type's autocast state: what a ``with`` block in forward changes."""
    autocast = [(torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")]
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled(), *autocast


class _Tracer(fx.Tracer):
    """An fx tracer that remembers the innermost module whose forward failed to trace, and
    whether grad mode or autocast changed while nodes were made (a ``with`` block fx drops)."""

    def __init__(self, leaves: LeafRule) -> None:
        super().__init__()
        # a buffer the forward reads or updates is a graph node, so an update runs at every
        # call rather than once while tracing
        self.proxy_buffer_attributes = True
        self.leaves = leaves
        self.failed_in: str | None = None
        self.start_state: tuple[Any, ...] = ()
        self.state_changed = False

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        self.start_state, self.state_changed = _grad_state(), False
        return super().trace(root, concrete_args)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        if not self.state_changed and _grad_state() != self.start_state:
            self.state_changed = True
        return super().create_node(*args, **kwargs)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self.leaves.is_leaf(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.path_of_module(m)
            raise


@dataclass
class Traced:
    """A traced forward: the module its targets resolve in (holding the model's own tensors at
    their paths), its graph, and for each node of a layer module's call, the layer's name and
    the call it belongs to."""

    root: nn.Module
    graph: fx.Graph
    calls: dict[fx.Node, tuple[str, int]]
    mode: bool | None = None  # exported graphs keep the train/eval mode of the export
    keywords: tuple[str, ...] = ()  # exported: the keyword arguments, after the positional ones
    output_spec: TreeSpec | None = None  # exported: how the flat outputs make the model's output
    state: frozenset[str] | None = None  # the model's state-dict keys (other tensors the graph holds are not state)
    input_sizes: tuple[tuple[int, ...] | None, ...] | None = None  # exported: fixed non-batch sizes
    # exported: the sample's values of its inputs that are no tensors (numbers, flags), which the
    # graph keeps, by position among the inputs' leaves
    input_constants: tuple[tuple[int, Any], ...] = ()
    traced_mode: bool | None = None  # fx: the capture's mode, if the graph reads the train/eval flag
    argument_names: tuple[str, ...] = ()  # fx: the forward's arguments in the graph, in order (none if variadic)
    positional_names: tuple[str, ...] = ()  # fx: the forward's parameters a call may pass by position, fixed too
    # fx: the arguments fixed by the capture, each name's value in the graph and its default in the forward
    fixed: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    batch_sizes: tuple[int | None, ...] | None = None  # exported: first sizes the graph fixed, per tensor input
    # exported: per tensor input, the batch sizes its graph holds for ((least, most or None), None: any),
    # where the model's forward branches on the batch size; None where it does not
    batch_ranges: tuple[tuple[int, int | None] | None, ...] | None = None
    # exported: export's checks of the inputs' sizes (its conditions on the batch size among them,
    # ``B % 2 == 0``), called on the inputs' leaves; raises AssertionError naming the one that fails
    batch_guards: Callable[..., None] | None = None
    input_dtypes: tuple[torch.dtype | None, ...] | None = None  # exported: the inputs' dtypes, which the graph keeps
    # the hooks of the model's modules the trace ran into its graph, by path (runtime/_structure.py)
    hooks: dict[str, Hooks] = field(default_factory=dict)
    # the plain values the traced code may read, which the graph keeps as constants (_state.reads;
    # runtime/_structure.py refuses a call once one changed)
    reads: list[Read] = field(default_factory=list)


def trace(model: nn.Module, leaves: LeafRule, sample_input: Any, *, fx_first: bool = True, why: str = "") -> Traced:
    """torch.fx, else torch.export on ``sample_input``; one :class:`CaptureError` if neither works,
    or if the code traced assigns the modules' attributes or writes into their tensors that are no
    buffers (:class:`~autopipe.model.capture._state.Snapshot`: they change at the capture only, and
    are put back as they were, as they are when the capture fails).

    ``fx_first=False`` exports straight away (models whose forward fx is known not to trace, or
    ``why`` not, which an export's failure then says first)."""
    snapshot = Snapshot(descendants(model))
    try:
        traced = _traced(model, leaves, sample_input, fx_first, why)
    finally:
        changed = snapshot.changed()
        snapshot.put_back()
    if not changed and traced.mode is not None:  # torch.export put back what it assigned: run the model
        changed = assignments_on_sample(model, *split_sample(sample_input))
    if changed:
        raise CaptureError(f"cannot capture {type(model).__name__}: {_AssignsAttributes(changed)}")
    return traced


def _traced(model: nn.Module, leaves: LeafRule, sample_input: Any, fx_first: bool, why: str) -> Traced:
    """:func:`trace`'s capture."""
    if not fx_first:
        return _with_hooks(_exported(model, leaves, sample_input,
                                     f"cannot capture {type(model).__name__}: {why}torch.export failed"), model)
    tracer = _Tracer(leaves)
    try:
        return _with_hooks(_symbolic(model, tracer, sample_input), model)
    except Exception as error:  # noqa: BLE001 - any failure of the user's forward under fx
        failure = _trace_failure(model, tracer.failed_in or "", error)
        if isinstance(error, _AssignsBuffers):  # export would drop the assignment: no way out there
            raise CaptureError(failure) from error
        if sample_input is None:
            way_out = "pass sample_input" if isinstance(error, _ChangesGradMode) else "or pass sample_input"
            raise CaptureError(f"{failure} ({way_out} to let torch.export try)") from error
        return _with_hooks(_exported(model, leaves, sample_input, f"{failure}; torch.export failed too"), model)


def _with_hooks(traced: Traced, model: nn.Module) -> Traced:
    """``traced`` with the forward hooks torch.export ran into its graph: it runs every module's
    call, the model's own included, and keeps what a forward hook or pre-hook does to the tensors
    (not what it does besides: a list it appends to fills at the capture only); a backward hook it
    drops, so none is recorded (one there is then refused).  torch.fx traces through no module with
    hooks (they are layers, :class:`LeafRule`): nothing is recorded."""
    if traced.mode is None:
        return traced
    modules = model.named_modules(remove_duplicate=False)
    return replace(traced, hooks={path: call_hooks(module)[:2] + ((), ()) for path, module in modules})


def _exported(model: nn.Module, leaves: LeafRule, sample_input: Any, failure: str) -> Traced:
    """:func:`_export`, its failure summed up in one :class:`CaptureError` after ``failure``,
    unless the model itself fails on the sample: then that exception, as its own type."""
    try:
        return _export(model, leaves, sample_input)
    except CaptureError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure of the user's forward under export
        failed = error
    _run_on_sample(model, sample_input)
    summary = str(failed).strip().splitlines()[0]
    raise CaptureError(f"{failure}: {summary}") from failed


def _run_on_sample(model: nn.Module, sample_input: Any) -> None:
    """Run the model on the sample once, without grad, its buffers and attributes put back after
    (:func:`left_as_is`): an exception it raises (a shape check of its own) is the model's, and
    reaches the caller as its own type rather than as the export's failure."""
    args, kwargs = split_sample(sample_input)
    try:
        with left_as_is(model):
            model(*args, **kwargs)
    except Exception as error:
        add_note(error, f"{RAISED_BY}{type(model).__name__} run on the sample while capturing it "
                        "(torch.export failed, and the model itself fails on this sample)")
        raise


def _symbolic(model: nn.Module, tracer: _Tracer, sample_input: Any = None) -> Traced:
    """The fx graph.  An argument with a default is fixed to it unless the sample passes it (they
    are not micro-batched): a tensor the sample passes is an input, a non-tensor value is fixed to
    that value.  A graph that reads the train/eval flag (``if self.training:``,
    ``F.dropout(x, training=self.training)``) keeps the capture's mode, and its layers refuse the other."""
    signature = inspect.signature(model.forward)
    passed = _passed(signature, sample_input)
    defaults = {
        name: passed.get(name, p.default)
        for name, p in signature.parameters.items()
        if p.default is not inspect.Parameter.empty
        and not any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(passed.get(name)))
    }
    graph = _graph(model, tracer, defaults)
    mode = None if _same_in_both_modes(model, tracer.leaves, defaults, graph) else model.training
    inputs = _input_names(signature, defaults)
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.target not in inputs]:
        _erase_with_users(graph, node)  # a fixed argument's placeholders are named `mask_1`, `mask_2`...
    for node in [n for n in graph.nodes if n.op == "placeholder" and str(n.target).startswith("*") and not n.users]:
        graph.erase_node(node)  # an unread `*args` or `**kwargs` would take a micro-batch's place
    names = tuple(str(n.target) for n in graph.nodes if n.op == "placeholder")
    calls = [node for node in graph.nodes if node.op == "call_module"]
    named = not any(name.startswith("*") for name in names)
    positional = tuple(name for name, p in signature.parameters.items() if p.kind in _POSITIONAL)
    return Traced(model, graph, {node: (str(node.target), index) for index, node in enumerate(calls)},
                  traced_mode=mode, argument_names=names if named else (), positional_names=positional if named else (),
                  state=frozenset(model.state_dict()),
                  fixed={name: (value, signature.parameters[name].default) for name, value in defaults.items()})


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _passed(signature: inspect.Signature, sample_input: Any) -> dict[str, Any]:
    """The forward's arguments that the sample gives (none without a sample, or if it does not bind)."""
    if sample_input is None:
        return {}
    if isinstance(sample_input, Mapping):
        args, kwargs = (), dict(sample_input)
    else:
        args, kwargs = (sample_input if isinstance(sample_input, tuple) else (sample_input,)), {}
    try:
        return dict(signature.bind_partial(*args, **kwargs).arguments)
    except TypeError:
        return {}


def _input_names(signature: inspect.Signature, fixed: Mapping[str, Any]) -> list[str]:
    """The targets of the placeholders fx makes for the arguments not fixed, in order (``*args``
    for a variadic one)."""
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [stars.get(p.kind, "") + name for name, p in signature.parameters.items() if name not in fixed]


def _graph(model: nn.Module, tracer: _Tracer, defaults: dict[str, Any]) -> fx.Graph:
    """fx's graph of the forward, refused if the forward assigns buffers or changes grad mode."""
    with _buffers_kept(model) as assigned:
        graph = tracer.trace(model, concrete_args=defaults or None)
    if assigned:
        raise _AssignsBuffers(assigned)
    if tracer.state_changed:
        raise _ChangesGradMode()
    return graph


def _same_in_both_modes(model: nn.Module, leaves: LeafRule, defaults: dict[str, Any], graph: fx.Graph) -> bool:
    """Whether tracing with every module's train/eval flag flipped gives the same code.  Leaf
    modules (``nn.Dropout``, ``nn.BatchNorm2d``) are calls in the graph, so their modes stay free;
    only a forward traced through that reads ``self.training`` bakes one mode in."""
    try:
        with training_flags(model, lambda flag: not flag):
            other = _graph(model, _Tracer(leaves), defaults)
    except Exception:  # noqa: BLE001 - the other mode's forward does not even trace: it differs
        return False
    return other.python_code("self").src == graph.python_code("self").src


@contextlib.contextmanager
def _buffers_kept(model: nn.Module) -> Iterator[list[str]]:
    """Put back every buffer the block assigned, and list the paths of those assigned anything
    but an update in place of themselves (``self.count += 1`` is one, recorded in the graph;
    ``self.count = self.count + 1`` under tracing assigns a proxy that no call would update)."""
    held = [(path, module, dict(module._buffers)) for path, module in model.named_modules()]
    assigned: list[str] = []
    try:
        yield assigned
    finally:
        for path, module, buffers in held:
            for name, tensor in buffers.items():
                value = module._buffers.get(name)
                if value is not tensor:
                    module._buffers[name] = tensor
                    where = f"{path}.{name}" if path else name
                    if not _updates_itself(value, where):
                        assigned.append(where)


def _updates_itself(value: Any, path: str) -> bool:
    """Whether ``value`` is the proxy of an augmented assignment into the buffer at ``path``."""
    if not isinstance(value, fx.Proxy):
        return False
    node = value.node
    target = node.args[0] if node.op == "call_function" and node.args else None
    return (node.target in AUGMENTED and isinstance(target, fx.Node) and target.op == "get_attr"
            and target.target == path)


@contextlib.contextmanager
def _assignments(model: nn.Module) -> Iterator[list[str]]:
    """The paths of the buffers ``model``'s forward assigns inside the block (torch.export's
    tracing drops them without a word); ``self.count += 1`` assigns the buffer itself back and
    is recorded as the update in place it is."""
    paths = {id(module): path for path, module in model.named_modules()}
    assigned: list[str] = []

    def seen(module: nn.Module, name: str, value: Any) -> None:
        if id(module) in paths and value is not module._buffers.get(name):
            assigned.append(".".join(filter(None, (paths[id(module)], name))))

    hook = register_module_buffer_registration_hook(seen)
    try:
        yield assigned
    finally:
        hook.remove()


def _export(model: nn.Module, leaves: LeafRule, sample_input: Any) -> Traced:
    """The exported graph (ATen operations on the model's own parameters and buffers), each
    node assigned to the outermost layer module in its ``nn_module_stack``."""
    args, kwargs = _unaliased(*split_sample(sample_input))
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    dynamic = {name: tree_map(_batch_dynamic, value) for name, value in bound.items()}
    with _assignments(model) as assigned, _torch_output_held():
        program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic)
    root = program.module()
    if assigned:
        raise CaptureError(f"cannot capture {type(model).__name__}: {_AssignsBuffers(assigned)}")
    graph = root.graph
    for node in [n for n in graph.nodes if n.op == "call_module" and not n.users]:
        graph.erase_node(node)  # export's input guards: sizes are the micro-batch's, not the sample's
    modules = dict(model.named_modules())
    calls: dict[fx.Node, tuple[str, int]] = {}
    run, previous = -1, None
    for node in graph.nodes:
        path = _layer_of(modules, leaves, node.meta.get("nn_module_stack", {}))
        if path is not None:
            run += path != previous
            calls[node], previous = (path, run), path
    leaves = tree_leaves((args, kwargs))
    sizes = tuple(tuple(t.shape[1:]) if isinstance(t, torch.Tensor) else None for t in leaves)
    dtypes = tuple(t.dtype if isinstance(t, torch.Tensor) else None for t in leaves)
    constants = tuple((i, value) for i, value in enumerate(leaves) if not isinstance(value, torch.Tensor))
    return Traced(root, graph, calls, model.training, tuple(kwargs), getattr(root, "_out_spec", None),
                  frozenset(model.state_dict()), sizes, batch_sizes=_fixed_batch(program), input_dtypes=dtypes,
                  batch_ranges=_batch_ranges(program), batch_guards=_guards(root, leaves), input_constants=constants)


def _guards(root: nn.Module, leaves: list[Any]) -> Callable[..., None] | None:
    """Export's checks of the whole inputs (sizes, the conditions the forward's branches on them
    took, ``B % 2 == 0``), taken out of the graph, whose micro-batches are smaller: the caller
    runs them on a whole batch, before it is split.  ``None`` where export made none, or they
    do not take the inputs' leaves as the sample passes them."""
    guards = getattr(root, "_guards_fn", None)
    if guards is None:
        return None
    try:
        guards(*leaves)
    except (AssertionError, IndexError, TypeError, AttributeError):
        return None
    return guards.forward


@contextlib.contextmanager
def _torch_output_held() -> Iterator[None]:
    """Hold back torch's log records and what it prints to stderr while the body runs, and
    emit them only if it succeeds: an export that fails prints its partial graph (dozens of
    lines, twice) ahead of the :class:`CaptureError`, which already says why."""
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if record.name.split(".")[0] != "torch":
            return True
        if not any(record is other for other in held):  # one record may reach several handlers
            held.append(record)
        return False

    loggers = [logging.root, *(logger for name, logger in logging.root.manager.loggerDict.items()
                               if name.split(".")[0] == "torch" and isinstance(logger, logging.Logger))]
    handlers = list({id(h): h for logger in loggers for h in logger.handlers}.values())  # torch's do not propagate
    printed = io.StringIO()
    for handler in handlers:
        handler.addFilter(hold)
    try:
        with contextlib.redirect_stderr(printed):
            yield
    finally:
        for handler in handlers:
            handler.removeFilter(hold)
    sys.stderr.write(printed.getvalue())
    for record in held:
        logging.getLogger(record.name).handle(record)


def _unaliased(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The sample with each tensor that shares storage with an earlier one cloned.  torch.export
    makes one input of tensors that alias (``{"input_ids": ids, "labels": ids}``), and its graph
    reads that one input where the model reads each argument; cloned, every argument is its own."""
    seen: set[tuple[torch.device, int]] = set()

    def own(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        storage = (value.device, value.untyped_storage().data_ptr())
        if storage in seen:
            return value.clone()
        seen.add(storage)
        return value

    return tree_map(own, (args, kwargs))


def _fixed_batch(program: torch.export.ExportedProgram) -> tuple[int | None, ...] | None:
    """For each tensor input in order, the first dimension's size if export fixed it in the graph
    (a sample of batch 1, which export specialises with only a warning, or a forward that needs
    the sample's batch size); None if it fixed none."""
    values = _input_values(program)
    sizes = tuple(int(v.shape[0]) if v.dim() and not isinstance(v.shape[0], torch.SymInt) else None
                  for v in values if isinstance(v, torch.Tensor))
    return sizes if any(size is not None for size in sizes) else None


def _input_values(program: torch.export.ExportedProgram) -> list[Any]:
    """The example values of the model's inputs in the graph, in order (fake tensors, sizes symbolic)."""
    inputs = set(program.graph_signature.user_inputs)
    return [node.meta.get("val") for node in program.graph.nodes if node.op == "placeholder" and node.name in inputs]


def _batch_ranges(program: torch.export.ExportedProgram) -> tuple[tuple[int, int | None] | None, ...] | None:
    """For each tensor input in order, the batch sizes the graph holds for where the forward
    branches on the batch size (``if x.shape[0] > 6``: export keeps the sample's branch and records
    its condition as the range of the batch's symbol, 7 and more); ``None`` for an input whose
    range is export's own (2 and more: a batch of 1 runs the graph as well); ``None`` if every
    input's is."""
    values = _input_values(program)
    ranges = tuple(_range_of(program, v.shape[0]) if v.dim() else None for v in values if isinstance(v, torch.Tensor))
    return ranges if any(bounds is not None for bounds in ranges) else None


def _range_of(program: torch.export.ExportedProgram, size: Any) -> tuple[int, int | None] | None:
    """The bounds export recorded for a dynamic first size (``None``: fixed, or export's own range)."""
    if not isinstance(size, torch.SymInt):
        return None
    bounds = program.range_constraints.get(size.node.expr)
    if bounds is None:
        return None
    least = int(bounds.lower)
    most = int(bounds.upper) if bounds.upper < 2**62 else None  # export's unbounded is sympy's int_oo
    return None if least <= 2 and most is None else (least, most)


def _batch_dynamic(value: Any) -> dict[int, Any] | None:
    """Only the batch dimension stays dynamic: every other size is the sample's."""
    return {0: torch.export.Dim.AUTO} if isinstance(value, torch.Tensor) else None


def split_sample(sample_input: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments: a mapping (``{"input_ids": ids, ...}``, a tokenizer's
    batch) is keyword arguments, a tuple positional ones, anything else the one argument."""
    if isinstance(sample_input, Mapping):
        wrong = [name for name, value in sample_input.items() if not isinstance(value, torch.Tensor)]
        if wrong:
            raise CaptureError(
                f"the sample's keyword arguments {wrong} are not tensors; give only the batch's tensors "
                "(settings such as use_cache belong in the model's config)"
            )
        return (), dict(sample_input)
    return (sample_input if isinstance(sample_input, tuple) else (sample_input,)), {}


def _layer_of(modules: dict[str, nn.Module], leaves: LeafRule, stack: dict[str, tuple[str, Any]]) -> str | None:
    for path, _ in stack.values():
        if path in leaves.paths or path in modules and leaves.is_extra(modules[path], path):
            return path
    return None


def _erase_with_users(graph: fx.Graph, node: fx.Node) -> None:
    """Remove a fixed argument's placeholder with the checks fx made that it keeps its value."""
    for user in list(node.users):
        _erase_with_users(graph, user)
    graph.erase_node(node)


def _trace_failure(model: nn.Module, path: str, error: Exception) -> str:
    if isinstance(error, (_AssignsBuffers, _ChangesGradMode)):
        return f"cannot capture {type(model).__name__}: {error}"
    module = model.get_submodule(path)
    where = f"module '{path}' ({type(module).__name__})" if path else f"{type(model).__name__}.forward"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_FX_DIR)]
    forwards = [f for f in frames if f.name == "forward"] or frames
    line = forwards[-1] if forwards else None
    operation = f" at {line.filename}:{line.lineno} `{(line.line or '').strip()}`" if line else ""
    if path:
        way_out = (
            f"keep it whole as one layer with autopipe.chain(model, leaf_modules=['{path}']) "
            f"(or leaf_modules=[{type(module).__name__}]), or wrap the model's layers in an nn.Sequential"
        )
    else:
        way_out = (
            "move the data-dependent part into a submodule and pass it as "
            "autopipe.chain(model, leaf_modules=[...]), or wrap the model's layers in an nn.Sequential"
        )
    return (
        f"cannot capture {type(model).__name__}: torch.fx cannot trace {where}{operation}: "
        f"{type(error).__name__}: {error}. Way out: {way_out}"
    )


