"""`python -m cli` runs podctl."""

from cli.main import main

main()
