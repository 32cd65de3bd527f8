"""Shared test set-up: one intra-op thread, so stage workers each get a core and runs repeat."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_and_seed() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
