"""Server-side NVFlare components that record every message the server receives.

Put into a job by tests/test_audit.py (with this file in the app's ``custom/`` folder):
:class:`AuditFilter` as a task-result filter (NVFlare applies it to every result of the listed tasks
before the controller sees it), :class:`AuditEventRecorder` as a component (it sees every event a
site sends to the server, such as the metrics its tracking writer streams, ``fed.analytix_log_stats``).
Neither changes anything; per message they write ``NNNN_<task>_<site>.json`` (every leaf that is not
an array: numbers, strings, byte lengths, types) and ``.npz`` (every array), so the test can search
everything the server was sent.
"""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path

import numpy as np
from nvflare.apis.filter import Filter
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey, ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReservedHeaderKey, Shareable

_lock = threading.Lock()
_counter = itertools.count()


def _walk(value, path: str, leaves: dict, arrays: dict) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if key == ReservedHeaderKey.PEER_CTX:  # the framework's FLContext of the peer, not sent data
                continue
            _walk(item, f"{path}/{key}", leaves, arrays)
    elif isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            arrays[path] = np.asarray(value, dtype=np.float64)
        else:
            for i, item in enumerate(value):
                _walk(item, f"{path}/{i}", leaves, arrays)
    elif hasattr(value, "detach"):  # a torch tensor
        arrays[path] = value.detach().cpu().numpy()
    elif isinstance(value, np.ndarray):
        arrays[path] = value
    elif isinstance(value, (bytes, bytearray)):
        leaves[path] = {"bytes": len(value)}
    elif value is None or isinstance(value, (bool, int, float, str)):
        leaves[path] = value
    elif isinstance(value, np.generic):
        leaves[path] = value.item()
    else:
        leaves[path] = {"type": type(value).__name__, "repr": repr(value)[:200]}


def _record(out_dir: str, task: str, site: str, message) -> None:
    leaves: dict = {}
    arrays: dict = {}
    _walk(dict(message) if isinstance(message, dict) else {"data": message}, "", leaves, arrays)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _lock:
        n = next(_counter)
    stem = out / f"{n:04d}_{task}_{site}"
    np.savez(f"{stem}.npz", **{f"a{i}": a for i, a in enumerate(arrays.values())})
    record = {"task": task, "site": site, "leaves": leaves, "arrays": list(arrays)}
    Path(f"{stem}.json").write_text(json.dumps(record, default=str))


class AuditEventRecorder(FLComponent):
    """Records every event a site sends to the server (event types ``fed.*``)."""

    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        if not event_type.startswith("fed."):
            return
        data = fl_ctx.get_prop(FLContextKey.EVENT_DATA)
        site = data.get_peer_prop(ReservedKey.IDENTITY_NAME, None) if isinstance(data, Shareable) else None
        _record(self.out_dir, f"event:{event_type}", str(site or "?"), data)


class AuditFilter(Filter):
    """Records every task result the server receives (module docstring)."""

    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        peer = fl_ctx.get_peer_context()
        site = peer.get_identity_name() if peer is not None else "?"
        task = shareable.get_header(ReservedHeaderKey.TASK_NAME) or "?"
        _record(self.out_dir, str(task), site, shareable)
        return shareable
