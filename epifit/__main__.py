import sys

from epifit.cli import main

sys.exit(main())
