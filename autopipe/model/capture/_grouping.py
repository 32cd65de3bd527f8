"""Grouping a traced graph's nodes into layers: one per leaf call, glue with its latest input."""
from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from ._tracing import AUGMENTED, Traced

__all__: list[str] = []


def group(traced: Traced) -> list[list[fx.Node]]:
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


def _place(traced: Traced) -> dict[fx.Node, int]:
    """Each node's layer.  Glue moves up to its latest input's layer, but never above a node
    that may write in place (:func:`_may_write`); such a node stays where it is, with the glue
    that makes what it writes into: a write must stay after the reads before it and before the
    reads after it, and which values alias is not tracked.  A node reading no placed node (an
    attribute, a constant) joins its first user's layer, unless only unused nodes read it: those
    (export's dtype check of ``self.bias.to(h.device)``) join their latest input's layer, so that
    they pull no state into an earlier layer.  A buffer's readers end up in one layer
    (:func:`_merge_shared_state`)."""
    where: dict[fx.Node, int] = {}
    writes = {node for node in traced.graph.nodes if _may_write(traced, node)}
    staying = _feeding(traced, writes) | writes
    layer, current, floor = -1, None, 0
    for node in traced.graph.nodes:
        if node in traced.calls:
            if traced.calls[node] != current:
                layer, current = layer + 1, traced.calls[node]
            where[node] = layer
        elif node.op == "placeholder":
            where[node] = 0
        elif node in staying:
            where[node] = max(layer, 0)
        elif node.op in ("call_function", "call_method"):
            placed = [where[n] for n in node.all_input_nodes if n in where]
            if placed:
                where[node] = max(*placed, floor)
        if node in writes:
            floor = where[node]
    last = max(layer, 0)
    called = _called_state(traced, where)
    unused: dict[fx.Node, None] = {}  # in reverse graph order
    for node in reversed(traced.graph.nodes):
        if node.op != "output" and node not in where:
            users = [last if user.op == "output" else where[user] for user in node.users if user not in unused]
            if users:
                where[node] = min(users + _held(traced, node, called))
            else:
                unused[node] = None
    for node in reversed(unused):
        inputs = [where[n] for n in node.all_input_nodes]
        where[node] = max(inputs, default=min(_held(traced, node, called), default=0))
    return where


def _held(traced: Traced, node: fx.Node, called: dict[int, int]) -> list[int]:
    """The layers of the module calls holding the parameter ``node`` reads: a parameter that a
    module call holds too (tied weights) starts where that call is, and travels to later readers
    as a skip."""
    return [called[id(t)] for t in _state_of(traced.root, node) if isinstance(t, nn.Parameter) and id(t) in called]


def _called_state(traced: Traced, where: dict[fx.Node, int]) -> dict[int, int]:
    """Per tensor that a module call holds, the first layer calling it."""
    first: dict[int, int] = {}
    for node in traced.graph.nodes:
        if node.op == "call_module" and node in where:
            for tensor in _state_of(traced.root, node):
                first[id(tensor)] = min(first.get(id(tensor), where[node]), where[node])
    return first


def _feeding(traced: Traced, writes: set[fx.Node]) -> set[fx.Node]:
    """The glue that a glue write reads from, back to the leaf calls and inputs: staying with the
    write, a value it writes into (``shifted = labels.new_zeros(...)``) and a view of it
    (``shifted[:, 1:]``) do not travel to it apart, as two tensors."""
    found: set[fx.Node] = set()
    todo = [n for node in writes if node not in traced.calls for n in node.all_input_nodes]
    while todo:
        node = todo.pop()
        if node not in found and node not in traced.calls and node.op in ("call_function", "call_method"):
            found.add(node)
            todo.extend(node.all_input_nodes)
    return found


def _may_write(traced: Traced, node: fx.Node) -> bool:
    """Whether ``node`` may write into a tensor in place: an in-place method or function
    (``x.add_``, ``torch.relu_``), an augmented assignment (``h += y``), one given
    ``inplace=True`` (fx records it by keyword) or ``out=``, a mutating ATen operation of an
    exported graph, or a module with ``inplace`` set (``nn.ReLU(inplace=True)``) or from outside
    ``torch.nn``, whose code is not known."""
    if node.op == "call_module":
        module = traced.root.get_submodule(str(node.target))
        return bool(getattr(module, "inplace", False)) or not type(module).__module__.startswith("torch.nn")
    if node.op not in ("call_function", "call_method"):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    if node.op == "call_function" and node.target in AUGMENTED:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    in_place = name.endswith("_") and not name.endswith("__")
    return in_place or bool(node.kwargs.get("inplace")) or "out" in node.kwargs


def _merge_shared_state(traced: Traced, where: dict[fx.Node, int], count: int) -> dict[fx.Node, int]:
    """Layers that use one parameter or buffer (a module called twice, tied weights) become one,
    with every layer between them: a tensor must live on exactly one stage.  A parameter's
    attribute node may hand it on to later layers (tied weights travel as a skip, their
    gradients adding up), but every layer reading a buffer uses it: the buffer may be updated
    in place (running statistics, a counter), and a stage that received it could read it while
    its owner updates it for the next micro-batch."""
    uses: dict[int, list[int]] = {}
    for node in traced.graph.nodes:
        if node.op == "get_attr" and not node.users:
            continue  # read by nothing (an alias left in the graph): it holds no layer's state
        for tensor in _state_of(traced.root, node):
            layers = uses.setdefault(id(tensor), [])
            layers.append(where[node])
            if node.op == "get_attr" and not isinstance(tensor, nn.Parameter):
                layers.extend(count - 1 if user.op == "output" else where[user] for user in _readers(traced, node))
    renumber = list(range(count))
    for start, end in sorted((min(layers), max(layers)) for layers in uses.values()):
        for index in range(start, end + 1):
            renumber[index] = renumber[start]
    dense = {old: new for new, old in enumerate(sorted(set(renumber)))}
    return {node: dense[renumber[index]] for node, index in where.items()}


def _readers(traced: Traced, attribute: fx.Node) -> list[fx.Node]:
    """The users of a buffer's node and, through writes into it (``add_`` returns the buffer:
    an exported graph reads it after the write through that node), of every alias so made."""
    aliases, readers = [attribute], []
    for alias in aliases:
        for user in alias.users:
            readers.append(user)
            if _may_write(traced, user) and user.args and user.args[0] is alias and user not in aliases:
                aliases.append(user)
    return readers


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


