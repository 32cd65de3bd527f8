"""Timing passes, and the load: a twin of the chain training on another thread while the
passes are timed, so layers are timed beside a busy neighbour as pipeline stages run."""
from __future__ import annotations

import threading

from ..model._copy import deep_copy

from ._layer_runs import LayerRun, train_pass
from ._progress import Progress

__all__: list[str] = []


Times = tuple[list[list[float]], list[list[float]]]  # per layer: forward ms, backward ms of each pass


def time_passes(runs: dict[int, list[LayerRun]], warmup: int, repeats: int, progress: Progress,
                load: Load | None) -> dict[int, Times]:
    """Per size, each layer's forward and backward ms in ``repeats`` training passes after
    ``warmup``; each round makes one pass of every size (and sets the load to that size)."""
    times: dict[int, Times] = {b: ([[] for _ in chain], [[] for _ in chain]) for b, chain in runs.items()}
    for count in range(warmup + repeats):
        for size, chain in runs.items():
            if load is not None:
                load.size = size
            measured = train_pass(chain, size)
            if count >= warmup:
                for index, (forward_ms, backward_ms) in enumerate(measured):
                    times[size][0][index].append(forward_ms)
                    times[size][1][index].append(backward_ms)
            progress.step(f"pass {count + 1} b={size}")
    return times


class Load:
    """A twin of the chain (deep copies of the layers, its own input leaves) training in a loop
    on another thread, for as long as the ``with`` block lasts, at the micro-batch size last set
    in ``size``; its error, if any, is raised on exit rather than lost."""

    def __init__(self, runs: dict[int, list[LayerRun]]) -> None:
        first = next(iter(runs.values()))
        modules = [deep_copy(run.layer.module) for run in first]
        self.twins = {b: [run.twin(module) for run, module in zip(chain, modules)] for b, chain in runs.items()}
        self.size = next(iter(runs))
        self.stop = threading.Event()
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._loop, name="autopipe-profile-load", daemon=True)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.thread.join()
        if self.error is not None and exc_info[0] is None:
            raise self.error

    def _loop(self) -> None:
        try:
            while True:  # at least one pass, however short the block
                size = self.size
                train_pass(self.twins[size], size)
                if self.stop.is_set():
                    break
        except Exception as error:  # handed to the profiling thread by __exit__
            self.error = error
