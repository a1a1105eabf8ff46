"""Packages, and where the tuning database comes from (the rest is in pyproject.toml).

The database is edited and diffed as ``tuning/`` at the top of the checkout; wheels and
sdists carry it as the package data ``aotattn/tuning_db`` (found at run time through
importlib.resources, see aotattn/paths.py). pyproject.toml alone cannot map a folder
outside the package into it, hence this file.
"""

from setuptools import find_namespace_packages, setup

setup(
    # prebuilt images under aotattn/images are package data of aotattn, not packages
    packages=find_namespace_packages(include=["aotattn*"], exclude=["aotattn.images*"]) + ["aotattn.tuning_db"],
    package_dir={"aotattn.tuning_db": "tuning"},
)
