"""A pytest plugin for device runs cut short by a time limit: each failure's traceback is written the moment its
report arrives (also from pytest-xdist workers), to stdout and to ``$INSTAFAIL`` if set, instead of only in the
summary at the end of the session, which a killed run never prints.

Usage: ``python3 -m pytest -p tools.pytest_instafail ...`` from the repository root."""
import os
import sys


def pytest_runtest_logreport(report):
    if not report.failed:
        return
    text = f"\n==== {report.when} FAILED {report.nodeid}\n{report.longreprtext}\n"
    sys.stdout.write(text)
    sys.stdout.flush()
    path = os.environ.get("INSTAFAIL")
    if path:
        with open(path, "a") as f:
            f.write(text)
