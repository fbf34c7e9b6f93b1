"""The site's trusted files (policy, privacy ledger, DP-SGD accountant) are read only if the site's user
alone can change them, links followed, as ssh's StrictModes judges its files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fedweigh.secure.accountant import AccountantState, load_accountant_state, save_accountant_state
from fedweigh.secure.dp_config import DPConfig
from fedweigh.secure.file_checks import check_private_file
from fedweigh.site.ledger import PrivacyLedger
from fedweigh.site.policy import SitePolicy

OTHER_UID = 12345


def private_folder(parent: Path, name: str = "local") -> Path:
    folder = parent / name
    folder.mkdir()
    os.chmod(folder, 0o700)
    return folder


def write(path: Path, text: str = "{}", mode: int = 0o600) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


def give_to_another_user(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``path`` owned by neither this site's user nor root (as root: chown it; else pretend to be
    another user, so that the file's owner is not the site's)."""
    if os.geteuid() == 0:
        os.chown(path, OTHER_UID, -1)
    else:  # pragma: no cover - the suite runs as root in CI
        uid = os.geteuid() + 1
        monkeypatch.setattr(os, "geteuid", lambda: uid)


def test_a_private_file_in_a_private_folder_is_accepted(tmp_path):
    path = write(private_folder(tmp_path) / "p.json", mode=0o644)
    assert check_private_file(path, "site policy") == path.resolve()
    link = private_folder(tmp_path, "links") / "p.json"
    link.symlink_to(path)
    assert check_private_file(link, "site policy") == path.resolve()  # the target is judged


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="site policy .*none.json does not exist"):
        check_private_file(tmp_path / "none.json", "site policy")


def test_a_world_writable_file_is_refused_with_its_mode_and_the_fix(tmp_path):
    path = write(private_folder(tmp_path) / "p.json", mode=0o666)
    with pytest.raises(PermissionError) as e:
        check_private_file(path, "privacy ledger", "anyone could erase it")
    assert str(e.value) == (
        f"privacy ledger {path} is writable by every user of this machine (mode -rw-rw-rw-): anyone could "
        f"erase it. Make it writable by its owner only: chmod o-w,g-w {path}"
    )


def test_a_group_writable_file_is_refused(tmp_path):
    path = write(private_folder(tmp_path) / "p.json", mode=0o664)
    with pytest.raises(PermissionError) as e:
        check_private_file(path, "site policy")
    assert str(e.value) == (
        f"site policy {path} is writable by its group (mode -rw-rw-r--): any member of the group could change "
        f"it. Make it writable by its owner only: chmod g-w {path}"
    )


def test_a_link_to_a_file_of_another_user_is_refused_naming_the_target(tmp_path, monkeypatch):
    target = write(private_folder(tmp_path, "elsewhere") / "theirs.json", mode=0o644)
    link = private_folder(tmp_path) / "fedweigh_policy.json"
    link.symlink_to(target)
    give_to_another_user(target, monkeypatch)
    with pytest.raises(PermissionError) as e:
        check_private_file(link, "site policy")
    message = str(e.value)
    assert message.startswith(f"site policy {link} (a link to {target.resolve()}) is owned by uid ")
    assert f"chown {os.geteuid()} {target.resolve()}" in message


def test_a_file_that_is_not_a_regular_file_is_refused(tmp_path):
    folder = private_folder(private_folder(tmp_path), "p.json")
    with pytest.raises(PermissionError, match=r"p\.json is not a regular file \(mode d"):
        check_private_file(folder, "site policy")


@pytest.mark.parametrize(
    ("mode", "shown"), [(0o777, "drwxrwxrwx"), (0o770, "drwxrwx---"), (0o1777, "drwxrwxrwt")]
)
def test_a_folder_others_can_write_is_refused(tmp_path, mode, shown):
    folder = private_folder(tmp_path)
    path = write(folder / "p.json")
    os.chmod(folder, mode)
    with pytest.raises(PermissionError) as e:
        check_private_file(path, "site policy")
    message = str(e.value)
    assert message.startswith(
        f"site policy {path}: its folder {folder} is writable by other users (mode {shown})"
    )
    assert message.endswith(f"Make the folder writable by its owner only: chmod go-w {folder}")
    assert ("sticky bit" in message) == bool(mode & 0o1000)


def test_a_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    folder = private_folder(tmp_path)
    path = write(folder / "p.json")
    if os.geteuid() != 0:  # pragma: no cover - the suite runs as root in CI
        pytest.skip("only root can give a folder away while keeping its file")
    os.chown(folder, OTHER_UID, -1)
    with pytest.raises(PermissionError, match=f"its folder {folder} is owned by uid {OTHER_UID}"):
        check_private_file(path, "site policy")


def test_a_link_kept_in_a_folder_others_can_write_is_refused(tmp_path):
    """Whoever can write the link's folder can point the link elsewhere, however private its target."""
    target = write(private_folder(tmp_path, "private") / "p.json")
    shared = private_folder(tmp_path)
    os.chmod(shared, 0o777)
    link = shared / "fedweigh_policy.json"
    link.symlink_to(target)
    with pytest.raises(PermissionError, match=f"its folder {shared} is writable by other users"):
        check_private_file(link, "site policy")


# ---------------------------------------------------------------------------------- where it is applied
def test_the_site_policy_is_held_to_the_check(tmp_path, monkeypatch):
    local = private_folder(tmp_path)
    path = write(local / "fedweigh_policy.json", json.dumps({"require_dp": True}), mode=0o644)
    assert SitePolicy.from_file(path).require_dp
    os.chmod(path, 0o664)
    with pytest.raises(PermissionError, match="writable by its group.*chmod g-w"):
        SitePolicy.from_file(path)
    os.chmod(path, 0o644)
    os.chmod(local, 0o777)
    with pytest.raises(PermissionError, match=f"its folder {local} is writable by other users"):
        SitePolicy.from_file(path)
    os.chmod(local, 0o700)
    give_to_another_user(path, monkeypatch)
    with pytest.raises(PermissionError, match="is owned by uid"):
        SitePolicy.from_file(path)


def test_the_ledger_writes_its_file_private_and_refuses_one_others_can_write(tmp_path):
    folder = private_folder(tmp_path, "site")
    path = folder / "ledger.json"
    ledger = PrivacyLedger(path)
    ledger.record("job-1", "dp_sgd", 1.0)
    assert path.stat().st_mode & 0o777 == 0o600
    assert PrivacyLedger(path).spent() == 1.0
    os.chmod(path, 0o620)
    with pytest.raises(PermissionError, match=r"privacy ledger .*ledger\.json is writable by its group"):
        PrivacyLedger(path)
    with pytest.raises(PermissionError, match="writable by its group"):  # every transaction re-checks
        ledger.record("job-1", "dp_sgd", 2.0)
    os.chmod(path, 0o600)
    os.chmod(folder, 0o777)
    with pytest.raises(PermissionError, match=f"its folder {folder} is writable by other users"):
        ledger.spent()


def test_the_dp_sgd_accountant_file_is_held_to_the_check(tmp_path):
    config = DPConfig(noise_multiplier=1.0)
    path = private_folder(tmp_path, "site") / "account.json"
    save_accountant_state(path, config, "site-a", AccountantState(history=[(1.0, 0.1, 3)]))
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_accountant_state(path, config, "site-a").history == [(1.0, 0.1, 3)]
    os.chmod(path, 0o646)
    with pytest.raises(
        PermissionError,
        match=r"site-a: DP-SGD accountant .*account\.json is writable by every user of this machine "
        r"\(mode -rw-r--rw-\): anyone could erase the steps it counts\. Make it",
    ):
        load_accountant_state(path, config, "site-a")


def test_a_kept_statistics_release_is_held_to_the_check(tmp_path):
    """The release a site reuses in a later task or process must be its own: a file others could write
    is refused before it is read, naming the file and what a writer could do."""
    import numpy as np

    from fedweigh.secure.dp_config import StatsDPConfig
    from fedweigh.secure.stats_release import HistogramReleaser

    folder = private_folder(tmp_path, "site")
    releaser = HistogramReleaser(StatsDPConfig(epsilon=1.0), "site-a", "job-1", folder=folder)
    first = releaser.release(np.array([30, 40]), 100, "multilabel")
    assert releaser.path.stat().st_mode & 0o022 == 0
    again = HistogramReleaser(StatsDPConfig(epsilon=1.0), "site-a", "job-1", folder=folder)
    assert again.release(np.array([30, 40]), 100, "multilabel").class_counts.tolist() == (
        first.class_counts.tolist()
    )
    os.chmod(releaser.path, 0o646)
    later = HistogramReleaser(StatsDPConfig(epsilon=1.0), "site-a", "job-1", folder=folder)
    with pytest.raises(
        PermissionError,
        match=r"^site-a: statistics release .*fedweigh_stats_dp_job-1_site-a\.json is writable by every user "
        r"of this machine \(mode -rw-r--rw-\): anyone could replace what this site revealed\. Make it",
    ):
        later.release(np.array([30, 40]), 100, "multilabel")
