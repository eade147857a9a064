"""``python -m lightning_dos`` runs the ``lightning-dos`` command line."""

from lightning_dos.cli import main

raise SystemExit(main())
