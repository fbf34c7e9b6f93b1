"""Add the fedweigh entries of provisioning/resources.json to a site's class allow-list.

    python3 allow_fedweigh.py <kit folder> [<kit folder> ...]

NVFlare 2.9 reads a site's ``local/resources.json`` in place of ``local/resources.json.default``
(the files are not merged), and a ``class_allow_list`` found there replaces the built-in list.
This script therefore starts from the site's ``resources.json`` if it has one, else from the
``resources.json.default`` provisioning wrote, appends the entries of ``resources.json`` next to
this script that are missing, removes the package prefix ``fedweigh.`` that earlier versions added
(it admitted every function of the package, not only its components), and writes
``local/resources.json``. In a site's kit (``startup/fed_client.json``) it also adds the
``site_components`` of ``resources.json`` to the ``components`` there: fedweigh's
``JobPolicyAuthorizer``, which judges every job against the site's policy in the site's parent process
before the job launches (as the site's ``app_deployer``). Running it twice changes nothing. Standard
library only: it runs at a server or site without fedweigh installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FRAGMENT = Path(__file__).resolve().with_name("resources.json")
KEY = "class_allow_list"
SITE_KEY = "site_components"
#: Entries earlier versions added and that must not stay: they admit more than fedweigh's components.
RETIRED = ("fedweigh.",)


def allow_list_entries(fragment: Path = FRAGMENT) -> list[str]:
    """The class paths the fragment adds (exact component classes)."""
    entries = json.loads(fragment.read_text()).get(KEY)
    if not isinstance(entries, list) or not all(isinstance(e, str) and "." in e for e in entries):
        raise ValueError(
            f"{fragment}: {KEY!r} must be a list of dotted class paths or prefixes ending in '.'"
        )
    return entries


def site_components(fragment: Path = FRAGMENT) -> list[dict]:
    """The components the fragment adds to a site's ``local/resources.json`` (id, path, args)."""
    entries = json.loads(fragment.read_text()).get(SITE_KEY, [])
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("id"), str) and isinstance(e.get("path"), str)
        for e in entries
    ):
        raise ValueError(f"{fragment}: {SITE_KEY!r} must be a list of components with an 'id' and a 'path'")
    return entries


def add_site_components(kit: Path, resources: dict, components: list[dict]) -> list[str]:
    """Add ``components`` to a site kit's ``resources`` (in place); returns the ids added.

    A component whose id the site already uses for another class is an error: the site chose its own
    and must decide (the ``app_deployer`` id is the one NVFlare deploys jobs with).
    """
    if not (kit / "startup" / "fed_client.json").is_file():
        return []
    present = resources.setdefault("components", [])
    if not isinstance(present, list):
        raise ValueError(f"{kit / 'local'}: 'components' of resources.json must be a list")
    added = []
    for component in components:
        same_id = [c for c in present if isinstance(c, dict) and c.get("id") == component["id"]]
        if same_id and same_id[0].get("path") != component["path"]:
            raise ValueError(
                f"{kit / 'local' / 'resources.json'}: the component id {component['id']!r} is already "
                f"{same_id[0].get('path')!r}; fedweigh needs it for {component['path']!r}"
            )
        if not same_id:
            present.append(json.loads(json.dumps(component)))
            added.append(component["id"])
    return added


def allow(kit: Path, entries: list[str], components: list[dict] | None = None) -> list[str]:
    """Write ``kit/local/resources.json`` with ``entries`` in its allow-list and, in a site's kit,
    ``components`` (default: the fragment's ``site_components``); returns what was added."""
    local = kit / "local"
    current, default = local / "resources.json", local / "resources.json.default"
    source = current if current.is_file() else default
    if not source.is_file():
        raise FileNotFoundError(
            f"{kit} is not a server or site startup kit: neither {current} nor {default} exists"
        )
    resources = json.loads(source.read_text())
    allow_list = resources.get(KEY)
    if not isinstance(allow_list, list):
        raise ValueError(
            f"{source} has no {KEY!r} list; copy the {KEY!r} of a freshly provisioned "
            "resources.json.default into it first"
        )
    removed = [e for e in allow_list if e in RETIRED]
    for entry in removed:
        allow_list.remove(entry)
        print(f"{current}: removed the package prefix {entry!r} (it admits every function of the package)")
    added = [e for e in entries if e not in allow_list]
    allow_list.extend(added)
    added += add_site_components(kit, resources, site_components() if components is None else components)
    current.write_text(json.dumps(resources, indent=2) + "\n")
    return added


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    entries = allow_list_entries()
    for kit in map(Path, argv):
        added = allow(kit, entries)
        print(f"{kit / 'local' / 'resources.json'}: added {added}" if added else f"{kit}: already allowed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
