"""Hypothesis profiles for tests that compile: ``settings.load_profile("minishard")``."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings


def register_profiles() -> tuple[str, ...]:
    """Register hypothesis profiles for compiling tests; ``settings.load_profile("minishard")``.

    * ``"minishard"``: 10 examples (each may compile), no deadline (the first
      example of a shape compiles, the next ones do not: timings vary 100x),
      no health check for slow data generation, and a failure reported as soon
      as it is shrunk: no hunt for further distinct bugs, no explain phase
      (each re-runs the test many times);
    * ``"minishard-ci"``: the same, derandomized, so CI runs the same examples
      every time, and printing the reproduction blob;
    * ``"minishard-dev"``: 50 examples, to search harder locally.

    Registered when ``minishard.testing`` is imported; calling again is harmless.
    Load one in ``conftest.py``, or build on one for a single test:
    ``@settings(settings.get_profile("minishard"), max_examples=3)``.

    >>> register_profiles()
    ('minishard', 'minishard-ci', 'minishard-dev')
    """
    base = settings(
        settings.get_profile("default"),  # not the profile loaded now, which settings() would build on
        max_examples=10,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        report_multiple_bugs=False,
        phases=[phase for phase in Phase if phase != Phase.explain],
    )
    settings.register_profile("minishard", base)
    settings.register_profile("minishard-ci", base, derandomize=True, print_blob=True)
    settings.register_profile("minishard-dev", base, max_examples=50)
    return ("minishard", "minishard-ci", "minishard-dev")


__all__ = ["register_profiles"]
