"""aotattn: flash attention in Triton, compiled ahead of time.

Public operators follow flash-attn's (``flash_attn_func``) and PyTorch's
(``scaled_dot_product_attention``) conventions; ``aotattn.reference`` is the float64
reference they are tested against. Importing aotattn touches no GPU driver.
"""

from aotattn.families.flash import (dropout_mask, flash_attn_func, flash_attn_varlen_func,
                                    scaled_dot_product_attention)
from aotattn import families, reference, tuning
from aotattn.families.rmsnorm import rms_norm

# The tuning package knows no family: the package root, above both, hands it their tables.
tuning.use_tables(families.tables)

__version__ = "0.1.0"

__all__ = ["dropout_mask", "flash_attn_func", "flash_attn_varlen_func", "scaled_dot_product_attention",
           "rms_norm", "reference", "__version__"]
