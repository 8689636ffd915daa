"""`python -m gaexp.progress`: gaexp-status."""

from gaexp.progress.status import main

if __name__ == "__main__":
    main()
