"""The server's model persistor: weights only, and no file outside the job's workspace unless the
server's operator named its folder.

NVFlare's stock ``PTFileModelPersistor`` takes its file handling from the job: ``load_weights_only:
false`` makes ``torch.load`` unpickle (run code from) the checkpoint, an absolute
``source_ckpt_file_full_name`` reads any file the server can read, and file names or an
``environment.json`` checkpoint folder join onto absolute paths and write the model anywhere the server
can write. A job without code is only configuration, so these are the levers a job submitter has.
:class:`FedweighModelPersistor` is the same persistor with the levers removed:

- checkpoints are read with ``torch.load(weights_only=True)`` only; ``load_weights_only: false`` is
  refused when the job is built;
- the model files it writes (``global_model_file_name``, ``best_global_model_file_name``, the
  checkpoint folder) must stay inside the job's app folder;
- a checkpoint it reads (``source_ckpt_file_full_name``, the model's ``pretrained`` file, and the
  controller's ``resume_from`` folder, :func:`check_server_path`) must be inside the job's app folder
  or a folder the server's operator lists in ``FEDWEIGH_SERVER_READ_DIRS`` (``os.pathsep``-separated).

In a workspace that is not a provisioned kit (``nvflare simulator``, in-process runs) the operator
and the job submitter are the same person, and any path may be read (the same split as the site
policy's defaults, :mod:`fedweigh.site.policy`).

``provisioning/resources.json`` admits this class and not the stock one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nvflare.apis.fl_constant import FLContextKey, WorkspaceConstants
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import DefaultCheckpointFileName
from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor

from fedweigh.secure.contexts import STARTUP_FOLDER, find_site_root, is_provisioned

__all__ = ["SERVER_READ_DIRS_ENV", "FedweighModelPersistor", "check_server_path", "server_read_dirs"]

#: Folders (``os.pathsep``-separated) from which the server's operator lets jobs read checkpoints and
#: run state (``pretrained``, ``initial_ckpt``, ``resume_from``).
SERVER_READ_DIRS_ENV = "FEDWEIGH_SERVER_READ_DIRS"


def server_read_dirs(start: str | Path | None = None) -> list[Path] | None:
    """The folders a job may read from at this server: ``$FEDWEIGH_SERVER_READ_DIRS``; None (any
    folder) in a workspace that is not a provisioned kit and names none."""
    listed = [Path(p).resolve() for p in os.environ.get(SERVER_READ_DIRS_ENV, "").split(os.pathsep) if p]
    if listed:
        return listed
    root = find_site_root(start)
    if root is not None and is_provisioned(Path(root) / STARTUP_FOLDER):
        return []
    return None


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_server_path(path: str | Path, what: str, workspace: str | Path | None = None) -> Path:
    """``path`` resolved (links followed) if the job may read it at this server: inside ``workspace``
    (the job's app folder) or a folder of :func:`server_read_dirs`; PermissionError naming ``what``
    otherwise."""
    resolved = Path(os.path.expanduser(os.path.expandvars(str(path)))).resolve()
    allowed = server_read_dirs()
    if allowed is None or (workspace is not None and _inside(resolved, Path(workspace).resolve())):
        return resolved
    if any(_inside(resolved, folder) for folder in allowed):
        return resolved
    raise PermissionError(
        f"{what}={str(path)!r} is outside the job's workspace and every folder this server lets jobs read "
        f"({[str(f) for f in allowed] or 'none'}); the server's operator lists such folders in "
        f"{SERVER_READ_DIRS_ENV}"
    )


def _plain_file_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise ValueError(f"FedweighModelPersistor: {what} must be a plain file name, got {name!r}")
    return name


class FedweighModelPersistor(PTFileModelPersistor):
    """``PTFileModelPersistor`` without unpickling and without paths outside the job (module docstring).

    Args: those of ``PTFileModelPersistor``; ``load_weights_only`` must stay True, the file names must be
    plain names, ``source_ckpt_file_full_name`` a file in the app's ``custom/`` folder (relative) or
    in a folder the server lists in ``FEDWEIGH_SERVER_READ_DIRS`` (absolute).
    """

    def __init__(
        self,
        exclude_vars: str | None = None,
        model: Any = None,
        global_model_file_name: str = DefaultCheckpointFileName.GLOBAL_MODEL,
        best_global_model_file_name: str = DefaultCheckpointFileName.BEST_GLOBAL_MODEL,
        source_ckpt_file_full_name: str | None = None,
        filter_id: str | None = None,
        load_weights_only: bool = True,
        allow_numpy_conversion: bool = True,
        load_device: str | None = None,
    ) -> None:
        if load_weights_only is not True:
            raise ValueError(
                f"FedweighModelPersistor: load_weights_only={load_weights_only!r} refused: a checkpoint is read "
                "as weights only (torch.load(weights_only=True)); unpickling runs code from the file"
            )
        _plain_file_name(global_model_file_name, "global_model_file_name")
        _plain_file_name(best_global_model_file_name, "best_global_model_file_name")
        if source_ckpt_file_full_name is not None and not os.path.isabs(source_ckpt_file_full_name):
            if ".." in Path(source_ckpt_file_full_name).parts:
                raise ValueError(
                    f"FedweighModelPersistor: source_ckpt_file_full_name={source_ckpt_file_full_name!r} leaves "
                    "the job's custom/ folder"
                )
        super().__init__(
            exclude_vars=exclude_vars,
            model=model,
            global_model_file_name=global_model_file_name,
            best_global_model_file_name=best_global_model_file_name,
            source_ckpt_file_full_name=source_ckpt_file_full_name,
            filter_id=filter_id,
            load_weights_only=True,
            allow_numpy_conversion=allow_numpy_conversion,
            load_device=load_device,
        )

    def _refuse(self, fl_ctx: FLContext, reason: str) -> None:
        self.log_error(fl_ctx, reason)
        self.system_panic(reason=reason, fl_ctx=fl_ctx)
        raise PermissionError(reason)

    def _initialize(self, fl_ctx: FLContext) -> None:
        app_root = Path(fl_ctx.get_prop(FLContextKey.APP_ROOT) or ".").resolve()
        if isinstance(self.model, dict):  # the model reads its pretrained file while it is built
            pretrained = (self.model.get("args") or {}).get("pretrained")
            if pretrained is not None:
                try:
                    check_server_path(pretrained, "pretrained", app_root)
                except PermissionError as e:
                    self._refuse(fl_ctx, str(e))
        super()._initialize(fl_ctx)
        self.load_weights_only = True
        for what, value in (
            ("the checkpoint folder", self.log_dir),
            ("global_model_file_name", self._ckpt_save_path),
            ("best_global_model_file_name", self._best_ckpt_save_path),
            ("the preload checkpoint", self.ckpt_preload_path),
        ):
            if value is not None and not _inside(Path(value).resolve(), app_root):
                self._refuse(
                    fl_ctx,
                    f"FedweighModelPersistor: {what} {value!r} is outside the job's app folder {app_root}",
                )

    def load_model(self, fl_ctx: FLContext):
        source = self.source_ckpt_file_full_name
        if source:
            app_root = Path(fl_ctx.get_prop(FLContextKey.APP_ROOT) or ".").resolve()
            if not os.path.isabs(source):
                custom = app_root / WorkspaceConstants.CUSTOM_FOLDER_NAME
                if not _inside((custom / source).resolve(), custom.resolve()):
                    self._refuse(
                        fl_ctx, f"source_ckpt_file_full_name={source!r} leaves the job's custom/ folder"
                    )
            else:
                try:
                    check_server_path(source, "source_ckpt_file_full_name", app_root)
                except PermissionError as e:
                    self._refuse(fl_ctx, str(e))
        self.load_weights_only = True
        return super().load_model(fl_ctx)

    def _get_model_from_location(self, location, fl_ctx):
        self.load_weights_only = True
        return super()._get_model_from_location(location, fl_ctx)
