"""Each client option is declared once, as a field of ClientArgs: the client script's command line,
the options a method may prescribe, the bench's flags, the checks' lists of choices and the training
and privacy settings all follow from it; an option that would change nothing is warned about."""

from __future__ import annotations

import argparse
import logging
import shlex
from dataclasses import fields, replace

import numpy as np
import pytest

import fedweigh.checks as checks
import fedweigh.site.trainer as trainer_module
from fedweigh.bench.cli import add_bench_parser
from fedweigh.checks import check_client_values
from fedweigh.data.base import LabeledImages, SiteData
from fedweigh.errors import ConfigError
from fedweigh.methods import CLIENT_OPTIONS
from fedweigh.secure import dp_config
from fedweigh.site.args import ClientArgs, bench_options, client_parser, ineffective_options, parse_args
from fedweigh.train import OPTIMIZERS

NAMES = [f.name for f in fields(ClientArgs)]

#: Valid settings that, together, move every option off its default (DP-SGD excludes augment).
CHANGED = (
    ClientArgs(
        dataset="chestmnist",
        scenario="label-a0.5",
        data_path="/data/chestmnist_64.npz",
        loader_options={"task": "multilabel"},  # one the dataset's loader takes
        size=64,
        num_images=100,
        test_images=50,
        seed=3,
        arch="vit",
        norm="group",
        pretrained="start.pt",
        loss="focal",
        loss_options={"gamma": 2.0},
        epochs=2,
        batch_size=8,
        lr=0.01,
        optimizer="sgd",
        momentum=0.5,
        weight_decay=1e-4,
        max_steps=5,
        threads=2,
        eval_test=False,
        device="cpu",
        channels_last=False,
        keep_optimizer=True,
        amp=True,
        compile=True,
        augment=True,
    ),
    ClientArgs(
        dp_epsilon=4.0,
        dp_delta=1e-6,
        dp_max_grad_norm=2.0,
        dp_accountant="prv",
        dp_mode="hooks",
        stats_dp_epsilon=1.0,
        stats_dp_delta=1e-6,
        he_precision_bits=12,
    ),
    ClientArgs(dp_noise_multiplier=1.0),  # DP-SGD takes a target epsilon or a fixed sigma
)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def test_the_client_parser_has_one_option_per_field_with_its_default_and_help():
    options = _options(client_parser())
    assert list(options) == NAMES
    defaults = ClientArgs()
    for f in fields(ClientArgs):
        action = options[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        assert action.default == getattr(defaults, f.name), f.name
        assert action.help == f.metadata["help"] and action.help.strip(), f.name
    assert parse_args([]) == defaults


def test_every_option_round_trips_through_the_command_line():
    defaults = ClientArgs()
    changed = {name for name in NAMES if any(getattr(a, name) != getattr(defaults, name) for a in CHANGED)}
    assert changed == set(NAMES)
    for args in CHANGED:
        assert parse_args(shlex.split(args.to_argv())) == args


def test_method_options_and_bench_flags_derive_from_the_declarations():
    assert CLIENT_OPTIONS == tuple(f.name for f in fields(ClientArgs) if f.metadata["method"])
    assert {"optimizer", "lr", "keep_optimizer", "augment"} <= set(CLIENT_OPTIONS)
    parser = argparse.ArgumentParser()
    bench = add_bench_parser(parser.add_subparsers(dest="command"))
    client_flags = {dest for dest in _options(bench) if dest in NAMES}
    declared = {f.name for f in fields(ClientArgs) if f.metadata["bench"]}
    assert client_flags - {"dataset"} == set(bench_options()) == declared  # --dataset: the run's own
    for name in declared - {"threads"}:
        assert _options(bench)[name].help == ClientArgs.__dataclass_fields__[name].metadata["help"] + (
            " (default: the profile's)"
        )
    # a bench flag left out keeps the profile's value: its default is None (threads: 1 per process)
    args = parser.parse_args(["bench", "--out", "x"])
    assert {name: getattr(args, name) for name in bench_options() if name != "threads"} == dict.fromkeys(
        set(bench_options()) - {"threads"}
    )


def test_the_lists_of_choices_are_their_owners():
    assert checks.OPTIMIZERS is OPTIMIZERS
    assert checks.DP_MODES is dp_config.DP_MODES and checks.ACCOUNTANTS is dp_config.ACCOUNTANTS
    with pytest.raises(
        ConfigError, match=r"dp_mode = 'fast2'.*choose one of auto, fast, hooks, functorch, ghost"
    ):
        parse_args(["--dp-mode", "fast2", "--dp-epsilon", "1"])


@pytest.mark.parametrize("name", NAMES)
def test_every_option_is_checked(name):
    values = {**vars(ClientArgs()), name: object()}
    with pytest.raises(ConfigError, match=f"x: {name} = "):
        check_client_values(values, "x")


def test_training_and_privacy_settings_derive_from_the_arguments():
    args = replace(CHANGED[0], amp=False)
    cfg = args.train_config(fedprox_mu=0.1, seed=7, device="cpu")
    assert (cfg.epochs, cfg.batch_size, cfg.lr, cfg.optimizer, cfg.momentum, cfg.weight_decay) == (
        2,
        8,
        0.01,
        "sgd",
        0.5,
        1e-4,
    )
    assert (cfg.max_steps, cfg.fedprox_mu, cfg.seed, cfg.device, cfg.amp, cfg.augment) == (
        5,
        0.1,
        7,
        "cpu",
        False,
        True,
    )
    assert args.dp_config() is None and args.stats_dp_config() is None
    dp = CHANGED[1].dp_config()
    assert (dp.epsilon, dp.delta, dp.max_grad_norm, dp.noise_multiplier, dp.accountant, dp.mode) == (
        4.0,
        1e-6,
        2.0,
        None,
        "prv",
        "hooks",
    )
    stats = CHANGED[1].stats_dp_config()
    assert (stats.epsilon, stats.delta) == (1.0, 1e-6)


# ---------------------------------------------------------------------------------- options without effect
def test_options_without_effect_are_named():
    assert ineffective_options(ClientArgs(), "cpu") == []
    assert ineffective_options(CHANGED[0], "cuda") == []  # SGD's momentum, no DP settings
    dp = ClientArgs(dp_epsilon=4.0, keep_optimizer=True, compile=True)
    assert [r.split(" ")[0] for r in ineffective_options(dp, "cpu")] == ["keep_optimizer", "compile"]
    assert "amp has no effect on device 'cpu'" in ineffective_options(ClientArgs(amp=True), "cpu")[0]
    assert ineffective_options(ClientArgs(amp=True), "cuda:0") == []
    assert ineffective_options(ClientArgs(momentum=0.5), "cpu") == [
        "momentum has no effect with optimizer 'adam' (SGD's momentum)"
    ]
    assert ineffective_options(ClientArgs(dp_mode="hooks", dp_delta=1e-6), "cpu") == [
        "dp_delta, dp_mode have no effect: DP-SGD is off"
    ]
    # stats_dp_delta is the delta of the site policy's default statistics release too: never without effect
    assert ineffective_options(ClientArgs(stats_dp_delta=1e-6), "cpu") == []


def _site() -> SiteData:
    rng = np.random.default_rng(0)

    def images(n):
        x = rng.normal(size=(n, 1, 16, 16)).astype(np.float32)
        return LabeledImages(x, rng.integers(0, 2, (n, 3)).astype(np.float32), ("a", "b", "c"), "multilabel")

    return SiteData(name="site-1", train=images(8), val=images(4))


def test_a_site_warns_once_when_keep_optimizer_meets_dp_sgd(caplog, monkeypatch):
    monkeypatch.setattr(trainer_module, "_WARNED", set())
    args = ClientArgs(size=16, dp_noise_multiplier=1.0, keep_optimizer=True, device="cpu")
    site = _site()
    with caplog.at_level(logging.WARNING, logger="fedweigh.site"):
        trainer_module.SiteTrainer(site, site.val, args)
        trainer_module.SiteTrainer(site, site.val, args)  # a second site of the same process: said once
    said = [r.getMessage() for r in caplog.records if "keep_optimizer" in r.getMessage()]
    assert said == ["keep_optimizer has no effect under DP-SGD (DP-SGD builds its optimizer every round)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedweigh.site"):
        trainer_module.SiteTrainer(site, site.val, replace(args, dp_noise_multiplier=None))
    assert not [r for r in caplog.records if "no effect" in r.getMessage()]
