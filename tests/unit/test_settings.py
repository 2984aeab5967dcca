"""Every SPMD_* variable is declared once (spmd.core.settings.SETTINGS) and read through
it: one parser for every module, errors that name the variable, and a table for the docs."""

from __future__ import annotations

import pathlib
import re

import pytest

from spmd.core import settings

SPMD = pathlib.Path(settings.__file__).resolve().parents[1]


def _sources():
    return [p for p in SPMD.rglob("*.py") if p.name != "settings.py"]


def test_every_variable_named_in_the_package_is_declared():
    named = set()
    for path in _sources():
        named |= set(re.findall(r"\bSPMD_[A-Z][A-Z0-9_]*\b", path.read_text()))
    assert named, "no SPMD_ variable found: the check would pass vacuously"
    assert named <= set(settings.SETTINGS), sorted(named - set(settings.SETTINGS))


def test_no_module_reads_a_variable_itself():
    """os.environ reads of SPMD_* variables happen in settings.read only (spawn's child
    takes its two hand-over variables out of the environment: popped, not read)."""
    found = []
    for path in _sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"environ(\.get)?[\[(]\s*\"SPMD_", line) or \
                    re.search(r"getenv\(\s*\"SPMD_", line):
                found.append(f"{path.relative_to(SPMD.parent)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_a_delay_is_meaningful_at_zero():
    """The device double with no simulated kernel time is a useful one: 0 is accepted."""
    assert settings.read("SPMD_DEVICE_DOUBLE_LAG", {"SPMD_DEVICE_DOUBLE_LAG": "0"}) == 0.0
    assert settings.read("SPMD_DEVICE_DOUBLE_LAG", {"SPMD_DEVICE_DOUBLE_LAG": "0.5"}) == 0.5


@pytest.mark.parametrize("text,value", [("1", True), ("yes", True), (" On ", True),
                                        ("true", True), ("0", False), ("off", False),
                                        ("No", False), ("", True)])
def test_booleans_parse_one_way(text, value):
    assert settings.read("SPMD_WATCHDOG", {"SPMD_WATCHDOG": text}) is value


@pytest.mark.parametrize("name,text,expected", [
    ("SPMD_WATCHDOG", "maybe", "expected 1 (on) or 0 (off)"),
    ("SPMD_TIMEOUT", "soon", "expected a number of seconds"),
    ("SPMD_TIMEOUT", "-3", "expected a positive number of seconds"),
    ("SPMD_TIMEOUT", "0", "expected a positive number of seconds"),
    ("SPMD_DEVICE_DOUBLE_LAG", "-0.1", "expected 0 or more seconds"),
    ("SPMD_DEVICE_DOUBLE_LAG", "nan", "expected 0 or more seconds"),
    ("SPMD_FUSION_BYTES", "0", "expected a positive integer"),
    ("SPMD_FLIGHT_RECORDER_SIZE", "-1", "expected 0 or more"),
    ("SPMD_DEVICE_TIMEOUT", "ignore", "expected one of abort, raise"),
])
def test_a_bad_value_names_the_variable(name, text, expected):
    with pytest.raises(ValueError, match=re.escape(f"{name}={text!r} is not a valid setting: "
                                                   f"{expected}")):
        settings.read(name, {name: text})


def test_defaults_and_typed_values():
    assert settings.read("SPMD_TIMEOUT", {}) is None
    assert settings.read("SPMD_TIMEOUT", {"SPMD_TIMEOUT": "7.5"}) == 7.5
    assert settings.read("SPMD_DEBUG", {"SPMD_DEBUG": "detail"}) == "DETAIL"
    assert settings.read("SPMD_FUSION_BYTES", {}) == 128 * 1024 * 1024
    with pytest.raises(KeyError):
        settings.read("SPMD_NOT_A_SETTING", {})


def test_the_table_lists_every_setting_once():
    rows = settings.table().splitlines()[2:]
    assert [r.split("`")[1] for r in rows] == list(settings.SETTINGS)
    assert all(s.doc for s in settings.SETTINGS.values())


@pytest.mark.parametrize("mode, oversubscribed, yields, naps_later", [
    ("auto", False, False, True), ("auto", True, True, True), ("spin", True, False, False),
    ("yield", False, True, True), ("yield", True, True, True)])
def test_spmd_wait_says_whether_waits_give_the_core_away(monkeypatch, mode, oversubscribed,
                                                         yields, naps_later):
    """SPMD_WAIT=auto naps from the start only on an oversubscribed node, and on any node
    once a wait has lasted NAP_AFTER_SECONDS; spin never naps, yield always (cores shared
    with other jobs); the node's oversubscription stays a fact of its own."""
    from spmd.core import wait

    monkeypatch.setenv("SPMD_WAIT", mode)
    monkeypatch.setattr(wait, "oversubscribed", wait.oversubscribed)
    monkeypatch.setattr(wait, "yields", wait.yields)
    monkeypatch.setattr(wait, "nap_after", wait.nap_after)
    wait.set_oversubscribed(oversubscribed)
    assert (wait.oversubscribed, wait.yields) == (oversubscribed, yields)
    assert wait.nap_after == (wait.NAP_AFTER_SECONDS if naps_later else -1.0)
