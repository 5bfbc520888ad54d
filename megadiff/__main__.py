import sys

from megadiff.cli import entry_point

if __name__ == "__main__":
    sys.exit(entry_point())
