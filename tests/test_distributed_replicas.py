"""Replicas on the distributed engine: 2 replicas × 2 stages in 4 gloo processes and pure data
parallel in 2; every gradient equals the plain model's on the whole batch, the checkpoint loads
into the plain model, the replicas' batch norm statistics end each step alike, and a job of the
wrong size or a parameter unfrozen after construction is refused with the fix named."""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import Tensor, nn

from autopipe.distributed.local import launch_local
from autopipe.planning.plans import Plan

if TYPE_CHECKING:
    from autopipe.distributed import DistributedPipeline

sys.path.insert(0, str(Path(__file__).parent))
from distributed_models import batch, error_of, inplace_model, padded, plan_for, trim_model  # noqa: E402

JOB_TIMEOUT_S = 150.0
CHUNKS = 2


def replicated(balance: list[int], replicas: int, schedule: str = "gpipe") -> Plan:
    plan = plan_for(inplace_model(), balance, CHUNKS, schedule)
    plan.replicas = replicas
    plan.replica_devices = [list(plan.devices) for _ in range(replicas)]
    return plan


def reference(replicas: int, model: nn.Module | None = None,
              data: tuple[Tensor, Tensor] | None = None) -> dict[str, Tensor]:
    """The plain model's gradient of the whole batch's mean loss, accumulated over the replicas'
    micro-batches (equal sizes, so it is the whole-batch gradient)."""
    model = inplace_model() if model is None else model
    x, y = data or batch()
    parts = replicas * CHUNKS
    for xi, yi in zip(x.chunk(parts), y.chunk(parts)):
        (nn.functional.mse_loss(model(xi), yi) / parts).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def batchnorm_model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)).double()


def batchnorm_reference(steps: int) -> dict[str, Tensor]:
    """The plain model's state after ``steps`` SGD steps as the replicas take them: gradients from
    the replicas' micro-batches, and batch norm statistics updated once per micro-batch index from
    the replicas' micro-batches of that index together (what averaging their buffers gives)."""
    model = batchnorm_model()
    x, y = (t.double() for t in batch())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        kept = {name: value.clone() for name, value in model.named_buffers()}
        parts = 2 * CHUNKS
        for xi, yi in zip(x.chunk(parts), y.chunk(parts)):
            (nn.functional.mse_loss(model(xi), yi) / parts).backward()
        with torch.no_grad():
            for name, value in model.named_buffers():
                value.copy_(kept[name])
            for k in range(CHUNKS):
                model(torch.cat([share.chunk(CHUNKS)[k] for share in x.chunk(2)]))
        optimizer.step()
    return model.state_dict()


class Silenced(nn.Module):
    """Returns its input, or while :attr:`silent` a string, which holds no tensor for ``loss_fn``."""

    silent = False

    def forward(self, x: Tensor) -> Any:
        return "silent" if self.silent else x


# ---- worker side ----------------------------------------------------------------------------

def _train(plan: Plan, out: Path | None = None) -> dict[str, Any]:
    from autopipe.distributed import DistributedPipeline

    runner = DistributedPipeline(inplace_model(), plan, loss_fn=nn.functional.mse_loss)
    x, y = batch()
    whole = error_of(lambda: runner.step(x, target=y))  # the whole batch: refused before anything runs
    loss = runner.step(runner.shard(x), target=runner.shard(y))
    result = {"grads": {n: p.grad.clone() for n, p in runner.named_parameters()}, "whole": whole,
              "replica": runner.replica, "stage": runner.rank, "loss": runner.broadcast_loss(loss)}
    if out is not None:
        optimizer = torch.optim.SGD(runner.parameters(), lr=0.1)
        optimizer.step()
        path = runner.save_checkpoint(out / "model.pt")
        result["checkpoint"] = None if path is None else str(path)
        optimizer.zero_grad()
        runner.step(runner.shard(x), target=runner.shard(y))  # DDP rebuilds its buckets after a first step
        result["second"] = {n: p.grad.clone() for n, p in runner.named_parameters()}
    return result


def _after_refusals() -> dict[str, Any]:
    """Steps refused mid-step, with zeros in place of what was refused (a stage's value of another shape
    than the probe's, the last stage's output without a tensor), each followed by a right step: DDP's
    reduction of the refused step must leave it ready for the next, which trains as the plain model."""
    from autopipe.distributed import DistributedPipeline

    trim = DistributedPipeline(trim_model(False), balance=[2, 2], chunks=CHUNKS, replicas=2,
                               loss_fn=nn.functional.mse_loss)
    result: dict[str, Any] = {"shape": _step_error(trim, padded([6, 2, 3, 1] * 2)),
                              "shape grads": _right_step(trim, padded([6] * 8))}
    model = nn.Sequential(*inplace_model(), Silenced())
    silenced = DistributedPipeline(model, balance=[3, 4], chunks=CHUNKS, replicas=2, loss_fn=nn.functional.mse_loss)
    model[-1].silent = True
    result["output"] = _step_error(silenced, batch())
    model[-1].silent = False
    result["output grads"] = _right_step(silenced, batch())
    return result


def _step_error(runner: DistributedPipeline, data: tuple[Tensor, Tensor]) -> str:
    return error_of(functools.partial(runner.step, runner.shard(data[0]), target=runner.shard(data[1])))


def _right_step(runner: DistributedPipeline, data: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
    """The gradients of one step from zero."""
    runner.module.zero_grad()
    runner.step(runner.shard(data[0]), target=runner.shard(data[1]))
    return {n: p.grad.clone() for n, p in runner.named_parameters()}


def _statistics(steps: int) -> dict[str, Tensor]:
    """Pure data parallel SGD steps of the batch norm model: this replica's state at the end."""
    from autopipe.distributed import DistributedPipeline

    runner = DistributedPipeline(batchnorm_model(), balance=[4], chunks=CHUNKS, replicas=2,
                                 loss_fn=nn.functional.mse_loss)
    x, y = (t.double() for t in batch())
    optimizer = torch.optim.SGD(runner.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        runner.step(runner.shard(x), target=runner.shard(y))
        optimizer.step()
    return {name: value.clone() for name, value in runner.state_dict().items()}


def _unfrozen() -> dict[str, Any]:
    """A layer frozen at construction and unfrozen after a step: refused on every replica; the pipeline
    built again after it (the fix named) averages its gradients too."""
    from autopipe.distributed import DistributedPipeline

    model, (x, y) = inplace_model(), batch()
    model[0].requires_grad_(False)
    runner = DistributedPipeline(model, balance=[6], chunks=CHUNKS, replicas=2, loss_fn=nn.functional.mse_loss)
    runner.step(runner.shard(x), target=runner.shard(y))
    model[0].requires_grad_(True)
    result: dict[str, Any] = {"refused": error_of(lambda: runner.step(runner.shard(x), target=runner.shard(y)))}
    model.zero_grad()
    runner = DistributedPipeline(model, balance=[6], chunks=CHUNKS, replicas=2, loss_fn=nn.functional.mse_loss)
    runner.step(runner.shard(x), target=runner.shard(y))
    result["grads"] = {n: p.grad.clone() for n, p in runner.named_parameters()}
    return result


def _unequal() -> dict[str, Any]:
    """Replicas fed shares of 6 and 2 samples directly (not by ``shard()``): each rank sees only its own,
    and the first step refuses on both; then equal shares train as the plain model."""
    from autopipe.distributed import DistributedPipeline

    runner = DistributedPipeline(inplace_model(), balance=[6], chunks=CHUNKS, replicas=2,
                                 loss_fn=nn.functional.mse_loss)
    (x, y), share = batch(), slice(0, 6) if runner.replica == 0 else slice(6, 8)
    result: dict[str, Any] = {"refused": error_of(lambda: runner.step(x[share], target=y[share]))}
    runner.step(runner.shard(x), target=runner.shard(y))
    result["grads"] = {n: p.grad.clone() for n, p in runner.named_parameters()}
    return result


def _worker(job: str, out: Path) -> None:
    import torch.distributed as dist

    from autopipe.distributed import DistributedPipeline

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if job == "hybrid":
        result = {"gpipe": _train(replicated([3, 3], 2), out), "1f1b": _train(replicated([3, 3], 2, "1f1b")),
                  "after_refusals": _after_refusals()}
    else:
        result = {"dp": _train(replicated([6], 2)), "statistics": _statistics(2), "unfrozen": _unfrozen(),
                  "unequal": _unequal(),
                  "too_few": error_of(lambda: DistributedPipeline(inplace_model(), replicated([3, 3], 2),
                                                                  loss_fn=nn.functional.mse_loss))}
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


# ---- test side ------------------------------------------------------------------------------

def _launch(job: str, nprocs: int, out: Path) -> list[dict[str, Any]]:
    launch_local([sys.executable, __file__, job, str(out)], nprocs, out, JOB_TIMEOUT_S)
    return [torch.load(out / f"rank{r}.pt") for r in range(nprocs)]


def _assert_replicas_equal_plain(results: list[dict[str, Any]], replicas: int) -> None:
    expected = reference(replicas)
    seen: dict[str, Tensor] = {}
    for result in results:
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=name, r=result["replica"]: f"replica {r} {n}: {m}")
            seen[name] = grad
    assert sorted(seen) == sorted(expected)
    x, y = batch()
    whole = nn.functional.mse_loss(inplace_model()(x), y).item()
    assert all(r["loss"] == pytest.approx(whole, rel=1e-5) for r in results)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch("hybrid", 4, tmp_path_factory.mktemp("hybrid"))


@pytest.mark.slow
def test_hybrid_two_replicas_of_two_stages_on_four_processes(hybrid: list[dict[str, Any]]) -> None:
    results = hybrid
    assert [(r["gpipe"]["replica"], r["gpipe"]["stage"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for schedule in ("gpipe", "1f1b"):
        _assert_replicas_equal_plain([r[schedule] for r in results], 2)
    assert [r["gpipe"]["checkpoint"] is not None for r in results] == [True, False, False, False]
    saved = torch.load(results[0]["gpipe"]["checkpoint"])
    model = inplace_model()
    model.load_state_dict(saved, strict=True)
    plain = inplace_model()
    for name, param in plain.named_parameters():  # one SGD step with the whole-batch gradient
        torch.testing.assert_close(saved[name], param.detach() - 0.1 * reference(2)[name], rtol=1e-5, atol=1e-7)
    model.zero_grad()
    second = reference(2, model)  # the next step's gradient, from the stepped weights
    for result in results:
        for name, grad in result["gpipe"]["second"].items():
            torch.testing.assert_close(grad, second[name], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_replicas_train_as_the_plain_model_after_a_step_refused_mid_step(hybrid: list[dict[str, Any]]) -> None:
    """Every rank raises, and the next step's gradients are the plain model's."""
    elsewhere = "DistributedError: another rank refused a value of this step"
    expected = {"shape": reference(2, trim_model(False), padded([6] * 8)), "output": reference(2)}
    for ranks in hybrid:
        result, first = ranks["after_refusals"], ranks["gpipe"]["stage"] == 0
        assert result["shape"].startswith("DistributedError: stage 0 sends" if first else elsewhere)
        assert result["output"].startswith(elsewhere if first else "DistributedError: the last stage ends with "
                                                                    "layer '6', which returns a str")
        for name, want in expected.items():
            for param, grad in result[f"{name} grads"].items():
                torch.testing.assert_close(grad, want[param], msg=lambda m, n=param: f"{n}: {m}")


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch("dp", 2, tmp_path_factory.mktemp("dp"))


@pytest.mark.slow
def test_pure_data_parallel_and_a_job_of_the_wrong_size(dp: list[dict[str, Any]]) -> None:
    _assert_replicas_equal_plain([r["dp"] for r in dp], 2)
    for result in dp:
        assert result["dp"]["whole"].startswith("DistributedError: the input batch has 8 samples, the whole batch of 2")
        assert "pass runner.shard(input) to step()" in result["dp"]["whole"]
        assert result["too_few"].startswith(
            "DistributedError: the plan has 2 replicas × 2 stages but the job has 2 ranks")
        assert "torchrun --nproc-per-node 4" in result["too_few"]


@pytest.mark.slow
def test_replicas_end_each_step_with_the_same_batch_norm_statistics(dp: list[dict[str, Any]]) -> None:
    """Each replica's batch norm sees its own share; averaged after every step, the running mean is
    the plain model's with micro-batches of the replicas' micro-batches together (the running
    variance is not: it leaves out the spread between the shares' means)."""
    one, other = (result["statistics"] for result in dp)
    for name, value in one.items():
        assert torch.equal(value, other[name]), name
    expected = batchnorm_reference(2)
    for name in ("0.weight", "3.weight", "1.running_mean", "1.num_batches_tracked"):
        torch.testing.assert_close(one[name], expected[name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_a_parameter_unfrozen_after_construction_is_refused_on_every_replica(dp: list[dict[str, Any]]) -> None:
    for result in dp:
        assert result["unfrozen"]["refused"].startswith(
            "DistributedError: requires_grad of ['0.weight', '0.bias'] changed since this DistributedPipeline "
            "was built")
        assert "build a new DistributedPipeline on every rank after changing requires_grad" in \
            result["unfrozen"]["refused"]
        expected = reference(2)
        for name, grad in result["unfrozen"]["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
        assert sorted(result["unfrozen"]["grads"]) == sorted(expected)


@pytest.mark.slow
def test_replica_shares_of_different_sizes_are_refused_on_every_replica(dp: list[dict[str, Any]]) -> None:
    """Averaged replica gradients weigh each share alike: shares of 6 and 2 samples would weigh the
    samples unequally (wrong gradients, no error)."""
    for result in dp:
        refused = result["unequal"]["refused"]
        assert refused.startswith("DistributedError: the ranks feed batches of different sizes: 6 samples on rank 0 "
                                  "and 2 samples on rank 1")
        assert "runner.shard(x) and runner.shard(y)" in refused
        expected = reference(2)
        for name, grad in result["unequal"]["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
        assert sorted(result["unequal"]["grads"]) == sorted(expected)


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))


@pytest.mark.slow
def test_all_reduce_profiled_into_the_profile(tmp_path: Path) -> None:
    from synthetic import make_profile

    from autopipe.distributed.reduction import main
    from autopipe.planning.replicas import plan
    from autopipe.profiling.profiles import Profile

    path = make_profile([1.0] * 4, devices=2, param_bytes=10**6, batch_size=8).save(tmp_path / "p.json")
    assert plan(Profile.load(path), 2, replicas=2, engine="distributed").options["reduction"] == \
        "estimated from copy fits"
    assert main([str(path), "--processes", "2"]) == 0
    profile = Profile.load(path)
    fit = profile.reduction_fit("distributed")
    assert fit is not None and fit.replicas == 2 and len(fit.points) == 4 * 5
    assert fit.time_ms(10**6) > 0
    chosen = plan(profile, 2, replicas=2, engine="distributed")
    assert chosen.options["reduction"] == "measured"
    assert chosen.predicted.reduction_ms == pytest.approx(fit.time_ms(4 * 10**6), rel=1e-9)


def test_a_stage_with_nothing_to_train_is_not_wrapped_in_ddp() -> None:
    """DDP refuses a module without a parameter that needs a gradient (an activation-only
    stage, or a frozen one); such a stage has nothing to reduce and runs as it is."""
    from autopipe.distributed._replicas import Layout, data_parallel

    where = Layout(replicas=2, stages=2, replica=0, stage=1, pipeline_group=None, data_group=None)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    for module in (nn.Tanh(), frozen):
        assert data_parallel(module, where, torch.device("cpu")) is module
