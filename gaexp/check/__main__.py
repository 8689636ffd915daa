"""`python -m gaexp.check`: gaexp-check (gaexp/check/cli.py)."""

from gaexp.check.cli import main

if __name__ == "__main__":
    main()
