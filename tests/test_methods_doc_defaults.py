"""Every "(default ...)" docs/methods.md states for an option equals the code's default."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from fedweigh.losses import LOSS_CLASSES
from fedweigh.weighting import get_scheme

DOC = Path(__file__).resolve().parents[1] / "docs" / "methods.md"

#: section heading (its start) -> the scheme the section documents (losses: by their `(`name`)`)
SECTIONS = {
    "# Methods": "feddraw",  # the shared options (geometry, integer_buffers) of every scheme
    "## FedDRAW": "feddraw",
    "### Defaults: the sensitivity study": "feddraw",
    "## FedBB": "cbr",
    "### FedBB as the paper runs it": None,
    "### Ablations": None,
    "## DAFL": "dafl",
    "## FedAvg": "fedavg",
    "## FedProx": "fedprox",
    "## FedNova": "fednova",
    "## FedAdp": "fedadp",
    "## IDA": "ida",
    "## FedDisco": "feddisco",
    "## FedAWA": "fedawa",
}

_INLINE = re.compile(r"\b(\w+)=(\"[^\"]*\"|None|-?\d+(?:\.\d+)?(?:e-?\d+)?)\s+\(default")
_NAMED = re.compile(r"`(\w+)`\s+\(default\s+\**(-?\d+(?:\.\d+)?|None)\**[);,]")
_BARE = re.compile(r"\b(\w+)\s+\(default\s+\*\*(-?\d+(?:\.\d+)?)\*\*\)")
_OPTION = re.compile(r"\(`(\w+)=`\)|option `(\w+)`|`(\w+)=`")
_CHOICE = re.compile(r"`\"(\w+)\"`\s+\(default")


def _value(text: str):
    if text == "None":
        return None
    if text.startswith('"'):
        return text.strip('"')
    return float(text)


def _sections() -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    in_code = False
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if line.startswith("#") and not in_code:
            out.append((line, []))
        elif out:
            out[-1][1].append(line)
    return out


def _target(heading: str):
    loss = re.search(r"\(`(\w+)`(?:, `\w+`)*\)", heading)
    if heading.startswith("###") and loss and loss.group(1) in LOSS_CLASSES:
        return LOSS_CLASSES[loss.group(1)]
    for start, scheme in SECTIONS.items():
        if heading == start or heading.startswith(start + " ") or heading.startswith(start + ":"):
            return get_scheme(scheme) if scheme else None
    return None


def _default(target, name: str):
    if inspect.isclass(target):
        param = inspect.signature(target).parameters.get(name)
        assert param is not None, f"{target.__name__} has no option {name!r}"
        return param.default
    assert hasattr(target, name), f"{type(target).__name__} has no option {name!r}"
    return getattr(type(target)(), name)


def documented_defaults() -> list[tuple[str, str, object, object]]:
    """(section, option, the doc's default, the target) for every stated default in a mapped section."""
    found = []
    for heading, lines in _sections():
        target = _target(heading)
        if target is None:
            continue
        option = None
        for line in lines:
            if not line.lstrip().startswith("- "):  # a list's options are named in the line before it
                for m in _OPTION.finditer(line):
                    option = next(g for g in m.groups() if g)
            for m in _INLINE.finditer(line):
                found.append((heading, m.group(1), _value(m.group(2)), target))
            for m in [*_NAMED.finditer(line), *_BARE.finditer(line)]:
                found.append((heading, m.group(1), _value(m.group(2)), target))
            for m in _CHOICE.finditer(line):
                if option is not None and not _INLINE.search(line):
                    found.append((heading, option, m.group(1), target))
    return found


def test_the_doc_states_defaults_for_feddraws_formula_block():
    names = {(h.split()[1], n) for h, n, _, _ in documented_defaults()}
    assert {("FedDRAW", "similarity"), ("FedDRAW", "spread"), ("FedDRAW", "prior_factor")} <= names


@pytest.mark.parametrize(
    "heading, name, documented, target", documented_defaults(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_each_documented_default_is_the_codes(heading, name, documented, target):
    actual = _default(target, name)
    if isinstance(documented, float) and isinstance(actual, int | float):
        assert actual == pytest.approx(documented), (heading, name)
    else:
        assert actual == documented, f"{heading}: {name} documented default {documented!r}, code {actual!r}"
