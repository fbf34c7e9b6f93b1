"""Every error fedweigh raises on purpose, in one place below everything else.

Each is a standard exception type (ValueError, PermissionError, ...) so that callers who catch those
keep working; each message names the file, field, site or job it is about and what is wrong.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BenchError",
    "BundleError",
    "ConfigError",
    "ContextNotFoundError",
    "DatasetFormatError",
    "FolderFormatError",
    "HEIncompatibleScheme",
    "InvalidClientResult",
    "PolicyRefusal",
    "PretrainedCheckpointError",
    "PrivacyBudgetExhausted",
    "ScenarioFileError",
    "ScenarioShortfall",
    "SimulationKeysRefused",
]


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})" if isinstance(value, str) else repr(value)


# -- user settings ---------------------------------------------------------------------------------
class ConfigError(ValueError):
    """A user setting that cannot work; the message names the source, field, value and what is allowed."""

    def __init__(self, source: str, field: str, value: Any, allowed: str):
        self.source, self.field, self.value, self.allowed = source, field, value, allowed
        super().__init__(f"{source}: {field} = {_show(value)} is not allowed; {allowed}")


class ScenarioShortfall(ConfigError):
    """A ``sites`` partition cannot give a site the size or label mix its scenario asks for; the
    one-line message names the scenario, the site and what ran short."""

    def __init__(self, scenario: str, site: str, message: str):
        self.source, self.field, self.value, self.allowed = f"scenario {scenario!r}", site, None, ""
        ValueError.__init__(self, message)


class ScenarioFileError(ValueError):
    """A scenario file that cannot be read or breaks the schema (one-line message)."""


class BundleError(ValueError):
    """A bundle, its data list or an override cannot be used; the message names the file or field."""


# -- data and models -------------------------------------------------------------------------------
class DatasetFormatError(ValueError):
    """A dataset file exists but does not have the expected layout; the message names file and problem."""


class FolderFormatError(ValueError):
    """The CSV or an image it names cannot be read; the message names the file, row and column."""


class PretrainedCheckpointError(ValueError):
    """A ``pretrained`` checkpoint that cannot be read or does not fit the network; names the file."""


# -- the server's round ----------------------------------------------------------------------------
class InvalidClientResult(ValueError):
    """A client result the server must skip; the message names the site and the problem."""


class HEIncompatibleScheme(ValueError):
    """A weighting scheme that needs plaintext client models was asked to run under HE."""


# -- the site's privacy ----------------------------------------------------------------------------
class PolicyRefusal(PermissionError):
    """A job asks for less than the site's privacy policy allows; the message says what and why."""


class PrivacyBudgetExhausted(RuntimeError):
    """Training another round would spend more than the site's DP-SGD budget."""


class ContextNotFoundError(FileNotFoundError):
    """No TenSEAL context could be found; the message lists every place that was searched."""


class SimulationKeysRefused(RuntimeError):
    """Simulation-only keys were offered in a provisioned deployment."""


# -- the benchmark ---------------------------------------------------------------------------------
class BenchError(RuntimeError):
    """Some cells failed (the others are stored; a rerun retries only the failed ones)."""
