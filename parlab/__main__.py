import sys

from parlab.cli import main

sys.exit(main())
