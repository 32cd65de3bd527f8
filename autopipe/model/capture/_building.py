"""Building the layers: what each reads and sends (main value or skip), and its own graph."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..layers import Layer
from ..skip import Namespace
from ._layer import CapturedLayer, fixed_dtype
from ._tracing import Traced

__all__: list[str] = []


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


def build(traced: Traced, groups: list[list[fx.Node]], namespace: Namespace) -> list[Layer]:
    output = next(node for node in traced.graph.nodes if node.op == "output")
    route = _Route(groups, output)
    names = _layer_names(groups, traced.calls, namespace.label or "model")
    layers: list[Layer] = []
    for index, nodes in enumerate(groups):
        pops = [_skip_name(node, names[index]) for node in route.popped(index)]
        stashes = [_skip_name(node, names[consumer]) for node, consumer in route.stashed(index)]
        code = _layer_code(traced.root, route, index)
        if traced.state is not None:
            _constants_not_saved(code, traced.state)
        main_in = len(route.main_inputs(index))
        main_out = len(route.main_outputs(index)) if index + 1 < len(groups) else None
        last = index == len(groups) - 1
        module = CapturedLayer(
            code, main_in, pops, stashes, main_out, traced.mode,
            keywords=traced.keywords if index == 0 else (),
            input_sizes=traced.input_sizes if index == 0 else None,
            input_constants=traced.input_constants if index == 0 else (),
            output_spec=traced.output_spec if last else None,
            traced_mode=traced.traced_mode,
            argument_names=traced.argument_names if index == 0 else (),
            positional_names=traced.positional_names if index == 0 else (),
            fixed=traced.fixed if index == 0 else None,
            batch_sizes=traced.batch_sizes if index == 0 else None,
            batch_ranges=traced.batch_ranges if index == 0 else None,
            batch_guards=traced.batch_guards if index == 0 else None,
            input_dtypes=traced.input_dtypes if index == 0 else None,
            traced_hooks=traced.hooks,
            traced_reads=traced.reads,
        ).isolate(namespace)
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


def _constants_not_saved(code: fx.GraphModule, state: frozenset[str]) -> None:
    """Tensors that export lifted out of the forward (``lifted_tensor_0``: a constant the forward
    makes), or that fx found in a module's plain attribute (``self.mask = torch.ones(...)``, not a
    buffer), are buffers of the layer but not state of the model: kept out of ``state_dict``."""
    for name, _ in list(code.named_buffers()):
        if name not in state:
            owner, _, leaf = name.rpartition(".")
            code.get_submodule(owner)._non_persistent_buffers_set.add(leaf)


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
    _explained_dtype_checks(graph)
    return fx.GraphModule(root, graph, class_name=f"Layer{index}")


def _explained_dtype_checks(graph: fx.Graph) -> None:
    """An exported graph's dtype checks (``aten._assert_tensor_metadata``) made :func:`fixed_dtype`
    calls, given the model's line each was traced from, so that a failed one says why."""
    for node in graph.nodes:
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            node.target = fixed_dtype
            node.kwargs = {**node.kwargs, "where": _model_line(node)}


def _model_line(node: fx.Node) -> str:
    """``at file.py:123 `code``` for the last frame of the node's trace, or nothing without one."""
    frames = str(node.meta.get("stack_trace") or "").strip().splitlines()
    found = re.search(r'File "([^"]+)", line (\d+)', frames[-2]) if len(frames) >= 2 else None
    if found is None:
        return ""
    return f"at {os.path.basename(found[1])}:{found[2]} `{frames[-1].strip()}`"


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
    (the runtime moves tensors only); it is the receiving micro-batch's own size.  A float is a
    float64 tensor, a Python float's own precision, and an int or bool keeps its dtype, so
    :func:`_unpack` gives the exact value back."""
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    if isinstance(value, (int, bool)):
        return torch.tensor(value)
    return torch.tensor(list(value), dtype=torch.int64)


def _unpack(packed: torch.Tensor) -> Any:
    return packed.item() if packed.dim() == 0 else torch.Size(packed.tolist())


