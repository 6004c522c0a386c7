"""The `justfit` command line. Importing it changes nothing in the process: the
command's entry (`cli.main:main`) calls `justfit.runtime.setup()` before any
subcommand's module loads `mlx.core`."""
