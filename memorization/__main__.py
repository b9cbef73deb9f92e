"""`python -m memorization` is the `memorize` command."""
import sys

from memorization.cli import main

sys.exit(main())
