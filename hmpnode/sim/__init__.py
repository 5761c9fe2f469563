"""The deterministic mesh simulator (docs/simulation.md): the real mesh core on virtual time."""
