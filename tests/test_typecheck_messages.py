"""Constructing a wire message is type-checked.

``wire_message`` and ``wire_struct`` carry ``typing.dataclass_transform``, so a
type checker knows the fields they make: a misspelt field, a value of the
wrong type, a missing required field or an assignment to a frozen message is
an error before the code runs. This test runs mypy on a small snippet and
checks that it reports exactly the lines marked ``# E: <code>`` (and so also
that the correct constructions pass).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api", reason="mypy is in the lint extra")

SNIPPET = textwrap.dedent(
    """
    from pcp_p2p.wire import Message, wire_message, wire_struct


    @wire_struct
    class Point(Message):
        x: float
        y: float


    @wire_message("typecheck.sample")
    class Sample(Message):
        run_id: str
        term: int
        where: Point
        signature: bytes = b""


    ok = Sample(run_id="r", term=3, where=Point(1.0, 2.0))
    ok_positional = Sample("r", 3, Point(x=0.5, y=1), b"sig")
    term: int = ok.term
    bad_name = Sample(run_id="r", trem=3, where=Point(1.0, 2.0))  # E: call-arg
    bad_type = Sample(run_id="r", term="three", where=Point(1.0, 2.0))  # E: arg-type
    bad_nested = Sample(run_id="r", term=3, where=Point("1", 2.0))  # E: arg-type
    missing = Sample(run_id="r", where=Point(1.0, 2.0))  # E: call-arg
    too_many = Point(1.0, 2.0, 3.0)  # E: call-arg
    wrong_attr: str = ok.term  # E: assignment
    ok.term = 4  # E: misc
    """
)

REAL_MESSAGE = textwrap.dedent(
    """
    from pcp_p2p.diloco.protocol.election import Heartbeat

    ok = Heartbeat(run_id="r", term=1, holder="peer", sent_at=1.0)
    bad_name = Heartbeat(run_id="r", term=1, holder="peer", sent=1.0)  # E: call-arg
    bad_type = Heartbeat(run_id="r", term=1.5, holder="peer", sent_at=1.0)  # E: arg-type
    """
)

ROOT = Path(__file__).resolve().parent.parent


def _mypy_errors(tmp_path: Path, source: str) -> set[tuple[int, str]]:
    path = tmp_path / "snippet.py"
    path.write_text(source)
    stdout, stderr, _status = mypy_api.run(
        [
            "--config-file=",  # not the project's: it names the whole package as a target
            "--strict",
            "--follow-imports=silent",
            "--ignore-missing-imports",
            "--no-error-summary",
            "--show-error-codes",
            f"--cache-dir={tmp_path / 'cache'}",
            str(path),
        ]
    )
    assert not stderr, stderr
    found = set()
    for line in stdout.splitlines():
        m = re.match(r".*snippet\.py:(\d+): error: .*\[([a-z-]+)\]$", line)
        if m:
            found.add((int(m.group(1)), m.group(2)))
    return found


def _expected(source: str) -> set[tuple[int, str]]:
    return {
        (n, m.group(1))
        for n, line in enumerate(source.splitlines(), start=1)
        if (m := re.search(r"# E: ([a-z-]+)$", line))
    }


def test_mypy_checks_message_fields(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    expected = _expected(SNIPPET)
    assert len(expected) == 7
    assert _mypy_errors(tmp_path, SNIPPET) == expected


@pytest.mark.slow
def test_mypy_checks_a_real_protocol_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    expected = _expected(REAL_MESSAGE)
    assert _mypy_errors(tmp_path, REAL_MESSAGE) == expected
