"""How far can a profile be trusted?  Profile ResNet-18 twice, print the run-to-run spread per layer
and in total, and compare the sum of per-layer forward+backward with a measured whole-model step.

The planner adds per-layer times, so both numbers bound what any prediction built on them can
achieve: the spread is the noise floor, the additivity ratio the systematic error of summing
layers measured alone (cache effects, the glue between layers).  Printed, not asserted.

    python examples/profile_spread.py [--batch 32] [--size 128] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchvision

from autopipe.profiling.profiler import profile
from autopipe.profiling.profiles import LayerProfile, Profile


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None)
    sample = torch.randn(args.batch, 3, args.size, args.size)
    options = {"warmup": args.warmup, "repeats": args.repeats, "copy_sizes": (4096, 65536), "quiet": True}
    runs = [profile(model, sample, ["cpu", "cpu"], [args.batch], **options) for _ in range(2)]
    step_ms = whole_step_ms(model, sample, args.warmup, args.repeats)
    print_spread(runs, args.batch)
    print_additivity(runs, args.batch, step_ms)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=128, help="image height and width")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


def layer_ms(result: Profile, b: int) -> list[float]:
    return [layer.forward[b].median_ms + layer.backward[b].median_ms for layer in result.layers]


def print_spread(runs: list[Profile], b: int) -> None:
    """Per layer: both runs' forward+backward medians, their difference, and each run's own
    min..max range relative to its median."""
    first, second = (layer_ms(r, b) for r in runs)
    print(f"ResNet-18, micro-batch {b}: forward+backward per layer, two profiles of the same model")
    print(f"{'layer':<10} {'run 1 ms':>9} {'run 2 ms':>9} {'diff':>7} {'range 1':>8} {'range 2':>8}")
    for index, layer in enumerate(runs[0].layers):
        ranges = [_range(r.layers[index], b) for r in runs]
        print(f"{layer.name:<10} {first[index]:9.2f} {second[index]:9.2f} "
              f"{_rel(first[index], second[index]):6.1%} {ranges[0]:8.1%} {ranges[1]:8.1%}")
    print(f"{'total':<10} {sum(first):9.2f} {sum(second):9.2f} {_rel(sum(first), sum(second)):6.1%}")


def print_additivity(runs: list[Profile], b: int, step_ms: float) -> None:
    sums = [sum(layer_ms(r, b)) for r in runs]
    print(f"whole-model forward+backward step at batch {b}: {step_ms:.2f} ms (median)")
    for index, total in enumerate(sums, 1):
        print(f"additivity ratio run {index}: sum of layers / whole step = {total / step_ms:.3f}")


def whole_step_ms(model: torch.nn.Module, sample: torch.Tensor, warmup: int, repeats: int) -> float:
    """The plain model's forward and backward (output gradient given, as the profiler does)."""
    model.train()
    grad = torch.randn(sample.shape[0], 1000)
    times = []
    for run in range(warmup + repeats):
        start = time.perf_counter()
        model(sample).backward(grad)
        elapsed = (time.perf_counter() - start) * 1e3
        model.zero_grad(set_to_none=True)
        if run >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def _range(layer: LayerProfile, b: int) -> float:
    total = layer.forward[b].median_ms + layer.backward[b].median_ms
    return (layer.forward[b].spread_ms + layer.backward[b].spread_ms) / total if total else 0.0


def _rel(a: float, b: float) -> float:
    return abs(a - b) / ((a + b) / 2) if a + b else 0.0


if __name__ == "__main__":
    main()
