"""Spec compiler: physically slimmed submodules and their slice maps."""

from .compiler import CompiledSpec, CompiledTier, build_submodel, compile_spec, extract, scatter_
from .slicemap import SliceEntry, SliceMap, split_tier_key, tier_key

__all__ = [
    "CompiledSpec",
    "CompiledTier",
    "SliceEntry",
    "SliceMap",
    "build_submodel",
    "compile_spec",
    "extract",
    "scatter_",
    "split_tier_key",
    "tier_key",
]
