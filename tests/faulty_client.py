"""A misbehaving fedweigh site for the failure tests (replaces the job's client entry script).

``FEDWEIGH_TEST_FAULTS`` holds JSON ``{site: {round: fault}}`` (rounds counted from 1); in those
rounds the site's training result is corrupted on its way out:

- ``nan``: one parameter array is all NaN;
- ``shape``: one parameter array loses its last row;
- ``negative``: the reported sample count is negative;
- ``inflate``: the reported sample count is 1000 times the true one;
- ``crash``: the script raises mid-round and the site stops taking part (it never comes back);
- ``silent``: the result is held back for ``FEDWEIGH_TEST_SILENT_S`` seconds (past the server's
  ``train_timeout``), then sent late; the site answers again in later rounds.
"""

import json
import os
import time

import nvflare.client as flare
from nvflare.client.api import get_context

from fedweigh.flare.client import main
from fedweigh.protocol import META_NUM_SAMPLES, TASK_TRAIN

FAULTS: dict = json.loads(os.environ.get("FEDWEIGH_TEST_FAULTS", "{}"))
SILENT_S = float(os.environ.get("FEDWEIGH_TEST_SILENT_S", "30"))

_receive, _send = flare.receive, flare.send
_current = {"round": 0, "task": ""}


def _faulty_receive(*args, **kwargs):
    model = _receive(*args, **kwargs)
    if model is not None:
        _current["round"] = int(model.current_round or 0) + 1
        _current["task"] = flare.get_task_name()
    return model


def _faulty_send(model, *args, **kwargs):
    fault = None
    if _current["task"] == TASK_TRAIN:
        fault = FAULTS.get(flare.get_site_name(), {}).get(str(_current["round"]))
    if fault == "nan":
        key = next(k for k, v in model.params.items() if v.is_floating_point())
        model.params[key] = model.params[key] * float("nan")
    elif fault == "shape":
        key = next(k for k, v in model.params.items() if v.ndim >= 2)
        true_shape = model.params[key].shape
        model.params[key] = model.params[key][:-1]
        _send(model, *args, **kwargs)
        # the in-process Client API remembers the shapes it sent to reshape what it receives next;
        # restore the true one so that only the server sees the fault
        shapes = getattr(get_context().api, "_params_conversion_state", {}).get("tensor_shapes")
        if shapes and key in shapes:
            shapes[key] = true_shape
        return None
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
