"""Plan files: JSON round trip, atomic save, validation errors naming file and field."""
from __future__ import annotations

import json
import re

import pytest
from synthetic import make_profile

from autopipe._jsonio import FormatError
from autopipe.errors import OptionError
from autopipe.planning.plans import Plan
from autopipe.planning.solver import plan


@pytest.fixture
def saved(tmp_path):
    profile = make_profile([1.0, 2.0, 3.0, 4.0, 5.0], sizes=(1, 2, 4), devices=3, output_bytes=100,
                           copies=(0.01, 1e-5))
    chosen = plan(profile, checkpoint="except_last", speeds=[1.0, 1.0, 2.0])
    path = chosen.save(tmp_path / "plans" / "p.json")
    return chosen, path


def test_round_trip(saved):
    chosen, path = saved
    loaded = Plan.load(path)
    assert loaded == chosen
    assert loaded.to_json() == chosen.to_json()
    document = json.loads(path.read_text())
    assert document["kind"] == "plan" and document["schema_version"] == 1
    assert document["balance"] == chosen.balance
    assert [p["index"] for p in document["split_points"]] == [s.start for s in chosen.stages[1:]]
    assert not list(path.parent.glob(".*.tmp"))


def edit(path, change):
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


@pytest.mark.parametrize("change, field, words", [
    (lambda d: d.update(checkpoint="sometimes"), "checkpoint", "not one of"),
    (lambda d: d.update(balance=[1, 1, 1]), "balance", "disagrees with the stages"),
    (lambda d: d["stages"][0].pop("forward_ms"), "stages[0].forward_ms", "missing"),
    (lambda d: d.update(chunks=d["batch_size"] + 1), "chunks", "must be 1..batch_size"),
    (lambda d: d.update(micro_batch_size=99), "micro_batch_size", "ceil(batch_size / chunks)"),
    (lambda d: d["stages"][0].update(stop=d["stages"][0]["stop"] + 1), "stages[1]", "must start at"),
    (lambda d: d.update(devices=d["devices"] + ["cpu"]), "devices", "devices for"),
    (lambda d: d["stages"][0].update(device="cuda:7"), "stages[0]", "devices[0] is cpu"),
    (lambda d: d["predicted"].update(iteration_ms="fast"), "predicted.iteration_ms", "a finite number"),
    (lambda d: d.update(schema_version=99), "schema_version", "upgrade autopipe"),
    # read later by the consistency check, the fingerprint check and bench, which failed there
    (lambda d: d["model"].pop("layers"), "model.layers", "missing"),
    (lambda d: d["model"].update(layers=5), "model.layers", "expected a list, found int"),
    (lambda d: d["model"].update(digest=7), "model.digest", "expected a string"),
    (lambda d: d.update(options=[]), "options", "expected an object, found list"),
    (lambda d: d["options"].update(optimizer_state_factor="abc"), "options.optimizer_state_factor",
     "a finite number"),
    (lambda d: d["model"].update(spec=5), "model.spec", "expected a string, found 5"),
    (lambda d: d["model"].update(input_shape="16"), "model.input_shape", "expected a shape (a list of integers)"),
    (lambda d: d["model"].update(input_shape=[0, 3]), "model.input_shape", "dimensions of at least 1"),
    # read as they were, such names failed only when the plan ran, naming neither file nor field
    (lambda d: d["devices"].__setitem__(0, "gpu"), "devices[0]", "'gpu' is not a device autopipe can use"),
    (lambda d: d["replica_devices"][0].__setitem__(1, "cuda:one"), "replica_devices[0][1]",
     "'cuda:one' is not a device"),
    # loaded as they were: the gap read 0 (optimal), and names disagreed with the stages
    (lambda d: d["predicted"].update(lower_bound_ms=2 * d["predicted"]["iteration_ms"]),
     "predicted.lower_bound_ms", "above the predicted iteration"),
    (lambda d: d["stages"][1].update(first_layer="nope"), "stages[1]", "names its layers 'nope'"),
    (lambda d: d["split_points"][0].update(name="nope"), "split_points", "disagrees with the stages"),
    # shown as they were: "bubble 200.0%", "activations (7453786524%)"
    (lambda d: d["predicted"].update(bubble_fraction=2.0), "predicted.bubble_fraction", "must be at most 1"),
    (lambda d: d["stages"][0]["memory_terms"].update(activations=10 ** 15), "stages[0].memory_terms",
     "must add up to the stage's memory_bytes"),
    # ignored: a 1F1B plan with its "schedule" misspelt ran fill-drain, the default
    (lambda d: d.update(Schedule=d.pop("schedule")), "Schedule", "is no field of a plan (a misspelt 'schedule'?)"),
    (lambda d: d["stages"][0].update(reduce=1.0), "stages[0].reduce",
     "is no field of a stage (a misspelt 'reduce_ms'?)"),
    (lambda d: d["predicted"].update(extra=1), "predicted.extra", "is no field of a prediction; remove or correct"),
])
def test_validation_names_the_field(saved, change, field, words):
    _, path = saved
    edit(path, change)
    with pytest.raises(FormatError) as error:
        Plan.load(path)
    assert f"field '{field}'" in str(error.value) and words in str(error.value) and str(path) in str(error.value)


def test_truncated_and_missing_files(saved, tmp_path):
    _, path = saved
    path.write_text(path.read_text()[:100])
    with pytest.raises(FormatError, match="corrupt or truncated"):
        Plan.load(path)
    with pytest.raises(FormatError, match="no such plan file"):
        Plan.load(tmp_path / "none.json")


@pytest.mark.parametrize("limit", [float("inf"), [None, float("inf"), 1e12]])
def test_an_infinite_memory_limit_is_no_limit_in_the_file(tmp_path, limit):
    """``memory_limit=float("inf")`` plans as no limit and saves (JSON has no infinity: the plan
    could not be written)."""
    profile = make_profile([1.0, 2.0, 3.0], sizes=(1, 2), devices=3)
    chosen = plan(profile, memory_limit=limit)
    loaded = Plan.load(chosen.save(tmp_path / "p.json"))
    assert loaded.options["memory_limit_bytes"][:2] == [None, None]
    assert loaded.options["memory_limit"] in (None, [None, None, 1e12])


def test_save_refuses_what_load_would(saved):
    """A plan changed in memory is checked as a file is read: nothing is written that
    :meth:`Plan.load` would refuse, and an earlier file stays whole."""
    chosen, path = saved
    before = path.read_text()
    chosen.chunks = 100_000_000
    with pytest.raises(FormatError, match="in-memory plan: field 'chunks': 100000000 micro-batches"):
        chosen.save(path)
    with pytest.raises(FormatError, match="field 'chunks'"):
        chosen.validate()
    assert path.read_text() == before and [p.name for p in path.parent.iterdir()] == ["p.json"]


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("chunks", 0, "must be at least 1, found 0"),
    ("replicas", 0, "must be at least 1, found 0"),
    ("batch_size", None, "expected an integer, found null"),
])
def test_save_names_a_count_the_micro_batch_size_divides_by(saved, field, value, problem):
    """``micro_batch_size`` divides by them: a ZeroDivisionError (or TypeError) before they were checked."""
    chosen, path = saved
    before = path.read_text()
    setattr(chosen, field, value)
    for call in (lambda: chosen.save(path), chosen.validate):
        with pytest.raises(FormatError, match=re.escape(f"in-memory plan: field '{field}': {problem}")):
            call()
    assert path.read_text() == before


def test_load_refuses_what_is_no_file_name():
    with pytest.raises(OptionError, match=r"path must name a plan file \(a str or os.PathLike .*\), got None"):
        Plan.load(None)


@pytest.mark.parametrize("options", [dict(chunks=2), dict(memory_limit=10**9), dict(memory_limit=[10**9, None, None]),
                                     dict(time_limit=0.5), dict(interleave=1), dict(optimizer_state=2)])
def test_numpy_numbers_as_options_give_a_plan_that_saves(tmp_path, options):
    """numpy numbers (``np.int64(2)`` from an array) were taken and planned with, then the plan's
    save failed inside json (``Object of type int64 is not JSON serializable``)."""
    import numpy as np

    def as_numpy(value):
        if isinstance(value, list):
            return [as_numpy(v) for v in value]
        return np.float32(value) if isinstance(value, float) else np.int64(value) if value is not None else None

    profile = make_profile([1.0, 2.0, 3.0, 4.0], sizes=(1, 2, 4), devices=3)
    expected = plan(profile, **options)
    chosen = plan(profile, **{name: as_numpy(value) for name, value in options.items()})
    loaded = Plan.load(chosen.save(tmp_path / "p.json"))
    fields = ("balance", "chunks", "checkpoint")
    assert [getattr(loaded, name) for name in fields] == [getattr(expected, name) for name in fields]
    assert loaded.options == json.loads(json.dumps(expected.options))
