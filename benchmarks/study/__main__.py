import sys

from .main import main

if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
