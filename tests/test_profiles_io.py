"""Profile files: lossless round trip, atomic writes, and one named error per kind of bad file."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn

from autopipe._jsonio import FormatError
from autopipe.cli import main
from autopipe.errors import OptionError
from autopipe.profiling.profiler import profile
from autopipe.profiling.profiles import PROFILE_SCHEMA_VERSION, Profile, Stat
from autopipe.model.skip import pop, skippable, stash


@skippable(stash=["half"])
class Keep(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[override]
        yield stash("half", x[:, :2] * 0.5)
        return x


@skippable(pop=["half"])
class Join(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[override]
        half = yield pop("half")
        return torch.cat([x, half], dim=1)


@pytest.fixture(scope="module")
def measured() -> Profile:
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(4, 4), Keep(), nn.ReLU(inplace=True), nn.BatchNorm1d(4), Join())
    return profile(model, torch.randn(4, 4), ["cpu", "cpu"], [2, 4], warmup=0, repeats=2, copy_sizes=(1024, 8192),
                   quiet=True)


@pytest.fixture
def saved_file(measured: Profile, tmp_path: Path) -> Path:
    return measured.save(tmp_path / "p.json")


def test_round_trip_is_lossless(measured: Profile, saved_file: Path) -> None:
    loaded = Profile.load(saved_file)
    assert loaded == measured
    assert loaded.digest == measured.digest
    assert loaded.layers[1].stash_bytes == {"half": 2 * 4} and loaded.layers[4].pop == ["half"]
    assert isinstance(loaded.copies[0].points[0], tuple)


def test_save_is_atomic_and_leaves_no_temporary_files(measured: Profile, saved_file: Path) -> None:
    before = saved_file.read_text()
    broken = Profile(**{**measured.__dict__, "batch_size": float("nan")})
    with pytest.raises(ValueError):
        broken.save(saved_file)  # NaN is not JSON: nothing is written
    assert saved_file.read_text() == before
    measured.save(saved_file)  # overwriting goes through a temporary file and a rename
    assert [p.name for p in saved_file.parent.iterdir()] == ["p.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert saved_file.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0600


def edit(path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))
    return path


def expect_error(path: Path, *fragments: str) -> None:
    with pytest.raises(FormatError) as caught:
        Profile.load(path)
    message = str(caught.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message


def test_corrupt_file(saved_file: Path) -> None:
    saved_file.write_bytes(b"\x00\x01 not json at all")
    expect_error(saved_file, "not valid JSON", "corrupt or truncated")


def test_truncated_file(saved_file: Path) -> None:
    text = saved_file.read_text()
    saved_file.write_text(text[: len(text) // 2])
    expect_error(saved_file, "not valid JSON", "corrupt or truncated")


def test_newer_schema(saved_file: Path) -> None:
    edit(saved_file, lambda d: d.update(schema_version=PROFILE_SCHEMA_VERSION + 1))
    expect_error(saved_file, "field 'schema_version'", "newer than this autopipe understands", "upgrade")


def test_wrong_kind(saved_file: Path) -> None:
    edit(saved_file, lambda d: d.update(kind="plan"))
    expect_error(saved_file, "field 'kind'", "'plan' file, not a profile file")


def test_missing_file(tmp_path: Path) -> None:
    expect_error(tmp_path / "absent.json", "no such profile file")


@pytest.mark.parametrize(("change", "field", "problem"), [
    (lambda d: d["layers"][2].pop("forward"), "layers[2].forward", "missing"),
    (lambda d: d.pop("copies"), "copies", "missing"),
    (lambda d: d["layers"][0].update(output_bytes="8"), "layers[0].output_bytes", "expected an integer"),
    (lambda d: d["layers"][0].update(param_bytes=-4), "layers[0].param_bytes", "must be at least 0"),
    (lambda d: d["layers"][1]["saved_bytes"].update({"4": 1.5}), "layers[1].saved_bytes.4", "non-negative integer"),
    (lambda d: d["layers"][1]["forward"]["4"].update(median_ms=None), "layers[1].forward.4.median_ms",
     "finite number"),
    (lambda d: d["layers"][1]["forward"]["4"].update(min_ms=99.0), "layers[1].forward.4", "min_ms <= median_ms"),
    (lambda d: d["layers"][1]["forward"]["4"].update(min_ms=-1.0), "layers[1].forward.4.min_ms", "at least 0"),
    (lambda d: d["layers"][1]["backward"]["2"].update(max_ms=float("inf")), "layers[1].backward.2.max_ms",
     "finite number"),
    (lambda d: d["layers"][0]["forward"]["2"].update(repeats=True), "layers[0].forward.2.repeats",
     "expected an integer"),
    (lambda d: d["layers"][1]["backward"].pop("2"), "layers[1].backward", "expected the profile's batch_sizes"),
    (lambda d: d["layers"][3]["forward"].update({"x": {}}), "layers[3].forward", "positive integers, found 'x'"),
    (lambda d: d["layers"][1].update(stash_bytes={}), "layers[1].stash_bytes", "expected the layer's stash"),
    (lambda d: d["copies"][0]["points"].__setitem__(1, ["big", 1.0]), "copies[0].points[1]", "[bytes, ms]"),
    (lambda d: d["copies"][1].update(dst=7), "copies[1]", "device index out of range"),
    (lambda d: d["copies"][0].update(latency_ms=-0.5), "copies[0].latency_ms", "at least 0"),
    (lambda d: d["copies"][1].update(ms_per_byte=float("inf")), "copies[1].ms_per_byte", "finite number"),
    (lambda d: d["copies"][0].update(src=True), "copies[0].src", "expected an integer"),
    (lambda d: d["copies"][0]["points"].__setitem__(0, [8, True]), "copies[0].points[0]", "[bytes, ms]"),
    (lambda d: d["layers"][2]["saved_bytes"].update({"2": True}), "layers[2].saved_bytes.2", "non-negative integer"),
    (lambda d: d.update(batch_sizes=[4, 2]), "batch_sizes", "increasing positive"),
    (lambda d: d.update(environment=[]), "environment", "expected an object"),
    (lambda d: d["model"].pop("digest"), "model.digest", "missing"),
    (lambda d: d["layers"].pop(), "layers", "4 layers but the model fingerprint lists 5"),
    # a workspace measured at some sizes only read the others as 0 bytes (a negative 'transient')
    (lambda d: d["layers"][3]["workspace_bytes"].pop("4"), "layers[3].workspace_bytes",
     "has sizes [2], expected the profile's batch_sizes [2, 4] (or none)"),
    (lambda d: d.update(input_shape=[-16]), "input_shape", "expected dimensions of at least 1, found [-16]"),
    (lambda d: d.update(input_shape="16"), "input_shape", "expected a shape (a list of integers)"),
    (lambda d: d["model"].update(layers=5), "model.layers", "expected a list, found int"),
    (lambda d: d["model"]["layers"].__setitem__(0, 5), "model.layers[0]", "expected an object"),
    (lambda d: d["model"]["layers"][0]["tensors"].__setitem__(0, ["weight", 4, "float32"]),
     "model.layers[0].tensors[0][1]", "expected a shape"),
    (lambda d: d["model"].update(spec=5), "model.spec", "expected a string"),
    (lambda d: d["layers"][0].update(stash_params=["half"]), "layers[0].stash_params", "not in the layer's stash"),
    (lambda d: d["layers"][0].update(grad_param_bytes=10 ** 6), "layers[0].grad_param_bytes",
     "more than the layer's param_bytes"),
    (lambda d: d["layers"][0].update(grad_param_bytes=-1), "layers[0].grad_param_bytes", "at least 0"),
    (lambda d: d["layers"][0].update(output_fixed_bytes=-1), "layers[0].output_fixed_bytes", "at least 0"),
])
def test_bad_field_is_named(saved_file: Path, change: Callable[[dict[str, Any]], None], field: str,
                            problem: str) -> None:
    expect_error(edit(saved_file, change), f"field '{field}'", problem)


def test_times_written_as_integers_are_read_as_floats(measured: Profile, saved_file: Path) -> None:
    """A file written by other tools may hold ``2`` for ``2.0``: the same profile."""
    def whole(document: dict[str, Any]) -> None:
        document["layers"][0]["forward"]["2"] = {"median_ms": 2, "min_ms": 1, "max_ms": 3, "repeats": 4}

    stat = Profile.load(edit(saved_file, whole)).layers[0].forward[2]
    assert stat == Stat(2.0, 1.0, 3.0, 4) and type(stat.median_ms) is float


def test_copy_fits_written_with_integers_are_read_as_floats(measured: Profile, saved_file: Path) -> None:
    def whole(document: dict[str, Any]) -> None:
        document["copies"][0].update(latency_ms=2, ms_per_byte=0, points=[[8, 3], [16, 4.5]])

    fit = Profile.load(edit(saved_file, whole)).copies[0]
    assert (fit.latency_ms, fit.ms_per_byte, fit.points) == (2.0, 0.0, [(8, 3.0), (16, 4.5)])
    assert type(fit.latency_ms) is float and type(fit.points[0][1]) is float


def test_stat_spread() -> None:
    assert Stat(2.0, 1.5, 3.0, 5).spread_ms == 1.5


def test_a_profile_without_workspaces_is_read_and_its_empty_shape_kept(measured: Profile, saved_file: Path) -> None:
    """Profiles made before the workspace was measured have none (the cost model estimates it);
    a sample of no dimensions (a scalar per sample) is a shape of its own, not a missing one."""
    def older(document: dict[str, Any]) -> None:
        for layer in document["layers"]:
            del layer["workspace_bytes"]
        document["input_shape"] = []

    loaded = Profile.load(edit(saved_file, older))
    assert all(layer.workspace_bytes == {} for layer in loaded.layers) and loaded.input_shape == []


def test_a_profile_without_trainable_bytes_or_stashed_parameters_reads_as_before(measured: Profile,
                                                                                 saved_file: Path) -> None:
    """Profiles made before ``grad_param_bytes`` and ``stash_params`` were recorded charge
    gradients for every parameter and every skip as a new tensor: the old behaviour."""
    assert [layer.grad_param_bytes for layer in measured.layers] == [layer.param_bytes for layer in measured.layers]

    def older(document: dict[str, Any]) -> None:
        for layer in document["layers"]:
            layer.pop("grad_param_bytes")
            assert "stash_params" not in layer  # written only when a skip is a parameter

    loaded = Profile.load(edit(saved_file, older))
    assert all(layer.grad_param_bytes is None and layer.stash_params == [] for layer in loaded.layers)
    assert [layer.trainable_bytes for layer in loaded.layers] == [layer.param_bytes for layer in loaded.layers]


def test_a_copy_fit_to_the_same_device_or_a_second_one_for_a_pair_is_refused(measured: Profile,
                                                                               saved_file: Path) -> None:
    """Either was read silently (the first fit of a pair won, a fit to itself was never used): a
    hand-merged or damaged file, refused in one error that names the fit and the fix, from a file
    or in memory."""
    expect_error(edit(saved_file, lambda d: d["copies"][0].update(dst=d["copies"][0]["src"])), "field 'copies[0]'",
                 "is a copy fit from device 0 to itself", "fits between distinct devices only: remove it")
    saved_file = measured.save(saved_file)
    expect_error(edit(saved_file, lambda d: d["copies"].append({**d["copies"][0], "latency_ms": 9.0})),
                 "field 'copies[2]'", "is a second copy fit for devices 0 -> 1 (the first is copies[0])",
                 "keep one fit per pair")
    doubled = Profile(**{**measured.__dict__, "copies": [*measured.copies, measured.copies[1]]})
    with pytest.raises(FormatError, match=r"copies\[2\]': is a second copy fit for devices 1 -> 0"):
        doubled.validate()


def test_a_second_reduction_fit_for_an_engine_is_refused(measured: Profile) -> None:
    """The first fit for an engine was used and the second ignored, silently (a bogus first fit
    turned data parallel into a pipeline)."""
    from autopipe.profiling.profiles import ReductionFit

    fits = [ReductionFit("local", 2, 0.1, 1e-6, []), ReductionFit("local", 2, 1000.0, 1e-6, [])]
    doubled = Profile(**{**measured.__dict__, "reductions": fits})
    with pytest.raises(FormatError, match=r"reductions\[1\]': is a second reduction fit for the engine 'local' "
                                          r"\(the first is reductions\[0\]\); keep one fit per engine"):
        doubled.validate()


def test_layers_unlike_the_model_fingerprint_are_refused(saved_file: Path) -> None:
    """Only the layer count was compared: a layer of another name or type (timings of another
    model under this one's fingerprint) was planned without a word."""
    expect_error(edit(saved_file, lambda d: d["layers"][2].update(type="Conv2d")), "field 'layers[2]'",
                 "is 2 (Conv2d) but the model fingerprint lists 2 (ReLU) there", "profile this one again")


def test_a_plan_holds_its_own_copy_of_the_profiles_model(measured: Profile) -> None:
    """The plan's model fingerprint was the profile's own dict: editing one edited the other."""
    from autopipe.planning.solver import plan

    made = plan(measured, interleave=1)
    made.model["spec"] = "changed:here"
    assert measured.model.get("spec") != "changed:here"


@pytest.mark.parametrize("names", [["cuda:0", "cuda:1"], ["cuda", "cpu"], ["meta", "cpu:1"]])
def test_device_names_every_step_takes_are_read(saved_file: Path, names: list[str]) -> None:
    assert Profile.load(edit(saved_file, lambda d: d.update(devices=names))).devices == names


@pytest.mark.parametrize(("names", "field", "shown"), [
    (["cpu", "gpu"], "devices[1]", "'gpu'"),
    (["cuda:x", "cpu"], "devices[0]", "'cuda:x'"),
    (["cpu", 0], "devices[1]", "'0'"),
])
def test_a_device_name_no_step_takes_is_refused_naming_the_field(saved_file: Path, names: list[Any], field: str,
                                                                  shown: str) -> None:
    """Read as it was, 'gpu' was refused only by ``plan``, naming neither the file nor the field."""
    expect_error(edit(saved_file, lambda d: d.update(devices=names)), f"field '{field}'",
                 f"{shown} is not a device autopipe can use", "correct it, or make the file again")


@pytest.mark.parametrize(("text", "problem"), [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply to read"),
    ('{"kind": "profile", "schema_version": ' + "1" * 5000 + "}", "a number too long to read"),
])
@pytest.mark.parametrize("command", ["plan", "show"])
def test_json_beyond_python_is_one_line_from_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                                     problem: str, command: str) -> None:
    path = tmp_path / "deep.json"
    path.write_text(text)
    expect_error(path, problem, "the profile file is corrupt")
    assert main([command, str(path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"autopipe {command}: error: {path}: ") and problem in error
    assert "Traceback" not in error and error.count("\n") == 1


def test_load_refuses_what_is_no_file_name() -> None:
    with pytest.raises(OptionError, match=r"path must name a profile file \(a str or os.PathLike .*\), got None"):
        Profile.load(None)  # type: ignore[arg-type]
