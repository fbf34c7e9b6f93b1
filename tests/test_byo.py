"""Bring your own: a user's Client API script, model and checkpoint under a fedweigh scheme."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedweigh.errors import ConfigError
from fedweigh.flare.byo import result_meta
from fedweigh.flare.recipes import FedDRAWRecipe, MethodRecipe
from fedweigh.protocol import META_NUM_SAMPLES, META_NUM_STEPS, META_PLAN, META_SCALARS
from fedweigh.server.rounds import PlaintextBackend, RoundStep
from fedweigh.weighting import get_scheme
from fedweigh.weighting.base import ScalarContext

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "byo_feddraw"


def _task(scheme: str, scheme_args: dict | None = None, params=None):
    """A received task as the fedweigh controller sends it (its plan from the round step)."""
    step = RoundStep(get_scheme(scheme, **(scheme_args or {})), PlaintextBackend({}), num_rounds=3)
    return SimpleNamespace(meta={META_PLAN: step.plan(scheme, scheme_args or {})}, params=params)


def test_result_meta_reports_what_the_scheme_asks_for(exact_statistics_policy):
    counts = [30, 5, 0, 65]
    meta = result_meta(_task("cbr"), num_samples=100, num_steps=7, class_counts=counts)
    expected = get_scheme("cbr").client_scalars(
        ScalarContext(class_counts=np.array(counts, float), num_samples=100)
    )
    assert meta[META_NUM_SAMPLES] == 100 and meta[META_NUM_STEPS] == 7
    assert set(meta[META_SCALARS]) == {"skew"}
    assert meta[META_SCALARS]["skew"] == pytest.approx(expected["skew"])
    # FedDRAW asks for no scalars in plaintext: only N_k and tau_k
    assert result_meta(_task("feddraw"), num_samples=10, num_steps=1)[META_SCALARS] == {}


def test_result_meta_meets_the_server_checks():
    """What result_meta builds passes the round step's checks of a result's meta."""
    from fedweigh.server.validation import check_meta

    step = RoundStep(get_scheme("cbr"), PlaintextBackend({}), num_rounds=3)
    meta = result_meta(_task("cbr"), num_samples=50, num_steps=3, class_counts=[10, 40])
    check_meta("site-1", meta, step.scalars, step.safeguards.limits)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_samples": 0, "num_steps": 1}, "num_samples must be an integer >= 1, got 0"),
        ({"num_samples": 10, "num_steps": -1}, "num_steps must be an integer >= 0, got -1"),
        ({"num_samples": 10, "num_steps": 1}, r"scheme 'cbr' asks for \['skew'\].*pass class_counts="),
        (
            {"num_samples": 10, "num_steps": 1, "class_counts": [[1, 2]]},
            "class_counts must be a non-empty 1-D list",
        ),
    ],
)
def test_result_meta_refuses_what_the_server_could_not_weigh(kwargs, message):
    with pytest.raises(ValueError, match=message):
        result_meta(_task("cbr"), **kwargs)


def _site_trainer():
    """A small fedweigh site (the same one for every call)."""
    from fedweigh.data.base import LabeledImages, SiteData
    from fedweigh.site.args import ClientArgs
    from fedweigh.site.trainer import SiteTrainer

    rng = np.random.default_rng(0)

    def images(n):
        x = rng.random((n, 1, 16, 16), dtype=np.float32)
        return LabeledImages(x, (rng.random((n, 3)) < 0.4).astype(np.float32), ("a", "b", "c"), "multilabel")

    site = SiteData(name="site-1", train=images(12), val=images(4))
    args = ClientArgs(size=16, batch_size=4, max_steps=2, device="cpu", eval_test=False)
    return SiteTrainer(site, images(4), args, threads=1)


def test_result_meta_reports_what_a_fedweigh_site_reports_for_feddraw_direction():
    """FedDRAW's similarity="direction" under HE: a script of your own compares its update with the
    global update since its previous training round, as fedweigh's own sites do, to the last bit."""
    from fedweigh.train import get_params

    plan = {
        **_task("feddraw").meta[META_PLAN],
        "scalars": list(get_scheme("feddraw").scalars(encrypted=True)),  # what the site reports under HE
        "he": True,
        "budget_id": "job-direction",
    }
    trainer = _site_trainer()
    received, sent = [get_params(trainer.model)], []
    for t in range(3):
        out = trainer.run_round(received[-1], t, plan, evaluate_received=False)
        sent.append(out)
        received.append(out.params)  # the next global model: this site's, as if it were alone
    reported = [
        result_meta(
            SimpleNamespace(meta={META_PLAN: plan}, params=received[t]),
            num_samples=out.num_samples,
            num_steps=out.num_steps,
            class_counts=trainer.class_counts,
            params=out.params,
        )[META_SCALARS]
        for t, out in enumerate(sent)
    ]
    assert [r["similarity"] for r in reported] == [out.scalars["similarity"] for out in sent]
    assert reported[0]["similarity"] == 0.0 and all(r["similarity"] != 0.0 for r in reported[1:])
    # given explicitly, the previous global model is used as given; a new job starts afresh
    again = result_meta(
        SimpleNamespace(meta={META_PLAN: plan}, params=received[2]),
        num_samples=sent[2].num_samples,
        num_steps=1,
        class_counts=trainer.class_counts,
        params=sent[2].params,
        previous_global=received[1],
    )
    assert again[META_SCALARS] == sent[2].scalars
    other_job = {**plan, "budget_id": "job-other"}
    fresh = result_meta(
        SimpleNamespace(meta={META_PLAN: other_job}, params=received[2]),
        num_samples=sent[2].num_samples,
        num_steps=1,
        class_counts=trainer.class_counts,
        params=sent[2].params,
    )
    assert fresh[META_SCALARS] == {"similarity": 0.0}


def _example_model():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from model import TinyNet

        return TinyNet
    finally:
        sys.path.remove(str(EXAMPLE))


def _server_config(job: Path) -> dict:
    return json.loads((job / "app" / "config" / "config_fed_server.json").read_text())


def _component(config: dict, comp_id: str) -> dict:
    return next(c for c in config["components"] + config["workflows"] if c["id"] == comp_id)


def test_recipe_ships_the_users_script_and_model(tmp_path):
    TinyNet = _example_model()
    recipe = FedDRAWRecipe(
        name="byo",
        min_clients=2,
        train_script=str(EXAMPLE / "train.py"),
        train_args="--lr 0.1",
        model=TinyNet(),
    )
    recipe.export(str(tmp_path))
    job = tmp_path / "byo"
    client = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())
    executor = client["executors"][0]["executor"]["args"]
    assert (executor["task_script_path"], executor["task_script_args"]) == ("train.py", "--lr 0.1")
    (shipped,) = (job / "app" / "custom").rglob("train.py")  # NVFlare finds the script by name
    assert shipped.read_text() == (EXAMPLE / "train.py").read_text()
    assert (job / "app" / "custom" / "model.py").is_file()
    persistor = _component(_server_config(job), "persistor")
    assert persistor["args"]["model"]["path"] == "model.TinyNet"
    assert _component(_server_config(job), "controller")["args"].get("statistics", "none") == "none"


def test_recipe_takes_a_monai_network_and_an_initial_checkpoint(tmp_path, monkeypatch):
    from monai.networks.nets import DenseNet121

    args = {"spatial_dims": 2, "in_channels": 1, "out_channels": 3}
    net = DenseNet121(**args)
    monkeypatch.chdir(tmp_path)
    torch.save(net.state_dict(), "start.pt")
    # DenseNet121 keeps no copy of its arguments: NVFlare would export it with args {}, which the
    # server cannot build, so the module itself is refused, naming the dict form to give
    with pytest.raises(
        ConfigError, match='pass model=\\{"class_path": "monai.networks.nets.densenet.DenseNet121"'
    ):
        FedDRAWRecipe(name="monai", min_clients=2, train_script=str(EXAMPLE / "train.py"), model=net)
    recipe = FedDRAWRecipe(
        name="monai",
        min_clients=2,
        train_script=str(EXAMPLE / "train.py"),
        model={"class_path": "monai.networks.nets.DenseNet121", "args": args},
        initial_ckpt="start.pt",
    )
    recipe.export(str(tmp_path / "jobs"))
    job = tmp_path / "jobs" / "monai"
    persistor = _component(_server_config(job), "persistor")["args"]
    assert persistor["model"] == {"path": "monai.networks.nets.DenseNet121", "args": args}
    assert persistor["source_ckpt_file_full_name"] == "start.pt"
    assert (job / "app" / "custom" / "start.pt").is_file()
    # the sites import MONAI from their installation: the job carries none of its sources (NVFlare's
    # export would otherwise copy MONAI, NumPy, matplotlib, ... into custom/, about 74 MB)
    custom = job / "app" / "custom"
    shipped = [p.relative_to(custom) for p in custom.rglob("*") if p.is_file()]
    assert not any(p.parts[0] == "monai" for p in shipped), shipped[:5]
    assert sum((custom / p).stat().st_size for p in shipped) < 2 * (custom / "start.pt").stat().st_size


def test_statistics_follow_the_scheme_not_fedweighs_loss(tmp_path):
    TinyNet = _example_model()
    script = str(EXAMPLE / "train.py")
    for i, (method, options, expected) in enumerate(
        (
            ("fedbb", None, "none"),
            ("feddisco", {"target": "global"}, "secure"),
            ("feddisco", None, "none"),  # its default target is uniform: no histogram needed
        )
    ):
        # FedBB's PNB loss is fedweigh's, not the user's; FedDisco's pooled-histogram target needs it
        recipe = MethodRecipe(
            method=method, min_clients=2, train_script=script, model=TinyNet(), scheme_args=options
        )
        recipe.export(str(tmp_path / str(i)))
        controller = _component(_server_config(tmp_path / str(i) / method), "controller")
        assert controller["args"].get("statistics", "none") == expected, (method, options)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"train_script": "no_such_script.py", "model": "m"},
            "train_script = 'no_such_script.py' .*no such file",
        ),
        (
            {"train_script": str(EXAMPLE / "train.py")},
            "model = None .*with train_script, pass the global model",
        ),
        ({"initial_ckpt": "missing.pt"}, "initial_ckpt = 'missing.pt' .*existing local file"),
        (
            {"train_script": str(EXAMPLE / "train.py"), "model": "m", "he": True},
            "he = True .*need fedweigh's client script",
        ),
    ],
)
def test_recipe_refuses_bad_byo_arguments(kwargs, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"recipe 'x': {message}"):
        FedDRAWRecipe(name="x", min_clients=2, **kwargs)


def test_result_meta_reports_a_histogram_scalar_from_the_sites_noised_release_by_default(monkeypatch):
    """Private by default: without a policy allowing exact statistics, the skew comes from the release
    (Gaussian noise at the policy's statistics_epsilon), never from the exact counts; a model-only
    scalar plan draws no release."""
    import fedweigh.flare.byo as byo

    monkeypatch.delenv("FEDWEIGH_SITE_POLICY", raising=False)
    counts = [30, 5, 0, 65]
    exact = get_scheme("cbr").client_scalars(
        ScalarContext(class_counts=np.array(counts, float), num_samples=100)
    )
    skews = {
        result_meta(_task("cbr"), num_samples=100, num_steps=7, class_counts=counts)[META_SCALARS]["skew"]
        for _ in range(5)
    }
    assert all(np.isfinite(list(skews))) and exact["skew"] not in skews and len(skews) > 1
    drawn = []
    monkeypatch.setattr(byo, "site_release", lambda *a, **k: drawn.append(a) or None)
    similarity = SimpleNamespace(
        meta={META_PLAN: {"scheme": "feddraw", "scalars": ["similarity"]}}, params=None
    )
    with pytest.raises(ValueError):  # FedDRAW's similarity needs the models: what matters is no release drawn
        result_meta(similarity, num_samples=10, num_steps=1, class_counts=counts)
    assert drawn == []
