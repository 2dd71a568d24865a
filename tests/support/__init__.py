"""Test-only helpers that are not part of the nefl_zoo package (Flower processes, simulations)."""
