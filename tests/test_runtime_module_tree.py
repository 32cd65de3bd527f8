"""The pipeline's module tree is the model's: ``modules()``, ``get_submodule()``, ``apply()`` and
``print(pipe)`` reach the model's own modules (parameterless ones and real containers too), so
the usual ``isinstance`` loops change what the stages run; and a model on the meta device is
refused with the way out."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torchvision
from torch import Tensor, nn
from torch.nn import functional as F
from torchvision.models.resnet import BasicBlock

import autopipe
from models import StockEncoder


class Net(nn.Module):
    """A model that is no Sequential (captured by torch.fx), with a parameterless Dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.enc(x).tanh())


class Functional(nn.Module):
    """Reads a module's parameters, not the module: a captured layer holds them in a container."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.act(self.first(x)), self.proj.weight, self.proj.bias)


def sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4))


def nested() -> nn.Module:
    return nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5)), nn.ReLU(), nn.Linear(16, 4))


def resnet() -> nn.Module:
    return torchvision.models.resnet18(weights=None, num_classes=10)


#: name -> (model maker, pipeline of a model, input)
Case = tuple[Callable[[], nn.Module], Callable[[nn.Module], autopipe.Pipeline], Tensor]
CASES: dict[str, Case] = {
    "sequential": (sequential, lambda m: autopipe.Pipeline(m, balance=[2, 2], chunks=2), torch.randn(6, 8)),
    "nested": (nested, lambda m: autopipe.Pipeline(m, balance=[1, 2], chunks=2), torch.randn(6, 8)),
    "replicas": (sequential, lambda m: autopipe.Pipeline(m, balance=[2, 2], chunks=2, replicas=2), torch.randn(8, 8)),
    "fx": (Net, lambda m: autopipe.Pipeline(m, balance=[3, 1], chunks=2), torch.randn(6, 8)),
    "resnet": (resnet, lambda m: autopipe.Pipeline(m, balance=[7, 8], chunks=2), torch.randn(4, 3, 32, 32)),
}


def named(module: nn.Module) -> list[tuple[str, int]]:
    return [(name, id(sub)) for name, sub in module.named_modules() if name]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_named_modules_are_the_models_own(case: str) -> None:
    make, build, _ = CASES[case]
    model = make()
    pipe = build(model)
    assert named(pipe) == named(model)
    assert list(pipe.state_dict()) == list(model.state_dict())
    assert [(n, id(p)) for n, p in pipe.named_parameters()] == [(n, id(p)) for n, p in model.named_parameters()]
    assert [(n, id(b)) for n, b in pipe.named_buffers()] == [(n, id(b)) for n, b in model.named_buffers()]
    pipe.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [case for case in CASES if case != "resnet"])  # train-mode batch norm: micro-batches
def test_dropout_set_through_modules_changes_what_runs(case: str) -> None:
    """The usual ``for m in net.modules(): if isinstance(m, nn.Dropout): m.p = 0`` on the pipeline
    gives the plain model's train-mode outputs (before, it found no Dropout and changed nothing)."""
    make, build, x = CASES[case]
    torch.manual_seed(1)
    model = make()
    torch.manual_seed(1)
    pipe = build(make())
    found = 0
    for net in (model, pipe):
        for module in net.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
                found += net is pipe
    assert found == sum(isinstance(m, nn.Dropout) for m in model.modules())
    torch.testing.assert_close(pipe(x), model(x))
    pipe.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chained", [False, True])
def test_resnet_zero_init_through_modules_is_the_models(chained: bool) -> None:
    """torchvision's ``zero_init_residual`` recipe run on ``pipe.modules()`` gives the state it
    gives on the model (before, the pipeline held no BasicBlock)."""
    model, other = resnet(), resnet()
    other.load_state_dict(model.state_dict())
    pipe = autopipe.Pipeline(autopipe.chain(other, torch.randn(2, 3, 32, 32)) if chained else other,
                             balance=[7, 7] if chained else [7, 8], chunks=2)
    for net in (model, pipe):
        blocks = [m for m in net.modules() if isinstance(m, BasicBlock)]
        assert len(blocks) == 8
        for block in blocks:
            nn.init.zeros_(block.bn2.weight)
    state = pipe.state_dict()
    assert list(state) == list(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key
    pipe.eval()
    model.eval()
    x = torch.randn(4, 3, 32, 32)
    torch.testing.assert_close(pipe(x), model(x))
    pipe.close()


@pytest.mark.timeout(120)
def test_get_submodule_apply_and_print_reach_every_layer() -> None:
    model = resnet()
    pipe = autopipe.Pipeline(model, balance=[7, 8], chunks=2)
    assert pipe.get_submodule("layer1.0.relu") is model.layer1[0].relu
    assert type(pipe.get_submodule("layer1")) is nn.Sequential
    seen: list[nn.Module] = []
    pipe.apply(seen.append)
    assert sum(isinstance(m, nn.ReLU) for m in seen) == sum(isinstance(m, nn.ReLU) for m in model.modules())
    text = repr(pipe)
    assert "(relu): ReLU(inplace=True)" in text and "(0): BasicBlock(" in text and "(maxpool): MaxPool2d(" in text
    pipe.close()


@pytest.mark.timeout(120)
def test_captured_chain_holds_the_models_modules_at_their_names() -> None:
    """A chain (``autopipe.chain``, what ``partition`` builds on) keeps its model, so the
    pipeline's modules are the model's own, containers too (``enc``, a Sequential), at their names."""
    model = Net()
    pipe = autopipe.Pipeline(autopipe.chain(model), balance=[3, 1], chunks=2)
    assert all(pipe.get_submodule(name) is module for name, module in model.named_modules() if name)
    assert list(pipe.state_dict()) == list(model.state_dict())
    pipe.close()


@pytest.mark.timeout(120)
def test_train_and_eval_reach_the_stages() -> None:
    model = sequential()
    pipe = autopipe.Pipeline(model, balance=[2, 2], chunks=2)
    x = torch.randn(6, 8)
    pipe.eval()
    assert not any(m.training for m in model.children())
    torch.testing.assert_close(pipe(x), model(x))
    pipe.train()
    assert all(m.training for m in model.children())
    pipe.close()


@pytest.mark.timeout(120)
def test_adopted_module_takes_assigned_tensors_to_the_stage() -> None:
    """A model module whose parameters a captured layer reads directly (``F.linear(x,
    self.proj.weight, ...)``) is the model's own in the tree, and a tensor that
    ``load_state_dict(assign=True)`` puts in it is the one the stage runs on."""
    model = Functional()
    pipe = autopipe.Pipeline(model, balance=[1, 1], chunks=2)
    assert pipe.get_submodule("proj") is model.proj
    other = Functional()
    pipe.load_state_dict(other.state_dict(), assign=True)
    x = torch.randn(6, 8)
    torch.testing.assert_close(pipe(x), other(x))
    pipe.close()


def test_meta_model_for_stages_with_data_is_refused_with_the_way_out() -> None:
    with torch.device("meta"):
        model = sequential()
    with pytest.raises(autopipe.DeviceError, match=r"meta device.*to_empty\(device='cpu'\).*load_state_dict"):
        autopipe.Pipeline(model, balance=[2, 2], chunks=2)


def test_meta_model_on_meta_stages_is_built() -> None:
    with torch.device("meta"):
        model = sequential()
    pipe = autopipe.Pipeline(model, balance=[2, 2], devices=["meta", "meta"], chunks=2)
    with torch.no_grad():
        assert pipe(torch.randn(6, 8, device="meta")).shape == (6, 4)
    pipe.close()


@pytest.mark.timeout(120)
def test_an_exported_layers_modules_it_does_not_run_are_not_shown() -> None:
    """A layer torch.export captured runs its graph, not the model's dropouts: the tree does not
    show them as the pipeline's (changing them would change nothing that runs)."""
    torch.manual_seed(0)
    model = StockEncoder()
    assert any(isinstance(module, nn.Dropout) for module in model.modules())
    x = torch.randn(8, 6, 8)
    chain = autopipe.chain(model, x)
    pipe = autopipe.Pipeline(chain, balance=[len(chain) - 1, 1], chunks=2)
    assert not [name for name, module in pipe.named_modules() if isinstance(module, nn.Dropout)]
    assert list(pipe.state_dict()) == list(model.state_dict())
    pipe.close()


class RootScaled(nn.Module):
    """A parameter of the model's root, read by a captured layer (as ViT's ``class_token``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.scale, self.head = nn.Linear(3, 8), nn.Parameter(torch.ones(8)), nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.inp(x) * self.scale))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loaded", ["model", "pipeline"])
def test_a_root_parameter_assigned_on_either_side_is_the_others(loaded: str) -> None:
    """``load_state_dict(assign=True)`` on the model reaches a root parameter the stage reads,
    and on the pipeline the model's: they had parted there (the stage ran the old ``scale``
    with the new layers, 4.8 off the model)."""
    torch.manual_seed(0)
    model, x = RootScaled(), torch.randn(8, 3)
    pipe = autopipe.Pipeline(autopipe.chain(model, x), balance=[1, 1], chunks=2)
    new = {key: torch.randn_like(value) for key, value in model.state_dict().items()}
    (model if loaded == "model" else pipe).load_state_dict(new, assign=True)
    theirs = pipe.state_dict(keep_vars=True)
    for key, value in model.state_dict(keep_vars=True).items():
        assert theirs[key] is value, key
        torch.testing.assert_close(value.detach(), new[key], msg=key)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
    pipe.close()
