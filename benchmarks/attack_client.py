"""A site that attacks the federation through the real transport (replaces the job's client entry
script in ``benchmarks/bench_attacks.py``'s simulator runs).

``FEDWEIGH_ATTACK`` holds JSON ``{site: {round: attack}}`` (rounds counted from 1); in those rounds
the site's training task goes wrong on its way out:

- ``silent``: the result is held back for ``FEDWEIGH_ATTACK_SILENT_S`` seconds (past the server's
  ``train_timeout``), then sent late;
- ``crash``: the script raises mid-round; the site stops taking part.
"""

import json
import os
import time

import nvflare.client as flare

from fedweigh.flare.client import main
from fedweigh.protocol import TASK_TRAIN

ATTACKS: dict = json.loads(os.environ.get("FEDWEIGH_ATTACK", "{}"))
SILENT_S = float(os.environ.get("FEDWEIGH_ATTACK_SILENT_S", "60"))

_receive, _send = flare.receive, flare.send
_current = {"round": 0, "task": ""}


def _receive_and_note(*args, **kwargs):
    model = _receive(*args, **kwargs)
    if model is not None:
        _current["round"] = int(model.current_round or 0) + 1
        _current["task"] = flare.get_task_name()
    return model


def _send_with_attack(model, *args, **kwargs):
    attack = None
    if _current["task"] == TASK_TRAIN:
        attack = ATTACKS.get(flare.get_site_name(), {}).get(str(_current["round"]))
    if attack == "crash":
        raise RuntimeError(f"attack: {flare.get_site_name()} crashes in round {_current['round']}")
    if attack == "silent":
        time.sleep(SILENT_S)
    elif attack is not None:
        raise ValueError(f"unknown attack {attack!r}")
    return _send(model, *args, **kwargs)


flare.receive, flare.send = _receive_and_note, _send_with_attack

if __name__ == "__main__":
    main()
