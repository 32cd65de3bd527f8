"""What a pipeline was built on, checked at every call: the modules at their paths, and the hooks
of the model's modules whose forward it does not run.

The stages run the layers the pipeline was built with.  One put in a layer's place afterwards
(``model.head = nn.Linear(...)``, ``pipe.head = ...``, or a container holding layers) would
never run, and an optimizer on its parameters would train them on nothing, where the plain model
runs the new module: refused.  What changes inside a layer (a parametrization added or removed,
a submodule of a block swapped) runs, as the layer's own call runs it; but replicas that run
copies of the layers (on CUDA) would not see it in their copies, so there every module is checked.

A pipeline runs the model's layers, not the forward of the modules above them: the model itself,
a Sequential flattened into its children, a ResNet's ``layer3`` split into its blocks, a container
torch.fx traced through.  A module with hooks is kept one layer when the chain is read (its call
runs them), so hooks above the layers are the model's own and those added later: refused.
torch.export traces every module's forward hooks into its graph as they were at the capture
(what they do to the tensors, not what they do besides) and drops backward hooks: any change
since, and any backward hook, is refused.  A capture keeps the plain values its code may read
(``self.temperature``, a config's ``scale``) in the graph as constants: a change since is
refused too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import nn

from ..errors import ChainError
from ..model.capture import CapturedLayer, Watched
from ..model.layers import UNCALLED, Hooks, Layer, call_hooks, run_modules

__all__ = ["Structure", "submodule"]

Paths = list[tuple[str, nn.Module]]
#: Where (``"model"`` or ``"pipeline"``), the path, and the parent module, name and child of one
#: step down that path: the child must still be there.
Edge = tuple[str, str, nn.Module, str, nn.Module]


@dataclass(frozen=True)
class Structure:
    """The steps down the module trees of a model and its pipeline to the layers the stages run
    (``edges``), the model's modules whose forward no stage runs (``above``), the hooks a
    capture traced into its graph, by path (``traced``), and the plain values the captured code
    may have read into it as constants (``reads``)."""

    edges: list[Edge]
    above: Paths
    traced: dict[str, Hooks]
    reads: Watched | None = None

    @staticmethod
    def of(pipe: nn.Module | None, held: Paths, layers: Sequence[Layer], inside: bool = False) -> Structure:
        """What to check of ``pipe`` holding ``held`` (none: only the hooks) that runs ``layers``
        (of the model a :class:`~autopipe.model.layers.Chain` was read from, if any); ``inside``:
        the modules inside the layers too (replicas run copies).  A layer torch.export captured
        runs no module of the model: every one is then checked."""
        model: nn.Module | None = getattr(layers, "model", None)
        paths = {path for path, _ in held}
        tops = held if inside else [(path, module) for path, module in held
                                    if not any(prefix in paths for prefix in _prefixes(path))]
        edges = _edges(tops, [("model", model), ("pipeline", pipe)])
        if model is None:
            return Structure(edges, [], {})
        captured = [layer.module for layer in layers if isinstance(layer.module, CapturedLayer)]
        traced = captured[0].traced_hooks if captured else {}
        reads = Watched(model, captured[0].traced_reads) if captured else None
        if any(layer.exported_mode is not None for layer in captured):
            modules = list(model.named_modules(remove_duplicate=False))
            return Structure(edges + _edges(modules[1:], [("model", model)]), _called(modules), traced, reads)
        run = {id(module) for layer in layers for module in run_modules(layer.module)}
        within = (layer.path(name) for layer in layers
                  for name, _ in layer.module.named_modules(remove_duplicate=False))
        prefixes = dict.fromkeys(prefix for path in within for prefix in _prefixes(path))
        above = [(path, module) for path in prefixes
                 for module in [submodule(model, path)] if module is not None and id(module) not in run]
        return Structure(edges, _called(above), traced, reads)

    def check(self) -> None:
        """Refuse a call if a layer the stages run was replaced (or a container holding it), in
        the model or in the pipeline, or hooks above the layers would not run as the plain model
        runs them, or a value the capture holds as a constant changed: 0.04 ms for a ResNet-50 (a
        dict lookup per step down to a layer, 300 of them), about 1 ms for 1,000 modules exported
        by torch.export (each module's hooks compared), 0.33 ms for the 477 values a 24-block
        GPT-2's code may read (``n_embd=32``, this 2-core machine).

        Raises:
            ChainError: naming the module and the way out.
        """
        for where, path, parent, name, child in self.edges:
            now = parent._modules.get(name)
            if now is not child:
                change = "was removed" if now is None else f"is a new {type(now).__name__}"
                raise ChainError(
                    f"the {where}'s module at '{path}' {change}, not the {type(child).__name__} the pipeline "
                    f"was built with: the stages run the modules they were built with, so it would never run nor "
                    f"train. Build the pipeline again from the model (autopipe.partition(model, ...) or "
                    f"autopipe.Pipeline(model, plan))")
        change = None if self.reads is None else self.reads.first_change()
        if change is not None:
            where, then, now = change
            name = where.rpartition(".")[2]
            raise ChainError(
                f"{where} was {then} when the model was captured, and the captured graph holds that value "
                f"as a constant (the capture ran the code that reads it once); it is {now} now, and the "
                f"pipeline would still compute with the old one. Capture the model again after changing it "
                f"(autopipe.partition(model, ...), or autopipe.chain(model, ...) then autopipe.Pipeline), or keep "
                f"the value in a buffer (self.register_buffer('{name}', torch.tensor(...))), which the graph reads "
                f"at every call")
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


def _called(modules: Paths) -> Paths:
    """Those of ``modules`` a forward may call: not a ``ModuleList`` or ``ModuleDict``, which a
    forward indexes (their hooks never run, on the plain model either)."""
    return [(path, module) for path, module in modules if not isinstance(module, UNCALLED)]


def _prefixes(path: str) -> list[str]:
    """The strict prefixes of a dotted module path, ``""`` (the root) first; none of ``""``."""
    parts = path.split(".") if path else []
    return [".".join(parts[:cut]) for cut in range(len(parts))]


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
        return (f"hooks on {what} changed since the model was captured, or it has a backward hook: torch.export "
                "traced the forward hooks there then into its graph, which runs them as they were, and drops "
                "backward hooks. Capture the model again and build the pipeline from it (autopipe.partition(model, "
                "...), or autopipe.chain(model, ...) then autopipe.Pipeline); a backward hook needs torch.fx")
    way = ("register them on the pipeline (pipe.register_forward_hook(...)), which is called as the model was"
           if not path else "register them before the model is read into layers (a module with hooks then stays "
           f"one layer, whose call runs them), or keep it one layer: autopipe.chain(model, leaf_modules=['{path}'])")
    return (f"{what} has hooks (register_forward_hook, register_forward_pre_hook or a backward hook) that would "
            f"never run: the pipeline runs the layers inside it, not its forward. Remove them, or {way}")


def submodule(model: nn.Module, path: str) -> nn.Module | None:
    """The module at the dotted ``path`` in ``model``, or ``None`` where there is none."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None
