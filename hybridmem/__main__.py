"""``python -m hybridmem`` is the ``hybridmem`` command."""

from hybridmem.cli import main

raise SystemExit(main())
