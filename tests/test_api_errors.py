"""Bad input to the public entry points: one ``AutopipeError`` that names the argument and the fix,
raised before any work, and never a plan silently made for other input than asked."""
from __future__ import annotations

import math
import re
from typing import Any, Callable

import pytest
import torch
from torch import nn

import autopipe
from autopipe.planning._options import device_names
from synthetic import make_profile


def mlp(width: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[autopipe.Profile, str]:
    """A profile of :func:`mlp` at batch 8 (micro-batches 1..8) on two CPU devices, and its file."""
    torch.manual_seed(0)
    measured = autopipe.profile(mlp(), torch.randn(8, 6), ["cpu", "cpu"], warmup=0, repeats=1, quiet=True)
    return measured, str(measured.save(tmp_path_factory.mktemp("profile") / "mlp.json"))


@pytest.fixture()
def prof(saved: tuple[autopipe.Profile, str]) -> autopipe.Profile:
    return saved[0]


@pytest.mark.parametrize("batch", [32, 4])
def test_partition_plans_for_the_samples_batch_not_the_profiles(saved: tuple[autopipe.Profile, str],
                                                                batch: int) -> None:
    model = mlp()
    x = torch.randn(batch, 6)
    pipe = autopipe.partition(model, x, ["cpu", "cpu"], profile=saved[1], replicas=1)
    assert pipe.plan.batch_size == batch
    assert pipe.plan.micro_batch_size <= 8  # within the sizes the profile measured
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))  # the pipeline runs the model's own layers, on CPU


def test_partition_refuses_a_sample_unlike_the_profiled_one_or_another_batch_size(
        saved: tuple[autopipe.Profile, str]) -> None:
    with pytest.raises(autopipe.OptionError, match=r"samples of shape \[7\] .* profile measured \[6\]"):
        autopipe.partition(mlp(), torch.randn(8, 7), ["cpu", "cpu"], profile=saved[1])
    with pytest.raises(autopipe.OptionError, match="batch_size=16 is not the sample_input's batch of 32"):
        autopipe.partition(mlp(), torch.randn(32, 6), ["cpu", "cpu"], profile=saved[1], batch_size=16)


@pytest.mark.parametrize("speed", [math.nan, math.inf, 0, -1, "1"])
def test_plan_refuses_speeds_that_are_not_finite_and_positive(prof: autopipe.Profile, speed: Any) -> None:
    with pytest.raises(autopipe.OptionError, match="speeds must be 2 finite positive numbers"):
        autopipe.plan(prof, 2, speeds=[speed, 1])


def test_one_speed_is_for_every_device(prof: autopipe.Profile) -> None:
    assert autopipe.plan(prof, 2, speeds=2).options["speeds"] == [2.0, 2.0]


@pytest.mark.parametrize("batch", [2.5, "8", 0, -8, True])
def test_plan_refuses_a_batch_size_that_is_not_a_positive_integer(prof: autopipe.Profile, batch: Any) -> None:
    with pytest.raises(autopipe.OptionError, match=f"batch_size must be a positive integer, got {batch!r}"):
        autopipe.plan(prof, 2, batch_size=batch)


@pytest.mark.parametrize("chunks", [-2, 0, 2.5, "2"])
def test_plan_refuses_chunks_that_are_not_a_positive_integer(prof: autopipe.Profile, chunks: Any) -> None:
    with pytest.raises(autopipe.OptionError, match=f"chunks must be a positive integer, got {chunks!r}"):
        autopipe.plan(prof, 2, chunks=chunks)


def test_chunks_messages_say_which_bound_is_crossed(prof: autopipe.Profile) -> None:
    with pytest.raises(autopipe.OptionError, match="micro-batches of 64 samples, but the profile measured "
                                                   "micro-batches of at most 8; use chunks >= 8"):
        autopipe.plan(prof, 2, batch_size=64, chunks=1)
    with pytest.raises(autopipe.OptionError, match="chunks=9 is more than the batch of 8 samples"):
        autopipe.plan(prof, 2, chunks=9, replicas=1)
    assert autopipe.plan(prof, 2, batch_size=64, chunks=8, replicas=1).micro_batch_size == 8


def test_plan_and_pipeline_take_a_path_and_refuse_other_objects(saved: tuple[autopipe.Profile, str],
                                                                 tmp_path: Any) -> None:
    measured, path = saved
    chosen = autopipe.plan(path, 2, replicas=1)
    assert chosen.profile_digest == measured.digest
    with pytest.raises(autopipe.OptionError, match=r"profile must be an autopipe.Profile .*Profile.load.*NoneType"):
        autopipe.plan(None, 2)
    plan_path = chosen.save(tmp_path / "plan.json")
    assert autopipe.Pipeline(mlp(), str(plan_path)).balance == chosen.balance
    with pytest.raises(autopipe.OptionError, match="plan must be an autopipe.Plan"):
        autopipe.Pipeline(mlp(), 42)  # type: ignore[arg-type]


def test_a_pipeline_of_a_plan_refuses_the_options_the_plan_sets(saved: tuple[autopipe.Profile, str]) -> None:
    """Each option of the manual form beside a plan is refused by name (``chunks=8`` and
    ``checkpoint="always"`` ran the plan's 1 and ``never``, silently); with none the plan runs."""
    chosen = autopipe.plan(saved[1], 2, replicas=1, chunks=1, checkpoint="never")
    with pytest.raises(TypeError, match="give either a plan or chunks, checkpoint, schedule, not both"):
        autopipe.Pipeline(mlp(), chosen, chunks=8, checkpoint="always", schedule="1f1b")
    with pytest.raises(TypeError, match="give either a plan or turns, not both"):
        autopipe.Pipeline(mlp(), chosen, turns="breadth_first")
    pipe = autopipe.Pipeline(mlp(), chosen)
    assert (pipe.chunks, pipe.checkpoint, pipe.replicas) == (1, "never", 1)


def test_a_pipeline_is_not_pickled_or_copied_but_says_what_to_save(tmp_path: Any) -> None:
    import copy
    import io

    pipe = autopipe.Pipeline(mlp(), balance=[2, 3], devices=["cpu", "cpu"])
    for attempt in (lambda: copy.deepcopy(pipe), lambda: torch.save(pipe, io.BytesIO())):
        with pytest.raises(TypeError, match=r"cannot be pickled or copied: save pipe.state_dict\(\)"):
            attempt()
    torch.save(pipe.state_dict(), tmp_path / "state.pt")
    mlp().load_state_dict(torch.load(tmp_path / "state.pt"))


@pytest.mark.parametrize("call", [
    lambda: autopipe.profile(42, torch.randn(8, 6), ["cpu", "cpu"]),
    lambda: autopipe.partition("resnet", torch.randn(8, 6), ["cpu", "cpu"]),
    lambda: autopipe.Pipeline(42, balance=[1]),
])
def test_a_model_that_is_no_module_is_named_as_such(call: Callable[[], Any]) -> None:
    with pytest.raises(autopipe.ChainError, match="the model must be a torch.nn.Module"):
        call()


@pytest.mark.parametrize("devices, shown", [(2.5, "got 2.5"), ("cpu", r"string 'cpu'; pass \['cpu'\]"),
                                            ("cpu,cpu", r"pass \['cpu', 'cpu'\]")])
def test_devices_that_are_no_list_nor_count_are_refused(prof: autopipe.Profile, devices: Any, shown: str) -> None:
    with pytest.raises(autopipe.DeviceError, match=f"devices must be a list of devices.*{shown}"):
        autopipe.plan(prof, devices)
    with pytest.raises(autopipe.DeviceError, match=f"devices must be a list of devices.*{shown}"):
        autopipe.Pipeline(mlp(), balance=[2, 3], devices=devices)


def test_time_limit_and_copy_sizes_are_checked_before_any_work(prof: autopipe.Profile) -> None:
    with pytest.raises(autopipe.OptionError, match=r"time_limit must be a positive number of seconds .*, got '1'"):
        autopipe.plan(prof, 2, time_limit="1")
    with pytest.raises(autopipe.OptionError, match=r"copy_sizes must be positive byte counts, got \[-5\]"):
        autopipe.profile(mlp(), torch.randn(8, 6), ["cpu", "cpu"], copy_sizes=[-5], quiet=True)


def test_an_unknown_keyword_is_named_for_the_function_called(saved: tuple[autopipe.Profile, str]) -> None:
    with pytest.raises(TypeError, match=r"^plan\(\) got an unexpected keyword argument 'chunk'"):
        autopipe.plan(saved[0], 2, chunk=4)  # type: ignore[call-arg]
    with pytest.raises(autopipe.OptionError, match=r"^partition\(\) got an unexpected keyword argument 'chunk'; "
                                                   "did you mean 'chunks'\\?"):
        autopipe.partition(mlp(), torch.randn(8, 6), ["cpu", "cpu"], profile=saved[1], chunk=3)


MISTAKES: dict[str, Callable[[autopipe.Profile, str], Any]] = {
    "device count 0": lambda p, _: autopipe.plan(p, 0),
    "device count 100000": lambda p, _: autopipe.plan(p, 100_000),
    "meta devices": lambda p, _: autopipe.plan(p, ["meta", "meta"]),
    "devices without CUDA": lambda p, _: autopipe.plan(p, ["cuda:0", "cuda:1"]),
    "memory_limit 16GX": lambda p, _: autopipe.plan(p, 2, memory_limit="16GX"),
    "memory_limit -1": lambda p, _: autopipe.plan(p, 2, memory_limit=-1),
    "memory_limit 0": lambda p, _: autopipe.plan(p, 2, memory_limit=0),
    "chunks 0": lambda p, _: autopipe.plan(p, 2, chunks=0),
    "time_limit -1": lambda p, _: autopipe.plan(p, 2, time_limit=-1),
    "replicas 3": lambda p, _: autopipe.plan(p, 2, replicas=3),
    "speeds 0": lambda p, _: autopipe.plan(p, 2, speeds=[0, 1]),
    "engine": lambda p, _: autopipe.plan(p, 2, engine="nccl"),
    "checkpoint": lambda p, _: autopipe.plan(p, 2, checkpoint="sometimes"),
    "schedule": lambda p, _: autopipe.plan(p, 2, schedule="zigzag"),
    "interleave": lambda p, _: autopipe.plan(p, 2, interleave=0),
    "optimizer_state": lambda p, _: autopipe.plan(p, 2, optimizer_state="rmsprop"),
    "plan of another model": lambda p, _: autopipe.Pipeline(mlp(5), autopipe.plan(p, 2, replicas=1)),
    "profile of another model": lambda _, path: autopipe.partition(mlp(5), torch.randn(8, 6), ["cpu", "cpu"],
                                                                   profile=path),
    "balance total": lambda p, _: autopipe.Pipeline(mlp(), balance=[2, 2]),
    "Pipeline chunks 0": lambda p, _: autopipe.Pipeline(mlp(), balance=[2, 3], chunks=0),
    "Pipeline checkpoint": lambda p, _: autopipe.Pipeline(mlp(), balance=[2, 3], checkpoint="x"),
    "profile batch_sizes": lambda p, _: autopipe.profile(mlp(), torch.randn(8, 6), ["cpu", "cpu"],
                                                         batch_sizes=[16], quiet=True),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_every_user_mistake_is_an_autopipe_error_and_still_a_value_error(
        saved: tuple[autopipe.Profile, str], mistake: str) -> None:
    with pytest.raises(autopipe.AutopipeError) as caught:
        MISTAKES[mistake](*saved)
    assert isinstance(caught.value, ValueError)


def test_a_balance_with_an_empty_stage_names_the_stage() -> None:
    with pytest.raises(autopipe.OptionError, match=r"balance \[2, 0, 3\]: stage 1 has 0 layers"):
        autopipe.Pipeline(mlp(), balance=[2, 0, 3], devices=["cpu"] * 3)


def test_a_plan_whose_fingerprint_was_changed_says_so(prof: autopipe.Profile) -> None:
    chosen = autopipe.plan(prof, 2, replicas=1)
    chosen.model = {**chosen.model, "digest": "0" * len(chosen.model["digest"])}
    with pytest.raises(autopipe.OptionError, match="the plan was made for another model: the layers listed match "
                                                   "but the fingerprints differ.*; plan this model again"):
        autopipe.Pipeline(mlp(), chosen)


def test_devices_the_profile_has_no_copy_times_for_are_a_device_error(prof: autopipe.Profile) -> None:
    with pytest.raises(autopipe.DeviceError, match=r"^the profile has no copy measurement from meta to meta: it was "
                                                   r"measured on cpu, cpu; plan on those devices \(a meta device "
                                                   r"holds no data to time\)$"):
        autopipe.plan(prof, ["meta", "meta"])


@pytest.mark.parametrize("devices", [100_000, ["cpu"] * 4097])
def test_a_device_count_whose_pair_tables_would_not_fit_is_refused_before_allocating(
        prof: autopipe.Profile, devices: Any) -> None:
    """Planned, 100,000 devices failed allocating two 74.5 GiB tables of every pair of devices."""
    count = devices if isinstance(devices, int) else len(devices)
    with pytest.raises(autopipe.DeviceError, match=f"^{count:,} devices are more than the planner takes "
                                                   r"\(4,096 at most\): .* GiB each .*plan for at most 4,096"):
        autopipe.plan(prof, devices)
    assert device_names(prof, 4096) == ["cpu"] * 4096  # the most taken


@pytest.mark.parametrize(("engine", "least"), [("local", 7), ("distributed", 8)])
def test_a_replicas_share_too_small_to_split_says_so_and_the_least_batch(engine: str, least: int) -> None:
    """Each replica plans for its share: 3 samples of 6 for 2 replicas, below the profiled 4..8.
    The message spoke of a batch size 3 and advised 'at least 4', which 2 replicas cannot take."""
    measured = make_profile([1.0, 2.0], sizes=(4, 8))
    message = (f"batch size 6 over 2 replicas gives each replica a share of up to 3 samples, which cannot be split "
               f"into {'equal ' if engine == 'distributed' else ''}micro-batches of the profiled sizes 4..8; use a "
               f"batch size of {least} (the least that 2 replicas can take), or fewer replicas")
    with pytest.raises(autopipe.OptionError, match=f"^{re.escape(message)}$"):
        autopipe.plan(measured, 2, batch_size=6, replicas=2, engine=engine)
    assert autopipe.plan(measured, 2, batch_size=least, replicas=2, engine=engine).replicas == 2
    with pytest.raises(autopipe.OptionError, match="or profile micro-batch size 2 too$"):
        autopipe.plan(measured, 2, batch_size=3, replicas=2)
