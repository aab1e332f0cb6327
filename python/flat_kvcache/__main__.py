"""``python -m flat_kvcache``: the same command line as ``flat-kvcache``."""

from flat_kvcache.cli import main

raise SystemExit(main())
