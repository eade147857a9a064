"""Host and process helpers: CPU cores and host threads, host memory, ranks, signals, a quiet console."""
