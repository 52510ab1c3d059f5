"""pytest plugin that tools/mutation.py loads (``-p mutation_plugin --mutation-log PATH``) into
every test run it makes.

It appends one JSON line per test phase (setup, call, teardown) and per failed collection to PATH,
and first a line saying where ``rlalign`` was imported from: the baseline run gets each test's time
and outcome from it, and proves that the tests ran the private copy, not the working tree; a mutant
run gets the test that killed it.
"""

from __future__ import annotations

import json
import sys

import pytest

_LOG: list[str] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--mutation-log", default=None, help="JSON-lines file written for tools/mutation.py")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--mutation-log")
    if path:
        _LOG.append(path)


def _write(record: dict) -> None:
    if _LOG:
        with open(_LOG[0], "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _message(report) -> str:
    lines = (report.longreprtext or "").strip().splitlines()
    return lines[-1][:300] if lines else ""


def pytest_collection_finish(session: pytest.Session) -> None:
    module = sys.modules.get("rlalign")
    _write({"rlalign": getattr(module, "__file__", None), "collected": len(session.items)})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _write({"nodeid": report.nodeid, "when": "collect", "outcome": "failed", "duration": 0.0, "message": _message(report)})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    record = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "duration": report.duration}
    if report.failed:
        record["message"] = _message(report)
    _write(record)
