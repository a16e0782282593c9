"""Paged KV cache management: pool groups per life cycle, radix-tree prefix reuse, prioritised eviction.

Pure Python; torch and the kernels appear only at the device page-table seam.
"""
