"""The commands behind ``lightning-dos``: train (main), plan, simulate, report."""
