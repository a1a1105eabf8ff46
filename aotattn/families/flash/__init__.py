"""Flash attention: forward and backward, masks, GQA, varlen, dropout, bias."""

from aotattn.families.flash.ops import (dropout_mask, flash_attn_func, flash_attn_varlen_func,
                                        scaled_dot_product_attention)
from aotattn.families.flash import custom_ops  # noqa: F401  (registers the torch.compile custom ops)

__all__ = ["dropout_mask", "flash_attn_func", "flash_attn_varlen_func", "scaled_dot_product_attention"]
