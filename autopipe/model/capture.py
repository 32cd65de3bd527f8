"""Capture a non-Sequential model as a layer chain, its long-lived values routed as stash/pop skips."""
from __future__ import annotations

import inspect
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Sequence

import torch
from torch import fx, nn

from .layers import ChainError, Layer
from .skip import Namespace, Skippable, pop, stash

__all__ = ["chain", "CapturedLayer", "CaptureError"]

Granularity = Literal["module", "finer"]
LeafSpec = str | type[nn.Module]
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_FX_DIR = os.path.dirname(fx.__file__)


class CaptureError(ChainError):
    """The model's forward cannot be traced into a chain."""


def chain(
    model: nn.Module,
    sample_input: Any = None,
    granularity: Granularity = "module",
    *,
    leaf_modules: Iterable[LeafSpec] = (),
) -> list[Layer]:
    """The layers of ``model`` in forward order, with every long-lived value routed as a skip.

    The model is traced with torch.fx (symbolically: no batch size is baked in), or, where fx
    cannot and a ``sample_input`` is given, exported with torch.export (only the batch dimension
    stays dynamic; Python branches, other sizes and the train/eval mode are the sample's).  The
    nodes of a leaf module's call make one layer; functional glue joins the layer of its latest
    input (so ``x + identity`` or ``torch.cat`` runs where its last operand is made); a value that
    the next layer reads is part of the main value (a tensor or a tuple) and one that a later
    layer reads is a stash/pop skip.  Each layer is a :class:`CapturedLayer` holding the original
    modules (fx) or the original parameters and buffers (export) at their original paths, so
    state-dict keys are the model's own (``Layer.prefix == ""``) and nothing is copied.

    ``granularity="module"`` makes each top-level child a layer, except that containers
    (``Sequential``, ``ModuleList``, ``ModuleDict``) and top-level children holding one are opened
    into their blocks (``layer1.0``, ``features.3``, ``encoder.layers.2``); ``"finer"`` opens each
    such block one level more.  ``leaf_modules`` (dotted paths or classes) are kept whole: the way
    around a submodule whose forward cannot be traced.
    """
    leaves = _LeafRule(model, granularity, tuple(leaf_modules))
    traced = _trace(model, leaves, sample_input)
    groups = _group(traced)
    return _build(traced, groups, Namespace(type(model).__name__))


# --------------------------------------------------------------------------- which modules are leaves


@dataclass
class _LeafRule:
    """The dotted paths that become layers, and the user's extra leaves."""

    model: nn.Module
    granularity: Granularity
    extra: tuple[LeafSpec, ...]
    paths: set[str] = field(init=False)
    ancestors: set[str] = field(init=False)

    def __post_init__(self) -> None:
        if self.granularity not in ("module", "finer"):
            raise ValueError(f"granularity must be 'module' or 'finer', not {self.granularity!r}")
        paths = self._module_level()
        if self.granularity == "finer":
            paths = [p for path in paths for p in self._finer(path)]
        self.paths = set(paths)
        self.ancestors = {path.rsplit(".", i)[0] for path in paths for i in range(1, path.count(".") + 1)}

    def is_extra(self, module: nn.Module, path: str) -> bool:
        return any(spec == path if isinstance(spec, str) else isinstance(module, spec) for spec in self.extra)

    def is_leaf(self, module: nn.Module, path: str) -> bool:
        """Layers and extra leaves are leaves; their ancestors are traced through; else fx's rule."""
        if path in self.paths or self.is_extra(module, path):
            return True
        if path in self.ancestors:
            return False
        builtin = module.__module__.startswith("torch.nn") and not isinstance(module, _CONTAINERS)
        return builtin or not any(module.children())

    def _module_level(self) -> list[str]:
        paths: list[str] = []
        for name, child in self.model.named_children():
            holds_container = any(isinstance(c, _CONTAINERS) for c in child.children())
            opened = isinstance(child, _CONTAINERS) or holds_container
            paths.extend(self._open(child, name) if opened and not self.is_extra(child, name) else [name])
        return paths

    def _open(self, module: nn.Module, prefix: str) -> list[str]:
        """Children of ``module`` as paths, containers opened recursively."""
        paths: list[str] = []
        for name, child in module.named_children():
            path = f"{prefix}.{name}"
            if isinstance(child, _CONTAINERS) and not self.is_extra(child, path):
                paths.extend(self._open(child, path))
            else:
                paths.append(path)
        return paths

    def _finer(self, path: str) -> list[str]:
        module = self.model.get_submodule(path)
        whole = module.__module__.startswith("torch.nn") or self.is_extra(module, path)
        return [path] if whole or not any(module.children()) else self._open(module, path)


# --------------------------------------------------------------------------- tracing


class _Tracer(fx.Tracer):
    """An fx tracer that remembers the innermost module whose forward failed to trace."""

    def __init__(self, leaves: _LeafRule) -> None:
        super().__init__()
        self.leaves = leaves
        self.failed_in: str | None = None

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
class _Traced:
    """A traced forward: the module its targets resolve in (holding the model's own tensors at
    their paths), its graph, and for each node of a layer module's call, the layer's name and
    the call it belongs to."""

    root: nn.Module
    graph: fx.Graph
    calls: dict[fx.Node, tuple[str, int]]
    mode: bool | None = None  # exported graphs keep the train/eval mode of the export


def _trace(model: nn.Module, leaves: _LeafRule, sample_input: Any) -> _Traced:
    """torch.fx, else torch.export on ``sample_input``; one :class:`CaptureError` if neither works."""
    tracer = _Tracer(leaves)
    try:
        return _symbolic(model, tracer)
    except Exception as error:  # noqa: BLE001 - any failure of the user's forward under fx
        failure = _trace_failure(model, tracer.failed_in or "", error)
        if sample_input is None:
            raise CaptureError(f"{failure} (or pass sample_input to let torch.export try)") from error
        try:
            return _export(model, leaves, sample_input)
        except Exception as export_error:  # noqa: BLE001
            summary = str(export_error).strip().splitlines()[0]
            raise CaptureError(f"{failure}; torch.export failed too: {summary}") from export_error


def _symbolic(model: nn.Module, tracer: _Tracer) -> _Traced:
    """The fx graph; arguments with defaults are fixed to them (they are not micro-batched)."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(model.forward).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    graph = tracer.trace(model, concrete_args=defaults or None)
    fixed = [n for n in graph.nodes if n.op == "placeholder" and str(n.target).rsplit("_", 1)[0] in defaults]
    for node in fixed:
        _erase_with_users(graph, node)
    calls = [node for node in graph.nodes if node.op == "call_module"]
    return _Traced(model, graph, {node: (str(node.target), index) for index, node in enumerate(calls)})


def _export(model: nn.Module, leaves: _LeafRule, sample_input: Any) -> _Traced:
    """The exported graph (ATen operations on the model's own parameters and buffers), each
    node assigned to the outermost layer module in its ``nn_module_stack``."""
    inputs = sample_input if isinstance(sample_input, tuple) else (sample_input,)
    batch = tuple({0: torch.export.Dim.AUTO} if isinstance(t, torch.Tensor) else None for t in inputs)
    root = torch.export.export(model, inputs, dynamic_shapes=batch).module()
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
    return _Traced(root, graph, calls, mode=model.training)


def _layer_of(modules: dict[str, nn.Module], leaves: _LeafRule, stack: dict[str, tuple[str, Any]]) -> str | None:
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


# --------------------------------------------------------------------------- grouping nodes into layers


def _group(traced: _Traced) -> list[list[fx.Node]]:
    """Nodes per layer, in graph order.  Leaf calls open layers; glue joins its latest input's
    layer; constants and attributes join their first user's; layers sharing state are merged."""
    where = _place(traced)
    count = max(where.values(), default=0) + 1
    where = _merge_shared_state(traced, where, count)
    groups: list[list[fx.Node]] = [[] for _ in range(max(where.values(), default=0) + 1)]
    for node in traced.graph.nodes:
        if node.op != "output":
            groups[where[node]].append(node)
    return _merge_readless(groups)


def _place(traced: _Traced) -> dict[fx.Node, int]:
    where: dict[fx.Node, int] = {}
    layer, current = -1, None
    for node in traced.graph.nodes:
        if node in traced.calls:
            if traced.calls[node] != current:
                layer, current = layer + 1, traced.calls[node]
            where[node] = layer
        elif node.op == "placeholder":
            where[node] = 0
        elif node.op in ("call_function", "call_method"):
            placed = [where[n] for n in node.all_input_nodes if n in where]
            if placed:
                where[node] = max(placed)
    last = max(layer, 0)
    for node in reversed(traced.graph.nodes):
        if node.op != "output" and node not in where:
            users = [last if user.op == "output" else where[user] for user in node.users]
            where[node] = min(users, default=0)
    return where


def _merge_shared_state(traced: _Traced, where: dict[fx.Node, int], count: int) -> dict[fx.Node, int]:
    """Layers that use one parameter or buffer (a module called twice, tied weights) become one,
    with every layer between them: a tensor must live on exactly one stage."""
    first: dict[int, int] = {}
    spans: list[tuple[int, int]] = []
    for node in traced.graph.nodes:
        for tensor in _state_of(traced.root, node):
            key = id(tensor)
            if key in first and first[key] != where[node]:
                spans.append((first[key], where[node]))
            first.setdefault(key, where[node])
    renumber = list(range(count))
    for start, end in sorted(spans):
        for index in range(start, end + 1):
            renumber[index] = renumber[start]
    dense = {old: new for new, old in enumerate(sorted(set(renumber)))}
    return {node: dense[renumber[index]] for node, index in where.items()}


def _state_of(model: nn.Module, node: fx.Node) -> list[torch.Tensor]:
    if node.op == "call_module":
        module = model.get_submodule(str(node.target))
        return list(module.parameters()) + list(module.buffers())
    if node.op == "get_attr":
        value = _fetch(model, str(node.target))
        return [value] if isinstance(value, torch.Tensor) else []
    return []


def _fetch(model: nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(model.get_submodule(owner), name)


def _merge_readless(groups: list[list[fx.Node]]) -> list[list[fx.Node]]:
    """A layer that reads nothing from earlier layers has no input to receive: it joins the previous."""
    merged: list[list[fx.Node]] = []
    for nodes in groups:
        if not nodes:
            continue
        own = set(nodes)
        reads = any(n not in own for node in nodes for n in node.all_input_nodes)
        if merged and not reads:
            merged[-1].extend(nodes)
        else:
            merged.append(nodes)
    return merged


# --------------------------------------------------------------------------- routing values between layers


@dataclass
class _Route:
    """What each layer reads from others, and which layer hands each value to it.

    A value read by several later layers travels from reader to reader (each passes it on), so
    it crosses every cut at most once and costs its bytes once wherever the plan cuts.
    """

    groups: list[list[fx.Node]]
    output: fx.Node
    producer: dict[fx.Node, int] = field(init=False)
    reads: list[list[fx.Node]] = field(init=False)
    source: list[dict[fx.Node, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.producer = {node: index for index, nodes in enumerate(self.groups) for node in nodes}
        last = len(self.groups) - 1
        self.reads = [[] for _ in self.groups]
        for node in self.producer:
            for user in node.users:
                consumer = last if user.op == "output" else self.producer[user]
                if consumer != self.producer[node] and node not in self.reads[consumer]:
                    self.reads[consumer].append(node)
        self.source = [{} for _ in self.groups]
        for node in self.producer:
            holder = self.producer[node]
            for consumer, read in enumerate(self.reads):
                if node in read:
                    self.source[consumer][node] = holder
                    holder = consumer
        self._relay_into_empty_mains()

    def _relay_into_empty_mains(self) -> None:
        """Every layer after the first needs a main input: if it reads nothing from its
        predecessor, the predecessor relays the first value it reads from further back."""
        for consumer in range(len(self.groups) - 1, 0, -1):
            if any(self.source[consumer][node] == consumer - 1 for node in self.reads[consumer]):
                continue
            node = self.reads[consumer][0]
            if node not in self.source[consumer - 1]:
                self.reads[consumer - 1].append(node)
                self.source[consumer - 1][node] = self.source[consumer][node]
            self.source[consumer][node] = consumer - 1

    def main_inputs(self, index: int) -> list[fx.Node]:
        if index == 0:
            return [n for n in self.groups[0] if n.op == "placeholder"]
        return [n for n in self.reads[index] if self.source[index][n] == index - 1]

    def popped(self, index: int) -> list[fx.Node]:
        return [n for n in self.reads[index] if self.source[index][n] < index - 1]

    def main_outputs(self, index: int) -> list[fx.Node]:
        return self.main_inputs(index + 1) if index + 1 < len(self.groups) else []

    def stashed(self, index: int) -> list[tuple[fx.Node, int]]:
        return [
            (node, consumer)
            for consumer in range(index + 2, len(self.groups))
            for node in self.reads[consumer]
            if self.source[consumer][node] == index
        ]


def _build(traced: _Traced, groups: list[list[fx.Node]], namespace: Namespace) -> list[Layer]:
    output = next(node for node in traced.graph.nodes if node.op == "output")
    route = _Route(groups, output)
    names = _layer_names(groups, traced.calls, namespace.label or "model")
    layers: list[Layer] = []
    for index, nodes in enumerate(groups):
        pops = [_skip_name(node, names[index]) for node in route.popped(index)]
        stashes = [_skip_name(node, names[consumer]) for node, consumer in route.stashed(index)]
        code = _layer_code(traced.root, route, index)
        main_in = len(route.main_inputs(index))
        main_out = len(route.main_outputs(index)) if index + 1 < len(groups) else None
        module = CapturedLayer(code, main_in, pops, stashes, main_out, traced.mode).isolate(namespace)
        layers.append(Layer(names[index], module, module.stash_keys(), module.pop_keys(), prefix=""))
    return layers


def _layer_names(groups: list[list[fx.Node]], calls: dict[fx.Node, tuple[str, int]], model_name: str) -> list[str]:
    """Each layer is named after its first leaf module call; repeats get ``:2``, ``:3``…"""
    names: list[str] = []
    for nodes in groups:
        call = next((calls[n][0] for n in nodes if n in calls), model_name)
        name, repeat = call, 1
        while name in names:
            repeat += 1
            name = f"{call}:{repeat}"
        names.append(name)
    return names


def _skip_name(node: fx.Node, consumer: str) -> str:
    return f"{node.name}->{consumer}"


def _layer_code(root: nn.Module, route: _Route, index: int) -> fx.GraphModule:
    """A GraphModule over ``root`` (same tensors and modules) computing one layer: inputs are its
    main values then its popped skips; outputs its main values then its stashes (or, for the last
    layer, the model's output)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in route.main_inputs(index) + route.popped(index):
        env[node] = graph.placeholder(node.name)
        if _is_metadata(node):
            env[node] = graph.call_function(_unpack, (env[node],))
    for node in route.groups[index]:
        if node not in env:
            env[node] = graph.node_copy(node, lambda n: env[n])
    if index == len(route.groups) - 1:
        graph.output(fx.map_arg(route.output.args[0], lambda n: env[n]))
    else:
        sent = route.main_outputs(index) + [node for node, _ in route.stashed(index)]
        graph.output(tuple(_sendable(graph, env[node], node) for node in sent))
    return fx.GraphModule(root, graph, class_name=f"Layer{index}")


_METADATA_METHODS = {"size", "dim", "numel", "nelement", "ndimension", "stride", "element_size"}


def _is_metadata(node: fx.Node) -> bool:
    """Whether the node computes a size or number from tensor metadata (``x.size(0)``,
    ``x.shape[2:]``, ``h * w``) rather than a tensor."""
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    if node.op != "call_function":
        return False
    if node.target is torch.ops.aten.sym_size.int:
        return True
    if node.target is getattr:
        return node.args[1] in ("shape", "ndim")
    if node.target is len:
        return True
    inputs = node.all_input_nodes
    return getattr(node.target, "__module__", None) == "_operator" and bool(inputs) and all(
        _is_metadata(n) for n in inputs
    )


def _sendable(graph: fx.Graph, value: fx.Node, original: fx.Node) -> fx.Node:
    return graph.call_function(_pack, (value,)) if _is_metadata(original) else value


def _pack(value: Any) -> torch.Tensor:
    """A size or number as a tensor, so that it travels between stages like any other value
    (the runtime moves tensors only); it is the receiving micro-batch's own size."""
    if isinstance(value, (int, float, bool)):
        return torch.tensor(value)
    return torch.tensor(list(value), dtype=torch.int64)


def _unpack(packed: torch.Tensor) -> Any:
    return packed.item() if packed.dim() == 0 else torch.Size(packed.tolist())


# --------------------------------------------------------------------------- the layer module


_MODES = {True: "train", False: "eval"}


class CapturedLayer(Skippable):
    """One captured layer: runs its slice of the traced graph, popping and stashing its skips.

    It holds the original modules, parameters and buffers at their original dotted paths (as
    ``fx.GraphModule`` does), so its ``state_dict`` keys are the model's keys.
    """

    def __init__(
        self,
        code: fx.GraphModule,
        main_inputs: int,
        pops: Sequence[str],
        stashes: Sequence[str],
        main_outputs: int | None,
        exported_mode: bool | None = None,
    ) -> None:
        super().__init__()
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

    def forward(self, *main: Any) -> Any:
        """``main`` is the previous layer's value (a tensor or a tuple), or the model's inputs."""
        if self.exported_mode is not None and self.training != self.exported_mode:
            raise RuntimeError(
                f"this layer was captured with torch.export in {_MODES[self.exported_mode]} mode, which "
                f"the exported graph keeps; call autopipe.chain again with the model in "
                f"{_MODES[self.training]} mode"
            )
        if self.pop_names or self.stash_names:
            return self._drive(self._steps(main))
        return self._main(self._code(self, *self._inputs(main)))

    def _steps(self, main: tuple[Any, ...]) -> Any:
        inputs = self._inputs(main)
        for name in self.pop_names:
            inputs.append((yield pop(name)))
        outputs = self._code(self, *inputs)
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

    def extra_repr(self) -> str:
        return f"pop={list(self.pop_names)}, stash={list(self.stash_names)}"
