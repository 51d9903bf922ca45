import sys

from mpitrain.cli import main

sys.exit(main())
