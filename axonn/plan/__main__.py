"""`python -m axonn.plan` runs the `axonn-plan` CLI."""
from axonn.plan.cli import main

raise SystemExit(main())
