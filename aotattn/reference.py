"""The float64 reference of the attention contract (see docs/semantics.md)."""

from aotattn.families.flash.reference import attention, visible

__all__ = ["attention", "visible"]
