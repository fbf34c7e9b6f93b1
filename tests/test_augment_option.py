"""The ``augment`` client option: from the job's arguments to the training batches."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

from fedweigh import train as train_module
from fedweigh.checks import check_client_args
from fedweigh.data import build_federation
from fedweigh.errors import ConfigError
from fedweigh.site.args import ClientArgs, parse_args
from fedweigh.site.trainer import SiteTrainer
from fedweigh.train import get_params


def test_augment_reaches_the_client_script():
    args = ClientArgs(augment=True)
    assert "--augment" in args.to_argv()
    assert parse_args(args.to_argv().split()).augment is True
    assert parse_args([]).augment is False


def _round(augment: bool):
    fed = build_federation("iid-4", "synthcxr", size=28, seed=0, num_images=240)
    args = ClientArgs(size=28, num_images=240, batch_size=16, max_steps=3, eval_test=False, augment=augment)
    trainer = SiteTrainer(fed.sites[0], fed.test, args, threads=1)
    start = get_params(trainer.model)
    with mock.patch("fedweigh.train.augment_batch", wraps=train_module.augment_batch) as aug:
        out = trainer.run_round(start, 1, {})
    return out.params, aug.call_count


def test_augmented_training_sees_augmented_batches():
    plain, plain_calls = _round(False)
    augmented, calls = _round(True)
    assert plain_calls == 0 and calls == 3
    assert any(not np.allclose(plain[k], augmented[k]) for k in plain if plain[k].dtype.kind == "f")


def test_augment_is_refused_with_dp_sgd():
    with pytest.raises(
        ConfigError, match=r"augment = True is not allowed; DP-SGD trains without augmentation"
    ):
        check_client_args(ClientArgs(augment=True, dp_epsilon=8.0))
    with pytest.raises(ConfigError, match=r"augment = 'yes'"):
        check_client_args(ClientArgs(augment="yes"))
