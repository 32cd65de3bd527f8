"""Benchmark a balance on torch.distributed.pipelining against one device (ResNet-18, synthetic data).

    python examples/bench_distributed.py --balance 7,8 --chunks 4 [--schedule 1f1b] [--json]

Starts one localhost process per stage itself (no torchrun needed), one thread each, and prints
the median step time after warm-up; rounds interleave with a plain one-thread step of the
unpartitioned model, whose median is the speedup's denominator.
"""
from autopipe.distributed.bench import main

if __name__ == "__main__":
    main()
