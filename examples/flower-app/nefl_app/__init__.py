"""A Flower App running nefl-zoo's nested federated learning (see ../pyproject.toml)."""
