"""A misbehaving fedweigh site for the failure tests (replaces the job's client entry script).

``FEDWEIGH_TEST_FAULTS`` holds JSON ``{site: {round: fault}}`` (rounds counted from 1); in those
rounds the site's training result is corrupted on its way out:

- ``nan``: one parameter array is all NaN;
- ``shape``: one parameter array is sent flattened (same values, another shape); the site reshapes the
  next global model it receives, which the Client API hands back in the shape last sent;
- ``negative``: the reported sample count is negative;
- ``inflate``: the reported sample count is 1000 times the true one;
- ``crash``: the script raises mid-round and the site stops taking part (it never comes back);
- ``silent``: the result is held back for ``FEDWEIGH_TEST_SILENT_S`` seconds (past the server's
  ``train_timeout``), then sent late; the site answers again in later rounds.

With ``FEDWEIGH_TEST_RECORD_DIR`` set, every training round's global model as received and the site's
trained parameters as trained (before any fault) are kept in ``<dir>/<site>/{received,sent}_<round>.npz``.
Only the public Client API is used: what ``flare.receive`` returns and what is passed to ``flare.send``.
"""

import json
import os
import time
from pathlib import Path

import numpy as np
import nvflare.client as flare

from fedweigh.flare.client import main
from fedweigh.protocol import META_NUM_SAMPLES, TASK_TRAIN

FAULTS: dict = json.loads(os.environ.get("FEDWEIGH_TEST_FAULTS", "{}"))
SILENT_S = float(os.environ.get("FEDWEIGH_TEST_SILENT_S", "30"))
RECORD_DIR = os.environ.get("FEDWEIGH_TEST_RECORD_DIR")

_receive, _send = flare.receive, flare.send
_current = {"round": 0, "task": ""}
_reshape_back: dict = {}  # key -> true shape of an array last sent flattened


def _record(kind: str, params) -> None:
    if RECORD_DIR and params:
        folder = Path(RECORD_DIR) / flare.get_site_name()
        folder.mkdir(parents=True, exist_ok=True)
        arrays = {
            k: np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v) for k, v in params.items()
        }
        np.savez(folder / f"{kind}_{_current['round']}.npz", **arrays)


def _faulty_receive(*args, **kwargs):
    model = _receive(*args, **kwargs)
    if model is not None:
        _current["round"] = int(model.current_round or 0) + 1
        _current["task"] = flare.get_task_name()
        for key, shape in _reshape_back.items():
            if model.params and key in model.params:
                model.params[key] = model.params[key].reshape(shape)
        _reshape_back.clear()
        if _current["task"] == TASK_TRAIN:
            _record("received", model.params)
    return model


def _faulty_send(model, *args, **kwargs):
    fault = None
    if _current["task"] == TASK_TRAIN:
        _record("sent", model.params)
        fault = FAULTS.get(flare.get_site_name(), {}).get(str(_current["round"]))
    if fault == "nan":
        key = next(k for k, v in model.params.items() if v.is_floating_point())
        model.params[key] = model.params[key] * float("nan")
    elif fault == "shape":
        key = next(k for k, v in model.params.items() if v.ndim >= 2)
        _reshape_back[key] = tuple(model.params[key].shape)
        model.params[key] = model.params[key].reshape(-1)
    elif fault == "negative":
        model.meta[META_NUM_SAMPLES] = -int(model.meta[META_NUM_SAMPLES])
    elif fault == "inflate":
        model.meta[META_NUM_SAMPLES] = 1000 * int(model.meta[META_NUM_SAMPLES])
    elif fault == "crash":
        raise RuntimeError(f"injected crash at {flare.get_site_name()} in round {_current['round']}")
    elif fault == "silent":
        time.sleep(SILENT_S)
    elif fault is not None:
        raise ValueError(f"unknown fault {fault!r}")
    return _send(model, *args, **kwargs)


flare.receive, flare.send = _faulty_receive, _faulty_send

if __name__ == "__main__":
    main()
