"""The built-in methods: every module here that defines a method registers it when imported, and
the registry (:mod:`nefl_zoo.fl.strategy.registry`) imports them all, in sorted order. A new
built-in method is one new module here. Two modules register nothing: :mod:`.common`, the pieces
the methods share (and :class:`~.common.Nested`, a nested method assembled from them), and
:mod:`.feddyn`, FedDyn's client and server updates (DepthFL's)."""
