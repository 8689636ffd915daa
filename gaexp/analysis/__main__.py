"""`python -m gaexp.analysis`: gaexp-report."""

from gaexp.analysis.reporting import main

if __name__ == "__main__":
    main()
