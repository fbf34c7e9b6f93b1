import numpy as np
import pytest

from fedweigh.errors import InvalidClientResult
from fedweigh.server.validation import ResultLimits, check_meta, check_params

REF = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32), "n": np.array(0, np.int64)}


def _params(**over):
    p = {"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32), "n": np.array(5, np.int64)}
    p.update(over)
    return p


def _check(params=None, meta=None, required=(), limits=None):
    meta = {"num_samples": 10, "NUM_STEPS_CURRENT_ROUND": 3} if meta is None else meta
    checked = check_meta("site-2", meta, required, limits or ResultLimits())
    return (
        check_params("site-2", params or _params(), REF),
        checked.num_samples,
        checked.num_steps,
        checked.scalars,
    )


def test_valid_result_passes():
    params, n, steps, scalars = _check(
        meta={"num_samples": 10, "NUM_STEPS_CURRENT_ROUND": 3, "fedweigh_scalars": {"skew": 0.5}},
        required=("skew",),
    )
    assert (n, steps, scalars) == (10, 3, {"skew": 0.5})
    assert set(params) == set(REF)


@pytest.mark.parametrize(
    "params, message",
    [
        (_params(w=np.full((2, 3), np.nan, np.float32)), "non-finite"),
        (_params(w=np.ones((3, 2), np.float32)), "shape"),
        ({"w": np.ones((2, 3), np.float32)}, "missing"),
        ({**_params(), "extra": np.ones(1)}, "unexpected"),
    ],
)
def test_bad_params_are_named(params, message):
    with pytest.raises(InvalidClientResult, match=message) as e:
        _check(params=params)
    assert "site-2" in str(e.value)


@pytest.mark.parametrize(
    "meta, message",
    [
        ({}, "num_samples"),
        ({"num_samples": -4}, "positive"),
        ({"num_samples": 2.5}, "integer"),
        ({"num_samples": True}, "integer"),
        ({"num_samples": 10**9}, "plausibility"),
        ({"num_samples": 10, "fedweigh_scalars": {"skew": float("inf")}}, "skew"),
        ({"num_samples": 10, "fedweigh_scalars": {}}, "missing scalar"),
        ({"num_samples": 10, "fedweigh_scalars": [1, 2]}, "mapping"),
    ],
)
def test_bad_meta_is_named(meta, message):
    with pytest.raises(InvalidClientResult, match=message):
        _check(meta=meta, required=("skew",), limits=ResultLimits(max_num_samples=1000))


@pytest.mark.parametrize(
    "steps, message",
    [
        (0, "positive"),
        (-3, "positive"),
        (2.5, "integer"),
        (float("nan"), "integer"),
        (float("inf"), "integer"),
        ("many", "integer"),
        (None, "integer"),
        (True, "integer"),
        (10**9, "plausibility"),
    ],
)
def test_bad_step_count_is_named(steps, message):
    """FedNova weights and stock FedAvg's weights use the reported step count: it is checked like N_k."""
    meta = {"num_samples": 10, "NUM_STEPS_CURRENT_ROUND": steps}
    with pytest.raises(InvalidClientResult, match=f"site-2: NUM_STEPS_CURRENT_ROUND.*{message}"):
        _check(meta=meta, limits=ResultLimits(max_num_steps=1000))


def test_missing_step_count_counts_as_one_step():
    assert _check(meta={"num_samples": 10})[2] == 1
