"""Profile, plan and train a small GPT-2 (random weights, synthetic tokens) as a pipeline on two CPU devices.

    python examples/train_gpt2.py                                   # 6 blocks, width 256, batch 16
    python examples/train_gpt2.py --layers 2 --width 32 --steps 3   # a quick smoke run

``autopipe.partition`` captures ``GPT2LMHeadModel`` into its blocks (``transformer.h.N``) on
one keyword batch ``{"input_ids", "attention_mask", "labels"}``, measures every layer, plans
and returns the pipeline; ``pipe(**batch)`` then returns the model's own
``CausalLMOutputWithCrossAttentions`` with its loss.  Tokens are a few fixed random batches, so
the loss falls as the model memorises them.  Each step's forward + backward is timed (the
optimizer step apart) and its median compared with the plan's predicted iteration time.
Nothing is downloaded: the config is built here.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import autopipe

try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as missing:  # pragma: no cover - the hf extra
    raise SystemExit("this example needs transformers: pip install -e '.[hf]'") from missing


def main() -> None:
    args = _parser().parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=args.sequence)
    model = GPT2LMHeadModel(config).train()
    generator = torch.Generator().manual_seed(1)
    data = [_batch(args, generator) for _ in range(args.batches)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # use_cache is turned off for the capture
        pipe = autopipe.partition(model, data[0], devices=["cpu", "cpu"], quiet=not args.progress,
                                  optimizer_state="adam")  # AdamW below: two state tensors per parameter
    plan = pipe.plan
    assert plan is not None
    print(f"GPT-2: {args.layers} blocks, width {args.width}, {sum(p.numel() for p in model.parameters()):,} "
          f"parameters; batch {args.batch} x {args.sequence} tokens")
    print(f"plan: {plan.replicas} replica(s) (data parallel over {plan.replicas}), each of stages {plan.balance} "
          f"on {plan.devices[:plan.device_count]} ({plan.interleave} per device), {plan.chunks} micro-batches, "
          f"checkpoint={plan.checkpoint}")
    for index, name in plan.split_points:
        print(f"  cut before layer {index} ({name})")

    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    step_ms: list[float] = []
    for step in range(args.steps):
        batch = data[step % len(data)]
        optimizer.zero_grad()
        start = time.perf_counter()
        out = pipe(**batch)
        out.loss.backward()
        step_ms.append((time.perf_counter() - start) * 1000)
        optimizer.step()
        print(f"step {step + 1}: loss {out.loss.item():.4f} ({type(out).__name__}), "
              f"forward + backward {step_ms[-1]:.1f} ms")
    measured = statistics.median(step_ms[args.warmup:] or step_ms)
    predicted = plan.predicted.iteration_ms
    print(f"predicted {predicted:.1f} ms per iteration, measured median {measured:.1f} ms "
          f"(measured / predicted {measured / predicted:.2f}; steps after the first {args.warmup})")
    pipe.close()


def _batch(args: argparse.Namespace, generator: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, args.vocab, (args.batch, args.sequence), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6, help="transformer blocks")
    parser.add_argument("--width", type=int, default=256, help="embedding size")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--sequence", type=int, default=64, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batches", type=int, default=2, help="distinct synthetic batches")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing median")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (one core per stage)")
    parser.add_argument("--progress", action="store_true", help="show the profiler's progress bar")
    return parser


if __name__ == "__main__":
    main()
