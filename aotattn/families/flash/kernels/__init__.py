"""Triton kernels of the flash-attention family, one module per pass.

- :mod:`.common`: mask geometry, tile loads, the matrix product, Philox.
- :mod:`.forward`: ``attn_fwd``.
- :mod:`.backward`: ``attn_bwd_preprocess``, ``attn_bwd_dkdv``, ``attn_bwd_dq``, ``attn_bwd_fused``.
- :mod:`.dropout`: ``dropout_mask_kernel``, ``philox_words``.

Each kernel's declaration (arguments, functionals, tuning space) is in
:mod:`aotattn.families.flash.rules`, which names the module holding it.
"""
