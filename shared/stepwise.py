"""Device work in pieces: generator functions that yield between forwards, so a caller can interleave them.

A ``Steps[T]`` generator does a bounded piece of device work per ``next()`` and returns its result ``T``
when exhausted. :func:`drain` runs one to the end (what a process with one role does); the all-in-one
decode scheduler instead advances the prefill worker's steps one piece per decode round.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")

Steps = Generator[None, None, T]


def drain(steps: Steps[T]) -> T:
    """Run ``steps`` to the end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
