"""Per-method options: scheme, loss and client (local-training) options in method labels, the
catalogue's variants and ablations, recipes that train with a method's optimizer, and ``--tune``,
which picks a value on validation data without reading the test set."""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import replace

import numpy as np
import pytest
import torch

import fedweigh.bench.federations as federations
import fedweigh.bench.modes as modes
import fedweigh.site.trainer as site_module
import fedweigh.train as train_module
from fedweigh.bench.cells import cell_key, settings_hash
from fedweigh.bench.cli import add_bench_parser, main_bench
from fedweigh.bench.config import TuneSpec, Tuning, cell_args, make_config, parse_tune
from fedweigh.bench.runner import run_bench
from fedweigh.bench.tuning import TUNING_DIR
from fedweigh.cli import main
from fedweigh.data.base import LabeledImages, SiteData
from fedweigh.methods import (
    ABLATIONS,
    ALL_METHODS,
    CLIENT_OPTIONS,
    FEDERATED_METHODS,
    METHODS,
    VARIANTS,
    parse_method,
)
from fedweigh.site.args import ClientArgs, parse_args
from fedweigh.site.trainer import SiteTrainer

torch.set_num_threads(1)

SIZE = 16


def images(n: int, classes: int = 3, seed: int = 0) -> LabeledImages:
    rng = np.random.default_rng(seed)
    x = rng.random((n, 1, SIZE, SIZE), dtype=np.float32)
    names = tuple(f"c{i}" for i in range(classes))
    return LabeledImages(x, (rng.random((n, classes)) < 0.4).astype(np.float32), names, "multilabel")


# ------------------------------------------------------------------------------------------ labels
def test_label_options_go_to_the_scheme_the_loss_and_the_clients():
    spec = parse_method("fedbb:gamma=0.5,loss.mu=2,optim=sgd,lr=0.01,momentum=0.5,client.weight_decay=1e-4")
    assert spec.scheme_args == {"gamma": 0.5}
    assert spec.loss_options == {"mu": 2}
    assert spec.client_options == {"optimizer": "sgd", "lr": 0.01, "momentum": 0.5, "weight_decay": 1e-4}
    assert spec.label == "fedbb:gamma=0.5,loss.mu=2,optim=sgd,lr=0.01,momentum=0.5,client.weight_decay=1e-4"
    # scheme. forces the scheme's reading of a name both could mean (FedAWA's server lr)
    assert parse_method("fedawa:scheme.lr=0.05").scheme_args == {"lr": 0.05}
    assert parse_method("fedawa:client.lr=0.05").client_options == {"lr": 0.05}
    # the references take client options
    assert parse_method("centralized:optim=sgd,lr=0.01").client_options == {"optimizer": "sgd", "lr": 0.01}


@pytest.mark.parametrize(
    ("label", "expected"),
    [
        (
            "fedbb:optim=rmsprop",
            "method 'fedbb' client options: optimizer = 'rmsprop' (str) is not allowed; ",
        ),
        ("fedbb:lr=-1", "lr = -1 is not allowed; must be a number > 0"),
        ("fedbb:momentum=1.5", "momentum = 1.5 is not allowed; must be a number in [0, 1)"),
        ("fedbb:foo=1", "method 'fedbb': unknown option(s) foo of scheme 'cbr'; its options: eps, gamma,"),
        (
            "fedbb:loss.foo=1",
            "unknown option(s) loss.foo of loss 'pnb'; its options: loss.negatives, loss.mu,",
        ),
        (
            "fedbb:loss.mu=-1",
            "method 'fedbb': loss options {'mu': -1} rejected by loss 'pnb': pnb: mu must be",
        ),
        ("fedavg:loss.mu=1", "method 'fedavg': trains with the dataset's default loss (BCE / CE)"),
        (
            "fedawa:lr=0.1",
            "option 'lr' is both an option of scheme 'fedawa' and a client option; write scheme.lr",
        ),
        ("fedbb:opt.lr=0.1", "option 'opt.lr' has an unknown prefix; prefixes: scheme., loss., client."),
        (
            "centralized:gamma=1",
            "the reference 'centralized' takes client options only (epochs, batch_size, lr,",
        ),
        ("fedbb:client.size=64", "unknown client option(s) size; client options: epochs, batch_size, lr,"),
    ],
)
def test_bad_options_are_one_line_errors_naming_method_key_and_what_is_allowed(label, expected):
    with pytest.raises(ValueError) as info:
        parse_method(label)
    message = str(info.value)
    assert expected in message and "\n" not in message


def test_bad_option_on_the_bench_command_line_is_one_line(tmp_path, capsys):
    rc = main(["bench", "--methods", "fedbb:optim=adamw", "--out", str(tmp_path / "b")])
    assert rc == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines == [
        "error: method 'fedbb' client options: optimizer = 'adamw' (str) is not allowed; choose one of adam, sgd"
    ]
    assert not (tmp_path / "b").exists()


# --------------------------------------------------------------------------- variants and ablations
def test_ablations_and_the_paper_variant_have_the_right_parts():
    parts = {name: (METHODS[name].scheme, METHODS[name].loss) for name in VARIANTS}
    assert parts == {
        "fedbb-paper": ("cbr", "pnb"),
        "fedbb-pnb": ("fedavg", "pnb"),
        "fedbb-cbr": ("cbr", "default"),
        "dafl-loss": ("fedavg", "dafl"),
        "uniform": ("uniform", "default"),
        "feddraw-nosim": ("feddraw", "default"),
        "feddraw-noanneal": ("feddraw", "default"),
    }
    assert set(ABLATIONS) == {"fedbb-pnb", "fedbb-cbr", "dafl-loss"}
    # the loss's histogram still needs the statistics phase under FedAvg weights; CBR alone does not
    assert parse_method("fedbb-pnb").needs_statistics() and parse_method("dafl-loss").needs_statistics()
    assert not parse_method("fedbb-cbr").needs_statistics()
    # the paper's chest X-ray settings (Chung & Lee, Sec. 4)
    paper = parse_method("fedbb-paper")
    assert paper.scheme_args == {"gamma": 1.0}
    assert paper.loss_options == {"mu": 4.0, "a": 10.0, "beta": 0.9999999}
    assert paper.client_options == {"optimizer": "sgd", "lr": 0.01, "momentum": 0.9}
    # label options update the prescribed ones
    assert parse_method("fedbb-paper:lr=0.05").client_options["lr"] == 0.05
    # variants run by name but stay out of the default lists and of the job catalogue
    assert not set(VARIANTS) & set(ALL_METHODS) and set(FEDERATED_METHODS) | set(VARIANTS) == set(METHODS)


def test_client_options_are_local_training_fields_of_client_args():
    fields = set(vars(ClientArgs()))
    assert set(CLIENT_OPTIONS) <= fields
    assert not {"dataset", "scenario", "arch", "size", "seed", "device"} & set(CLIENT_OPTIONS)


# ---------------------------------------------------------------------------------- training with them
class OptimizerSpy:
    """Records every optimizer the local training builds."""

    def __init__(self, monkeypatch):
        self.built: list[torch.optim.Optimizer] = []
        real = train_module.make_optimizer

        def spy(model, cfg):
            optimizer = real(model, cfg)
            self.built.append(optimizer)
            return optimizer

        monkeypatch.setattr(train_module, "make_optimizer", spy)
        monkeypatch.setattr(site_module, "make_optimizer", spy)


def test_method_client_options_make_the_site_train_with_that_optimizer(monkeypatch):
    label = "fedbb:optim=sgd,lr=0.01,momentum=0.5,weight_decay=1e-4"
    config = make_config("smoke", "synthcxr", methods=[label], size=SIZE)
    args = cell_args(config, "iid-4", 0, config.spec(label))
    assert (args.optimizer, args.lr, args.momentum, args.weight_decay) == ("sgd", 0.01, 0.5, 1e-4)
    assert (args.loss, config.client.optimizer) == ("pnb", "adam")  # only this method's cells change
    spy = OptimizerSpy(monkeypatch)
    site = SiteData(name="site-1", train=images(16), val=images(4, seed=1))
    trainer = SiteTrainer(site, images(4, seed=2), replace(args, max_steps=1, batch_size=4))
    trainer.train(None, 0.0, round_seed=0)
    (optimizer,) = spy.built
    assert isinstance(optimizer, torch.optim.SGD)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.01, 0.5, 1e-4)
    # and a method without client options keeps the shared Adam
    plain = cell_args(config, "iid-4", 0, parse_method("fedbb"))
    assert (plain.optimizer, plain.lr) == ("adam", config.client.lr)


def test_client_options_change_the_cell_settings_hash_and_stay_file_names():
    label = "fedbb:optim=sgd,lr=0.01"
    config = make_config("smoke", "synthcxr", methods=["fedbb", label])
    assert settings_hash(config, "iid-4", "fedbb", 0) != settings_hash(config, "iid-4", label, 0)
    key = cell_key("iid-4", label, 0)
    assert key == "iid-4__fedbb_optim=sgd_lr=0.01__s0"
    assert "loss.mu=4" in cell_key("iid-4", "fedbb:loss.mu=4", 0)


def test_the_client_script_reproduces_the_optimizer_options():
    args = ClientArgs(optimizer="sgd", lr=0.01, momentum=0.5, weight_decay=1e-4)
    assert parse_args(shlex.split(args.to_argv())) == args


def test_fedbb_paper_recipe_trains_the_clients_with_sgd():
    from fedweigh.flare.recipes import FedBBRecipe, MethodRecipe

    recipe = MethodRecipe(method="fedbb-paper", name="fedbb_paper", num_rounds=1, min_clients=2)
    client = recipe.client_args
    assert (client.optimizer, client.lr, client.momentum, client.loss) == ("sgd", 0.01, 0.9, "pnb")
    assert client.loss_options == {"mu": 4.0, "a": 10.0, "beta": 0.9999999}
    # what the job ships to the sites: the client script's arguments
    shipped = parse_args(shlex.split(client.to_argv()))
    assert (shipped.optimizer, shipped.lr, shipped.loss_options["a"]) == ("sgd", 0.01, 10.0)
    # any method takes client options, over those of ``client``
    fedbb = FedBBRecipe(
        num_rounds=1,
        min_clients=2,
        client=ClientArgs(lr=0.5),
        client_options={"optimizer": "sgd", "lr": 0.01},
    )
    assert (fedbb.client_args.optimizer, fedbb.client_args.lr) == ("sgd", 0.01)
    with pytest.raises(ValueError, match="unknown client option"):
        MethodRecipe(method="fedbb", num_rounds=1, min_clients=2, client_options={"arch": "vit"})


# ----------------------------------------------------------------------------------------- tuning
def test_parse_tune():
    assert parse_tune("lr=3e-4,1e-3") == TuneSpec("client.lr", (3e-4, 1e-3), None)
    assert parse_tune("fedprox:client_mu=0.001,0.01") == TuneSpec("client_mu", (0.001, 0.01), "fedprox")
    assert parse_tune("fedbb:loss.mu=2,4").key == "loss.mu"
    for bad, message in (
        ("lr", "expected"),
        ("lr=", "expected"),
        ("lr=1,,2", "empty value"),
        ("lr=1,1", "twice"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_tune(bad)


def test_tune_grid_and_its_errors():
    config = make_config(
        "smoke",
        "synthcxr",
        methods=["fedavg", "fedprox"],
        tuning=Tuning(("lr=1e-3,3e-3", "fedprox:client_mu=0.01,0.1")),
    )
    assert config.tuning.seed == 1 and config.tuning.scenario == "iid-4"
    assert config.tune_grid("fedavg") == [{"client.lr": 1e-3}, {"client.lr": 3e-3}]
    assert len(config.tune_grid("fedprox")) == 4
    with pytest.raises(ValueError, match="no reported cell uses"):
        make_config("smoke", "synthcxr", tuning=Tuning(("lr=1e-3,3e-3",), seed=0))
    with pytest.raises(ValueError, match="no method 'fedprox'"):
        make_config("smoke", "synthcxr", methods=["fedavg"], tuning=Tuning(("fedprox:client_mu=0.01,0.1",)))
    with pytest.raises(ValueError, match="lr = -1 is not allowed"):
        make_config("smoke", "synthcxr", methods=["fedavg"], tuning=Tuning(("lr=1e-3,-1",)))
    with pytest.raises(ValueError, match="need --tune"):
        make_config("smoke", "synthcxr", tuning=Tuning.given(None, seed=5))


def test_tuning_picks_by_validation_auc_and_never_reads_the_test_set(tmp_path, monkeypatch):
    config = make_config(
        "smoke",
        "synthcxr",
        methods=["fedavg"],
        scenarios=["iid-4"],
        rounds=1,
        num_images=120,
        max_steps=1,
        tuning=Tuning(("lr=1e-4,3e-3",)),
    )
    feds: dict[int, object] = {}
    real_federation_for = federations.federation_for

    def recording_federation_for(cfg, scenario, seed):
        feds[seed] = real_federation_for(cfg, scenario, seed)
        return feds[seed]

    seen: list[tuple[str, LabeledImages]] = []

    def probe(module, name):
        real = getattr(module, name)

        def wrapper(model, data, *args, **kwargs):
            seen.append((name, data))
            return real(model, data, *args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    monkeypatch.setattr(modes, "federation_for", recording_federation_for)
    for module, name in ((modes, "evaluate"), (modes, "predict"), (site_module, "evaluate")):
        probe(module, name)
    for name in ("evaluate", "predict"):
        probe(train_module, name)
    result = run_bench(config, tmp_path, progress=False)
    tuning_test, reported_test = feds[config.tuning.seed].test, feds[0].test
    assert seen, "the probe saw no evaluation"
    # the tuning cells never read their federation's test images (the reported cells do read theirs)
    assert not any(np.shares_memory(data.images, tuning_test.images) for _, data in seen)
    assert any(np.shares_memory(data.images, reported_test.images) for _, data in seen)
    stored = [json.loads(p.read_text()) for p in sorted((tmp_path / TUNING_DIR).glob("*.json"))]
    assert len(stored) == 2
    for record in stored:
        assert not any(k.startswith("test_") for row in record["rows"] for k in row)
        assert record["seed"] == config.tuning.seed
    # the choice: the grid point with the larger final validation AUC, recorded in summary.json
    tuning = json.loads((tmp_path / "summary.json").read_text())["tuning"]["fedavg"]
    aucs = [p["val_auc"] for p in tuning["grid"]]
    assert all(math.isfinite(a) for a in aucs)
    assert tuning["chosen"] == tuning["grid"][int(np.argmax(aucs))]["options"]
    assert (tuning["scenario"], tuning["seed"], tuning["selected_by"]) == ("iid-4", 1, "val_auc")
    assert result.summary["tuning"]["fedavg"]["chosen"] == tuning["chosen"]
    # the reported cell ran with the chosen value
    cell = json.loads((tmp_path / "cells" / "iid-4__fedavg__s0.json").read_text())
    assert cell["options"] == tuning["chosen"]
    assert cell["settings_hash"] == settings_hash(
        replace(config, tuned={"fedavg": tuning["chosen"]}), "iid-4", "fedavg", 0
    )


def test_tune_on_the_command_line(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["bench", "--tune", "lr=1e-3,3e-3", "fedbb:loss.mu=2,4", "--tune-seed", "7", "--out", str(tmp_path)]
    )
    assert args.tune == ["lr=1e-3,3e-3", "fedbb:loss.mu=2,4"] and args.tune_seed == 7
    args = parser.parse_args(["bench", "--tune", "lr=1e-3,-3", "--out", str(tmp_path / "x")])
    assert main_bench(args) == 2 and not (tmp_path / "x").exists()


def test_fednova_with_sgd_clients_uses_the_momentum_sgd_normaliser():
    spec = parse_method("fednova:optim=sgd,lr=0.01,client.momentum=0.5")
    assert spec.scheme_args == {"local_optimizer": "sgd", "momentum": 0.5}
    assert spec.make_scheme().local_optimizer == "sgd"
    # an explicit scheme setting wins; Adam clients keep the step-count normaliser
    assert parse_method("fednova:optim=sgd,local_optimizer=adam").scheme_args == {"local_optimizer": "adam"}
    assert parse_method("fednova").scheme_args == {}
