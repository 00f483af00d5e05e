"""``python -m zerofn.footprint``: the planner's command line."""

from zerofn.footprint.cli import main

if __name__ == "__main__":
    main()
