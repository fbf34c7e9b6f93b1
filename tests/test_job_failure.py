"""A job whose sites all fail fails: ``nvflare simulator`` exits non-zero and the server's log names the
cause and quotes the first site's error (here a site configuration that does not exist)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace

import pytest
from simulation import TINY_CLIENT

from fedweigh.cli import simulator_command
from fedweigh.flare.recipes import FedweighRecipe
from fedweigh.protocol import SITE_CONFIG_ENV


@pytest.mark.slow
def test_a_job_whose_sites_all_fail_fails_naming_the_first_error(tmp_path):
    recipe = FedweighRecipe(
        name="every_site_fails",
        scheme="fedavg",
        num_rounds=2,
        min_clients=2,
        client=replace(TINY_CLIENT),
        train_timeout=120,
    )
    recipe.export(str(tmp_path / "jobs"))
    workspace = tmp_path / "ws"
    missing = tmp_path / "no_such_site_config.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", SITE_CONFIG_ENV: str(missing)}
    proc = subprocess.run(
        simulator_command(tmp_path / "jobs" / recipe.name, workspace, 2),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    server_log = "\n".join(p.read_text() for p in workspace.rglob("log.txt") if "server" in p.parts)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (
        "fedweigh job failed: round 1 ended with no valid result: every site that answered failed"
        in server_log
    )
    assert f"FileNotFoundError: {SITE_CONFIG_ENV}={missing} does not name an existing file" in server_log
    assert "round 2/2" not in server_log  # the run ended at once, not after every round


# ------------------------------------------------------------------ in process (the controller's rule)
def _federation(failing: set[str]):
    from test_controller_run import InProcessFederation

    from fedweigh.flare.task_loop import error_model
    from fedweigh.protocol import TASK_TRAIN

    class Failing(InProcessFederation):
        def answer(self, site, task, data):
            if task == TASK_TRAIN and site in failing:
                return error_model(f"ValueError: {site} cannot read its images")
            return super().answer(site, task, data)

    return Failing(sites={"site-1": 40, "site-2": 25, "site-3": 60})


def test_a_round_where_every_site_fails_fails_the_job_quoting_the_first_error(tmp_path, caplog):
    from test_controller_run import make_controller

    fed = _federation({"site-1", "site-2", "site-3"})
    controller = make_controller(fed, tmp_path, num_rounds=3)
    controller.run()
    assert controller.failure is not None
    assert controller.failure.startswith(
        "round 1 ended with no valid result: every site that answered failed (3 of 3)"
    )
    assert "first error, site-1: ValueError: site-1 cannot read its images" in controller.failure
    assert [s.task for s in fed.sent] == ["train"]  # no further round, no final validation
    assert "round 1: site-2 failed: ValueError: site-2 cannot read its images" in caplog.text


def test_a_round_where_one_site_fails_goes_on_and_names_it(tmp_path, caplog):
    from test_controller_run import make_controller

    fed = _federation({"site-2"})
    controller = make_controller(fed, tmp_path, num_rounds=2)
    controller.run()
    assert controller.failure is None
    assert [s.task for s in fed.sent] == ["train", "train", "validate"]
    assert "round 1: site-2 failed: ValueError: site-2 cannot read its images" in caplog.text
