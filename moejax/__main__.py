import sys

from moejax.cli import main

sys.exit(main())
