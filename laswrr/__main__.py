"""``python -m laswrr``: the ``laswrr`` command."""

from laswrr.cli import main

raise SystemExit(main())
