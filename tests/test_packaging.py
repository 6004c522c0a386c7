"""What installing puts into site-packages (pyproject.toml): justfit's packages with
their data files, the repository's cli/ as justfit.cli, and no top-level `cli` or
`bench`."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages

import cli.main

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_install_has_every_package_folder_and_no_top_level_cli_or_bench():
    config = _setuptools()
    listed, folders = config["tool"]["setuptools"]["packages"], config["tool"]["setuptools"]["package-dir"]
    assert folders == {"justfit.cli": "cli"}
    on_disk = find_packages(str(ROOT), include=["justfit*", "kvexec*", "phaseswap*", "statetrans*", "cli*"])
    expected = {f"justfit.{p}" if p.split(".")[0] == "cli" else p for p in on_disk}
    assert set(listed) == expected  # a new package folder must be listed, or a wheel would miss it
    assert {p.split(".")[0] for p in listed} == {"justfit", "kvexec", "phaseswap", "statetrans"}
    for package in listed:
        top = next((k for k in folders if package == k or package.startswith(k + ".")), None)
        folder = folders[top] + package[len(top):].replace(".", "/") if top else package.replace(".", "/")
        assert (ROOT / folder / "__init__.py").is_file(), package


def test_every_data_file_in_a_package_folder_is_installed():
    config = _setuptools()["tool"]["setuptools"]
    data = config["package-data"]
    for package in config["packages"]:
        folder = ROOT / (config["package-dir"].get(package) or package.replace(".", "/"))
        for path in folder.iterdir():
            if path.is_file() and path.suffix not in (".py", ".pyc"):
                assert any(path.match(str(folder / pattern)) for pattern in data.get(package, [])), path
    for pattern in data["justfit.server"]:  # the status page's files, in subfolders of a package
        assert list((ROOT / "justfit/server").glob(pattern)), pattern


def test_console_script_is_the_cli_folders_main():
    module, attr = _setuptools()["project"]["scripts"]["justfit"].split(":")
    assert (module, attr) == ("justfit.cli.main", "main")  # justfit.cli is cli/ (package-dir)
    assert getattr(cli.main, attr).name == "main" and "serve" in cli.main.COMMANDS
