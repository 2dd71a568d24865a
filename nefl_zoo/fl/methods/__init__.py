"""The built-in methods: every module here registers its methods when imported, and the
registry (:mod:`nefl_zoo.fl.registry`) imports them all, in sorted order. A new built-in method
is one new module here."""
