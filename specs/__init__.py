"""The submodel specs shipped with nefl-zoo, installed as package data (``nefl_zoo_specs``).

One folder per model, one YAML file per spec; ``train/`` holds training configs. Found with
:func:`nefl_zoo.spec.shipped_specs_dir` (``$NEFL_ZOO_SPECS`` overrides it).
"""
