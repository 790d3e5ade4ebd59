import sys

try:
    from parlab.cli import main

    status = main()
except KeyboardInterrupt:  # Ctrl-C before the command's own handling began (while parlab and torch import)
    print("parlab: interrupted", file=sys.stderr)
    status = 130
sys.exit(status)
