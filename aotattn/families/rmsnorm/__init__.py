"""RMSNorm: the small second family, proof that a family is one directory."""

from aotattn.families.rmsnorm.ops import rms_norm

__all__ = ["rms_norm"]
