"""pytest plugin: each failing test's id and report, appended to $FAILNOW at once."""
import os


def pytest_runtest_logreport(report):
    if report.failed:
        with open(os.environ["FAILNOW"], "a") as f:
            f.write(f"=== {report.nodeid} [{report.when}] {report.duration:.1f}s\n{report.longreprtext[-6000:]}\n")
