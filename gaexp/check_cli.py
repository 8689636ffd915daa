"""`python -m gaexp.check_cli` and the `gaexp-check` script of an install made before the check had a folder of
its own: the names first announced. The command is gaexp/check/cli.py (`python -m gaexp.check`)."""

from gaexp.check.cli import main

if __name__ == "__main__":
    main()
