"""The student kit: the launcher, tracing, network emulation, memory, models, the CLI, packaging and the package's structure."""
