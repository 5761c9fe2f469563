"""`python -m hmpnode` is the same as the `hmpnode` console script."""

from hmpnode.cli import main

raise SystemExit(main())
