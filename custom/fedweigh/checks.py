"""Checks of user settings before a run: client options, site data configs, recipe arguments.

A job's client options are checked when its recipe is built (and so when it is exported), the
client script checks them again when a site starts, a site's ``fedweigh_site.json`` is checked when
it is read, and ``fedweigh bench`` checks its arguments before any cell runs. Every error is a
:class:`ConfigError` whose one-line message names where the setting came from, the field, the value
and what is allowed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from fedweigh.errors import ConfigError
from fedweigh.protocol import ABSOLUTE_MIN
from fedweigh.secure.dp_config import ACCOUNTANTS, DP_MODES
from fedweigh.secure.precision import MAX_PRECISION_BITS, MIN_PRECISION_BITS, check_precision_bits
from fedweigh.train import OPTIMIZERS

#: The smallest image side the models accept.
MIN_SIZE = 8
#: Label-statistics exchanges a run may hold before training (the controller's ``statistics``).
STATISTICS_MODES: tuple[str, ...] = ("none", "plain", "secure")

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})" if isinstance(value, str) else repr(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


class _Checker:
    """Checks fields of one mapping of settings, raising :class:`ConfigError` on the first bad one."""

    def __init__(self, source: str, values: Mapping[str, Any]):
        self.source = source
        self.values = values

    def fail(self, name: str, allowed: str) -> None:
        raise ConfigError(self.source, name, self.values.get(name), allowed)

    def choice(self, name: str, choices: Iterable[str]) -> None:
        choices = tuple(choices)
        if self.values.get(name) not in choices:
            self.fail(name, f"choose one of {', '.join(choices)}")

    def integer(self, name: str, minimum: int, optional: bool = False) -> None:
        value = self.values.get(name)
        if value is None and optional:
            return
        if not _is_int(value) or value < minimum:
            self.fail(name, f"must be an integer >= {minimum}" + (" or null" if optional else ""))

    def number(
        self, name: str, low: float = 0.0, high: float = math.inf, *, optional: bool = False, open_high=False
    ) -> None:
        """A finite number with ``low < value`` and ``value <= high`` (``< high`` with open_high)."""
        value = self.values.get(name)
        if value is None and optional:
            return
        ok = _is_number(value) and low < value and (value < high if open_high else value <= high)
        if not ok:
            bounds = f"> {low:g}" if high == math.inf else f"in ({low:g}, {high:g}{')' if open_high else ']'}"
            self.fail(name, f"must be a number {bounds}" + (" or null" if optional else ""))

    def boolean(self, name: str) -> None:
        if not isinstance(self.values.get(name), bool):
            self.fail(name, "must be true or false")

    def mapping(self, name: str) -> None:
        if not isinstance(self.values.get(name), dict):
            self.fail(name, 'must be a JSON object, e.g. {"key": "value"}')

    def text(self, name: str, optional: bool = False) -> None:
        value = self.values.get(name)
        if value is None and optional:
            return
        if not isinstance(value, str) or not value.strip():
            self.fail(name, "must be a non-empty text" + (" or null" if optional else ""))


def check_loader_options(source: str, dataset: str, options: Any) -> None:
    """Loader options the dataset's loader takes (a misspelt key names the field and the keys it
    takes) and those a dataset requires (``images_csv``: its label columns, ...)."""
    from fedweigh.data.pools import DATASETS, check_loader_option_names

    if dataset in DATASETS and isinstance(options, dict):
        check_loader_option_names(dataset, options, source)
    if dataset == "images_csv" and isinstance(options, dict):
        from fedweigh.data.folder import check_options

        check_options(options, source)


def check_dataset_path(source: str, dataset: str, data_path: Any, field: str = "data_path") -> None:
    """A dataset that reads files (chestmnist, chexpert) needs a data path."""
    from fedweigh.data.pools import _DATA_PATH_HINT, dataset_info

    if dataset_info(dataset)["needs_data_path"] and data_path in (None, ""):
        raise ConfigError(
            source, field, data_path, f"dataset {dataset!r} needs the path of {_DATA_PATH_HINT[dataset]}"
        )


def check_client_values(values: Mapping[str, Any], source: str = "client options") -> None:
    """Check the fields of :class:`fedweigh.site.args.ClientArgs` given as a mapping (names as in ClientArgs)."""
    from fedweigh.data.pools import DATASETS
    from fedweigh.data.scenarios import SCENARIOS
    from fedweigh.losses import LOSS_CLASSES, loss_options
    from fedweigh.models import ARCHITECTURES, NORMS

    c = _Checker(source, values)
    c.choice("dataset", DATASETS)
    c.choice("scenario", SCENARIOS)
    c.text("data_path", optional=True)
    check_dataset_path(source, values["dataset"], values.get("data_path"))
    c.mapping("loader_options")
    check_loader_options(source, values["dataset"], values["loader_options"])
    c.integer("size", MIN_SIZE)
    c.integer("num_images", 1, optional=True)
    c.integer("test_images", 1, optional=True)
    c.integer("seed", 0)
    c.choice("arch", ARCHITECTURES)
    c.choice("norm", NORMS)
    c.text("pretrained", optional=True)
    c.choice("loss", ("default", *LOSS_CLASSES))
    c.mapping("loss_options")
    if values["loss"] != "default":
        known = loss_options(values["loss"])
        unknown = sorted(set(values["loss_options"]) - set(known))
        if unknown:
            raise ConfigError(
                source,
                "loss_options",
                values["loss_options"],
                f"loss {values['loss']!r} takes {', '.join(known) or 'no options'} (unknown: {', '.join(unknown)})",
            )
    c.integer("epochs", 1)
    c.integer("batch_size", 1)
    c.number("lr")
    c.choice("optimizer", OPTIMIZERS)
    for name, allowed in (
        ("momentum", "must be a number in [0, 1)"),
        ("weight_decay", "must be a number >= 0"),
    ):
        value = values.get(name)
        if not _is_number(value) or value < 0 or (name == "momentum" and value >= 1):
            c.fail(name, allowed)
    c.integer("max_steps", 1, optional=True)
    c.integer("threads", 0)
    for flag in ("eval_test", "channels_last", "keep_optimizer", "amp", "compile", "augment"):
        c.boolean(flag)
    if not isinstance(values.get("device"), str) or not _DEVICE.match(values["device"]):
        c.fail("device", "choose auto, cpu, cuda or cuda:N")
    c.number("dp_epsilon", optional=True)
    c.number("dp_delta", 0.0, 1.0, open_high=True)
    c.number("dp_max_grad_norm")
    c.number("dp_noise_multiplier", optional=True)
    c.choice("dp_accountant", ACCOUNTANTS)
    c.choice("dp_mode", DP_MODES)
    c.number("stats_dp_epsilon", optional=True)
    c.number("stats_dp_delta", 0.0, 1.0, open_high=True)
    bits = values.get("he_precision_bits")
    if bits is not None:
        try:
            check_precision_bits(bits)
        except ValueError:
            c.fail(
                "he_precision_bits",
                f"a whole number of fractional bits in [{MIN_PRECISION_BITS}, {MAX_PRECISION_BITS}] (decrypted "
                "values are rounded to 2^-b: finer keeps the CKKS decryption noise, coarser wipes out updates)",
            )
    if values["augment"] and (values["dp_epsilon"] is not None or values["dp_noise_multiplier"] is not None):
        c.fail("augment", "DP-SGD trains without augmentation: set augment to false or turn DP-SGD off")


def check_client_args(args: Any, source: str = "client options") -> Any:
    """Check a :class:`fedweigh.site.args.ClientArgs`; returns it unchanged, raises :class:`ConfigError`."""
    check_client_values(vars(args), source)
    return args


def check_site_values(values: Mapping[str, Any], source: str) -> None:
    """Check the fields of a site data config (:class:`fedweigh.site.data_config.SiteDataConfig`)."""
    from fedweigh.data.pools import DATASETS

    c = _Checker(source, values)
    c.choice("dataset", DATASETS)
    c.text("data_path", optional=True)
    check_dataset_path(source, values["dataset"], values.get("data_path"))
    c.mapping("loader_options")
    check_loader_options(source, values["dataset"], values["loader_options"])
    c.integer("size", MIN_SIZE)
    c.number("val_fraction", 0.0, 1.0, open_high=True)
    c.integer("seed", 0)
    c.integer("num_images", 1, optional=True)


def check_recipe_values(values: Mapping[str, Any], source: str = "recipe") -> None:
    """Check a recipe's own arguments (its name, and the server's options it sets)."""
    _Checker(source, values).text("name")
    check_server_values(values, source)


#: The server's integer options and their least values.
_SERVER_INTEGERS: tuple[tuple[str, int], ...] = (
    ("num_rounds", 1),
    ("min_clients", 1),
    ("min_secure_sum", ABSOLUTE_MIN),
    ("train_timeout", 0),
    ("memory_gc_rounds", 0),
    ("eval_every", 1),
)


def declaration_problem(raw: object) -> tuple[str, object, str] | None:
    """What is wrong with a declaration, as (field, value, what is allowed); None when it is one: a
    non-empty mapping of non-empty site names to integers >= 1 (the one rule, which
    :func:`check_server_values` and :mod:`fedweigh.server.declared` apply)."""
    if not isinstance(raw, Mapping) or not raw:
        return "declared_sizes", raw, "a non-empty JSON object of site name -> count"
    for site, count in raw.items():
        if not isinstance(site, str) or not site:
            return "declared_sizes", site, "a site name must be a non-empty string"
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            return f"declared_sizes[{site!r}]", count, "a declared size is an integer >= 1"
    return None


def check_server_values(values: Mapping[str, Any], source: str) -> None:
    """Check the server's options among ``values`` (those present; other keys are not read).

    One rule per option, wherever it is set: the recipes, ``FedweighController``,
    ``FedweighAggregator``, the round step's ``Safeguards`` (:mod:`fedweigh.server.safeguards`) and
    the bench. ``stop_after`` is checked against ``num_rounds`` when both are given.
    """
    c = _Checker(source, values)
    for name, minimum in _SERVER_INTEGERS:
        if name in values:
            c.integer(name, minimum)
    if "sample_fraction" in values:
        c.number("sample_fraction", 0.0, 1.0)
    if "statistics" in values:
        c.choice("statistics", STATISTICS_MODES)
    value = values.get("max_share")
    if value not in ("auto", None) and not (_is_number(value) and 0.0 < value <= 1.0):
        c.fail("max_share", "'auto' (the default cap), null (no cap) or a number in (0, 1]")
    value = values.get("update_norm_bound")
    if value is not None and not (_is_number(value) and value >= 1.0):
        c.fail("update_norm_bound", "null (off) or a finite number >= 1")
    value = values.get("norm_colluders", "auto")
    if value not in ("auto", "median") and not (_is_int(value) and value >= 0):
        c.fail("norm_colluders", "'auto', 'median' or an integer >= 0")
    value = values.get("min_update_cosine")
    if value is not None and not (_is_number(value) and -1.0 <= value <= 1.0):
        c.fail("min_update_cosine", "null (off) or a number in [-1, 1]")
    if "aggregator" in values and values["aggregator"] not in ("mean", "median", "trimmed_mean"):
        c.fail("aggregator", "'mean' (the scheme's weighted mean), 'median' or 'trimmed_mean'")
    if "trim" in values and not (_is_number(values["trim"]) and 0.0 <= values["trim"] < 0.5):
        c.fail("trim", "a number in [0, 0.5)")
    value = values.get("krum_f")
    if value is not None and not (_is_int(value) and value >= 1):
        c.fail("krum_f", "null (off) or an integer >= 1")
    value = values.get("array_cosine")
    if value is not None and not (_is_number(value) and -1.0 <= value <= 1.0):
        c.fail("array_cosine", "null (off) or a number in [-1, 1]")
    value = values.get("clip_norm")
    if value is not None and not (_is_number(value) and value > 0.0):
        c.fail("clip_norm", "null (off) or a finite number > 0")
    value = values.get("nnm_f")
    if value is not None and not (_is_int(value) and value >= 1):
        c.fail("nnm_f", "null (off) or an integer >= 1")
    value = values.get("declared_sizes")
    if value is not None and declaration_problem(value) is not None:
        c.fail("declared_sizes", "null (no declaration) or a mapping of site name to an integer >= 1")
    value, rounds = values.get("stop_after"), values.get("num_rounds")
    if value is not None and not (_is_int(value) and 1 <= value <= (rounds if _is_int(rounds) else value)):
        c.fail("stop_after", f"null or an integer in 1..num_rounds={rounds}")
    value = values.get("he_layers")
    if value is not None and (
        isinstance(value, str)
        or not isinstance(value, (list, tuple))
        or not all(isinstance(p, str) and p for p in value)
    ):
        c.fail("he_layers", "null (encrypt every floating-point array) or a list of non-empty patterns")
