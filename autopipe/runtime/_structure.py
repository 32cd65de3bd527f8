"""What a pipeline was built on, checked at every call: the modules at their paths, and the hooks
of the model's modules whose forward it does not run.

The stages run the modules the pipeline was built with.  One put in their place afterwards
(``model.head = nn.Linear(...)``, or ``pipe.head = ...``) would never run, and an optimizer on
its parameters would train them on nothing, where the plain model runs the new module: refused.

A pipeline runs the model's layers, not the forward of the modules above them: the model itself,
a Sequential flattened into its children, a ResNet's ``layer3`` split into its blocks, a container
torch.fx traced through.  Their hooks would never run (a Sequential or ResNet stage with hooks is
kept one layer when the chain is read, so this is about the model itself and hooks added later):
refused.  torch.export traces every hook of the model into its graph, which runs them as they
were at the capture; any change since is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import nn

from ..errors import ChainError
from ..model.capture import CapturedLayer
from ..model.layers import Layer, call_hooks

__all__ = ["Structure", "submodule"]

Paths = list[tuple[str, nn.Module]]
#: Where (``"pipeline"`` or ``"model"``), the path, and the parent module, name and child of one
#: step down that path: the child must still be there.
Edge = tuple[str, str, nn.Module, str, nn.Module]


@dataclass(frozen=True)
class Structure:
    """The steps down the module trees of a pipeline and its model to the modules the stages run
    (``edges``), the model's modules whose forward no stage runs (``above``) and the hooks
    torch.export traced into a captured graph, per path of those (``traced``)."""

    edges: list[Edge]
    above: Paths
    traced: dict[str, tuple[tuple[int, ...], ...]]

    @staticmethod
    def of(pipe: nn.Module | None, held: Paths, layers: Sequence[Layer], model: nn.Module | None) -> Structure:
        """What to check of ``pipe`` holding ``held`` (none: only the hooks) that runs ``layers``
        of ``model``.  Where a layer is a graph torch.export captured, no module of the model
        runs and the hooks are those it traced, now."""
        edges = _edges(held, [("pipeline", pipe), ("model", model)])
        if model is None:
            return Structure(edges, [], {})
        if any(isinstance(layer.module, CapturedLayer) and layer.module.exported_mode is not None for layer in layers):
            above = list(model.named_modules(remove_duplicate=False))
            return Structure(edges, above, {path: call_hooks(module) for path, module in above})
        run = {id(module) for layer in layers for module in layer.module.modules() if type(module) is not nn.Module}
        paths = [layer.path(name) for layer in layers for name, _ in layer.module.named_modules(remove_duplicate=False)]
        prefixes = dict.fromkeys(".".join(path.split(".")[:cut])  # each path's strict prefixes, "" too
                                 for path in paths if path for cut in range(path.count(".") + 1))
        above = [(path, module) for path in prefixes
                 for module in [submodule(model, path)] if module is not None and id(module) not in run]
        return Structure(edges, above, {})

    def check(self) -> None:
        """Refuse a call if a module the stages run was replaced (or a container holding it), in
        the pipeline or in the model, or hooks above its layers would not run as the plain model
        runs them.  A dict lookup per step: 0.04 ms for a ResNet-50's 300 steps.

        Raises:
            ChainError: naming the module and the way out.
        """
        for where, path, parent, name, child in self.edges:
            now = parent._modules.get(name)
            if now is not child:
                raise ChainError(
                    f"the {where}'s module at '{path}' is not the one the pipeline was built with "
                    f"({type(now).__name__} for {type(child).__name__}): the stages run the modules they "
                    f"were built with, so it would never run nor train. Build the pipeline again from the model "
                    f"(autopipe.partition(model, ...) or autopipe.Pipeline(model, plan))")
        self.check_hooks()

    def check_hooks(self) -> None:
        """Refuse hooks above the layers that would not run as the plain model runs them.

        Raises:
            ChainError: naming the module and the way out.
        """
        for path, module in self.above:
            if call_hooks(module) != self.traced.get(path, _NONE):
                raise ChainError(_unrun_hooks(path, module, path in self.traced))


_NONE = call_hooks(nn.Module())


def _edges(held: Paths, roots: list[tuple[str, nn.Module | None]]) -> list[Edge]:
    """Each step from each root down to each held module's path, once (where the path exists)."""
    edges: dict[tuple[str, int, str], Edge] = {}
    for where, root in roots:
        for path, _ in held:
            node, walked = root, []
            for name in path.split("."):
                child = None if node is None else node._modules.get(name)
                if child is None:
                    break
                walked.append(name)
                edges.setdefault((where, id(node), name), (where, ".".join(walked), node, name, child))
                node = child
    return list(edges.values())


def _unrun_hooks(path: str, module: nn.Module, traced: bool) -> str:
    """Why hooks on the model's ``module`` at ``path`` do not run, and the way out."""
    what = "the model" if not path else f"the model's '{path}' ({type(module).__name__})"
    if traced:
        return (f"hooks on {what} changed since the pipeline was built: torch.export traced the ones there then "
                "into its graph, which runs them as they were. Build the pipeline again from the model")
    way = ("register them on the pipeline (pipe.register_forward_hook(...)), which is called as the model was"
           if not path else "register them before building the pipeline (a module with hooks then stays one "
           f"layer, whose call runs them), or keep it one layer: autopipe.chain(model, leaf_modules=['{path}'])")
    return (f"{what} has hooks (register_forward_hook, register_forward_pre_hook or a backward hook) that would "
            f"never run: the pipeline runs the layers inside it, not its forward. Remove them, or {way}")


def submodule(model: nn.Module, path: str) -> nn.Module | None:
    """The module at the dotted ``path`` in ``model``, or ``None`` where there is none."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None
