"""Recipes in NVFlare's style: one object that builds a whole fedweigh job.

    recipe = FedDRAWRecipe(name="synthcxr_feddraw", num_rounds=5, min_clients=4)
    recipe.export("jobs")                 # a job folder for `nvflare simulator` / `submit_job`
    recipe.execute(SimEnv(num_clients=4)) # or run it directly (SimEnv, PocEnv, ProdEnv)

Every recipe pairs the :class:`~fedweigh.flare.controller.FedweighController` (server) with the
fedweigh Client API script (clients) and a PyTorch model persistor for
:class:`~fedweigh.models.FedweighNet`. :class:`MethodRecipe` builds any method of the catalogue
(:data:`fedweigh.methods.METHODS`) by name; :class:`FedDRAWRecipe`, :class:`FedBBRecipe`,
:class:`DAFLRecipe` and :class:`BaselineRecipe` are thin subclasses that fix the method and name its
options.
"""

from __future__ import annotations

import importlib
import inspect
import json
import warnings
from dataclasses import asdict, dataclass, fields, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from nvflare.app_common.executors.client_api_executor import ClientAPIExecutor
from nvflare.app_opt.pt.job_config.base_fed_job import BaseFedJob
from nvflare.app_opt.pt.job_config.model import PTModel
from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver
from nvflare.job_config.fed_job_config import FedJobConfig
from nvflare.job_config.script_runner import FrameworkType, ScriptRunner
from nvflare.recipe.spec import Recipe
from nvflare.recipe.utils import prepare_initial_ckpt, recipe_model_to_job_model

from fedweigh.checks import check_client_args, check_recipe_values
from fedweigh.data.pools import dataset_classes
from fedweigh.errors import ConfigError
from fedweigh.flare.controller import DEFAULT_MIN_SECURE_SUM, DEFAULT_TRAIN_TIMEOUT, FedweighController
from fedweigh.flare.persistor import FedweighModelPersistor
from fedweigh.flare.tracking import use_tracking_receivers
from fedweigh.kernels import pin_cpu_kernels
from fedweigh.losses import loss_uses_global_stats
from fedweigh.methods import BASELINES, METHODS, REFERENCE_METHODS, method_spec
from fedweigh.secure.precision import check_precision_bits
from fedweigh.server.safeguards import DEFAULT_MIN_UPDATE_COSINE, DEFAULT_UPDATE_NORM_BOUND
from fedweigh.site.args import ClientArgs

#: The script ScriptRunner ships in the job's custom/ folder; it imports the installed package.
CLIENT_SCRIPT = str(Path(__file__).with_name("fedweigh_client.py"))
#: The class the server's persistor builds the global model with (``FedweighNet(arch=...)`` builds the
#: architecture's class); a site's allow-list names it (provisioning/resources.json).
MODEL_CLASS_PATH = "fedweigh.models.base.FedweighNet"


class ClientScriptRunner(ScriptRunner):
    """``ScriptRunner`` that names its script by file name in the job config.

    The stock runner writes the script's absolute path on the exporting machine into
    ``task_script_path``; NVFlare also finds a script by file name under the app's ``custom/``
    folder, which keeps exported jobs portable (and byte-identical across checkouts).
    """

    def add_to_fed_job(self, job, ctx, **kwargs):
        tasks = kwargs.get("tasks", ["*"])
        executor = ClientAPIExecutor(
            task_script_path=Path(self._script).name,
            task_script_args=self._script_args,
            execution_mode=self._execution_mode,
            params_exchange_format=self._params_exchange_format,
            server_expected_format=self._server_expected_format,
            params_transfer_type=self._params_transfer_type,
            memory_gc_rounds=self._memory_gc_rounds,
            cuda_empty_cache=self._cuda_empty_cache,
        )
        job.add_executor(executor, tasks=tasks, ctx=ctx)
        job.add_resources(resources=[self._script], ctx=ctx)
        return {}


def installed_model_packages(model: object, bundle: bool = False) -> list[str]:
    """The top-level package of ``model``'s class when an installed distribution provides it.

    NVFlare's job export copies the source of every component class, and of everything it imports,
    into the job's ``custom/`` folder unless its package is an app package. For a network from an
    installed library (MONAI, timm, torchvision, ...) that copies the library itself (MONAI, NumPy,
    matplotlib, ...: 74 MB and half a minute for a MONAI DenseNet121); the sites import it from
    their own installation instead, as they import torch. A network of the user's own file (no
    distribution) is still shipped. With ``bundle`` fedweigh's own networks travel in the job.
    """
    if model is None or isinstance(model, (ModelSpec, dict)):
        return []
    top = type(model).__module__.split(".")[0]
    if top == "__main__" or (bundle and top == "fedweigh"):
        return []
    return [top] if top in metadata.packages_distributions() else []


@dataclass
class ModelSpec:
    """Arguments of :class:`fedweigh.models.FedweighNet` (stored in the job, built at the server)."""

    arch: str = "densenet_compact"
    num_classes: int = 14
    in_channels: int = 1
    img_size: int = 32
    norm: str = "batch"
    seed: int = 0
    #: checkpoint file with the network's weights, read by the server's persistor (None: random)
    pretrained: str | None = None

    def as_job_model(self) -> dict:
        args = asdict(self)
        if args["pretrained"] is None:  # jobs without a checkpoint keep their configuration
            del args["pretrained"]
        return {"path": MODEL_CLASS_PATH, "args": args}


class _ExportedArguments(FedJobConfig):
    """NVFlare's own reading of a component's constructor arguments (what a job export writes for
    it: the ``__init__`` parameters the object keeps as ``self.<name>`` or ``self._<name>``), without
    copying the class's source anywhere."""

    def __init__(self):  # noqa: D107 - reads arguments only; no job
        pass

    def _get_class_path(self, obj, custom_dir):
        return f"{type(obj).__module__}.{type(obj).__name__}"

    def of(self, component: object) -> dict:
        return self._get_args(component, None)


def _fix_for(cls: type, args: dict) -> str:
    """The dict form to pass instead: the constructor's required arguments ("...") and the given ones
    it takes."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    required = [n for n, p in params.items() if p.default is p.empty and p.kind in kinds]
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    shown = {n: "..." for n in required}
    shown.update({k: v for k, v in args.items() if open_ended or k in params})
    form = json.dumps({"class_path": f"{cls.__module__}.{cls.__qualname__}", "args": shown}, default=repr)
    return f"pass model={form} with the arguments the network is built with"


def _rebuild(cls: type, args: dict, where: str, shown: str) -> torch.nn.Module:
    """``cls(**args)``, or a ConfigError naming the model, the arguments and the fix."""
    try:
        return cls(**args)
    except Exception as e:  # any constructor error: the server would die on it at start
        message = " ".join(str(e).split())
        raise ConfigError(
            where,
            "model",
            shown,
            f"{cls.__qualname__}(**{args}) does not build ({message}); {_fix_for(cls, args)}",
        ) from None


def _state_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def job_model(model: object, where: str) -> ModelSpec | dict | torch.nn.Module:
    """The global model as the job carries it, checked by rebuilding it from the arguments the job
    will hold (the server builds it so at start):

    * a :class:`ModelSpec`: as is;
    * a dict, NVFlare's ``{"class_path": ..., "args": ...}`` or ``{"path": ..., "args": ...}``: as
      ``{"path", "args"}``, once its class imports and builds with those arguments;
    * an ``nn.Module``: as is, once the arguments NVFlare exports for it rebuild a network with the same
      parameter names and shapes (a network that keeps no copy of its constructor arguments, such as
      MONAI's DenseNet121, is exported with ``args: {}``).

    Anything else, or a model that does not rebuild, is a one-line ConfigError naming the fix.
    """
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):
        try:
            converted = recipe_model_to_job_model(model)
        except (TypeError, ValueError) as e:
            raise ConfigError(where, "model", model, " ".join(str(e).split())) from None
        module, _, name = converted["path"].rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(
                where,
                "model",
                model,
                f"cannot import {converted['path']} here ({e}); the server imports it too",
            ) from None
        _rebuild(cls, dict(converted["args"]), where, converted["path"])
        return converted
    if isinstance(model, torch.nn.Module):
        cls = type(model)
        args = _ExportedArguments().of(model)
        rebuilt = _rebuild(cls, args, where, f"{cls.__qualname__}(...)")
        mine, theirs = _state_shapes(model), _state_shapes(rebuilt)
        if mine != theirs:
            first = next(
                (k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)), "(order)"
            )
            raise ConfigError(
                where,
                "model",
                f"{cls.__qualname__}(...)",
                f"the job can only carry the arguments {args} NVFlare reads from it, and "
                f"{cls.__qualname__}(**{args}) is another network ({first}: {mine.get(first)} given, "
                f"{theirs.get(first)} rebuilt); {_fix_for(cls, args)}",
            )
        return model
    raise ConfigError(
        where,
        "model",
        type(model).__name__,
        'give a torch.nn.Module, {"class_path": "pkg.Class", "args": {...}}, {"path": ..., "args": ...} or a ModelSpec',
    )


#: NVFlare ``FedAvgRecipe`` arguments a fedweigh recipe does not take, and why (a one-line ConfigError).
REFUSED_STOCK_ARGUMENTS = {
    "aggregator": "the server weighs the sites with the recipe's scheme; for stock FedAvg with a fedweigh "
    "scheme use FedAvgRecipe(aggregator=FedweighAggregator(...))",
    "aggregator_data_kind": "the fedweigh controller aggregates full weights",
    "aggregation_weights": "the scheme computes each round's weights",
    "model_persistor": "the recipe adds the PyTorch persistor of model=",
    "launch_external_process": "fedweigh's client runs in the site's process",
    "command": "fedweigh's client runs in the site's process",
    "framework": "fedweigh recipes are PyTorch",
    "server_expected_format": "the fedweigh controller exchanges NumPy arrays",
    "params_transfer_type": "the sites send full weights",
    "stop_cond": "use stop_after= to end after a round",
    "patience": "use stop_after= to end after a round",
    "per_site_config": "every site runs the same fedweigh client; a site's own data go in its "
    "local/fedweigh_site.json and its privacy limits in local/fedweigh_policy.json (docs/deploy.md)",
}


def _refuse_stock_arguments(given: dict, where: str) -> None:
    """A ConfigError for the first NVFlare recipe argument given that a fedweigh recipe refuses; a
    TypeError, as Python's, for any other unknown keyword."""
    for key, value in given.items():
        if key in REFUSED_STOCK_ARGUMENTS:
            raise ConfigError(
                where, key, value, f"not taken by fedweigh recipes: {REFUSED_STOCK_ARGUMENTS[key]}"
            )
        raise TypeError(f"{where}: unexpected keyword argument {key!r}")


def _deprecated(old: str, new: str, where: str) -> None:
    warnings.warn(
        f"{where}: {old} is deprecated; use {new} (NVFlare's name for the same setting)",
        FutureWarning,
        stacklevel=4,
    )


def fedprox_options(
    scheme: str, scheme_args: dict | None, fedprox_mu: float | None, where: str
) -> tuple[dict, float | None]:
    """(scheme_args without the proximal coefficient, mu or None) from NVFlare's ``fedprox_mu`` or the
    deprecated ``scheme_args["client_mu"]`` (which warns); ConfigError when both are given or the
    scheme has no proximal term."""
    args = dict(scheme_args or {})
    if "fedprox_mu" in args:  # NVFlare's name inside the scheme's options
        if fedprox_mu is not None:
            raise ConfigError(where, "scheme_args['fedprox_mu']", args["fedprox_mu"], "give fedprox_mu once")
        fedprox_mu = args.pop("fedprox_mu")
    if "client_mu" in args:
        if fedprox_mu is not None:
            raise ConfigError(
                where,
                "scheme_args['client_mu']",
                args["client_mu"],
                "give fedprox_mu alone (client_mu is its old name)",
            )
        _deprecated("scheme_args['client_mu']", "fedprox_mu=", where)
        fedprox_mu = args.pop("client_mu")
    if fedprox_mu is None:
        return args, None
    if scheme != "fedprox":
        raise ConfigError(
            where, "fedprox_mu", fedprox_mu, f"FedProx's coefficient; scheme {scheme!r} has none"
        )
    if isinstance(fedprox_mu, bool) or not isinstance(fedprox_mu, (int, float)) or not fedprox_mu >= 0:
        raise ConfigError(where, "fedprox_mu", fedprox_mu, "a number >= 0")
    return args, float(fedprox_mu)


def _encrypt_layers(
    encrypt_layers: list[str] | None, he_layers: list[str] | None, where: str
) -> list[str] | None:
    """``encrypt_layers``, or the deprecated ``he_layers`` (warns); ConfigError for both or a string."""
    if he_layers is not None:
        if encrypt_layers is not None:
            raise ConfigError(
                where, "he_layers", he_layers, "give encrypt_layers alone (he_layers is its old name)"
            )
        _deprecated("he_layers", "encrypt_layers", where)
        encrypt_layers = he_layers
    if isinstance(encrypt_layers, str):
        raise ConfigError(
            where,
            "encrypt_layers",
            encrypt_layers,
            "a list of non-empty patterns: glob patterns or selectors (first:N, last:N, largest:N); "
            "a regular-expression string is not supported",
        )
    return encrypt_layers


def _scheme_options(
    scheme: str, scheme_args: dict | None, fedprox_mu: float | None, where: str
) -> dict | None:
    """The scheme's options with FedProx's coefficient as ``client_mu`` (:func:`fedprox_options`);
    None when none are given (a job exported exactly as before: no scheme options)."""
    given = scheme_args
    scheme_args, mu = fedprox_options(scheme, scheme_args, fedprox_mu, where)
    if mu is not None:
        scheme_args["client_mu"] = mu
    elif given is None and not scheme_args:
        return None
    return scheme_args


def _new_job(
    name: str,
    min_clients: int,
    app_packages: list[str],
    key_metric: str = "val_auc",
    key_metric_mode: str = "max",
    analytics_receiver: TBAnalyticsReceiver | None = None,
) -> BaseFedJob:
    """An empty PyTorch job whose sites' metrics (Client API SummaryWriter) and the server's round
    records stream to ``analytics_receiver``, the server's TensorBoard folder; ``app_packages``:
    packages the sites import from their installation; ``key_metric``: the sites' metric NVFlare's
    model selector keeps the best global model by."""
    job = BaseFedJob(
        name=name,
        min_clients=min_clients,
        key_metric=key_metric,
        key_metric_mode=key_metric_mode,
        analytics_receiver=analytics_receiver or TBAnalyticsReceiver(),
    )
    if app_packages:
        job.set_app_packages(app_packages)
    return job


def _check_own_script(train_script: str | None, model: object, he: bool, where: str) -> None:
    """With the user's own ``train_script``: the file exists, the global model is given, no ``he``."""
    if train_script is None:
        return
    if not Path(train_script).is_file():
        raise ConfigError(where, "train_script", train_script, "no such file")
    if model is None:
        raise ConfigError(
            where,
            "model",
            None,
            "with train_script, pass the global model (an nn.Module, {'path': ..., 'args': ...} or a ModelSpec)",
        )
    if he:
        raise ConfigError(where, "he", he, "encrypted updates need fedweigh's client script")


def _with_precision(client: ClientArgs, bits: int | None, train_script: str | None, where: str) -> ClientArgs:
    """``client`` with the recipe's ``he_precision_bits`` (checked: ConfigError for a value out of bounds,
    one that contradicts ``client``'s, or one given with the user's own script, which decrypts nothing)."""
    if bits is None:
        return client
    if train_script is not None:
        raise ConfigError(
            where,
            "he_precision_bits",
            bits,
            "fedweigh's client script applies it; train_script decrypts nothing",
        )
    if client.he_precision_bits not in (None, bits):
        raise ConfigError(
            where,
            "he_precision_bits",
            bits,
            f"client sets he_precision_bits={client.he_precision_bits}; give one value, in one place",
        )
    try:
        check_precision_bits(bits)
    except ValueError as e:
        raise ConfigError(where, "he_precision_bits", bits, str(e)) from None
    return replace(client, he_precision_bits=int(bits))


def _check_initial_ckpt(initial_ckpt: str | None, where: str) -> None:
    """A relative ``initial_ckpt`` names an existing local file (shipped in the job)."""
    if initial_ckpt is not None and not Path(initial_ckpt).is_absolute() and not Path(initial_ckpt).is_file():
        raise ConfigError(
            where,
            "initial_ckpt",
            initial_ckpt,
            "a relative path must name an existing local file (shipped in the job); "
            "an absolute path names a file on the server",
        )


@dataclass
class ServerOptions:
    """What a recipe sets of the server's round: the arguments of
    :class:`~fedweigh.flare.controller.FedweighController` but the persistor's id (the recipe's
    arguments of the same names, ``he_layers`` being ``encrypt_layers``)."""

    num_rounds: int
    min_clients: int
    scheme: str
    scheme_args: dict | None
    sample_fraction: float
    statistics: str
    #: the client script's loss reads the global label histogram (the statistics phase sends it)
    loss_needs_global_stats: bool
    train_timeout: int
    seed: int
    resume_from: str | None
    he: bool
    he_layers: list[str] | None
    max_share: float | str | None
    stop_after: int | None
    update_norm_bound: float | None
    min_secure_sum: int
    min_update_cosine: float | None
    aggregator: str
    trim: float
    krum_f: int | None
    array_cosine: float | None
    clip_norm: float | None
    nnm_f: int | None = None
    declared_sizes: dict[str, int] | str | None = None
    norm_colluders: int | str = "auto"

    def controller(self, persistor_id: str) -> FedweighController:
        """The job's controller with these options and the persistor ``persistor_id``."""
        return FedweighController(
            **{f.name: getattr(self, f.name) for f in fields(self)}, persistor_id=persistor_id
        )


class FedweighRecipe(Recipe):
    """A fedweigh job: a weighting scheme at the server, the shared training script at the sites.

    Args:
        name: job name (folder name on export).
        scheme: registry name of the weighting scheme.
        scheme_args: options of the scheme.
        num_rounds: training rounds.
        min_clients: sites needed to start and the minimum valid results per round.
        client: arguments of the client script (dataset, scenario, model, loss, local training).
        model: the global model: any ``torch.nn.Module`` (MONAI networks included), NVFlare's dict
            form ``{"path": "pkg.Class", "args": {...}}``, or a :class:`ModelSpec`; derived from
            ``client`` when omitted (fedweigh's client script only).
        sample_fraction: fraction of sites sampled per round.
        statistics: label-statistics exchange: ``"none"``, ``"plain"`` or ``"secure"``.
        train_timeout: seconds to wait for a task's results; a silent site is left out of that
            task (default 3600; 0 = wait for every sampled site however long).
        resume_from: folder with the state of an earlier run to continue.
        max_share: cap on any one site's share of a round's weight: "auto" (default: half the weight
            once three or more sites count), a number in (0, 1], or None (no cap).
        update_norm_bound: scale every array of an update down to this many times the reference norm
            of the same array in the other sites' updates (their (f + 1)-th largest, f = floor((K - 1) /
            4); default 1: no longer than an honest site's; plaintext updates; None: off).
        min_update_cosine: leave out an update pointing away from a consensus of the others' (cosine
            below this with more than half of them, which agree with each other; default 0; None: off).
        min_secure_sum: the fewest contributions to any secure sum (default 3, at most the number of
            sites; each site's policy may ask for more).
        aggregator: ``"mean"`` (default: the scheme's weighted mean), ``"median"`` (weighted
            coordinate-wise median) or ``"trimmed_mean"`` (weighted trimmed mean), with the scheme's
            weights (plaintext updates; :mod:`fedweigh.server.robust`, docs/security.md).
        trim: the weight mass the trimmed mean cuts from each tail, in [0, 0.5) (default 0.25).
        krum_f: multi-Krum: keep the K - f updates closest to their neighbours (None: off).
        array_cosine: the direction check per array, so that an update flipping a few arrays (the
            classifier) is caught: those arrays are left out of it (None: off).
        clip_norm: clip every update to this absolute L2 norm, as Flower's fixed clipping (None: off).
        nnm_f: nearest-neighbour mixing: each update replaced by the mean of its K - f nearest (None: off).
        declared_sizes: the consortium's declaration of each site's training-set size (site -> N_k,
            or the path of a JSON file at the server): reported counts above it are clipped to it
            (docs/security.md, "Bounded influence"; None: counts as reported).
        norm_colluders: the sites acting together the norm bound withstands (``"auto"``: floor((K - 1) /
            4); an integer; ``"median"``).
        stop_after: end the run after that round; continue it with ``resume_from``.
        bundle: ship the fedweigh package inside the job's ``custom/`` folder (bring-your-own-code
            deployment); by default the job expects fedweigh installed where it runs.
        he: homomorphically encrypted model updates (CKKS, :mod:`fedweigh.secure.updates`): the
            server aggregates ciphertexts with the scheme's weights and never sees an update or,
            after round 1, the global model. Refused (ValueError naming the scheme and the reason)
            for schemes that need plaintext client models: IDA, FedAWA, FedAdp, FedDRAW with
            similarity="delta". Keys: HEBuilder contexts in POC/provisioned kits, simulation keys
            in the simulator.
        train_script: your own Client API script instead of fedweigh's (bring your own training, as
            NVFlare's ``FedAvgRecipe``); it must report the meta the scheme reads
            (:mod:`fedweigh.flare.byo`). ``client`` is then not used; ``model`` is required.
        train_args: the command-line arguments of ``train_script``.
        initial_ckpt: a PyTorch checkpoint (state dict) the global model starts from, as in NVFlare's
            recipes: a relative path is a local file shipped in the job, an absolute path a file on
            the server.
        initial_model: the name ``BaseFedJob`` gives ``model``; the same (not both).
        key_metric: the sites' validation metric NVFlare's model selector keeps the best global
            model by (``best_FL_global_model.pt``); fedweigh's client reports ``val_auc`` (default).
        key_metric_mode: ``"max"`` (default) or ``"min"``, whether a higher key metric is better.
        per_site_config, and NVFlare ``FedAvgRecipe`` arguments that have no meaning here
            (:data:`REFUSED_STOCK_ARGUMENTS`): refused with the reason (ConfigError);
            ``set_per_site_config(recipe, ...)`` likewise.
        encrypt_layers: with ``he``, encrypt only the floating-point arrays matching these glob
            patterns or selectors (``first:N``, ``last:N``, ``largest:N``); the others travel in clear
            (docs/privacy.md states what that reveals). None: encrypt all of them. NVFlare's
            ``FedAvgRecipeWithHE`` name; an exact parameter name is a pattern that matches itself.
        he_layers: the deprecated name of ``encrypt_layers`` (warns).
        he_precision_bits: the precision the sites agree on for what they decrypt (encrypted model
            updates and secure statistics): every decrypted value is rounded to 2^-b before a site
            stores, uses or sends it, so no raw CKKS decryption noise (which reveals the secret key)
            leaves the decryption (:mod:`fedweigh.secure.precision`). 8 to 20 bits; None: 16, the
            default for the kits' CKKS scale 2^40. It travels as the client option of the same name, so
            every site of the job applies the same b; ``client`` may set it instead, not both differently.
        fedprox_mu: FedProx's proximal coefficient mu (scheme ``fedprox``; NVFlare's
            ``FedProxRecipe`` name); None: the scheme's default. ``scheme_args={"client_mu": ...}``
            is its deprecated form (warns).
    """

    def __init__(
        self,
        *,
        name: str,
        scheme: str = "fedavg",
        scheme_args: dict | None = None,
        num_rounds: int = 5,
        min_clients: int = 2,
        client: ClientArgs | None = None,
        model: ModelSpec | torch.nn.Module | dict | None = None,
        sample_fraction: float = 1.0,
        statistics: str = "none",
        train_timeout: int = DEFAULT_TRAIN_TIMEOUT,
        resume_from: str | None = None,
        seed: int = 0,
        bundle: bool = False,
        he: bool = False,
        encrypt_layers: list[str] | None = None,
        he_layers: list[str] | None = None,
        he_precision_bits: int | None = None,
        fedprox_mu: float | None = None,
        max_share: float | str | None = "auto",
        stop_after: int | None = None,
        update_norm_bound: float | None = DEFAULT_UPDATE_NORM_BOUND,
        min_secure_sum: int = DEFAULT_MIN_SECURE_SUM,
        min_update_cosine: float | None = DEFAULT_MIN_UPDATE_COSINE,
        aggregator: str = "mean",
        trim: float = 0.25,
        krum_f: int | None = None,
        array_cosine: float | None = None,
        clip_norm: float | None = None,
        nnm_f: int | None = None,
        declared_sizes: dict[str, int] | str | None = None,
        norm_colluders: int | str = "auto",
        train_script: str | None = None,
        train_args: str = "",
        initial_ckpt: str | None = None,
        initial_model: torch.nn.Module | dict | ModelSpec | None = None,
        key_metric: str = "val_auc",
        key_metric_mode: str = "max",
        **stock_arguments: Any,
    ):
        where = f"recipe {name!r}"
        _refuse_stock_arguments(stock_arguments, where)
        if initial_model is not None and model is not None:
            raise ConfigError(
                where,
                "initial_model",
                type(initial_model).__name__,
                "give model= or initial_model=, not both",
            )
        model = model if model is not None else initial_model
        if not isinstance(key_metric, str) or not key_metric.strip():
            raise ConfigError(
                where, "key_metric", key_metric, "the name of a metric the sites report, e.g. val_auc"
            )
        if key_metric_mode not in ("max", "min"):
            raise ConfigError(where, "key_metric_mode", key_metric_mode, "max (higher is better) or min")
        check_recipe_values(
            {
                "name": name,
                "num_rounds": num_rounds,
                "min_clients": min_clients,
                "sample_fraction": sample_fraction,
                "statistics": statistics,
                "train_timeout": train_timeout,
                "max_share": max_share,
            },
            where,
        )
        encrypt_layers = _encrypt_layers(encrypt_layers, he_layers, where)
        scheme_args = _scheme_options(scheme, scheme_args, fedprox_mu, where)
        _check_own_script(train_script, model, he, where)
        _check_initial_ckpt(initial_ckpt, where)
        self.train_script = train_script
        self.client_args = _with_precision(client or ClientArgs(), he_precision_bits, train_script, where)
        if train_script is None:
            self.client_args = check_client_args(self.client_args, f"{where}: client options")
        self.model_spec = job_model(model, where) if model is not None else self._model_from_client(seed)
        loss_reads_stats = train_script is None and loss_uses_global_stats(self.client_args.loss)
        self.server_options = ServerOptions(
            num_rounds=num_rounds,
            min_clients=min_clients,
            scheme=scheme,
            scheme_args=scheme_args,
            sample_fraction=sample_fraction,
            statistics=statistics,
            loss_needs_global_stats=loss_reads_stats and statistics != "none",
            train_timeout=train_timeout,
            seed=seed,
            resume_from=resume_from,
            he=he,
            he_layers=encrypt_layers,
            max_share=max_share,
            stop_after=stop_after,
            update_norm_bound=update_norm_bound,
            min_secure_sum=min_secure_sum,
            min_update_cosine=min_update_cosine,
            aggregator=aggregator,
            trim=trim,
            krum_f=krum_f,
            array_cosine=array_cosine,
            clip_norm=clip_norm,
            nnm_f=nnm_f,
            declared_sizes=declared_sizes,
            norm_colluders=norm_colluders,
        )
        #: the TensorBoard receiver every fedweigh job has; one that add_experiment_tracking adds replaces it
        self._default_tb = TBAnalyticsReceiver()
        job = _new_job(
            name,
            min_clients,
            ([] if bundle else ["fedweigh"]) + installed_model_packages(model, bundle),
            key_metric,
            key_metric_mode,
            self._default_tb,
        )
        persistor_id = self._setup_model_and_persistor(job, initial_ckpt)
        job.to_server(self.server_options.controller(persistor_id), id="controller")
        job.to_clients(self._create_client_runner(train_args))
        self.he = he
        super().__init__(job)

    def _model_from_client(self, seed: int) -> ModelSpec:
        """The global model fedweigh's client script trains: its architecture, size and norm, the
        dataset's number of classes, initial weights from ``seed`` (or the ``pretrained`` checkpoint)."""
        classes = dataset_classes(self.client_args.dataset, self.client_args.loader_options)
        return ModelSpec(
            arch=self.client_args.arch,
            num_classes=len(classes),
            img_size=self.client_args.size,
            norm=self.client_args.norm,
            seed=seed,
            pretrained=self.client_args.pretrained,
        )

    def _setup_model_and_persistor(self, job: BaseFedJob, initial_ckpt: str | None) -> str:
        """Add the PyTorch persistor of the global model (and its initial checkpoint) to the server;
        its component id, recorded where NVFlare's ``add_cross_site_evaluation(recipe)`` reads it."""
        ckpt = prepare_initial_ckpt(initial_ckpt, job)
        model = self.model_spec
        job_model = model.as_job_model() if isinstance(model, ModelSpec) else model
        # fedweigh's persistor: weights only, no path outside the job (fedweigh.flare.persistor)
        safe = FedweighModelPersistor(model=job_model, source_ckpt_file_full_name=ckpt)
        persistor = job.to_server(PTModel(model=job_model, persistor=safe), id="persistor")
        persistor_id = (
            persistor.get("persistor_id", "persistor") if isinstance(persistor, dict) else "persistor"
        )
        # what NVFlare's add_cross_site_evaluation(recipe) reads: the framework and the persistor
        job.comp_ids.update(persistor if isinstance(persistor, dict) else {"persistor_id": persistor_id})
        return persistor_id

    def _create_client_runner(self, train_args: str) -> ClientScriptRunner:
        """The sites' runner: fedweigh's client script with the client arguments, or the user's script."""
        if self.train_script is None:
            return ClientScriptRunner(script=CLIENT_SCRIPT, script_args=self.client_args.to_argv())
        return ClientScriptRunner(script=str(Path(self.train_script).resolve()), script_args=train_args)

    def _apply_per_site_config(self, config: dict) -> None:
        """``set_per_site_config(recipe, ...)``: refused with the reason (every site runs the same client)."""
        raise ConfigError(
            f"recipe {self._job.name!r}",
            "per_site_config",
            sorted(config),
            f"not taken by fedweigh recipes: {REFUSED_STOCK_ARGUMENTS['per_site_config']}",
        )

    def finalize(self) -> None:
        """Before export or run: one TensorBoard receiver on the server (the one
        ``add_experiment_tracking(recipe, "tensorboard")`` added, else fedweigh's default), and the
        receivers of ``add_experiment_tracking(recipe, "mlflow" | "wandb")`` built to take the
        server's records too (:func:`fedweigh.flare.tracking.use_tracking_receivers`)."""
        super().finalize()
        use_tracking_receivers(self._job, self._default_tb)

    def process_env(self, env) -> None:
        """Before a run: an environment of fewer sites than ``min_clients`` is a ConfigError naming
        both (NVFlare would end with ``min_responses ... must be less than length of targets`` in a log).
        A simulated run (``SimEnv``) pins the CPU kernels its sites compute with (:mod:`fedweigh.kernels`)."""
        if type(env).__name__ == "SimEnv":
            pin_cpu_kernels()
        sites = getattr(env, "num_clients", 0) or len(getattr(env, "clients", None) or [])
        needed = self.server_options.min_clients
        if sites and sites < needed:
            raise ConfigError(
                f"recipe {self._job.name!r}",
                "min_clients",
                needed,
                f"{type(env).__name__} runs {sites} sites; build the recipe with min_clients={sites} or run "
                f"{needed} sites",
            )
        super().process_env(env)

    @property
    def framework(self) -> FrameworkType:
        """PyTorch, for NVFlare's ``add_cross_site_evaluation(recipe)``, which reads it first: under
        ``he`` the recipe refuses cross-site evaluation here, before anything is added to the job."""
        _refuse_cross_site_evaluation_under_he(self)
        return FrameworkType.PYTORCH


def _refuse_cross_site_evaluation_under_he(recipe: FedweighRecipe) -> None:
    if recipe.he:
        raise ValueError(
            f"recipe {recipe.name!r}: cross-site evaluation sends every site's model to the others and the "
            "global model in clear, which he=True keeps from the server; build the recipe without he"
        )


def _client_with_loss(
    client: ClientArgs | None, loss: str, loss_options: dict | None, client_options: dict | None = None
) -> ClientArgs:
    """``client`` (or the defaults) with the method's loss, unless the caller chose one, and the
    local-training options the method prescribes (:data:`fedweigh.methods.CLIENT_OPTIONS`), which
    win over ``client``'s (as in the benchmark's cells)."""
    client = client or ClientArgs()
    if client.loss == "default":
        client = replace(client, loss=loss, loss_options=dict(loss_options or client.loss_options))
    return replace(client, **(client_options or {}))


class MethodRecipe(FedweighRecipe):
    """A method of the catalogue (:data:`fedweigh.methods.METHODS`) by name: its scheme at the server,
    its loss at the sites (unless ``client`` names another), and the label-statistics phase
    (``"secure"``) when the scheme or the loss needs the global histogram.

    Args:
        method: catalogue name (``feddraw``, ``fedbb``, ``fedbb-paper``, ``dafl``, ``fedavg``, ...).
        scheme_args: options of the method's weighting scheme.
        loss_options: options of the method's loss.
        client_options: local-training options (``optimizer``, ``lr``, ``momentum``, ...:
            :data:`fedweigh.methods.CLIENT_OPTIONS`) over those the method prescribes; the sites train
            with them whatever ``client`` says.
        statistics: override the statistics mode (``"none"``, ``"plain"``, ``"secure"``).
        Other keywords: as :class:`FedweighRecipe`.
    """

    def __init__(
        self,
        *,
        method: str,
        name: str | None = None,
        scheme_args: dict | None = None,
        loss_options: dict | None = None,
        client_options: dict | None = None,
        client: ClientArgs | None = None,
        statistics: str | None = None,
        fedprox_mu: float | None = None,
        **kwargs,
    ):
        if method in REFERENCE_METHODS:
            raise ValueError(
                f"method {method!r} trains without federation; a recipe needs a federated method"
            )
        scheme = METHODS[method].scheme if method in METHODS else method
        given = scheme_args
        scheme_args, mu = fedprox_options(scheme, scheme_args, fedprox_mu, f"recipe {name or method!r}")
        spec = method_spec(
            method, {**scheme_args, **({} if mu is None else {"client_mu": mu})}, loss_options, client_options
        )
        # the catalogue's and the caller's scheme options; FedProx's coefficient travels as fedprox_mu
        scheme_args = {k: v for k, v in spec.scheme_args.items() if k != "client_mu"}
        if given is None and not scheme_args:
            scheme_args = None
        if statistics is None:
            # with the user's own script, only the scheme (not fedweigh's loss) can need the histogram
            needed = (
                spec.make_scheme().needs_global_histogram
                if kwargs.get("train_script") is not None
                else spec.needs_statistics()
            )
            statistics = "secure" if needed else "none"
        super().__init__(
            name=name or method,
            scheme=str(spec.scheme),
            scheme_args=scheme_args,
            client=_client_with_loss(client, spec.loss, spec.loss_options, spec.client_options),
            statistics=statistics,
            fedprox_mu=mu,
            **kwargs,
        )


class FedDRAWRecipe(MethodRecipe):
    """FedDRAW: size prior + spread cosine similarity, inner and deferred outer schedules.

    ``feddraw`` holds the scheme's options (see :class:`fedweigh.weighting.feddraw.FedDRAWWeights`),
    e.g. ``{"beta_max": 2.0, "rho": 0.6, "similarity": "params"}``.
    """

    def __init__(self, *, name: str = "feddraw", feddraw: dict | None = None, **kwargs):
        super().__init__(method="feddraw", name=name, scheme_args=feddraw, **kwargs)


class FedBBRecipe(MethodRecipe):
    """FedBB: Positive-Negative Balanced loss at the sites + Client Balanced Reweighting at the server.

    ``cbr`` holds CBR's options (``skew``, ``gamma``); ``pnb`` the loss options (``mu``, ``beta``,
    ``negatives``). The label statistics phase runs by default (the PNB loss may use the global histogram).
    """

    def __init__(self, *, name: str = "fedbb", cbr: dict | None = None, pnb: dict | None = None, **kwargs):
        super().__init__(method="fedbb", name=name, scheme_args=cbr, loss_options=pnb, **kwargs)


class DAFLRecipe(MethodRecipe):
    """DAFL: dynamic adaptive focal loss at the sites + distribution-aware aggregation at the server.

    The loss needs the global class histogram and c_client = sum_k N_k c_k / N, both from the label
    statistics phase. ``dafl`` holds the aggregation options (``mode``), ``loss`` the loss options.
    """

    def __init__(self, *, name: str = "dafl", dafl: dict | None = None, loss: dict | None = None, **kwargs):
        super().__init__(method="dafl", name=name, scheme_args=dafl, loss_options=loss, **kwargs)


class BaselineRecipe(MethodRecipe):
    """One of the baselines (FedAvg, FedProx, FedNova, FedAdp, IDA, FedDisco, FedAWA) by name; FedProx's
    coefficient is ``fedprox_mu`` as in NVFlare's ``FedProxRecipe``."""

    def __init__(self, *, baseline: str, name: str | None = None, scheme_args: dict | None = None, **kwargs):
        if baseline not in BASELINES:
            raise ValueError(f"unknown baseline {baseline!r}; choose one of {BASELINES}")
        super().__init__(method=baseline, name=name or baseline, scheme_args=scheme_args, **kwargs)


def run_outcome(run) -> tuple[int, str]:
    """(exit code, one line) for a finished ``recipe.execute(env)`` run: 0 when at least one round
    changed the global model; 1 (naming the left-out sites' reasons) when none did, e.g. every site
    failed, which NVFlare's simulator still ends with status "finished"."""
    from fedweigh.protocol import METRICS_JSON
    from fedweigh.server.records import load_rows

    result = run.get_result()
    status = run.get_status()
    found = sorted(Path(result).rglob(METRICS_JSON)) if result else []
    if not found:
        return 1, f"error: the run ({status}) left no {METRICS_JSON} under {result}; see its logs there"
    rows = [r for r in load_rows(found[-1]) if r.get("round", 0) >= 1]
    updated = [r for r in rows if r.get("global_updated")]
    if not updated:
        reasons = sorted({f"{site}: {why}" for r in rows for site, why in (r.get("excluded") or {}).items()})
        why = "; ".join(reasons) or "no site result arrived"
        return 1, f"error: no round changed the global model ({why}); logs under {result}"
    return 0, (
        f"{len(updated)} of {len(rows)} round(s) changed the global model ({status}); metrics: {found[-1]}"
    )
