"""Where aotattn's files are: the data installed with the package, the source checkout it
may run from, and the user's cache.

The tuning database and prebuilt images are package data, found through
:mod:`importlib.resources`: ``aotattn/tuning_db`` (a wheel or an sdist maps the checkout's
top-level ``tuning/`` there, see setup.py) and ``aotattn/images`` (present only in a
wheel built to carry images, see the README). A source checkout (an editable install, or
a clone on ``PYTHONPATH``) has no ``aotattn/tuning_db``: its database is ``tuning/`` at
the top, where it is edited and diffed, and ``aotattn build`` writes into its
``images/``. Installed from a wheel, builds go to the user's cache instead.

Nothing here touches a GPU or imports Triton.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import re
from pathlib import Path

TUNING_DB = "tuning_db"  # the tuning database, as package data
IMAGES = "images"  # prebuilt image archives, as package data (binary wheels only)


def package_data(name: str) -> Path | None:
    """The folder ``aotattn/<name>`` of the installed package, or None when there is none."""
    found = importlib.resources.files("aotattn").joinpath(name)
    # a zipped install would give another Traversable; the readers need plain files
    return Path(str(found)) if isinstance(found, Path) and found.is_dir() else None


@functools.cache
def checkout() -> Path | None:
    """The source checkout aotattn is imported from (the folder beside the package whose
    ``pyproject.toml`` names aotattn), or None when it runs from a wheel or sdist install."""
    top = Path(__file__).resolve().parents[1]
    try:
        project = (top / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    return top if re.search(r'^name\s*=\s*"aotattn"', project, re.MULTILINE) else None


def user_cache() -> Path:
    """``$XDG_CACHE_HOME/aotattn``, else ``~/.cache/aotattn``: what an installed aotattn
    builds into."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "aotattn"


def installed_tuning_db() -> Path:
    """The tuning database installed with aotattn: its package data, else the checkout's
    ``tuning/``. Where neither exists (a broken install), the package-data path, so that
    the error names where the database should be."""
    found = package_data(TUNING_DB)
    if found is not None:
        return found
    top = checkout()
    if top is not None and (top / "tuning").is_dir():
        return top / "tuning"
    return Path(__file__).resolve().parent / TUNING_DB


def default_images() -> Path:
    """Where ``aotattn build`` writes by default: the checkout's ``images/``, else the
    user's cache (``~/.cache/aotattn/images``)."""
    top = checkout()
    return top / "images" if top is not None else user_cache() / "images"


def default_build_cache() -> Path:
    """The compiled-kernel cache of ``aotattn build``: the checkout's ``build/cache/``, else
    ``~/.cache/aotattn/build``."""
    top = checkout()
    return top / "build" / "cache" if top is not None else user_cache() / "build"
