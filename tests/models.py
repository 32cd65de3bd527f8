"""Small models shared by test modules: non-Sequential ones whose forwards have long-lived values
(capture and runtime tests) and a Sequential with skips across stages."""
from __future__ import annotations

import torch
from torch import Tensor, nn

import autopipe


def _block(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(inputs, outputs, 3, padding=1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU(inplace=True)
    )


class UNet(nn.Module):
    """Two-level U-Net: each encoder output is concatenated into the decoder much later (skips)."""

    def __init__(self, channels: int = 3, width: int = 8, classes: int = 2) -> None:
        super().__init__()
        self.enc1 = _block(channels, width)
        self.enc2 = _block(width, 2 * width)
        self.pool = nn.MaxPool2d(2)
        self.middle = _block(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = _block(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec1 = _block(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        m = self.middle(self.pool(e2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.head(d1)


class TwoBranch(nn.Module):
    """A trunk feeding two branches; their two outputs are merged at the end (or returned as a pair)."""

    def __init__(self, features: int = 16, classes: int = 5, merge: bool = True) -> None:
        super().__init__()
        self.merge = merge
        self.trunk = nn.Sequential(nn.Linear(features, 32), nn.Tanh())
        self.left = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, classes))
        self.right = nn.Sequential(nn.Linear(32, 24), nn.GELU(), nn.Linear(24, classes))
        self.mix = nn.Linear(2 * classes, classes)

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        h = self.trunk(x)
        a, b = self.left(h), self.right(h)
        if not self.merge:
            return a, b
        return self.mix(torch.cat([a, b], dim=1)) + a * b


class Encoder(nn.Module):
    """Transformer encoder layers that all read one causal attention mask built in the forward."""

    def __init__(self, width: int, heads: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), device=x.device)
        for layer in self.layers:
            x = layer(x, src_mask=mask)
        return self.norm(x)


class TinyTransformer(nn.Module):
    """Sequence classifier: embedding plus position, causal encoder, mean over time, linear head."""

    def __init__(self, features: int = 8, width: int = 16, heads: int = 2, depth: int = 3, classes: int = 4,
                 length: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.position = nn.Parameter(torch.randn(1, length, width) * 0.02)
        self.encoder = Encoder(width, heads, depth)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        batch, length = x.shape[:2]
        h = self.encoder(self.embed(x) + self.position[:, :length])
        return self.head(h.reshape(batch, length, -1).mean(dim=1))


@autopipe.skippable(stash=["skip"])
class Save(nn.Module):
    """Stashes its input as "skip" and passes it on."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield autopipe.stash("skip", x)
        return x


@autopipe.skippable(pop=["skip"])
class Add(nn.Module):
    """Adds the "skip" an earlier :class:`Save` stashed."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield autopipe.pop("skip")
        return x + skip


@autopipe.skippable(stash=["a"])
class StashA(nn.Linear):
    def forward(self, x: Tensor):  # type: ignore[override]
        y = super().forward(x)
        yield autopipe.stash("a", y)
        return torch.relu(y)


@autopipe.skippable(stash=["b"], pop=["a"])
class PopAStashB(nn.Linear):
    def forward(self, x: Tensor):  # type: ignore[override]
        a = yield autopipe.pop("a")
        y = super().forward(x) * a
        yield autopipe.stash("b", y)
        return y


@autopipe.skippable(pop=["b"])
class PopB(nn.Linear):
    def forward(self, x: Tensor):  # type: ignore[override]
        b = yield autopipe.pop("b")
        return super().forward(x) + b


def skip_model() -> nn.Sequential:
    """Layer 0 stashes a, layer 3 pops a and stashes b, layer 6 pops b."""
    return nn.Sequential(
        StashA(8, 8), nn.Linear(8, 8), nn.Tanh(), PopAStashB(8, 8),
        nn.Linear(8, 8), nn.Tanh(), PopB(8, 8), nn.Linear(8, 4),
    )


@autopipe.skippable(pop=["skip"])
class DoubleSkip(nn.Module):
    """Pops "skip" and doubles it in place: in the plain model, whatever else that tensor is
    doubles too."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield autopipe.pop("skip")
        skip.mul_(2)
        return x + skip


@autopipe.skippable(stash=["skip", "twin"])
class SaveTwice(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield autopipe.stash("skip", x)
        yield autopipe.stash("twin", x)
        return torch.tanh(x)


@autopipe.skippable(pop=["twin"])
class AddTwin(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        twin = yield autopipe.pop("twin")
        return x + twin


class Twice(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x


class DoubleFirst(nn.Module):
    """Doubles the first of a pair in place: in the plain model, the second too if it is the same."""

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        first, second = pair
        first.mul_(2)
        return first + second


def aliased(case: str) -> nn.Sequential:
    """A model that writes in place into a tensor that is also stashed (each ``case`` a way to
    reach it), and the layer before that write (the split that separates them)."""
    torch.manual_seed(0)
    layers = {
        # the stage's input is the stash
        "input": [nn.Linear(4, 4), Save(), nn.ReLU(inplace=True), nn.Linear(4, 4), Add()],
        # ... passed on unchanged by a stage between
        "passed on": [nn.Linear(4, 4), Save(), nn.Identity(), nn.ReLU(inplace=True), nn.Linear(4, 4), Add()],
        # the popped skip is the stage's input
        "popped": [nn.Linear(4, 4), Save(), DoubleSkip(), nn.Linear(4, 4)],
        # one tensor stashed under two names, one of them written
        "two names": [nn.Linear(4, 4), SaveTwice(), nn.Linear(4, 4), DoubleSkip(), AddTwin(), nn.Linear(4, 2)],
        # one tensor returned twice, one of them written
        "returned twice": [nn.Linear(4, 4), Twice(), DoubleFirst(), nn.Linear(4, 2)],
    }[case]
    return nn.Sequential(*layers)


#: Per case of :func:`aliased`, balances that split the stash from the write.
REFUSED = {"input": ([2, 3], [2, 2, 1]), "passed on": ([2, 1, 3],), "popped": ([2, 2],), "two names": ([2, 4],),
           "returned twice": ([2, 2],)}


class Regain(nn.Module):
    """Grows its gain by assigning the buffer a new tensor (not in place), then multiplies by it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        self.gain = self.gain * 1.5
        return x * self.gain


class TiedHead(nn.Module):
    """An embedding whose weight the head reads again (tied input and output embeddings): the
    weight lives with ``emb`` and travels to the head as a skip."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.m = nn.Linear(8, 8)
        self.n = nn.Linear(8, 8)

    def forward(self, ids: Tensor) -> Tensor:
        return self.n(torch.tanh(self.m(self.emb(ids)))) @ self.emb.weight.t()


class StockEncoder(nn.Module):
    """``nn.TransformerEncoder`` with a causal mask, whose forward fx cannot trace."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), device=x.device)
        h = self.encoder(self.embed(x), mask=mask, is_causal=True)
        return self.head(self.norm(h.mean(dim=1)).view(x.size(0), -1))


class BranchesOnBatch(nn.Module):
    """A forward that branches on the batch size: fx cannot trace it, export keeps the sample's branch."""

    def __init__(self, outputs: int = 3) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, outputs)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        if x.shape[0] > 6:
            h = h * 2
        return self.out(h)


class BranchesOnBatchParity(BranchesOnBatch):
    """Branches on a condition of the batch size that is no range of sizes: even, or not 5."""

    def __init__(self, condition: str, outputs: int = 3) -> None:
        super().__init__(outputs)
        self.condition = condition

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        if (x.shape[0] % 2 == 0) if self.condition == "even" else (x.shape[0] != 5):
            h = h * 2
        return self.out(h)
