"""Custom Triton kernels used by memopt.

``memopt.kernels.flash_attn`` holds a FlashAttention forward/backward pair.
Kernels are imported lazily by their users: importing this package does not
import Triton.
"""
