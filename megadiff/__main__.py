import sys

from megadiff.cli import main

if __name__ == "__main__":
    sys.exit(main())
