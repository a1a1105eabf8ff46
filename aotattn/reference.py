"""The float64 reference of the attention contract (see docs/semantics.md)."""

from aotattn.families.flash.reference import attention, attention_varlen, visible

__all__ = ["attention", "attention_varlen", "visible"]
