"""The edges of the site privacy policy (fedweigh.site.policy): every field's default in both columns,
each field's bounds on both sides and at the bound, the exact refusal messages of a bad file, of a job, of
a task and of the epsilon/delta guard, the folders a job may read from, and where the policy file is
found."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import pytest

from fedweigh.errors import PolicyRefusal
from fedweigh.protocol import SITE_POLICY_ENV
from fedweigh.site import policy as policy_module
from fedweigh.site.ledger import PrivacyLedger
from fedweigh.site.policy import (
    DEFAULT_MAX_DELTA,
    LEDGER_FILE,
    PERMISSIVE_DEFAULT,
    PROVISIONED_DEFAULT,
    STATISTICS_MODES,
    PrivacyGuard,
    SitePolicy,
    find_policy_file,
    ledger_path,
    load_site_policy,
)

ALL_SCALARS = ("similarity", "skew", "imbalance", "discrepancy")
KNOWN_FIELDS = [
    "statistics_modes",
    "require_encrypted_updates",
    "require_dp",
    "require_statistics_dp",
    "statistics_epsilon",
    "max_epsilon_per_job",
    "max_epsilon_total",
    "max_delta",
    "read_dirs",
    "min_secure_sum",
    "report_scalars",
]
PROVISIONED_SOURCE = "default policy of a provisioned site (no fedweigh_policy.json)"
PERMISSIVE_SOURCE = "permissive default (no fedweigh_policy.json and no provisioned startup kit: simulation)"


def exactly(text: str) -> str:
    return r"^" + re.escape(text) + r"$"


def args(**kw) -> SimpleNamespace:
    """Client arguments holding only what is given (every other attribute absent)."""
    return SimpleNamespace(**kw)


# ---------------------------------------------------------------------------------- constants, defaults
def test_module_constants_and_exports():
    assert STATISTICS_MODES == ("plain", "secure")
    assert LEDGER_FILE == "fedweigh_privacy_ledger_{site}.json"
    assert DEFAULT_MAX_DELTA == 1e-5
    assert policy_module.__all__ == [
        "DEFAULT_MAX_DELTA",
        "LEDGER_FILE",
        "MECHANISMS",
        "PERMISSIVE_DEFAULT",
        "PROVISIONED_DEFAULT",
        "STATISTICS_MODES",
        "PolicyRefusal",
        "PrivacyGuard",
        "PrivacyLedger",
        "SitePolicy",
        "find_policy_file",
        "ledger_path",
        "load_site_policy",
    ]
    for name in policy_module.__all__:
        assert hasattr(policy_module, name)


def test_a_policy_built_without_arguments_has_the_left_column():
    p = SitePolicy()
    assert p.statistics_modes == ("secure",)
    assert p.require_encrypted_updates is False
    assert p.require_dp is False
    assert p.require_statistics_dp is False
    assert p.max_epsilon_per_job == 10.0
    assert p.max_epsilon_total == 100.0
    assert p.max_delta == 1e-5
    assert p.read_dirs == ()
    assert p.min_secure_sum == 3
    assert p.report_scalars == ALL_SCALARS
    assert p.source == "built-in default"


def test_the_provisioned_default_is_the_left_column_with_its_source():
    assert PROVISIONED_DEFAULT == SitePolicy(source=PROVISIONED_SOURCE)
    assert PROVISIONED_DEFAULT.source == PROVISIONED_SOURCE


def test_the_permissive_default_is_the_right_column():
    p = PERMISSIVE_DEFAULT
    assert p.statistics_modes == ("plain", "secure")
    assert p.require_encrypted_updates is False and p.require_dp is False
    assert p.require_statistics_dp is False
    assert p.max_epsilon_per_job is None and p.max_epsilon_total is None
    assert p.max_delta == 1e-5
    assert p.read_dirs is None
    assert p.min_secure_sum == 2
    assert p.report_scalars == ALL_SCALARS
    assert p.source == PERMISSIVE_SOURCE


def test_as_dict_holds_the_file_layout():
    assert PROVISIONED_DEFAULT.as_dict() == {
        "statistics_modes": ["secure"],
        "require_encrypted_updates": False,
        "require_dp": False,
        "require_statistics_dp": False,
        "statistics_epsilon": 1.0,
        "max_epsilon_per_job": 10.0,
        "max_epsilon_total": 100.0,
        "max_delta": 1e-5,
        "read_dirs": [],
        "min_secure_sum": 3,
        "report_scalars": list(ALL_SCALARS),
    }
    permissive = PERMISSIVE_DEFAULT.as_dict()
    assert permissive["read_dirs"] is None
    assert permissive["statistics_modes"] == ["plain", "secure"]
    assert permissive["max_epsilon_per_job"] is None and permissive["max_epsilon_total"] is None
    assert permissive["min_secure_sum"] == 2
    assert permissive["statistics_epsilon"] == 1.0  # private by default in simulation too
    custom = SitePolicy(
        require_encrypted_updates=True,
        require_dp=True,
        require_statistics_dp=True,
        max_epsilon_per_job=1.5,
        max_epsilon_total=7.0,
        max_delta=1e-7,
        read_dirs=("/data/a",),
        min_secure_sum=5,
        report_scalars=("skew",),
    )
    d = custom.as_dict()
    assert d["require_encrypted_updates"] is True and d["require_dp"] is True
    assert d["require_statistics_dp"] is True
    assert (d["max_epsilon_per_job"], d["max_epsilon_total"], d["max_delta"]) == (1.5, 7.0, 1e-7)
    assert d["read_dirs"] == ["/data/a"] and d["min_secure_sum"] == 5 and d["report_scalars"] == ["skew"]
    assert list(d) == KNOWN_FIELDS
    assert SitePolicy.from_dict(d, "again") == replace_source(custom, "again")


def replace_source(p: SitePolicy, source: str) -> SitePolicy:
    from dataclasses import replace

    return replace(p, source=source)


# ---------------------------------------------------------------------------------- from_dict
def test_an_empty_object_keeps_the_provisioned_defaults_and_names_its_origin():
    p = SitePolicy.from_dict({}, "origin.json")
    assert p == replace_source(PROVISIONED_DEFAULT, "origin.json")
    assert p.source == "origin.json"


def test_missing_fields_keep_the_given_base():
    p = SitePolicy.from_dict({"min_secure_sum": 4}, "o", base=PERMISSIVE_DEFAULT)
    assert p.min_secure_sum == 4
    assert p.statistics_modes == ("plain", "secure") and p.read_dirs is None
    assert p.max_epsilon_per_job is None and p.source == "o"


def test_any_mapping_is_accepted():
    p = SitePolicy.from_dict(MappingProxyType({"require_dp": True}), "o")
    assert p.require_dp is True


@pytest.mark.parametrize("raw, kind", [([1], "list"), ("x", "str"), (None, "NoneType"), (3, "int")])
def test_a_policy_that_is_not_an_object_is_refused(raw, kind):
    with pytest.raises(ValueError, match=exactly(f"site policy o.json must hold a JSON object, got {kind}")):
        SitePolicy.from_dict(raw, "o.json")


def test_unknown_fields_are_listed_sorted_with_the_known_ones():
    with pytest.raises(ValueError) as e:
        SitePolicy.from_dict({"zeta": 1, "alpha": 2, "require_dp": True}, "o.json")
    assert str(e.value) == f"site policy o.json: unknown field(s) ['alpha', 'zeta']; known: {KNOWN_FIELDS}"


def test_source_is_not_a_field_of_the_file():
    with pytest.raises(ValueError) as e:
        SitePolicy.from_dict({"source": "me"}, "o.json")
    assert str(e.value) == f"site policy o.json: unknown field(s) ['source']; known: {KNOWN_FIELDS}"


@pytest.mark.parametrize("name", ["require_encrypted_updates", "require_dp", "require_statistics_dp"])
def test_switches_take_true_and_false_only(name):
    assert getattr(SitePolicy.from_dict({name: True}, "o"), name) is True
    assert getattr(SitePolicy.from_dict({name: False}, "o", base=SitePolicy(**{name: True})), name) is False
    for bad in (1, 0, "true", None):
        with pytest.raises(
            ValueError, match=exactly(f"site policy o: {name} must be true or false, got {bad!r}")
        ):
            SitePolicy.from_dict({name: bad}, "o")


@pytest.mark.parametrize("name", ["max_epsilon_per_job", "max_epsilon_total"])
def test_epsilon_caps_are_numbers_at_least_zero_or_null(name):
    assert getattr(SitePolicy.from_dict({name: None}, "o"), name) is None
    zero = getattr(SitePolicy.from_dict({name: 0}, "o"), name)
    assert zero == 0.0 and type(zero) is float
    assert getattr(SitePolicy.from_dict({name: 2.5}, "o"), name) == 2.5
    big = getattr(SitePolicy.from_dict({name: 7}, "o"), name)
    assert big == 7.0 and type(big) is float
    assert getattr(SitePolicy.from_dict({name: 1e308}, "o"), name) == 1e308
    for bad in (-1e-9, -1, math.inf, math.nan, True, False, "5", [5]):
        message = f"site policy o: {name} must be a number >= 0 or null (no cap), got {bad!r}"
        with pytest.raises(ValueError, match=exactly(message)):
            SitePolicy.from_dict({name: bad}, "o")


def test_read_dirs_are_absolute_folders_or_null():
    assert SitePolicy.from_dict({"read_dirs": None}, "o").read_dirs is None
    assert SitePolicy.from_dict({"read_dirs": []}, "o").read_dirs == ()
    assert SitePolicy.from_dict({"read_dirs": ["/a", "/b/c"]}, "o").read_dirs == ("/a", "/b/c")
    for bad in ("/a", ["/a", "rel"], [1], ("/a",), ["/a", None]):
        message = (
            f"site policy o: read_dirs must be a list of absolute folder paths or null (any), got {bad!r}"
        )
        with pytest.raises(ValueError, match=exactly(message)):
            SitePolicy.from_dict({"read_dirs": bad}, "o")


def test_max_delta_lies_strictly_between_zero_and_one():
    assert SitePolicy.from_dict({"max_delta": 0.5}, "o").max_delta == 0.5
    assert SitePolicy.from_dict({"max_delta": 1e-300}, "o").max_delta == 1e-300
    assert SitePolicy.from_dict({"max_delta": 0.999999}, "o").max_delta == 0.999999
    for bad in (0, 0.0, 1, 1.0, -0.1, 1.5, math.nan, True, "0.1", None):
        with pytest.raises(
            ValueError, match=exactly(f"site policy o: max_delta must be a number in (0, 1), got {bad!r}")
        ):
            SitePolicy.from_dict({"max_delta": bad}, "o")


def test_statistics_epsilon_is_a_positive_finite_number_or_null():
    assert SitePolicy.from_dict({"statistics_epsilon": 2}, "o").statistics_epsilon == 2.0
    assert SitePolicy.from_dict({"statistics_epsilon": 1e-300}, "o").statistics_epsilon == 1e-300
    assert SitePolicy.from_dict({"statistics_epsilon": None}, "o").statistics_epsilon is None
    for bad in (0, 0.0, -1.0, math.inf, math.nan, True, "1.0", [1.0]):
        with pytest.raises(
            ValueError,
            match=exactly(
                f"site policy o: statistics_epsilon must be a number > 0 or null (exact statistics), got {bad!r}"
            ),
        ):
            SitePolicy.from_dict({"statistics_epsilon": bad}, "o")


def test_a_guards_record_overwrites_what_it_reserved_even_where_another_job_holds_that_figure(tmp_path):
    """Job A of a budget reached 1.5; job B reserves 2.0 and reaches 1.5: B's entry is 1.5 (its own
    reservation overwritten), so the budget holds 3.0, not A's 1.5 plus B's reserved 2.0."""
    ledger = PrivacyLedger(tmp_path / "ledger.json")
    policy = SitePolicy(source="t")
    first = PrivacyGuard(policy, ledger, "site-a", "budget", job_id="job-a")
    first.check("statistics", 1.5, delta=1e-5, num_samples=1000)
    first.record("statistics", 1.5, 1e-5)
    second = PrivacyGuard(policy, ledger, "site-a", "budget", job_id="job-b")
    second.check("statistics", 2.0, delta=1e-5, num_samples=1000)
    assert ledger.spent("budget") == pytest.approx(3.5)
    second.record("statistics", 1.5, 1e-5)
    assert ledger.spent("budget") == pytest.approx(3.0)


def test_min_secure_sum_is_an_integer_of_at_least_two():
    assert SitePolicy.from_dict({"min_secure_sum": 2}, "o").min_secure_sum == 2
    assert SitePolicy.from_dict({"min_secure_sum": 17}, "o").min_secure_sum == 17
    for bad in (1, 0, -3, 2.0, 3.0, True, "3", None):
        with pytest.raises(
            ValueError, match=exactly(f"site policy o: min_secure_sum must be an integer >= 2, got {bad!r}")
        ):
            SitePolicy.from_dict({"min_secure_sum": bad}, "o")


def test_statistics_modes_are_a_list_of_the_known_modes():
    assert SitePolicy.from_dict({"statistics_modes": ["plain"]}, "o").statistics_modes == ("plain",)
    assert SitePolicy.from_dict({"statistics_modes": []}, "o").statistics_modes == ()
    both = SitePolicy.from_dict({"statistics_modes": ["secure", "plain"]}, "o")
    assert both.statistics_modes == ("secure", "plain")
    for bad in (["secure", "encrypted"], ["Plain"], ("secure",), "secure", None):
        message = f"site policy o: statistics_modes must be a list of ['plain', 'secure'], got {bad!r}"
        with pytest.raises(ValueError, match=exactly(message)):
            SitePolicy.from_dict({"statistics_modes": bad}, "o")


def test_report_scalars_are_a_list_of_the_known_scalars():
    assert SitePolicy.from_dict({"report_scalars": ["skew", "imbalance"]}, "o").report_scalars == (
        "skew",
        "imbalance",
    )
    assert SitePolicy.from_dict({"report_scalars": []}, "o").report_scalars == ()
    for bad in (["skew", "histogram"], ("skew",), "skew", None):
        message = f"site policy o: report_scalars must be a list of {list(ALL_SCALARS)}, got {bad!r}"
        with pytest.raises(ValueError, match=exactly(message)):
            SitePolicy.from_dict({"report_scalars": bad}, "o")


# ---------------------------------------------------------------------------------- from_file
def test_a_missing_policy_file_is_named(tmp_path):
    path = tmp_path / "none.json"
    with pytest.raises(FileNotFoundError, match=exactly(f"site policy {path} does not exist")):
        SitePolicy.from_file(path)


def test_a_file_that_is_not_json_names_the_parser_error(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"require_dp": tru}')
    try:
        json.loads('{"require_dp": tru}')
    except json.JSONDecodeError as e:
        parser = str(e)
    with pytest.raises(ValueError, match=exactly(f"site policy {path} is not valid JSON: {parser}")):
        SitePolicy.from_file(path)


def test_a_world_writable_file_is_refused_with_its_mode_and_the_fix(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{}")
    os.chmod(path, 0o646)
    message = (
        f"site policy {path} is writable by every user of this machine (mode -rw-r--rw-): "
        f"anyone could loosen it. Make it writable by its owner only: chmod o-w {path}"
    )
    with pytest.raises(PermissionError, match=exactly(message)):
        SitePolicy.from_file(path)


@pytest.mark.parametrize("mode", [0o600, 0o644, 0o604, 0o400])  # group-writable: tests/test_file_checks.py
def test_a_file_others_cannot_write_is_read(tmp_path, mode):
    path = tmp_path / "p.json"
    path.write_text('{"require_dp": true}')
    os.chmod(path, mode)
    p = SitePolicy.from_file(str(path))
    assert p.require_dp is True and p.source == str(path)
    assert p.statistics_modes == ("secure",)


def test_from_file_passes_its_base_on(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{}")
    os.chmod(path, 0o600)
    assert SitePolicy.from_file(path, base=PERMISSIVE_DEFAULT) == replace_source(
        PERMISSIVE_DEFAULT, str(path)
    )
    assert SitePolicy.from_file(path) == replace_source(PROVISIONED_DEFAULT, str(path))


def test_a_field_error_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"max_delta": 0}')
    os.chmod(path, 0o600)
    with pytest.raises(
        ValueError, match=exactly(f"site policy {path}: max_delta must be a number in (0, 1), got 0")
    ):
        SitePolicy.from_file(path)


# ---------------------------------------------------------------------------------- job_refusal
def test_a_job_without_any_dp_passes_a_policy_that_requires_none():
    assert SitePolicy(source="t").job_refusal(args()) is None
    assert PROVISIONED_DEFAULT.job_refusal(SimpleNamespace(unrelated=1)) is None


def test_require_dp_refuses_a_job_without_dp_sgd_with_the_exact_reason():
    p = SitePolicy(require_dp=True, source="t")
    assert p.job_refusal(args()) == (
        "the job trains without DP-SGD, and this site requires DP on its model updates (site policy: t)"
    )
    assert p.job_refusal(args(dp_epsilon=1.0, dp_delta=1e-5)) is None
    assert p.job_refusal(args(dp_noise_multiplier=1.0, dp_delta=1e-5)) is None


def test_require_statistics_dp_refuses_a_job_without_noisy_statistics():
    p = SitePolicy(require_statistics_dp=True, statistics_epsilon=None, source="t")
    assert p.job_refusal(args(dp_epsilon=1.0, dp_delta=1e-6)) == (
        "the job releases the label statistics without DP noise, and this site requires it (site policy: t)"
    )
    assert p.job_refusal(args(stats_dp_epsilon=1.0, stats_dp_delta=1e-6)) is None
    # a site whose own statistics_epsilon noises every release needs no epsilon from the job
    noised_by_site = SitePolicy(require_statistics_dp=True, statistics_epsilon=1.0, source="t")
    assert noised_by_site.job_refusal(args(dp_epsilon=1.0, dp_delta=1e-6)) is None


def test_missing_dp_sgd_is_named_before_missing_statistics_noise():
    p = SitePolicy(require_dp=True, require_statistics_dp=True, source="t")
    assert p.job_refusal(args()).startswith("the job trains without DP-SGD")


def test_the_dp_sgd_delta_is_judged_at_and_past_max_delta():
    p = SitePolicy(max_delta=1e-4, source="t")
    assert p.job_refusal(args(dp_epsilon=1.0, dp_delta=1e-4)) is None
    assert p.job_refusal(args(dp_epsilon=1.0, dp_delta=5e-5)) is None
    assert p.job_refusal(args(dp_epsilon=1.0, dp_delta=1.0001e-4)) == (
        "the job asks for dp_delta=0.00010001, above this site's max_delta=0.0001 (site policy: t)"
    )
    # a fixed sigma turns DP-SGD on as well
    assert p.job_refusal(args(dp_noise_multiplier=1.0, dp_delta=0.5)) == (
        "the job asks for dp_delta=0.5, above this site's max_delta=0.0001 (site policy: t)"
    )


def test_a_missing_or_nan_delta_of_an_active_mechanism_is_refused():
    p = SitePolicy(source="t")
    assert p.job_refusal(args(dp_epsilon=1.0)) == (
        "the job asks for dp_delta=None, above this site's max_delta=1e-05 (site policy: t)"
    )
    assert p.job_refusal(args(stats_dp_epsilon=1.0)) == (
        "the job asks for stats_dp_delta=None, above this site's max_delta=1e-05 (site policy: t)"
    )
    assert p.job_refusal(args(dp_epsilon=1.0, dp_delta=math.nan)) == (
        "the job asks for dp_delta=nan, above this site's max_delta=1e-05 (site policy: t)"
    )


def test_the_statistics_delta_is_judged_only_when_the_statistics_are_noisy():
    p = SitePolicy(source="t")
    assert p.job_refusal(args(stats_dp_epsilon=1.0, stats_dp_delta=1e-5)) is None
    assert p.job_refusal(args(stats_dp_epsilon=1.0, stats_dp_delta=2e-5)) == (
        "the job asks for stats_dp_delta=2e-05, above this site's max_delta=1e-05 (site policy: t)"
    )
    assert p.job_refusal(args(stats_dp_delta=0.9, dp_delta=0.9)) is None  # neither mechanism is on
    # a large DP-SGD delta is not judged when only the statistics are noisy
    assert p.job_refusal(args(stats_dp_epsilon=1.0, stats_dp_delta=1e-5, dp_delta=0.9)) is None


def test_the_dp_sgd_delta_is_named_before_the_statistics_delta():
    p = SitePolicy(source="t")
    refusal = p.job_refusal(args(dp_epsilon=1.0, dp_delta=0.5, stats_dp_epsilon=1.0, stats_dp_delta=0.6))
    assert refusal == "the job asks for dp_delta=0.5, above this site's max_delta=1e-05 (site policy: t)"


def test_a_pretrained_checkpoint_from_outside_is_refused_naming_read_dirs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = SitePolicy(source="t")
    assert p.job_refusal(args(pretrained=str(tmp_path / "w.pt"))) is None
    assert p.job_refusal(args(pretrained=None)) is None
    assert p.job_refusal(args(pretrained="/elsewhere/w.pt")) == (
        "the job reads the checkpoint pretrained='/elsewhere/w.pt' from outside its own folder and this "
        "site's read_dirs=[] (site policy: t)"
    )
    listed = SitePolicy(read_dirs=("/data/models",), source="t")
    assert listed.job_refusal(args(pretrained="/elsewhere/w.pt")) == (
        "the job reads the checkpoint pretrained='/elsewhere/w.pt' from outside its own folder and this "
        "site's read_dirs=['/data/models'] (site policy: t)"
    )
    assert SitePolicy(read_dirs=None).job_refusal(args(pretrained="/elsewhere/w.pt")) is None


def test_the_planned_epsilon_is_the_sum_of_both_mechanisms_at_and_past_the_cap():
    p = SitePolicy(max_epsilon_per_job=5.0, max_delta=0.1, source="t")
    ok = {"dp_delta": 1e-5, "stats_dp_delta": 1e-5}
    assert p.job_refusal(args(dp_epsilon=4.0, stats_dp_epsilon=1.0, **ok)) is None  # 5 = the cap
    assert p.job_refusal(args(dp_epsilon=4.0, stats_dp_epsilon=1.5, **ok)) == (
        "the job plans to spend epsilon 5.5 (DP-SGD 4.0, statistics 1.5), "
        "more than this site's max_epsilon_per_job=5 (site policy: t)"
    )
    assert p.job_refusal(args(dp_epsilon=5.0, **ok)) is None  # statistics: nothing
    assert p.job_refusal(args(stats_dp_epsilon=5.0, **ok)) is None  # DP-SGD: nothing
    assert p.job_refusal(args(stats_dp_epsilon=5.25, **ok)) == (
        "the job plans to spend epsilon 5.25 (DP-SGD None, statistics 5.25), "
        "more than this site's max_epsilon_per_job=5 (site policy: t)"
    )
    assert p.job_refusal(args(dp_epsilon=6.0, **ok)) == (
        "the job plans to spend epsilon 6 (DP-SGD 6.0, statistics None), "
        "more than this site's max_epsilon_per_job=5 (site policy: t)"
    )
    # a fixed sigma spends an epsilon only the accountant knows: nothing is planned
    assert p.job_refusal(args(dp_noise_multiplier=0.1, **ok)) is None


def test_a_per_job_cap_of_zero_and_no_cap():
    zero = SitePolicy(max_epsilon_per_job=0.0, source="t")
    assert zero.job_refusal(args()) is None
    assert zero.job_refusal(args(dp_epsilon=0.1, dp_delta=1e-5)) is not None
    free = SitePolicy(max_epsilon_per_job=None, source="t")
    assert (
        free.job_refusal(args(dp_epsilon=1e6, dp_delta=1e-5, stats_dp_epsilon=1e6, stats_dp_delta=1e-5))
        is None
    )


# ---------------------------------------------------------------------------------- may_read
def test_any_path_may_be_read_when_read_dirs_is_null():
    p = SitePolicy(read_dirs=None)
    assert p.may_read("/etc/passwd") is True
    assert p.may_read("/etc/passwd", workspace="/nowhere") is True


def test_may_read_inside_and_at_the_workspace_only(tmp_path, monkeypatch):
    ws = tmp_path / "job"
    sibling = tmp_path / "job2"
    ws.mkdir()
    sibling.mkdir()
    monkeypatch.chdir(tmp_path / "job2")  # the working folder is not the workspace given
    p = SitePolicy()
    assert p.may_read(ws / "w.pt", workspace=ws) is True
    assert p.may_read(ws / "a" / "b" / "w.pt", workspace=str(ws)) is True
    assert p.may_read(ws, workspace=ws) is True
    assert p.may_read(sibling / "w.pt", workspace=ws) is False  # a name sharing the prefix is outside
    assert p.may_read(tmp_path, workspace=ws) is False
    assert p.may_read(ws / ".." / "job2" / "w.pt", workspace=ws) is False


def test_may_read_defaults_to_the_working_folder(tmp_path, monkeypatch):
    ws = tmp_path / "job"
    ws.mkdir()
    monkeypatch.chdir(ws)
    p = SitePolicy()
    assert p.may_read("w.pt") is True
    assert p.may_read(str(ws)) is True
    assert p.may_read(tmp_path / "other.pt") is False


def test_may_read_a_folder_of_read_dirs(tmp_path, monkeypatch):
    ws, shared, other = tmp_path / "job", tmp_path / "shared", tmp_path / "other"
    for d in (ws, shared, other):
        d.mkdir()
    monkeypatch.chdir(ws)
    p = SitePolicy(read_dirs=(str(shared),))
    assert p.may_read(shared / "m.pt") is True
    assert p.may_read(shared) is True
    assert p.may_read(ws / "m.pt") is True
    assert p.may_read(other / "m.pt") is False


def test_may_read_follows_links_and_expands_home_and_variables(tmp_path, monkeypatch):
    ws, outside = tmp_path / "job", tmp_path / "outside"
    ws.mkdir()
    outside.mkdir()
    (outside / "m.pt").write_text("x")
    (ws / "link.pt").symlink_to(outside / "m.pt")
    p = SitePolicy()
    assert p.may_read(ws / "link.pt", workspace=ws) is False
    monkeypatch.setenv("HOME", str(ws))
    monkeypatch.setenv("FEDWEIGH_TEST_DIR", str(ws))
    assert p.may_read("~/m.pt", workspace=ws) is True
    assert p.may_read("$FEDWEIGH_TEST_DIR/m.pt", workspace=ws) is True
    monkeypatch.setenv("HOME", str(outside))
    assert p.may_read("~/m.pt", workspace=ws) is False


# ---------------------------------------------------------------------------------- statistics / task
def test_statistics_refusal_names_the_mode_and_what_the_site_accepts():
    assert PROVISIONED_DEFAULT.statistics_refusal("plain") == (
        "the job exchanges label statistics in mode 'plain'; this site accepts only ['secure'] "
        f"(site policy: {PROVISIONED_SOURCE})"
    )
    assert PROVISIONED_DEFAULT.statistics_refusal("secure") is None
    assert PERMISSIVE_DEFAULT.statistics_refusal("plain") is None
    assert PERMISSIVE_DEFAULT.statistics_refusal("secure") is None
    none = SitePolicy(statistics_modes=(), source="t")
    assert none.statistics_refusal("secure") == (
        "the job exchanges label statistics in mode 'secure'; this site accepts only [] (site policy: t)"
    )
    assert none.statistics_refusal(None) == (
        "the job exchanges label statistics in mode None; this site accepts only [] (site policy: t)"
    )


def test_a_task_with_no_plan_passes_the_default():
    assert SitePolicy().task_refusal(None, encrypted=False) is None
    assert SitePolicy().task_refusal({}, encrypted=True) is None


def test_encrypted_updates_required():
    p = SitePolicy(require_encrypted_updates=True, source="t")
    assert p.task_refusal(None, encrypted=False) == (
        "the job sends model updates in clear; this site requires encrypted updates (site policy: t)"
    )
    assert p.task_refusal({"he": True}, encrypted=False) == (
        "the job sends model updates in clear; this site requires encrypted updates (site policy: t)"
    )
    assert p.task_refusal(None, encrypted=True) is None


def test_a_plan_announcing_he_needs_the_layout():
    p = SitePolicy(source="t")
    assert p.task_refusal({"he": True}, encrypted=False) == (
        "the plan announces encrypted updates but the task carries no HE layout (site policy: t)"
    )
    assert p.task_refusal({"he": True}, encrypted=True) is None
    assert p.task_refusal({"he": False}, encrypted=False) is None


def test_the_plans_scalars_must_be_a_list():
    p = SitePolicy(source="t")
    assert p.task_refusal({"scalars": "skew"}, encrypted=False) == (
        "the plan's scalars must be a list, got 'skew' (site policy: t)"
    )
    assert p.task_refusal({"scalars": {"skew": 1}}, encrypted=False) == (
        "the plan's scalars must be a list, got {'skew': 1} (site policy: t)"
    )
    assert p.task_refusal({"scalars": ("skew", "similarity")}, encrypted=False) is None
    assert p.task_refusal({"scalars": list(ALL_SCALARS)}, encrypted=False) is None
    assert p.task_refusal({"scalars": None}, encrypted=False) is None
    assert p.task_refusal({"scalars": ""}, encrypted=False) is None  # nothing asked


def test_scalars_the_site_does_not_report_are_named_in_order():
    p = SitePolicy(report_scalars=("similarity", "imbalance"), source="t")
    assert p.task_refusal({"scalars": ["discrepancy", "similarity", "skew"]}, encrypted=False) == (
        "the job asks for the scalar(s) ['discrepancy', 'skew']; this site reports only "
        "['similarity', 'imbalance'] (site policy: t)"
    )
    assert p.task_refusal({"scalars": ["imbalance"]}, encrypted=False) is None


# ---------------------------------------------------------------------------------- the guard
def guard(ledger: PrivacyLedger | None = None, **policy) -> PrivacyGuard:
    return PrivacyGuard(SitePolicy(source="t", **policy), ledger or PrivacyLedger(), "site-1", "job-1")


def test_the_guard_keeps_its_parts_and_the_budget_id_as_text():
    ledger = PrivacyLedger()
    p = SitePolicy()
    g = PrivacyGuard(p, ledger, "hospital-a", 42)
    assert g.policy is p and g.ledger is ledger and g.site_name == "hospital-a" and g.budget_id == "42"


def test_delta_refusal_bounds_delta_by_max_delta_on_both_sides():
    g = guard(max_delta=1e-4)
    assert g.delta_refusal("dp_sgd", 1e-4, None) is None
    assert g.delta_refusal("dp_sgd", 1e-300, None) is None
    for bad in (None, 0.0, -1e-6, 1.0001e-4, math.nan, math.inf):
        assert g.delta_refusal("dp_sgd", bad, 1000) == (
            f"site-1: dp_sgd asks for delta={bad}; this site allows 0 < delta <= max_delta=0.0001 (site policy: t)"
        )


def test_delta_refusal_requires_delta_below_one_over_n():
    g = guard(max_delta=0.5)
    assert g.delta_refusal("statistics", 0.2, 4) is None  # 0.2 < 0.25
    assert g.delta_refusal("statistics", 0.2, 5) == (
        "site-1: statistics asks for delta=0.2, not below 1/N_k = 1/5 "
        "(a delta that large allows releasing one record outright; site policy: t)"
    )
    assert g.delta_refusal("statistics", 0.25, 4) is not None  # at 1/N
    assert g.delta_refusal("statistics", 0.3, 3) is None  # 0.3 < 1/3
    assert g.delta_refusal("statistics", 0.4, 3) is not None
    # no known record count: only max_delta applies
    assert g.delta_refusal("statistics", 0.4, None) is None
    assert g.delta_refusal("statistics", 0.4, 0) is None
    assert g.delta_refusal("statistics", 0.4, -2) is None


def test_a_delta_refusal_raises_and_reserves_nothing():
    g = guard()
    with pytest.raises(
        PolicyRefusal,
        match=exactly(
            "site-1: dp_sgd asks for delta=0.001; this site allows 0 < delta <= max_delta=1e-05 (site policy: t)"
        ),
    ):
        g.check("dp_sgd", 1.0, delta=1e-3, num_samples=100)
    with pytest.raises(PolicyRefusal, match=r"not below 1/N_k = 1/100000 "):
        g.check("dp_sgd", 1.0, delta=1e-5, num_samples=100_000)
    assert g.ledger.entries == {} and g.ledger.deltas == {}


def test_check_reserves_epsilon_and_delta_under_the_budget():
    g = guard()
    g.check("dp_sgd", 2.0, delta=1e-6, num_samples=100)
    assert g.ledger.entries == {"job-1": {"dp_sgd": 2.0}}
    assert g.ledger.deltas == {"job-1": {"dp_sgd": 1e-6}}
    g.record("dp_sgd", 2.5)
    assert g.ledger.entries == {"job-1": {"dp_sgd": 2.5}}
    assert g.ledger.deltas == {"job-1": {"dp_sgd": 1e-6}}  # no delta given: the reserved one stays
    g.record("statistics", 1.0, 1e-7)
    assert g.ledger.entries == {"job-1": {"dp_sgd": 2.5, "statistics": 1.0}}
    assert g.ledger.deltas == {"job-1": {"dp_sgd": 1e-6, "statistics": 1e-7}}


def test_record_without_delta_records_no_delta():
    g = guard()
    g.record("statistics", 1.0)
    assert g.ledger.entries == {"job-1": {"statistics": 1.0}} and g.ledger.deltas == {}


def test_the_per_job_cap_is_checked_with_a_relative_tolerance_of_1e_9():
    cap = 5.0
    g = guard(max_epsilon_per_job=cap, max_epsilon_total=None)
    g.check("dp_sgd", cap, delta=1e-5, num_samples=1000)
    g.check("dp_sgd", cap * (1 + 5e-10), delta=1e-5, num_samples=1000)
    g.check("dp_sgd", cap * (1 + 1e-9), delta=1e-5, num_samples=1000)  # at the tolerance itself
    for over in (cap * (1 + 3e-9), 5.5, 2 * cap):
        with pytest.raises(PolicyRefusal, match="max_epsilon_per_job"):
            g.check("dp_sgd", over, delta=1e-5, num_samples=1000)


def test_the_per_job_refusal_message():
    ledger = PrivacyLedger()
    ledger.record("job-1", "statistics", 1.0)
    g = guard(ledger, max_epsilon_per_job=5.0)
    with pytest.raises(PolicyRefusal) as e:
        g.check("dp_sgd", 4.12345, delta=1e-5, num_samples=1000)
    assert str(e.value) == (
        "site-1: dp_sgd would take budget 'job-1' to epsilon 5.123, "
        "above this site's max_epsilon_per_job=5 (site policy: t)"
    )
    assert ledger.entries == {"job-1": {"statistics": 1.0}}


def test_the_total_cap_counts_every_budget_and_its_message():
    ledger = PrivacyLedger()
    ledger.record("job-0", "dp_sgd", 2.0)
    ledger.record("job-0", "statistics", 1.0)
    ledger.record("job-1", "statistics", 2.0)
    g = guard(ledger, max_epsilon_per_job=None, max_epsilon_total=8.0)
    g.check("dp_sgd", 3.0, delta=1e-5, num_samples=1000)  # 2 + 1 + 2 + 3 = 8: at the cap
    with pytest.raises(PolicyRefusal) as e:
        g.check("dp_sgd", 3.5, delta=1e-5, num_samples=1000)
    assert str(e.value) == (
        "site-1: dp_sgd would take the site's total epsilon to 8.5, above its max_epsilon_total=8 "
        "(spent so far: 8; site policy: t)"
    )
    assert ledger.entries["job-1"] == {"statistics": 2.0, "dp_sgd": 3.0}


def test_the_total_cap_tolerance_and_spent_so_far_before_any_reservation():
    ledger = PrivacyLedger()
    ledger.record("job-0", "dp_sgd", 2.0)
    g = guard(ledger, max_epsilon_per_job=None, max_epsilon_total=4.0)
    with pytest.raises(PolicyRefusal) as e:
        g.check("statistics", 2.25, delta=1e-5, num_samples=1000)
    assert str(e.value) == (
        "site-1: statistics would take the site's total epsilon to 4.25, above its max_epsilon_total=4 "
        "(spent so far: 2; site policy: t)"
    )
    assert ledger.entries == {"job-0": {"dp_sgd": 2.0}}  # a refusal reserves nothing
    with pytest.raises(PolicyRefusal, match="max_epsilon_total=4"):
        g.check("statistics", 2.0 + 4.0 * 3e-9, delta=1e-5, num_samples=1000)
    g.check("statistics", 4.0 * (1 + 1e-10) - 2.0, delta=1e-5, num_samples=1000)  # within the tolerance


def test_the_per_job_cap_is_named_first_and_no_cap_lets_anything_through():
    g = guard(max_epsilon_per_job=1.0, max_epsilon_total=1.0)
    with pytest.raises(PolicyRefusal, match="max_epsilon_per_job=1 "):
        g.check("dp_sgd", 3.0, delta=1e-5, num_samples=1000)
    free = guard(max_epsilon_per_job=None, max_epsilon_total=None)
    free.check("dp_sgd", 1e9, delta=1e-5, num_samples=1000)
    assert free.ledger.entries == {"job-1": {"dp_sgd": 1e9}}


def test_a_cap_of_zero_allows_only_zero():
    g = guard(max_epsilon_per_job=0.0, max_epsilon_total=0.0)
    g.check("dp_sgd", 0.0, delta=1e-5, num_samples=1000)
    with pytest.raises(PolicyRefusal, match="max_epsilon_per_job=0 "):
        g.check("dp_sgd", 1e-6, delta=1e-5, num_samples=1000)
    total_only = guard(max_epsilon_per_job=None, max_epsilon_total=0.0)
    with pytest.raises(PolicyRefusal, match="max_epsilon_total=0 "):
        total_only.check("dp_sgd", 1e-6, delta=1e-5, num_samples=1000)


# ---------------------------------------------------------------------------------- ledger_path
def test_ledger_path_in_the_working_folder_by_default_and_with_a_safe_name(tmp_path):
    assert ledger_path("site-1") == Path(".") / "fedweigh_privacy_ledger_site-1.json"
    assert ledger_path("site-1", tmp_path) == tmp_path / "fedweigh_privacy_ledger_site-1.json"
    assert ledger_path("../a b", str(tmp_path)) == tmp_path / "fedweigh_privacy_ledger_.._a_b.json"


# ---------------------------------------------------------------------------------- finding the file
def _write_policy(folder: Path, content: str = "{}") -> Path:
    (folder / "local").mkdir(parents=True, exist_ok=True)
    path = folder / "local" / "fedweigh_policy.json"
    path.write_text(content)
    os.chmod(path, 0o600)
    return path


def test_the_environment_variable_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "anywhere.json"
    path.write_text("{}")
    monkeypatch.setenv(SITE_POLICY_ENV, str(path))
    _write_policy(tmp_path)  # the variable wins over the site's local/ file
    assert find_policy_file(tmp_path) == path


@pytest.mark.parametrize("target", ["missing.json", "a_folder"])
def test_an_environment_variable_naming_no_file_is_refused(tmp_path, monkeypatch, target):
    (tmp_path / "a_folder").mkdir()
    env = str(tmp_path / target)
    monkeypatch.setenv(SITE_POLICY_ENV, env)
    with pytest.raises(
        FileNotFoundError, match=exactly(f"FEDWEIGH_SITE_POLICY={env} does not name an existing file")
    ):
        find_policy_file(tmp_path)


def test_an_empty_environment_variable_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv(SITE_POLICY_ENV, "")
    path = _write_policy(tmp_path)
    assert find_policy_file(tmp_path) == path


def test_the_site_root_file_is_found_from_below_and_wins_over_the_start(tmp_path, monkeypatch):
    monkeypatch.delenv(SITE_POLICY_ENV, raising=False)
    root = tmp_path / "site"
    (root / "startup").mkdir(parents=True)
    below = root / "job-1" / "app_site"
    below.mkdir(parents=True)
    assert find_policy_file(below) is None
    at_root = _write_policy(root)
    assert find_policy_file(below) == at_root
    _write_policy(below)
    assert find_policy_file(below) == at_root


def test_the_start_folder_is_searched_without_a_site_root(tmp_path, monkeypatch):
    monkeypatch.delenv(SITE_POLICY_ENV, raising=False)
    assert find_policy_file(tmp_path) is None
    path = _write_policy(tmp_path)
    assert find_policy_file(tmp_path) == path
    assert find_policy_file(str(tmp_path)) == path
    monkeypatch.chdir(tmp_path)
    assert find_policy_file() == Path.cwd() / "local" / "fedweigh_policy.json"


def test_a_folder_named_like_the_policy_file_is_not_a_policy(tmp_path, monkeypatch):
    monkeypatch.delenv(SITE_POLICY_ENV, raising=False)
    (tmp_path / "local" / "fedweigh_policy.json").mkdir(parents=True)
    assert find_policy_file(tmp_path) is None


# ---------------------------------------------------------------------------------- loading the policy
def test_no_file_and_no_startup_kit_is_the_permissive_default(tmp_path, monkeypatch):
    monkeypatch.delenv(SITE_POLICY_ENV, raising=False)
    assert load_site_policy(tmp_path) is PERMISSIVE_DEFAULT
    monkeypatch.chdir(tmp_path)
    assert load_site_policy() is PERMISSIVE_DEFAULT


def test_an_empty_startup_folder_is_the_permissive_default(tmp_path, monkeypatch):
    monkeypatch.delenv(SITE_POLICY_ENV, raising=False)
    (tmp_path / "startup").mkdir()
    assert load_site_policy(tmp_path) is PERMISSIVE_DEFAULT


@pytest.mark.parametrize("marker", ["rootCA.pem", "fed_server.json", "fed_client.json"])
def test_a_provisioned_kit_without_a_file_is_the_provisioned_default(tmp_path, monkeypatch, marker):
    monkeypatch.delenv(SITE_POLICY_ENV, raising=False)
    (tmp_path / "startup").mkdir()
    (tmp_path / "startup" / marker).write_text("x")
    assert load_site_policy(tmp_path) is PROVISIONED_DEFAULT
    monkeypatch.chdir(tmp_path)
    assert load_site_policy() is PROVISIONED_DEFAULT


def test_a_file_found_is_read_over_the_strict_defaults_even_in_a_simulation(tmp_path, monkeypatch):
    monkeypatch.delenv(SITE_POLICY_ENV, raising=False)
    path = _write_policy(tmp_path, '{"min_secure_sum": 2}')
    p = load_site_policy(tmp_path)
    assert p == replace_source(SitePolicy(min_secure_sum=2), str(path))


def test_the_one_over_n_rule_binds_at_a_single_record_whatever_max_delta():
    # a policy built in code is not held to max_delta < 1: the 1/N_k rule alone refuses delta = 1 at N_k = 1
    guard = PrivacyGuard(SitePolicy(max_delta=1.0), PrivacyLedger(), "site-1", "job-1")
    assert guard.delta_refusal("DP-SGD", 0.5, 1) is None
    reason = guard.delta_refusal("DP-SGD", 1.0, 1)
    assert reason is not None and "not below 1/N_k = 1/1" in reason
    assert "not below 1/N_k = 1/2" in guard.delta_refusal("DP-SGD", 0.5, 2)
    assert guard.delta_refusal("DP-SGD", 0.5, 0) is None  # no record count: no 1/N_k rule
