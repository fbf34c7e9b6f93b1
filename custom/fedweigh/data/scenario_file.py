"""User-defined scenarios: a JSON or YAML file describing sites, sizes, label mixes, shift, noise, test mix.

Schema (docs/bench.md, "Your own scenario"; every key but ``name`` and the sites is optional)::

    name: my-hospitals            # letters, digits, '.', '_', '-'; not a catalogue name
    description: free text
    partition: sites              # sites (default) | iid | quantity | label | quantity+label
    alpha: 0.5                    # iid/quantity/label partitions only, as in the catalogue
    quantity_alpha: 1.0           # quantity+label only
    num_sites: 4                  # catalogue partitions: instead of a list of sites
    shift: 1.0                    # one acquisition-shift strength for every site
    sample_fraction: 1.0          # fraction of sites sampled per round, in (0, 1]
    val_fraction: 0.1             # in [0, 1)
    test_mix: pool                # pool | equal | sizes | [one share per site]
    shortfall: error              # error | warn: a site short of its label mix stops the run, or warns
                                  #   (the run records what each site got)
    sites:
      - name: big-hospital        # default site-1, site-2, ...
        size: 1200                # rows (or share: 0.5; every site the same kind); sites partition only
        labels: pool              # pool | balanced | {alpha: 0.5} | {prevalence: {hernia: 0.2}}
        shift: 1.0                # a strength, "degraded", {degraded: 0.5} or {contrast:, gamma:,
                                  #   noise_std:, blur_sigma:, offset:}
        label_noise: 0.3          # fraction of training labels flipped, in [0, 1)

Every error is one line naming the file, the field and what is allowed, e.g.
``scenario file my.yaml: sites[2].size: expected a positive integer, got "64"``.
"""

from __future__ import annotations

import difflib
import json
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedweigh.data.scenarios import (
    PARTITIONS,
    SCENARIOS,
    SHORTFALLS,
    TEST_MIXES,
    Scenario,
    SiteLabels,
)
from fedweigh.data.shift import AcquisitionProfile, degraded_profile
from fedweigh.errors import ScenarioFileError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_TOP_KEYS = (
    "name",
    "description",
    "partition",
    "alpha",
    "quantity_alpha",
    "num_sites",
    "shift",
    "sample_fraction",
    "val_fraction",
    "test_mix",
    "shortfall",
    "sites",
)
_SITE_KEYS = ("name", "size", "share", "labels", "shift", "label_noise")
_PROFILE_KEYS = ("contrast", "gamma", "noise_std", "blur_sigma", "offset")


class _Reader:
    """Checks values of one file and raises :class:`ScenarioFileError` naming file and field."""

    def __init__(self, path: Path, class_names: Sequence[str] | None = None):
        self.path = path
        self.class_names = tuple(class_names) if class_names is not None else None

    def fail(self, field: str, expected: str, value: Any) -> None:
        raise ScenarioFileError(
            f"scenario file {self.path.name}: {field}: expected {expected}, got {_show(value)}"
        )

    def number(
        self, field: str, value: Any, low: float, high: float, *, low_open: bool, high_open: bool
    ) -> float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = (
            ok
            and (value > low if low_open else value >= low)
            and (value < high if high_open else value <= high)
        )
        if not ok:
            lo, hi = "(" if low_open else "[", ")" if high_open else "]"
            upper = "inf" if high == float("inf") else f"{high:g}"
            self.fail(field, f"a number in {lo}{low:g}, {upper}{hi}", value)
        return float(value)

    def positive_int(self, field: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.fail(field, "a positive integer", value)
        return int(value)

    def choice(self, field: str, value: Any, allowed: tuple[str, ...]) -> str:
        if value not in allowed:
            self.fail(field, "one of " + ", ".join(allowed), value)
        return str(value)

    def keys(self, field: str, mapping: dict, allowed: tuple[str, ...]) -> None:
        unknown = [k for k in mapping if k not in allowed]
        if unknown:
            self.fail(f"{field}{unknown[0]}", "a known key (" + ", ".join(allowed) + ")", unknown[0])


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _where(error: Exception) -> str:
    """ ", line L, column C" (1-based) of a JSON or YAML parse error, where the parser marks one."""
    if isinstance(error, json.JSONDecodeError):
        return f", line {error.lineno}, column {error.colno}"
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    return "" if mark is None else f", line {mark.line + 1}, column {mark.column + 1}"


def _problem(error: Exception) -> str:
    """The parser's one-line description of what is wrong."""
    if isinstance(error, json.JSONDecodeError):
        return error.msg
    problem = getattr(error, "problem", None) or getattr(error, "context", None)
    if problem:
        return str(problem)
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _read_mapping(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as e:
        raise ScenarioFileError(f"scenario file {path}: cannot be read ({e.strerror or e})") from None
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ScenarioFileError(
            f"scenario file {path.name}{_where(e)}: not valid {path.suffix[1:].upper()}: {_problem(e)}"
        ) from None
    if not isinstance(data, dict):
        raise ScenarioFileError(
            f"scenario file {path.name}: expected a mapping of scenario fields, got {_show(data)}"
        )
    return data


def _labels(r: _Reader, field: str, value: Any) -> SiteLabels:
    if value in (None, "pool"):
        return SiteLabels()
    if value == "balanced":
        return SiteLabels("balanced")
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in ("alpha", "prevalence"):
        r.fail(field, "pool, balanced, {alpha: A} or {prevalence: {FINDING: P, ...}}", value)
    if "alpha" in value:
        alpha = r.number(f"{field}.alpha", value["alpha"], 0, float("inf"), low_open=True, high_open=True)
        return SiteLabels("alpha", alpha=alpha)
    table = value["prevalence"]
    if not isinstance(table, dict) or not table:
        r.fail(f"{field}.prevalence", "a mapping of finding names to fractions", table)
    for name in table:
        if r.class_names is not None and str(name) not in r.class_names:
            close = difflib.get_close_matches(str(name), r.class_names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            r.fail(
                f"{field}.prevalence", f"the dataset's finding names{hint}: {', '.join(r.class_names)}", name
            )
    pairs = tuple(
        (str(name), r.number(f"{field}.prevalence.{name}", p, 0, 1, low_open=False, high_open=False))
        for name, p in table.items()
    )
    return SiteLabels("prevalence", prevalence=pairs)


def _shift(r: _Reader, field: str, value: Any) -> float | AcquisitionProfile:
    if value == "degraded":
        return degraded_profile(1.0)
    if isinstance(value, dict) and set(value) == {"degraded"}:
        s = r.number(f"{field}.degraded", value["degraded"], 0, float("inf"), low_open=False, high_open=True)
        return degraded_profile(s)
    if isinstance(value, dict):
        r.keys(f"{field}.", value, _PROFILE_KEYS)
        params = {}
        for key, v in value.items():
            positive = key in ("contrast", "gamma")
            low = 0.0 if key != "offset" else -1.0
            params[key] = r.number(f"{field}.{key}", v, low, float("inf"), low_open=positive, high_open=True)
        return AcquisitionProfile(**params)
    expected = (
        'a strength >= 0, "degraded", {degraded: S} or {contrast:, gamma:, noise_std:, blur_sigma:, offset:}'
    )
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        r.fail(field, expected, value)
    return float(value)


@dataclass
class _Sites:
    """The per-site fields of a scenario file, in the order of its ``sites`` list."""

    names: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    shares: list[float] = field(default_factory=list)
    labels: list[SiteLabels] = field(default_factory=list)
    shifts: list[float | AcquisitionProfile] = field(default_factory=list)
    noise: list[float] = field(default_factory=list)


def _name_and_description(r: _Reader, data: dict, path: str | Path) -> tuple[str, str]:
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        r.fail("name", "a name of letters, digits, '.', '_' and '-'", name)
    if name in SCENARIOS:
        r.fail("name", "a name that is not a catalogue scenario's", name)
    description = data.get("description", f"scenario file {Path(path).name}")
    if not isinstance(description, str):
        r.fail("description", "text", description)
    return name, description


def _site_list(r: _Reader, data: dict, partition: str) -> list:
    """The ``sites`` list, or ``num_sites`` empty sites for a catalogue partition."""
    raw_sites = data.get("sites")
    if raw_sites is None:
        if partition == "sites":
            r.fail("sites", "a list of sites (a 'sites' partition gives each site its size)", raw_sites)
        return [{} for _ in range(r.positive_int("num_sites", data.get("num_sites")))]
    if not isinstance(raw_sites, list) or not raw_sites:
        r.fail("sites", "a non-empty list of sites", raw_sites)
    elif "num_sites" in data and data["num_sites"] != len(raw_sites):
        r.fail("num_sites", f"the number of sites listed ({len(raw_sites)})", data["num_sites"])
    return raw_sites


def _partition_options(r: _Reader, data: dict, partition: str) -> dict[str, Any]:
    """``alpha`` (and ``quantity_alpha``) of a catalogue partition; neither for ``iid`` and ``sites``."""
    kw: dict[str, Any] = {}
    if partition in ("iid", "sites"):
        for key in ("alpha", "quantity_alpha"):
            if key in data:
                r.fail(
                    key,
                    f"no {key} with partition {partition!r} (per-site labels go under sites[i].labels)",
                    data[key],
                )
    else:
        kw["alpha"] = r.number("alpha", data.get("alpha"), 0, float("inf"), low_open=True, high_open=True)
    if partition == "quantity+label":
        q = data.get("quantity_alpha")
        kw["quantity_alpha"] = r.number("quantity_alpha", q, 0, float("inf"), low_open=True, high_open=True)
    elif "quantity_alpha" in data and partition not in ("iid", "sites"):
        r.fail(
            "quantity_alpha",
            "no quantity_alpha (only partition 'quantity+label' takes one)",
            data["quantity_alpha"],
        )
    return kw


def _read_site(r: _Reader, i: int, site: Any, partition: str, sites: _Sites) -> None:
    """Check ``sites[i]`` and append its fields to ``sites`` (size, share and labels: ``sites`` partition)."""
    at = f"sites[{i}]"
    if not isinstance(site, dict):
        r.fail(at, "a mapping of site fields", site)
    r.keys(f"{at}.", site, _SITE_KEYS)
    site_name = site.get("name", f"site-{i + 1}")
    if not isinstance(site_name, str) or not _NAME.fullmatch(site_name) or site_name in sites.names:
        r.fail(f"{at}.name", "a new site name of letters, digits, '.', '_' and '-'", site_name)
    sites.names.append(site_name)
    if partition != "sites":
        for key in ("size", "share", "labels"):
            if key in site:
                r.fail(
                    f"{at}.{key}", f"no {key} with partition {partition!r} (use partition: sites)", site[key]
                )
    else:
        if ("size" in site) == ("share" in site):
            r.fail(
                at,
                "exactly one of size (rows) or share (of the pool)",
                {k: site.get(k) for k in ("size", "share")},
            )
        if "size" in site:
            sites.sizes.append(r.positive_int(f"{at}.size", site["size"]))
        else:
            sites.shares.append(
                r.number(f"{at}.share", site["share"], 0, float("inf"), low_open=True, high_open=True)
            )
        sites.labels.append(_labels(r, f"{at}.labels", site.get("labels")))
    sites.shifts.append(_shift(r, f"{at}.shift", site.get("shift", 0.0)))
    sites.noise.append(
        r.number(f"{at}.label_noise", site.get("label_noise", 0.0), 0, 1, low_open=False, high_open=True)
    )


def _read_sites(r: _Reader, raw_sites: list, partition: str) -> _Sites:
    """Every site's fields, sizes and shares checked together."""
    sites = _Sites()
    for i, site in enumerate(raw_sites):
        _read_site(r, i, site, partition, sites)
    sizes, shares = sites.sizes, sites.shares
    if sizes and shares:
        r.fail(
            "sites",
            "every site with a size or every site with a share, not both",
            f"{len(sizes)} sizes and {len(shares)} shares",
        )
    if shares and abs(sum(shares) - 1.0) > 1e-6:
        warnings.warn(
            f"scenario file {r.path.name}: sites[*].share sum to {sum(shares):g}, not 1; each site gets "
            f"its share divided by {sum(shares):g} of the pool",
            UserWarning,
            stacklevel=2,
        )
    if any(s < 2 for s in sizes):
        r.fail(
            f"sites[{next(i for i, s in enumerate(sizes) if s < 2)}].size",
            "at least 2 rows (one train, one val)",
            min(sizes),
        )
    return sites


def _shift_options(r: _Reader, data: dict, shifts: list[float | AcquisitionProfile]) -> dict[str, Any]:
    """``shift`` for every site, or ``site_shift`` per site (not both)."""
    if "shift" in data:
        if any(s != 0.0 for s in shifts):
            r.fail("shift", "either shift for all sites or sites[i].shift, not both", data["shift"])
        return {"shift": r.number("shift", data["shift"], 0, float("inf"), low_open=False, high_open=True)}
    if any(s != 0.0 for s in shifts):
        return {"site_shift": tuple(shifts)}
    return {}


def _test_mix(r: _Reader, data: dict, k: int) -> str | tuple[float, ...]:
    """``test_mix``: a named mix, or one share per site (not all 0)."""
    test_mix = data.get("test_mix", "pool")
    if isinstance(test_mix, list):
        if len(test_mix) != k:
            r.fail("test_mix", f"{k} shares (one per site)", test_mix)
        test_mix = tuple(
            r.number(f"test_mix[{i}]", w, 0, float("inf"), low_open=False, high_open=True)
            for i, w in enumerate(test_mix)
        )
        if not sum(test_mix) > 0:
            r.fail("test_mix", "shares that are not all 0", list(test_mix))
    else:
        r.choice("test_mix", test_mix, (*TEST_MIXES, "[shares]"))
    return test_mix


def scenario_from_mapping(
    data: dict, path: str | Path = "<mapping>", class_names: Sequence[str] | None = None
) -> Scenario:
    """The :class:`Scenario` a parsed scenario file describes (module docstring); ScenarioFileError
    otherwise. With ``class_names`` (the dataset's), a ``prevalence`` names only those findings."""
    r = _Reader(Path(path), class_names)
    r.keys("", data, _TOP_KEYS)
    name, description = _name_and_description(r, data, path)
    partition = r.choice("partition", data.get("partition", "sites"), PARTITIONS)
    raw_sites = _site_list(r, data, partition)
    kw = _partition_options(r, data, partition)
    sites = _read_sites(r, raw_sites, partition)
    k = len(raw_sites)
    kw.update(_shift_options(r, data, sites.shifts))
    test_mix = _test_mix(r, data, k)
    try:
        return Scenario(
            name=name,
            description=description,
            num_sites=k,
            partition=partition,  # type: ignore[arg-type]
            sample_fraction=r.number(
                "sample_fraction", data.get("sample_fraction", 1.0), 0, 1, low_open=True, high_open=False
            ),
            val_fraction=r.number(
                "val_fraction", data.get("val_fraction", 0.1), 0, 1, low_open=False, high_open=True
            ),
            site_counts=tuple(sites.sizes) if sites.sizes else None,
            site_shares=tuple(sites.shares) if sites.shares else None,
            site_labels=tuple(sites.labels)
            if partition == "sites" and any(m.kind != "pool" for m in sites.labels)
            else None,
            label_noise=tuple(sites.noise) if any(sites.noise) else None,
            test_mix=test_mix,
            shortfall=r.choice("shortfall", data.get("shortfall", "error"), SHORTFALLS),
            names=tuple(sites.names) if sites.names != [f"site-{i + 1}" for i in range(k)] else None,
            **kw,
        )
    except ScenarioFileError:
        raise
    except ValueError as e:  # a combination the checks above let through
        raise ScenarioFileError(f"scenario file {Path(path).name}: {e}") from None


def load_scenario_file(path: str | Path, class_names: Sequence[str] | None = None) -> Scenario:
    """The :class:`Scenario` in the JSON (``.json``) or YAML (any other suffix) file ``path``; with
    ``class_names``, its ``prevalence`` mixes are checked against them."""
    path = Path(path)
    return scenario_from_mapping(_read_mapping(path), path, class_names)
