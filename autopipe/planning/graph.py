"""The layer chain and its skip edges as a networkx (multi-)DiGraph: the solver's input.

Nodes are layer indices carrying the layer's profile; edges are tensors carrying their bytes per
sample: ``main`` edges ``i → i+1`` (layer ``i``'s output) and ``skip`` edges ``stash → pop``.  The
solver reads from it which tensors cross each cut (:class:`Chain`).  It is a ``MultiDiGraph`` (a
``DiGraph`` subclass) because a skip from layer ``i`` to ``i+1`` runs beside the main edge.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from ..profiling.profiles import Profile

__all__ = ["Skip", "Chain", "build_graph", "chain_of"]


@dataclass(frozen=True)
class Skip:
    """A skip tensor stashed by layer ``stash`` and popped by layer ``pop`` (``stash < pop``)."""

    name: str
    stash: int
    pop: int
    bytes_per_sample: int
    fixed_bytes: int = 0  # per micro-batch, whatever its size (a weight stashed for a tied head)
    param: bool = False  # the stashing layer's own parameter or buffer: no new memory where it is made


@dataclass(frozen=True)
class Chain:
    """What the solver needs from the graph: per-layer output bytes (per sample, and per
    micro-batch whatever its size) and the skip edges.

    Every position ``1..L-1`` is a valid cut (a skip crossing it is routed straight from its
    producer to its consumer stage).
    """

    layers: int
    output_bytes: list[int]
    skips: list[Skip]
    output_fixed_bytes: list[int]


def build_graph(profile: Profile) -> nx.MultiDiGraph:
    """The chain as a DiGraph; raises ``ValueError`` naming a skip that is not stashed once
    and then popped once by a later layer.  A name a layer both stashes and pops with no earlier
    stash of it open is paired inside that layer (a nested block's own skip): no edge."""
    graph = nx.MultiDiGraph()
    for index, layer in enumerate(profile.layers):
        graph.add_node(index, name=layer.name, profile=layer)
    for index, layer in enumerate(profile.layers[:-1]):
        graph.add_edge(index, index + 1, kind="main", name=f"{layer.name}:out", bytes=layer.output_bytes,
                       fixed_bytes=layer.output_fixed_bytes)
    stashed: dict[str, int] = {}
    for index, layer in enumerate(profile.layers):
        inside = set(layer.stash) & set(layer.pop) - set(stashed)
        for name in layer.pop:
            if name in inside:
                continue
            source = stashed.pop(name, None)
            if source is None or source >= index:
                raise ValueError(f"skip '{name}' is popped by layer {index} ({layer.name}) but not "
                                 "stashed by an earlier layer (or popped twice); fix the skippable layers")
            stasher = profile.layers[source]
            graph.add_edge(source, index, kind="skip", name=name, bytes=stasher.stash_bytes.get(name, 0),
                           fixed_bytes=stasher.stash_fixed_bytes.get(name, 0), param=name in stasher.stash_params)
        for name in layer.stash:
            if name in inside:
                continue
            if name in stashed:
                raise ValueError(f"skip '{name}' is stashed by layers {stashed[name]} and {index}; "
                                 "give each stash its own name (or a Namespace)")
            stashed[name] = index
    if stashed:
        raise ValueError(f"skips {sorted(stashed)} are stashed but never popped; pop them or remove the stash")
    return graph


def chain_of(graph: nx.MultiDiGraph) -> Chain:
    """Read the per-layer output bytes and the skip edges off the graph."""
    count = graph.number_of_nodes()
    output, fixed = [0] * count, [0] * count
    skips: list[Skip] = []
    for source, target, data in graph.edges(data=True):
        if data["kind"] == "main":
            output[source], fixed[source] = int(data["bytes"]), int(data.get("fixed_bytes", 0))
        else:
            skips.append(Skip(data["name"], source, target, int(data["bytes"]), int(data.get("fixed_bytes", 0)),
                              bool(data.get("param", False))))
    skips.sort(key=lambda s: (s.stash, s.pop, s.name))
    return Chain(count, output, skips, fixed)
