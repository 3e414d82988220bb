"""The one check behind every table of bad inputs: the call raises, and its message names what was wrong."""

from collections.abc import Callable, Sequence
from typing import Any

import pytest


def assert_named(call: Callable[[], Any], kind: type[BaseException], words: Sequence[str]) -> None:
    """``call()`` raises ``kind`` whose message holds every one of ``words`` (what, where, how to fix)."""
    with pytest.raises(kind) as error:
        call()
    for word in words:
        assert word in str(error.value), f"{word!r} not in: {error.value}"
