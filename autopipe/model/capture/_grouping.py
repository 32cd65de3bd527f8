"""Grouping a traced graph's nodes into layers: one per leaf call, glue with its latest input."""
from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from ._tracing import Traced

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


def _merge_shared_state(traced: Traced, where: dict[fx.Node, int], count: int) -> dict[fx.Node, int]:
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


