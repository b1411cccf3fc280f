import sys

from idemflow.cli import main

sys.exit(main())
