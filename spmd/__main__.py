import sys

from spmd.tools.cli import main

sys.exit(main())
