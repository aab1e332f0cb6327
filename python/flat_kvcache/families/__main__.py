"""``python -m flat_kvcache.families``: print the model-family table (Markdown)."""

import sys

from flat_kvcache.families import _main

sys.exit(_main(sys.argv[1:]))
