"""An uncaught exception's traceback ends at the program's call into spmd
(spmd.runtime.tracebacks): the frames inside spmd below it are left out, one line says
so, and nothing else is: not the program's frames, not other libraries', not spmd's own
when the program is spmd's, not the message.  SPMD_TRACEBACK=full shows every frame."""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import traceback

import pytest

from spmd.core.settings import read
from spmd.runtime import tracebacks
from spmd.runtime.tracebacks import LEFT_OUT, format_uncaught

SPMD = os.path.dirname(os.path.dirname(os.path.abspath(tracebacks.__file__)))
FAKE_SPMD = os.path.join(SPMD, "core", "_traceback_test_frames.py")   # never written


def _code_at(filename: str, source: str) -> dict:
    """Run ``source`` as if it were the file ``filename`` (its frames name that file)."""
    namespace: dict = {}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


# Functions whose frames lie "inside spmd": a check that raises, and one that calls back.
_spmd = _code_at(FAKE_SPMD, """
def check(x):
    return validate(x)

def validate(x):
    raise TypeError(f"all_reduce: tensor must be a numpy array, got {type(x).__name__}")

def call_back(fn):
    return fn()

def wrap(x):
    try:
        check(x)
    except TypeError as err:
        raise RuntimeError("spmd: the call failed") from err
""")


def _uncaught(fn, *args) -> str:
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001 - what the hook would get
        return format_uncaught(*sys.exc_info())
    raise AssertionError("did not raise")


def _frames(text: str) -> list[tuple[str, int]]:
    return [(f, int(n)) for f, n in re.findall(r'^  File "([^"]+)", line (\d+), in ', text, re.M)]


def _last_frame_before(text: str, message: str) -> tuple[str, int]:
    return _frames(text[:text.index(message)])[-1]


@pytest.fixture(autouse=True)
def _short(monkeypatch):
    monkeypatch.delenv("SPMD_TRACEBACK", raising=False)


def test_the_program_s_call_is_the_last_frame():
    def program():
        _spmd["check"]([1.0])   # the call into spmd

    text = _uncaught(program)
    call = program.__code__.co_firstlineno + 1
    assert _last_frame_before(text, "TypeError: all_reduce:") == (__file__, call), text
    assert FAKE_SPMD not in text
    assert LEFT_OUT in text and text.index(LEFT_OUT) < text.index("TypeError: all_reduce")
    assert text.rstrip().endswith("TypeError: all_reduce: tensor must be a numpy array, got list")


def test_full_shows_spmd_s_frames(monkeypatch):
    monkeypatch.setenv("SPMD_TRACEBACK", "full")
    text = _uncaught(lambda: _spmd["check"]([1.0]))
    assert [f for f, _ in _frames(text)].count(FAKE_SPMD) == 2, text
    assert LEFT_OUT not in text
    plain = "".join(traceback.format_exception(*_exc_info(lambda: _spmd["check"]([1.0]))))
    assert [f for f in _frames(text) if f[0] == FAKE_SPMD] == \
        [f for f in _frames(plain) if f[0] == FAKE_SPMD]


def _exc_info(fn):
    try:
        fn()
    except BaseException:  # noqa: BLE001
        return sys.exc_info()
    raise AssertionError("did not raise")


def test_a_bad_setting_shows_every_frame_and_says_why(monkeypatch):
    monkeypatch.setenv("SPMD_TRACEBACK", "some")
    text = _uncaught(lambda: _spmd["check"]([1.0]))
    assert FAKE_SPMD in text and LEFT_OUT not in text
    assert "spmd: SPMD_TRACEBACK='some' is not a valid setting: expected one of short, full" \
        in text
    with pytest.raises(ValueError, match="SPMD_TRACEBACK"):
        read("SPMD_TRACEBACK")


def test_program_code_spmd_calls_back_is_kept():
    """The program's function that spmd called raised: its frame, and spmd's between the
    program's, all stay."""
    def callback():
        raise ValueError("the program's own error")

    text = _uncaught(lambda: _spmd["call_back"](callback))
    files = [f for f, _ in _frames(text)]
    assert files == [__file__, __file__, FAKE_SPMD, __file__], text
    assert LEFT_OUT not in text
    assert _last_frame_before(text, "ValueError: the program's own error") == \
        (__file__, callback.__code__.co_firstlineno + 1)


def test_another_library_s_frames_are_kept():
    """spmd called a library that raised: nothing after the program's frames is spmd's
    alone, so every frame stays (json's frames included)."""
    import json

    text = _uncaught(lambda: _spmd["call_back"](lambda: json.loads("{")))
    assert json.decoder.__file__ in [f for f, _ in _frames(text)], text
    assert FAKE_SPMD in text and LEFT_OUT not in text


def test_a_cause_raised_and_caught_inside_spmd_loses_its_frames():
    def program():
        _spmd["wrap"]([1.0])

    text = _uncaught(program)
    assert "TypeError: all_reduce:" in text and "RuntimeError: spmd: the call failed" in text
    assert "The above exception was the direct cause of the following exception" in text
    assert FAKE_SPMD not in text, text
    assert text.count(LEFT_OUT) == 2   # the cause's frames, and the wrapper's
    assert _last_frame_before(text, "RuntimeError:") == \
        (__file__, program.__code__.co_firstlineno + 1)


def test_spmd_s_own_program_is_shown_whole():
    """Called into spmd from a launcher (a console script, runpy) or with no frame outside
    spmd at all: spmd's own error, every frame shown."""
    script = os.path.join(sysconfig.get_path("scripts"), "spmd")   # never written
    launcher = _code_at(script, "def main(check):\n    return check([1.0])\n")
    text = _uncaught(launcher["main"], _spmd["check"])
    assert [f for f, _ in _frames(text)][-3:] == [script, FAKE_SPMD, FAKE_SPMD], text
    assert LEFT_OUT not in text

    inside = _code_at(FAKE_SPMD, """
import sys
def caught(check, show):
    try:
        check([1.0])
    except TypeError:
        return show(*sys.exc_info())
""")
    text = inside["caught"](_spmd["check"], format_uncaught)   # a traceback of spmd's frames only
    assert [f for f, _ in _frames(text)] == [FAKE_SPMD] * 3, text
    assert LEFT_OUT not in text
