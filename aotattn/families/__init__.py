"""Kernel families: one directory each (kernels, rules, reference, operators)."""
