"""`python -m crossdevice <command>`."""

import sys

from crossdevice._cli.main import main

sys.exit(main())
