"""The ``nefl-zoo`` command-line interface (installed as the ``nefl_zoo_cli`` package)."""
