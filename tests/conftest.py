"""Shared test settings: GPU tests run only where CUDA exists; browser tests need Debian's chromium."""
import os
import shutil
from pathlib import Path

import pytest
import torch

from children import make_child_env

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if ("e2e" in item.keywords or "browser" in item.keywords) and CHROMIUM is None:
            if os.environ.get("CI"):
                raise pytest.UsageError("CI must run the browser tests: install Debian's chromium (.ci/run does).")
            item.add_marker(pytest.mark.skip(reason="needs Debian's chromium (apt-get install chromium)"))


@pytest.fixture
def root():
    """The repository's top folder."""
    return ROOT


@pytest.fixture(autouse=True)
def english(monkeypatch):
    """Messages are checked in English unless a test sets ``MPARLIB_LANG=ja`` itself (the Japanese notebooks check
    the other language end to end)."""
    monkeypatch.setenv("MPARLIB_LANG", "en")


@pytest.fixture(scope="session")
def child_env():
    """``child_env(*paths, **extra)``: the environment for child programs (``children.make_child_env``)."""
    return make_child_env
