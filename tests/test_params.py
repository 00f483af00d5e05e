"""Validation of what users pass as ``params``, and the element-wise optimizer check."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from _draws import draws
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.optim import ZeroRedundancyOptimizer

from zerofn.testing import strategies as zst
from zerofn.zero.optimizers import ELEMENTWISE_OPTIMIZERS, check_elementwise
from zerofn.zero.params import check_same_dense_type, normalize_params


def _all_tensors(groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    return [p for group in groups for p in group["params"]]


@pytest.mark.parametrize(
    ("params", "exc"),
    [
        (torch.zeros(3), TypeError),
        (3, TypeError),
        (None, TypeError),
        ([], ValueError),
        ((), ValueError),
        ([torch.zeros(2), 3], TypeError),
        ([torch.zeros(2), {"params": [torch.zeros(1)]}], TypeError),
        ([{"lr": 0.1}], ValueError),
        ([{"params": [torch.zeros(1), "w"]}], TypeError),
    ],
    ids=[
        "tensor",
        "int",
        "none",
        "empty-list",
        "empty-tuple",
        "tensor-and-int",
        "tensor-and-dict",
        "dict-without-params",
        "group-with-str",
    ],
)
def test_normalize_params_errors(params: Any, exc: type[Exception]) -> None:
    snapshot = (
        [dict(p) if isinstance(p, dict) else p for p in params]
        if isinstance(params, list)
        else None
    )
    with pytest.raises(exc):
        normalize_params(params)
    if snapshot is not None:
        assert len(params) == len(snapshot)
        for now, then in zip(params, snapshot, strict=True):
            if isinstance(then, dict):
                assert now.keys() == then.keys() and all(now[k] is then[k] for k in now)
            else:
                assert now is then


def test_dense_type_errors() -> None:
    dense = torch.zeros(2, 2)
    sparse = torch.zeros(2, 2).to_sparse()
    with pytest.raises(ValueError, match="dense"):
        check_same_dense_type(_all_tensors(normalize_params([dense, sparse])))
    with pytest.raises(ValueError, match="dense"):
        check_same_dense_type([sparse])
    with pytest.raises(ValueError, match="dtype"):
        check_same_dense_type([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match="dtype"):
        check_same_dense_type(
            _all_tensors(
                normalize_params(
                    [{"params": [torch.zeros(2)]}, {"params": torch.zeros(1, dtype=torch.half)}]
                )
            )
        )
    check_same_dense_type([torch.zeros(2), torch.ones(3, 4)])


@settings(max_examples=draws(60), deadline=None)
@given(zst.group_sizes(max_groups=3, max_params_per_group=4, max_numel=8, max_large=0), st.data())
def test_valid_params_are_normalized_without_mutation(
    groups: list[list[int]], data: st.DataObject
) -> None:
    tensors = [[torch.zeros(n) for n in group] for group in groups]
    flat = [t for group in tensors for t in group]
    as_dicts = data.draw(st.booleans())
    if as_dicts:
        user: list[Any] = []
        for g, group in enumerate(tensors):
            params: Any = group
            if len(group) == 1 and data.draw(st.booleans()):
                params = group[0]  # a single tensor is accepted in a group
            elif data.draw(st.booleans()):
                params = tuple(group)
            user.append({"params": params, "lr": 0.1 * (g + 1)})
        before = [{**d} for d in user]
        before_params = [
            d["params"] if isinstance(d["params"], torch.Tensor) else list(d["params"])
            for d in user
        ]
        out = normalize_params(user)
        # the user's dicts are untouched: same keys, same objects, same contents
        for d, b, bp in zip(user, before, before_params, strict=True):
            assert d.keys() == b.keys()
            assert all(d[k] is b[k] for k in d)
            if not isinstance(d["params"], torch.Tensor):
                assert list(d["params"]) == bp
        assert all(o is not d for o, d in zip(out, user, strict=True))
        assert [o["lr"] for o in out] == [d["lr"] for d in user]
    else:
        user = list(flat)
        out = normalize_params(iter(user) if data.draw(st.booleans()) else user)
        assert user == flat
        assert len(out) == 1
    assert all(isinstance(o["params"], list) for o in out)
    assert [id(t) for t in _all_tensors(out)] == [id(t) for t in flat]
    check_same_dense_type(_all_tensors(out))


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_elementwise_optimizers_accepted(cls: type) -> None:
    assert cls in ELEMENTWISE_OPTIMIZERS
    check_elementwise(cls)


def test_lbfgs_refused() -> None:
    with pytest.raises(ValueError, match="LBFGS"):
        check_elementwise(torch.optim.LBFGS)


def test_declared_elementwise_accepted() -> None:
    class MyOptimizer(torch.optim.Optimizer):
        pass

    with pytest.raises(ValueError, match="MyOptimizer"):
        check_elementwise(MyOptimizer)
    check_elementwise(MyOptimizer, declared_elementwise=True)
    check_elementwise(torch.optim.LBFGS, declared_elementwise=True)


# --- parity with PyTorch's ZeroRedundancyOptimizer checks ------------------------------


def _pytorch_error(params: Any) -> type[Exception] | None:
    """The exception PyTorch's ZeroRedundancyOptimizer raises while checking
    ``params`` (run without a process group), or None."""
    fake: Any = types.SimpleNamespace()
    try:
        ZeroRedundancyOptimizer._verify_and_init_params(fake, params)
        ZeroRedundancyOptimizer._verify_same_dense_param_type(fake)
    except Exception as e:
        return type(e)
    return None


def _our_error(params: Any) -> type[Exception] | None:
    try:
        check_same_dense_type(_all_tensors(normalize_params(params)))
    except Exception as e:
        return type(e)
    return None


def _parity_cases() -> dict[str, Any]:
    t = torch.zeros(2)
    sparse = torch.zeros(2, 2).to_sparse()
    return {
        "tensor": t,
        "int": 3,
        "none": None,
        "empty-list": [],
        "empty-generator": (p for p in []),
        "tensor-and-int": [t, 3],
        "tensor-and-dict": [t, {"params": [t]}],
        "dict-without-params": [{"params": [t]}, {"lr": 0.1}],
        "sparse-first": [sparse, t],
        "sparse-later": [torch.zeros(2, 2), sparse],
        "float-and-double": [t, torch.zeros(2, dtype=torch.float64)],
        "groups-float-and-half": [{"params": [t]}, {"params": [torch.zeros(1, dtype=torch.half)]}],
        "cpu-and-meta": [t, torch.zeros(2, device="meta")],
        "valid-tensors": [t, torch.ones(3, 4)],
        "valid-groups": [{"params": [t], "lr": 0.1}, {"params": [torch.ones(3)]}],
    }


@pytest.mark.parametrize("name", list(_parity_cases()))
def test_error_types_match_pytorch(name: str) -> None:
    theirs = _pytorch_error(_parity_cases()[name])
    ours = _our_error(_parity_cases()[name])
    assert ours is theirs
