"""``python -m lightning_dos`` runs the ``lightning-dos`` command line."""

from lightning_dos.commands.main import main

raise SystemExit(main())
