"""minishard.testing.profiles, and the test suite's own use of them (tests/conftest.py)."""

import os
import subprocess
import sys
from pathlib import Path

from hypothesis import Phase, settings

from minishard.testing import register_profiles

TESTS = Path(__file__).resolve().parent


def test_profiles_suit_tests_that_compile():
    assert register_profiles() == ("minishard", "minishard-ci", "minishard-dev")
    profile = settings.get_profile("minishard")
    assert profile.deadline is None and not profile.report_multiple_bugs
    assert Phase.explain not in profile.phases and Phase.shrink in profile.phases
    assert settings.get_profile("minishard-ci").derandomize
    assert settings.get_profile("minishard-dev").max_examples == 50


def test_conftest_loads_10_examples_unless_told_and_maps_ci_and_dev():
    script = (  # conftest.py imported afresh under each HYPOTHESIS_PROFILE; unset comes first
        "import importlib, os, sys\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "from hypothesis import settings\n"
        "for name in [None, 'ci', 'dev', 'minishard-dev']:\n"
        "    if name: os.environ['HYPOTHESIS_PROFILE'] = name\n"
        "    import conftest; importlib.reload(conftest)\n"
        "    print(settings.default.max_examples, settings.default.derandomize)\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "HYPOTHESIS_PROFILE"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.stdout.split("\n") == ["10 False", "10 True", "50 False", "50 False", ""], result.stderr
