"""Process-wide settings kiln needs for a while and then puts back: a library must not leave the
host application's environment, log levels or thread count changed."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator


@contextlib.contextmanager
def env(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` unless the user set it; restored afterwards."""
    old = os.environ.get(name)
    if old is None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)


@contextlib.contextmanager
def logger_level(name: str, level: int) -> Iterator[None]:
    logger = logging.getLogger(name)
    old = logger.level
    logger.setLevel(max(level, old) if old else level)
    try:
        yield
    finally:
        logger.setLevel(old)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Offline, errors only, no progress bars: loading a local checkpoint is not news to the user."""
    import transformers

    logs = transformers.utils.logging
    old_level, old_bars = logs.get_verbosity(), logs.is_progress_bar_enabled()
    logs.set_verbosity_error()
    logs.disable_progress_bar()
    try:
        with env("HF_HUB_OFFLINE", "1"):
            yield
    finally:
        logs.set_verbosity(old_level)
        if old_bars:
            logs.enable_progress_bar()


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op thread count for eager runs (None: leave it)."""
    if not threads:
        yield
        return
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)
