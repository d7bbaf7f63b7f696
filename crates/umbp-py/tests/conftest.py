"""What every test of the suite shares: a hung test ends the run, naming itself.

A test blocked for good (a deadlock in the native module, say) would otherwise hold the suite,
and CI, until something outside kills it, with nothing said of where it stood. Past
`HANG_AFTER` seconds in one test (`UMBP_TEST_HANG_AFTER` overrides it), Python's faulthandler
prints every thread's stack to the terminal's stderr (the test's frames are in the main
thread's) and exits the process with status 1. The bound only detects hangs: the slowest test
takes a few minutes on a loaded 2-core machine.
"""

import faulthandler
import os
import sys

import pytest

HANG_AFTER = float(os.environ.get("UMBP_TEST_HANG_AFTER", 20 * 60))

# Where the dump goes: stderr as it was when pytest configured itself, before a test's
# capture redirects it (what pytest's own faulthandler plugin keeps too).
_stderr = None


def pytest_configure(config):
    global _stderr
    _stderr = os.dup(sys.stderr.fileno())


def pytest_unconfigure(config):
    if _stderr is not None:
        os.close(_stderr)


@pytest.fixture(autouse=True)
def _a_hang_ends_the_run():
    faulthandler.dump_traceback_later(HANG_AFTER, exit=True, file=_stderr)
    yield
    faulthandler.cancel_dump_traceback_later()
