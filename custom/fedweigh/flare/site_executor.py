"""The client executor of jobs that carry no code, for sites with fedweigh installed.

A provisioned NVFlare 2.9 site builds the components of a job without a ``custom/`` folder only
when their class paths are in the site's ``class_allow_list`` (``local/resources.json``). NVFlare's
own ``ClientAPIExecutor`` is not in the default list, and allow-listing it would let any job run a
script or command of its choosing. :class:`InstalledClientExecutor` instead runs exactly one script,
the ``fedweigh_client.py`` of the fedweigh package installed at the site; the job chooses only the
script's arguments. The site allow-lists this class and fedweigh's other components by their exact
class paths, never the package prefix (which would let a job call any function of the package with
arguments of its choosing); see docs/deploy.md and provisioning/resources.json.
"""

from __future__ import annotations

from pathlib import Path

from nvflare.app_common.executors.client_api_executor import ClientAPIExecutor

#: The script every fedweigh job runs at the sites (file name in this package).
CLIENT_SCRIPT_NAME = "fedweigh_client.py"


def installed_client_script() -> Path:
    """Absolute path of ``fedweigh/flare/fedweigh_client.py`` in the fedweigh copy this process imports."""
    script = Path(__file__).resolve().with_name(CLIENT_SCRIPT_NAME)
    if not script.is_file():
        raise FileNotFoundError(f"the fedweigh installation at {script.parent} has no {CLIENT_SCRIPT_NAME}")
    return script


class InstalledClientExecutor(ClientAPIExecutor):
    """``ClientAPIExecutor`` in ``in_process`` mode, fixed to the installed fedweigh client script.

    Args:
        task_script_args: command line of the client script (``ClientArgs.to_argv()``).
        params_exchange_format: parameter format the script receives and sends.
        server_expected_format: parameter format the server expects.
        params_transfer_type: ``"FULL"`` or ``"DIFF"`` parameters in results.
        memory_gc_rounds: force a garbage collection every this many rounds (0 = never).
        cuda_empty_cache: also empty the CUDA cache at those collections.
    """

    def __init__(
        self,
        task_script_args: str = "",
        params_exchange_format: str = "pytorch",
        server_expected_format: str = "numpy",
        params_transfer_type: str = "FULL",
        memory_gc_rounds: int = 0,
        cuda_empty_cache: bool = False,
    ):
        super().__init__(
            execution_mode="in_process",
            task_script_path=str(installed_client_script()),
            task_script_args=task_script_args,
            params_exchange_format=params_exchange_format,
            server_expected_format=server_expected_format,
            params_transfer_type=params_transfer_type,
            memory_gc_rounds=memory_gc_rounds,
            cuda_empty_cache=cuda_empty_cache,
        )
