"""The Client API loop of a fedweigh site script: answer every task, and answer a failure with its error.

A site whose script raises leaves the server with nothing but NVFlare's return code, and a script that
cannot start (a bad site configuration, a missing bundle) stops answering at all. :func:`serve` keeps
the script in the job instead: a setup that fails answers every task with that error, a task that
fails is answered with its error (the next task is tried afresh), so the server logs each site's
error and, when every site fails, fails the job quoting the first one
(:class:`fedweigh.flare.controller.FedweighController`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import nvflare.client as flare
from nvflare.app_common.abstract.fl_model import FLModel

from fedweigh.protocol import META_SITE_ERROR

__all__ = ["describe_error", "error_model", "serve"]

logger = logging.getLogger("fedweigh.client")


def describe_error(error: BaseException) -> str:
    """An error in one line for the server's log: its type and message (for SystemExit from the
    argument parser, its exit code: the parser has printed the message in the site's log)."""
    if isinstance(error, SystemExit):
        return f"the client script's arguments were refused (exit code {error.code}; the site's log has the message)"
    return f"{type(error).__name__}: {error}"[:2000]


def error_model(error: str) -> FLModel:
    """A site's answer that carries no data, only the error its script met on the task (the server
    names it in its log and, when every site fails, in the failed job's reason)."""
    return FLModel(metrics={"fedweigh_error": 1.0}, meta={META_SITE_ERROR: error})


def serve(setup: Callable[[], Callable[[FLModel], FLModel]]) -> None:
    """Answer the job's tasks until it ends (after ``flare.init()``): ``setup()`` returns the function
    that answers one task; its failure, or a task's, is answered with the error (module docstring)."""
    site = flare.get_site_name()
    answer_task: Callable[[FLModel], FLModel] | None = None
    failure = ""
    try:
        answer_task = setup()
    except (Exception, SystemExit) as e:
        failure = describe_error(e)
        logger.exception("%s cannot take part in this job: %s", site, failure)
    while flare.is_running():
        received = flare.receive()
        if received is None:
            break
        if answer_task is None:
            flare.send(error_model(failure))
            continue
        try:
            answer = answer_task(received)
        except Exception as e:  # this task fails; the site stays in the job
            logger.exception("%s: task %s failed", site, flare.get_task_name())
            answer = error_model(describe_error(e))
        flare.send(answer)
