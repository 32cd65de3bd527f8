"""Micro-batches: tensor_split sizes, plain arguments repeated, outputs joined."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from autopipe.runtime._model_calls import join_outputs
from autopipe.runtime.microbatch import gather, map_tensors, scatter, split_sizes, tensors_of


@given(batch=st.integers(1, 200), chunks=st.integers(1, 40))
def test_sizes_follow_tensor_split_and_are_never_empty(batch: int, chunks: int) -> None:
    sizes = split_sizes(batch, chunks)
    assert len(sizes) == min(batch, chunks) and min(sizes) >= 1
    if batch >= chunks:
        assert sizes == [len(p) for p in torch.tensor_split(torch.arange(batch), chunks)]


def test_scatter_splits_tensors_and_repeats_other_arguments() -> None:
    x, y = torch.arange(7), torch.arange(14).view(7, 2)
    micro = scatter((x, "mode", y), 3)
    assert [m[0].tolist() for m in micro] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [m[1] for m in micro] == ["mode"] * 3
    assert torch.equal(torch.cat([m[2] for m in micro]), y)
    assert len(scatter((torch.zeros(2, 5),), 4)) == 2  # one sample per micro-batch
    pair = scatter(((x, y),), 2)  # one tuple argument, as nn.Sequential takes it
    assert [m[0][0].tolist() for m in pair] == [[0, 1, 2, 3], [4, 5, 6]]
    assert [m[0][1].shape[0] for m in pair] == [4, 3]


def test_scatter_refuses_unequal_batches_and_no_tensor() -> None:
    with pytest.raises(ValueError, match="same batch size"):
        scatter((torch.zeros(3), torch.zeros(4)), 2)
    with pytest.raises(TypeError, match="at least one tensor"):
        scatter((1, 2), 2)


def test_gather_joins_tensors_and_tuples() -> None:
    assert torch.equal(gather([torch.zeros(2, 3), torch.ones(1, 3)]), torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3]))
    a, b = gather([(torch.zeros(1), torch.ones(2)), (torch.zeros(2), torch.ones(1))])
    assert a.shape == (3,) and b.shape == (3,)
    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        gather([{"x": torch.zeros(1)}])


def test_map_tensors_keeps_structure_and_order() -> None:
    value = (torch.zeros(1), [torch.ones(1), 3], "s")
    doubled = map_tensors(value, lambda t: t + 2)
    assert doubled[1][1] == 3 and doubled[2] == "s"
    assert [t.item() for t in tensors_of(doubled)] == [2.0, 3.0]


def test_join_outputs_refuses_a_dim_0_that_is_not_the_micro_batch_only_when_joining() -> None:
    batch = [(torch.zeros(2, 3), (torch.ones(2), torch.tensor(1.0))),
             (torch.zeros(1, 3), (torch.ones(1), torch.tensor(4.0)))]
    first, (second, mean) = join_outputs(batch, [2, 1])
    assert first.shape == (3, 3) and second.shape == (3,) and mean.item() == 2.0  # (2·1 + 1·4) / 3
    with pytest.raises(ValueError, match=r"output \[1\]\[0\] has shape \(5,\) in a micro-batch of 2 samples"):
        join_outputs([(torch.zeros(2), (torch.ones(5),)), (torch.zeros(1), (torch.ones(5),))], [2, 1])
    with pytest.raises(ValueError, match=r"output \['state'\] has shape \(3, 2\) in a micro-batch of 2 samples"):
        join_outputs([{"state": torch.ones(3, 2)}, {"state": torch.ones(3, 1)}], [2, 1])
    assert join_outputs([torch.ones(5)], [2]).shape == (5,)  # one micro-batch: nothing joined


def test_join_outputs_refuses_to_average_integer_scalars() -> None:
    """A count per micro-batch has no mean in its type and its mean is not the batch's count:
    refused, naming the fix; kept where every micro-batch gave the same, or there is one."""
    with pytest.raises(ValueError, match=r"output \[1\] is a torch.int64 scalar that differs between "
                                         r"micro-batches \(2, 1\).*per sample.*chunks=1"):
        join_outputs([(torch.zeros(2), torch.tensor(2)), (torch.zeros(1), torch.tensor(1))], [2, 1])
    same = join_outputs([torch.tensor(True), torch.tensor(True)], [2, 1])
    assert same.dtype == torch.bool and same.item() is True
    one = join_outputs([torch.tensor(5)], [3])
    assert one.dtype == torch.int64 and one.item() == 5
    assert join_outputs([torch.tensor(1.0), torch.tensor(4.0)], [2, 1]).item() == 2.0


def test_join_outputs_names_an_item_that_cannot_be_joined() -> None:
    """A value that is neither a tensor nor a plain value alike in every micro-batch has no batch
    value; the error names where it is and what may stand there."""
    with pytest.raises(TypeError, match=r"output \[1\]\['n'\] is int \(3, 2 in its micro-batches\).*tensors"):
        join_outputs([(torch.zeros(3), {"n": 3}), (torch.zeros(2), {"n": 2})], [3, 2])
    with pytest.raises(TypeError, match=r"output \[0\] is object .* plain values"):
        join_outputs([(object(),)], [2])
