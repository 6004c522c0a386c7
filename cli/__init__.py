"""The `justfit` command line. Importing it changes nothing in the process: the
command's entry (`main:main` here) calls `justfit.runtime.setup()` before any
subcommand's module loads `mlx.core`.

Installed, this folder is the package `justfit.cli` (pyproject.toml); in the repository
it is also `cli` (`python -m cli.main`), so its modules import each other relatively."""
