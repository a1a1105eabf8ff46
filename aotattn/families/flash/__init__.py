"""Flash attention: forward and backward, masks, GQA, varlen, dropout, bias."""

from aotattn.families.flash.ops import flash_attn_func, scaled_dot_product_attention

__all__ = ["flash_attn_func", "scaled_dot_product_attention"]
