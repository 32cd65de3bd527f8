"""A pipeline runs what the model runs: a Sequential or ResNet subclass with its own forward is
captured (its forward traced), a container with hooks stays one layer (its call runs them); hooks
that would not run (on the model itself, or added later above the layers) and modules replaced
after the pipeline was built are refused, where each ran silently without them."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torchvision
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, ResNet

import autopipe
from autopipe.errors import ChainError
from models import StockEncoder


class Scaled(nn.Sequential):
    """A Sequential whose forward does more than call its children."""

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(x * 0.5) * 2 + 1


class NormalizedResNet(ResNet):
    """A ResNet whose forward scales its input and its logits."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x * 0.5) / 2


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _assert_trains_like(pipe: nn.Module, model: nn.Module, x: Tensor) -> None:
    """Output and every gradient of ``pipe(x)`` are the plain ``model``'s (a copy taken before)."""
    out, ref = pipe(x), model(x)
    torch.testing.assert_close(out, ref)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    for (name, p), q in zip(pipe.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def _refused_until_removed(pipe: autopipe.Pipeline, handle: Any, refusal: str) -> None:
    """A call of ``pipe`` (on 8 features) is refused, naming ``refusal``, until the hook of
    ``handle`` is removed; the pipeline is then closed."""
    with pytest.raises(ChainError, match=refusal):
        pipe(torch.randn(4, 8))
    handle.remove()
    assert pipe(torch.randn(4, 8)).shape == (4, 4)
    pipe.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nested", [False, True], ids=["root", "nested"])
def test_a_sequential_subclass_with_its_own_forward_runs_it(nested: bool) -> None:
    """It was read as a Sequential: its children in turn, its forward never run (0.49 off)."""
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        inner = Scaled(*_mlp())
        return nn.Sequential(nn.Linear(8, 8), inner, nn.Tanh()) if nested else inner

    x = torch.randn(6, 8)
    chain = autopipe.layer_chain(model())  # as partition reads it: nested Sequentials are flattened
    pipe = autopipe.Pipeline(chain, balance=[1, len(chain) - 1], chunks=2)
    _assert_trains_like(pipe, model(), x)
    pipe.close()
    manual = autopipe.Pipeline(model(), balance=[1, 2] if nested else [2, 3], chunks=2)  # torchgpipe's form
    _assert_trains_like(manual, model(), x)
    manual.close()


@pytest.mark.timeout(120)
def test_a_resnet_subclass_with_its_own_forward_runs_it() -> None:
    """It was read as a torchvision ResNet: ResNet's forward, not its own (0.38 off)."""
    torch.manual_seed(0)
    model = NormalizedResNet(BasicBlock, [1, 1, 1, 1], num_classes=5).eval()
    reference = copy.deepcopy(model)
    chain = autopipe.layer_chain(model, torch.randn(2, 3, 32, 32))
    pipe = autopipe.Pipeline(chain, balance=[len(chain) // 2, len(chain) - len(chain) // 2], chunks=2)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference(x))
    pipe.close()


@pytest.mark.timeout(120)
def test_containers_with_hooks_stay_one_layer_whose_call_runs_them() -> None:
    """A nested Sequential's and a ResNet stage's hooks never ran: they were flattened."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4))
    model[1].register_forward_hook(lambda module, args, out: out * 2)
    assert [layer.name for layer in autopipe.layer_chain(model)] == ["0", "1", "2"]
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(autopipe.layer_chain(model), balance=[2, 1], chunks=2)
    _assert_trains_like(pipe, reference, torch.randn(6, 8))
    pipe.close()
    net = torchvision.models.resnet18(num_classes=4)
    seen: list[tuple[int, ...]] = []
    net.layer3.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    names = [layer.name for layer in autopipe.layer_chain(net)]
    assert "layer3" in names and "layer3.0" not in names and "layer2.0" in names


@pytest.mark.timeout(60)
def test_hooks_on_the_model_itself_are_refused_with_the_way_out() -> None:
    model = _mlp()
    handle = model.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    with pytest.raises(ChainError, match=r"the model has hooks .* never run.*pipe.register_forward_hook"):
        autopipe.Pipeline(model, balance=[2, 3], chunks=2)
    with pytest.raises(ChainError, match="the model has hooks"):  # before profiling
        autopipe.partition(model, torch.randn(4, 8), devices=["cpu", "cpu"], quiet=True)
    handle.remove()
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(model, balance=[2, 3], chunks=2)
    hook = model.register_forward_hook(lambda module, args, out: out + 1)  # after building: at the call
    with pytest.raises(ChainError, match="the model has hooks"):
        pipe(torch.randn(4, 8))
    hook.remove()
    _assert_trains_like(pipe, reference, torch.randn(4, 8))  # the pipeline is still usable
    pipe.close()


@pytest.mark.timeout(60)
def test_a_hook_added_later_on_a_flattened_container_is_refused() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4))
    pipe = autopipe.Pipeline(autopipe.layer_chain(model), balance=[2, 2], chunks=2)
    handle = model[1].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    _refused_until_removed(pipe, handle, r"the model's '1' \(Sequential\) has hooks.*leaf_modules=\['1'\]")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["model", "pipeline"])
def test_a_module_replaced_after_building_is_refused(where: str) -> None:
    """The stages ran the old head and the new one got no gradient, with no error."""
    model = _mlp()
    pipe = autopipe.Pipeline(model, balance=[2, 3], chunks=2)
    old = model[4]
    setattr(model if where == "model" else pipe, "4", nn.Linear(16, 10))
    with pytest.raises(ChainError, match=rf"the {where}'s module at '4' is a new Linear, not the Linear"):
        pipe(torch.randn(4, 8))
    with pytest.raises(ChainError, match="Build the pipeline again"):
        pipe.train_step(torch.randn(4, 8), target=torch.randn(4, 4), loss_fn=nn.functional.mse_loss)
    setattr(model if where == "model" else pipe, "4", old)
    assert pipe(torch.randn(4, 8)).shape == (4, 4)
    pipe.close()


@pytest.mark.timeout(120)
def test_hooks_torch_export_traced_run_as_traced_and_a_change_is_refused() -> None:
    """torch.export traces the model's forward hooks into its graph: they run as at the capture,
    and one added since would not."""
    torch.manual_seed(0)
    model = StockEncoder().eval()
    model.register_forward_hook(lambda module, args, out: out * 3)
    model.head.register_forward_hook(lambda module, args, out: out + 1)
    x = torch.randn(4, 6, 8)
    chain = autopipe.chain(model, x)
    pipe = autopipe.Pipeline(chain, balance=[len(chain) - 1, 1], chunks=2)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
    model.embed.register_forward_hook(lambda module, args, out: out * 0)
    with pytest.raises(ChainError, match=r"hooks on the model's 'embed' \(Linear\) changed since the model"):
        pipe(x)
    pipe.close()


@pytest.mark.timeout(120)
def test_a_container_replaced_after_building_is_refused() -> None:
    """A ResNet stage replaced whole (a copy: the same layers, other tensors) is refused too."""
    net = torchvision.models.resnet18(num_classes=4)
    chain = autopipe.layer_chain(net)
    pipe = autopipe.Pipeline(chain, balance=[len(chain) // 2, len(chain) - len(chain) // 2], chunks=2)
    old, net.layer1 = net.layer1, copy.deepcopy(net.layer1)
    with pytest.raises(ChainError, match="the model's module at 'layer1' is a new Sequential, not the"):
        pipe(torch.randn(4, 3, 32, 32))
    net.layer1 = old
    assert pipe(torch.randn(4, 3, 32, 32)).shape == (4, 4)
    pipe.close()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.l1(x)))


class Traced(nn.Module):
    """Not a Sequential: torch.fx traces through ``enc`` (a Block is no leaf) and its call's hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.enc, self.out = nn.Linear(8, 8), Block(), nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.enc(self.inp(x)))


@pytest.mark.timeout(60)
def test_a_module_with_hooks_is_one_layer_of_a_captured_model_and_one_added_later_is_refused() -> None:
    """torch.fx traced through ``enc`` and kept only what its forward hooks did to the tensors: a
    backward hook, or a hook collecting features, never ran.  A module with hooks is now a layer."""
    torch.manual_seed(0)
    model = Traced()
    seen: list[int] = []
    model.enc.register_forward_hook(lambda module, args, out: seen.append(len(out)) or out * 2)
    model.enc.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 0,))
    reference = copy.deepcopy(model)
    chain = autopipe.chain(model, granularity="finer")
    assert [layer.name for layer in chain] == ["inp", "enc", "out"]
    pipe = autopipe.Pipeline(chain, balance=[2, 1], chunks=2)
    seen.clear()
    _assert_trains_like(pipe, reference, torch.randn(6, 8))  # the backward hook zeroes inp's gradients
    assert seen[:3] == [3, 3, 6]  # the pipeline's: once per micro-batch, as hooks on a layer are; the plain model's
    pipe.close()
    plain = Traced()
    chain = autopipe.chain(plain, granularity="finer")
    assert [layer.name for layer in chain] == ["inp", "enc.l1", "enc.l2", "out"]  # traced through
    pipe = autopipe.Pipeline(chain, balance=[2, 2], chunks=2)
    handle = plain.enc.register_forward_pre_hook(lambda module, args: (args[0] * 0,))
    _refused_until_removed(pipe, handle, r"the model's 'enc' \(Block\) has hooks .* before the model is read")


@pytest.mark.timeout(60)
def test_a_parametrization_removed_inside_a_layer_after_building_runs() -> None:
    """What changes inside a layer runs, as the layer's call runs it: removing weight norm after
    building (folding it for inference) was refused."""
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    model = _mlp()
    parametrizations.weight_norm(model[2])
    pipe = autopipe.Pipeline(model, balance=[2, 3], chunks=2)
    parametrize.remove_parametrizations(model[2], "weight")
    reference = copy.deepcopy(model)
    _assert_trains_like(pipe, reference, torch.randn(6, 8))
    pipe.close()


@pytest.mark.timeout(120)
def test_an_exported_model_refuses_hooks_added_before_building_and_modules_replaced_after() -> None:
    """An exported graph runs no module of the model: hooks added between the capture and the
    pipeline, and a module the model is given later, never ran, with no error."""
    torch.manual_seed(0)
    model = StockEncoder().eval()
    x = torch.randn(4, 6, 8)
    chain = autopipe.chain(model, x)
    handle = model.embed.register_forward_hook(lambda module, args, out: out * 0)
    with pytest.raises(ChainError, match=r"hooks on the model's 'embed' \(Linear\) changed since the model was"):
        autopipe.Pipeline(chain, balance=[len(chain) - 1, 1], chunks=2)
    handle.remove()
    pipe = autopipe.Pipeline(chain, balance=[len(chain) - 1, 1], chunks=2)
    model.head = nn.Linear(16, 4)
    with pytest.raises(ChainError, match="the model's module at 'head' is a new Linear"):
        pipe(x)
    pipe.close()


@pytest.mark.timeout(60)
def test_replicas_running_copies_refuse_a_module_swapped_inside_a_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas on CUDA run copies of the layers: a module swapped inside one (an activation) ran in
    the first replica only.  Copies are forced here on CPU, as CUDA devices would make them."""
    from autopipe.runtime import pipeline

    monkeypatch.setattr(pipeline, "shares_parameters", lambda groups: False)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 4))
    pipe = autopipe.Pipeline(model, balance=[1, 1], devices=["cpu"] * 4, chunks=1, replicas=2)
    model[0][1] = nn.Tanh()
    with pytest.raises(ChainError, match=r"the model's module at '0.1' is a new Tanh, not the ReLU"):
        pipe(torch.randn(4, 8))
    pipe.close()


class Stack(nn.Module):
    """Blocks in a ModuleList, which the forward indexes and never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(8, 8), nn.ModuleList(Block() for _ in range(3)), nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


@pytest.mark.timeout(60)
def test_hooks_on_a_module_list_change_nothing() -> None:
    """A ModuleList's hooks never run, on the plain model either ("hook every module" tools): they
    made it one layer, its blocks traced through, and the pipeline refused them."""
    torch.manual_seed(0)
    model = Stack()
    names = [layer.name for layer in autopipe.chain(model)]
    model.blocks.register_forward_hook(lambda module, args, out: out * 0)
    assert [layer.name for layer in autopipe.chain(model)] == names == ["inp", "blocks.0", "blocks.1", "blocks.2",
                                                                         "out"]
    reference = copy.deepcopy(model)
    pipe = autopipe.Pipeline(autopipe.chain(model), balance=[2, 3], chunks=2)
    _assert_trains_like(pipe, reference, torch.randn(6, 8))
    pipe.close()
