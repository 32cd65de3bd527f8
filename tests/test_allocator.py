"""steady_memory: huge pages only when set before torch is imported; one arena on glibc."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

SCRIPT = """
import os, sys
{before}
from autopipe._allocator import steady_memory
said = steady_memory()
import torch
x = torch.ones(2**21)  # 8 MiB: a huge-page allocation when enabled
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), "|", said)
"""


def run(before: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(before=before)], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.strip()


@pytest.mark.slow
def test_before_torch_both_settings_hold() -> None:
    out = run("")
    assert out.startswith("1 | huge pages on")
    if platform.libc_ver()[0] == "glibc":
        assert out.endswith("one malloc arena on")


@pytest.mark.slow
def test_after_torch_huge_pages_are_reported_off_with_the_fix() -> None:
    out = run("import torch")
    assert out.startswith("None | huge pages off (set THP_MEM_ALLOC_ENABLE=1 before torch is imported)")


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_pipeline_trains_the_same_under_steady_memory() -> None:
    script = """
from autopipe._allocator import steady_memory
steady_memory()
import torch, autopipe
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
x = torch.randn(6, 4)
model(x).sum().backward()
plain = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
pipe = autopipe.Pipeline(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=3)
pipe(x).sum().backward()
print(all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(plain, model.parameters())))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "True"
